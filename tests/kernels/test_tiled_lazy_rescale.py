"""``tiled:rescale_threshold=t``: FlashAttention-4's lazy rescaling (a stale row max kept until a
tile raises it by more than ``t`` powers of two; ``flash_attn/cute/softmax.py``).

Oracles: the FP64 golden value (the stale max cancels in ``o / l``, so the knob is exact in exact
arithmetic), and rows built so that the stale max shows through a saturating E4M3 cast of ``P``,
with the E4M3 roundings done by hand (in ``[2^e, 2^(e+1))`` E4M3's step is ``2^(e-3)``; 448 is its
largest value).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.kernels import (
    KernelSpecError,
    get_kernel,
    golden_attention,
    resolve_numerics,
    tiled_attention,
)


def logit_row(logits: list[float], d: int = 4, v: torch.Tensor | None = None):
    """One query row whose scaled scores are ``logits`` exactly (``scale=1``): q = e₀, k_j = logit_j·e₀.
    V = 1 unless given. Returns ``q (1, 1, 1, d), k (1, 1, N, d), v (1, 1, N, d)``."""
    n = len(logits)
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, d)
    k[0, 0, :, 0] = torch.tensor(logits)
    return q, k, torch.ones(1, 1, n, d) if v is None else v


@pytest.mark.parametrize("threshold", [0.5, 4, 8, 100])
@pytest.mark.parametrize("order", ["forward", "reverse", "shuffle"])
def test_lazy_rescale_is_exact_in_fp64(threshold, order, make_qkv):
    """The stale max shifts numerator and denominator alike: FP64 within 1e-12 of the golden value,
    causal and masked calls too; logits of scale 3 make the max rise tile after tile."""
    q, k, v = make_qkv(40, 150, 16, dtype=torch.float64, seed=1)
    q = 3 * q
    mask = torch.rand(40, 150, generator=torch.Generator().manual_seed(2)) > 0.4
    spec = f"tiled:rescale_threshold={threshold},order={order},block_k=16"
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}):
        out = get_kernel(spec)(q, k, v, **kwargs)
        assert (out - golden_attention(q, k, v, **kwargs)).abs().max().item() <= 1e-12


def test_lazy_rescale_gradients_are_exact_in_fp64(make_qkv):
    q, k, v = (t.requires_grad_(True) for t in make_qkv(20, 70, 8, dtype=torch.float64, seed=3))
    (get_kernel("tiled:rescale_threshold=8,block_k=16")(3 * q, k, v) ** 2).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (golden_attention(3 * q, k, v) ** 2).sum().backward()
    for a, t in zip(got, (q, k, v), strict=True):
        assert (a - t.grad).abs().max().item() <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_threshold_zero_and_a_single_tile_change_no_bit(dtype, make_qkv):
    """Off (0) is the default; and the first tile that sees a key always sets the max (FA4's
    ``is_first``), so a call of one key tile is bit-identical with any threshold."""
    q, k, v = make_qkv(33, 100, 16, dtype=dtype, seed=4)
    assert torch.equal(get_kernel("tiled:rescale_threshold=0")(q, k, v), get_kernel("tiled")(q, k, v))
    assert torch.equal(get_kernel("tiled:rescale_threshold=8")(q, k, v), get_kernel("tiled")(q, k, v))
    assert not torch.equal(
        get_kernel("tiled:rescale_threshold=8,block_k=16")(3 * q, k, v),
        get_kernel("tiled:block_k=16")(3 * q, k, v),
    )  # several tiles: the stale max rounds differently


# Row of 8 keys in tiles of 4, visited last to first: tile 1 (keys 4-7) at logit 0 comes first
# (m = 0, P = 1, ×256 = 256 exactly); then tile 0 raises the max by Δ bits at key 0 (keys 1-3 at 0).
#   stale (Δ ≤ t): α = 1, P_key0 = 2^Δ, cast(256·2^Δ);
#   updated (Δ > t): m = Δ·ln2, α = 2^-Δ, P_key0 = 1, keys 1-3: P = 2^-Δ, cast(256·2^-Δ).
# Hand roundings: 256·2^3.9 = 3821.7 saturates to 448; 256·2^0.7 = 415.9 → 416 (step 32);
# 256·2^-4.1 = 14.93 → 15 (step 1); 256·2^-0.9 = 137.2 → 144 (step 16: 137.2 is nearer 144 than 128).
CASES = [  # (threshold t, rise Δ in bits, stale?, E4M3 value of the cast that Δ decides)
    (4.0, 3.9, True, 448.0),
    (4.0, 4.1, False, 15.0),
    (0.75, 0.7, True, 416.0),
    (0.75, 0.9, False, 144.0),
]


@pytest.mark.parametrize(("threshold", "rise", "stale", "cast"), CASES)
def test_the_threshold_is_in_log2_units_and_a_rise_up_to_it_keeps_the_stale_max(threshold, rise, stale, cast):
    q, k, v = logit_row([rise * math.log(2.0)] + [0.0] * 7)
    spec = f"tiled:p_fp8=e4m3,p_scale=256,rescale_threshold={threshold:g},block_k=4"
    out = get_kernel(spec)(q, k, v, scale=1.0)[0, 0, 0, 0].item()
    if stale:  # numerator: tile 1's 4, keys 1-3's 3, key 0's cast; denominator: the fp32 P
        expected = (4 + 3 + cast / 256) / (4 + 3 + 2.0**rise)
    else:
        alpha = 2.0**-rise
        expected = (4 * alpha + 1 + 3 * cast / 256) / (4 * alpha + 1 + 3 * alpha)
    assert out == pytest.approx(expected, rel=1e-6)
    plain = get_kernel("tiled:p_fp8=e4m3,p_scale=256,block_k=4")(q, k, v, scale=1.0)[0, 0, 0, 0].item()
    assert (out == plain) is (not stale)  # an updated max is the eager kernel's arithmetic


def test_the_first_tile_sets_the_max_even_near_a_sentinel():
    """With a finite ``mask_value`` the running max starts at the sentinel; the first tile with a key
    sets it whatever the rise (FA4's ``is_first``). Keeping the sentinel as a stale max would leave
    the row "dead" (output 0, as a row whose logits all lie below the sentinel)."""
    logits = [-49_999.0, -49_999.5, -49_998.0, -49_999.0]  # 1-2 above the sentinel: a rise of ≤ 3 bits
    v = torch.arange(16.0).view(1, 1, 4, 4)
    q, k, _ = logit_row(logits)
    out = get_kernel("tiled:mask_value=-5e4,rescale_threshold=8,block_k=2")(q, k, v, scale=1.0)
    golden = golden_attention(q.double(), k.double(), v.double(), scale=1.0)
    assert (out.double() - golden).abs().max().item() <= 1e-5


def test_lazy_rescale_specs_describe_and_refuse():
    n = resolve_numerics(torch.bfloat16, preset="fa3_fp8", rescale_threshold=4)
    assert n.rescale_threshold == 4.0
    assert n.describe().startswith(
        "scores fp32, stats fp32, acc fp32, P bf16, update fa2, order reverse, "
        "lazy rescale (threshold 4 in log2)"
    )
    assert "lazy" not in resolve_numerics(torch.bfloat16).describe()
    assert get_kernel("tiled:rescale_threshold=8").options == {"rescale_threshold": 8}
    for spec, message in [
        ("tiled:rescale_threshold=-1", "rescale_threshold=-1 must be a finite number ≥ 0"),
        ("tiled:rescale_threshold=inf", "rescale_threshold=inf must be a finite number ≥ 0"),
        ("tiled:rescale_threshold=high", "rescale_threshold='high' must be a finite number ≥ 0"),
        ("tiled:preset=paper,rescale_threshold=8", "rescale_threshold=8 needs update=fa2"),
        ("tiled:update=fa1,rescale_threshold=4", "update=fa1 renormalises the output after every tile"),
    ]:
        with pytest.raises(KernelSpecError, match=message):
            get_kernel(spec)
    assert get_kernel("tiled:preset=paper,update=fa2,rescale_threshold=8").options["update"] == "fa2"
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="needs update=fa2"):  # called directly, too
        tiled_attention(q, q, q, update="fa1", rescale_threshold=1.0)
