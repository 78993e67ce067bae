"""FP8 in ``tiled``: casts, scales, the Hadamard rotation, the FP8 kernel and its refusals.

Oracles: the E4M3/E5M2 values built here from their bit layouts (sign, exponent, mantissa; OCP
FP8 spec) with round-to-nearest-even done by hand on that table; orthogonality in FP64; the FP64
golden value with a bound derived from the formats' unit roundoff; and attention written out by
hand (FP64) on hand-quantized operands.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashprobe.kernels import (
    KernelSpecError,
    KernelUnsupportedError,
    get_kernel,
    golden_attention,
    resolve_numerics,
)
from flashprobe.kernels.fp8 import cast_fp8, fp8_max, hadamard_rotation, quantize

#: (exponent bits, mantissa bits, exponent bias) of each format
LAYOUT = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}


def _decode(fmt: str, code: int) -> float:
    """The value of one 8-bit code, from the bit layout (NaN for NaN codes, inf for E5M2's inf)."""
    e_bits, m_bits, bias = LAYOUT[fmt]
    sign = -1.0 if code >> 7 else 1.0
    e = (code >> m_bits) & ((1 << e_bits) - 1)
    m = code & ((1 << m_bits) - 1)
    if fmt == "e4m3" and e == 15 and m == 7:  # E4M3 "fn": no infinity, one NaN per sign
        return math.nan
    if fmt == "e5m2" and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:  # subnormal
        return sign * m / (1 << m_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << m_bits)) * 2.0 ** (e - bias)


def _table(fmt: str) -> list[tuple[float, int]]:
    """Every finite value of ``fmt`` with its code, ascending (−0 left out)."""
    values = {}
    for code in range(256):
        x = _decode(fmt, code)
        if math.isfinite(x) and not (x == 0 and code >> 7):
            values[x] = code
    return sorted(values.items())


def _round_by_hand(x: float, fmt: str) -> float:
    """Round-to-nearest-even on the table, saturating at ±max; NaN stays NaN."""
    if math.isnan(x):
        return math.nan
    table = _table(fmt)
    top = table[-1][0]
    if x >= top:
        return top
    if x <= -top:
        return -top
    below = max((t for t in table if t[0] <= x), key=lambda t: t[0])
    above = min((t for t in table if t[0] >= x), key=lambda t: t[0])
    if x - below[0] != above[0] - x:
        return below[0] if x - below[0] < above[0] - x else above[0]
    return below[0] if below[1] % 2 == 0 else above[0]  # tie: the even mantissa


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_values_from_the_bit_layout(fmt):
    table = _table(fmt)
    assert len(table) == {"e4m3": 253, "e5m2": 247}[fmt]  # 256 codes − NaNs (− infs) − (−0)
    assert fp8_max(fmt) == table[-1][0] == {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    smallest = min(t[0] for t in table if t[0] > 0)
    assert smallest == {"e4m3": 2.0**-9, "e5m2": 2.0**-16}[fmt]
    values = torch.tensor([t[0] for t in table])
    assert torch.equal(cast_fp8(values, fmt), values)  # every representable value casts to itself


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_cast_rounds_to_nearest_even_and_saturates(fmt):
    table = [t[0] for t in _table(fmt)]
    positive = [t for t in table if t >= 0]
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(positive)]  # every tie
    gen = torch.Generator().manual_seed(0)
    top = fp8_max(fmt)
    random = (
        torch.randn(2000, generator=gen) * torch.exp2(torch.randint(-20, 18, (2000,), generator=gen))
    ).tolist()
    special = [top * 1.03, top * 1.5, 1e30, math.inf, -math.inf, math.nan, 0.0]
    xs = midpoints + [-m for m in midpoints] + random + special
    got = cast_fp8(torch.tensor(xs, dtype=torch.float32), fmt).tolist()
    for x, y in zip(xs, got, strict=True):
        x32 = torch.tensor(x, dtype=torch.float32).item()
        expected = _round_by_hand(x32, fmt)
        assert (math.isnan(y) and math.isnan(expected)) or y == expected, (fmt, x32, y, expected)


def test_torch_e5m2_overflows_to_inf_so_the_cast_clamps():
    """Why the explicit clamp: torch's own e5m2 cast overflows to inf (e4m3fn saturates)."""
    big = torch.tensor([1e6])
    assert math.isinf(big.to(torch.float8_e5m2).float().item())
    assert big.to(torch.float8_e4m3fn).float().item() == 448.0
    assert cast_fp8(big, "e5m2").item() == 57344.0


@pytest.mark.parametrize("scaling", ["tensor", "head", "block"])
def test_amax_scales_map_each_group_max_to_the_format_max(scaling):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 8, generator=gen) * torch.tensor([1.0, 10.0, 0.01]).view(1, 3, 1, 1)
    x[1, 2] = 0  # an all-zero head: scale 1, values 0
    values, descale = quantize(x, "e4m3", scaling=scaling, block=16)
    groups = {"tensor": [x.abs().amax()], "head": None, "block": None}[scaling]
    if scaling == "tensor":
        assert descale.shape == (1, 1, 1, 1) and values.abs().max().item() == 448.0
        assert descale.item() == pytest.approx(groups[0].item() / 448.0, rel=1e-6)
    elif scaling == "head":
        assert descale.shape == (2, 3, 1, 1)
        peaks = values.abs().amax(dim=(-2, -1))
        assert peaks[1, 2].item() == 0 and descale[1, 2].item() == 1.0
        peaks[1, 2] = 448.0
        assert torch.all(peaks == 448.0)
    else:
        assert descale.shape == (2, 3, 40, 1)
        for r0 in range(0, 40, 16):  # blocks of 16 rows; the last has 8
            block = values[0, :, r0 : r0 + 16]
            assert torch.all(block.abs().amax(dim=(-2, -1)) == 448.0)
            assert torch.all(descale[0, :, r0 : r0 + 16] == descale[0, :, r0 : r0 + 1])
    assert torch.equal(values, cast_fp8(x / descale, "e4m3"))
    assert ((values * descale - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * descale).all()


@pytest.mark.parametrize("scaling", ["tensor", "head", "block"])
def test_an_empty_group_quantizes_like_an_all_zero_one(scaling):
    """No rows (a call with no keys) or no channels: amax 0, so scale 1 and no values, not a crash."""
    for shape in ((2, 3, 0, 8), (2, 3, 5, 0)):
        values, descale = quantize(torch.empty(shape), "e4m3", scaling=scaling, block=4)
        assert values.shape == shape
        assert torch.all(descale == 1.0)
        expected = {"tensor": (1, 1, 1, 1), "head": (2, 3, 1, 1), "block": (2, 3, shape[2], 1)}[scaling]
        assert descale.shape == expected


@pytest.mark.parametrize("spec", ["math:fp8=e4m3", "math:fp8=e5m2,fp8_draw=3", "tiled:qkv_fp8=e4m3",
                                  "tiled:qkv_fp8=e4m3,fp8_scaling=head", "tiled:preset=fa3_fp8"])  # fmt: skip
def test_fp8_kernels_take_a_call_with_no_keys(spec, make_qkv):
    """A call with no keys outputs zeros, as torch SDPA's CPU kernels do (every row fully masked);
    the FP8 baseline crashed on the amax of its empty K and V."""
    q, _, _ = make_qkv(6, 0, 16)
    k, v = torch.empty(1, 2, 0, 16), torch.empty(1, 2, 0, 16)
    with torch.no_grad():
        out = get_kernel(spec)(q, k, v)
    assert out.shape == (1, 2, 6, 16)
    assert torch.equal(out, torch.zeros_like(out))


def test_static_scale():
    x = torch.tensor([0.5, 3.0, 100.0]).view(1, 1, 3, 1)
    values, descale = quantize(x, "e4m3", scale=8.0)
    assert values.flatten().tolist() == [4.0, 24.0, 448.0] and descale.item() == 0.125  # 800 saturates


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
def test_hadamard_rotation_is_orthogonal_in_fp64(d):
    m = hadamard_rotation(d, seed=3)
    assert m.dtype == torch.float64
    assert (m @ m.T - torch.eye(d, dtype=torch.float64)).abs().max().item() <= 1e-14
    assert torch.all(m.abs() == 1 / math.sqrt(d))  # a ±1 matrix scaled by 1/√d
    assert torch.equal(m, hadamard_rotation(d, seed=3))
    if d >= 16:
        assert not torch.equal(m, hadamard_rotation(d, seed=4))  # the seed draws the signs


def test_hadamard_rotation_refuses_other_head_dims():
    with pytest.raises(ValueError, match="power-of-two head dim, got 40"):
        hadamard_rotation(40)


def test_rotation_alone_is_exact_in_fp64(make_qkv):
    """(QM)(KM)ᵀ = QKᵀ: in fp64 the rotated kernel is the golden value to 1e-12, causal too."""
    q, k, v = make_qkv(70, 90, 32, dtype=torch.float64, seed=2)
    for causal in (False, True):
        out = get_kernel("tiled:rotation=hadamard,rotation_seed=5,block_k=32")(q, k, v, is_causal=causal)
        assert (out - golden_attention(q, k, v, is_causal=causal)).abs().max().item() <= 1e-12


def test_one_tile_fp8_kernel_is_attention_on_hand_quantized_operands(make_qkv):
    """One key tile, static scale 1: Q, K, V rounded to E4M3 by hand, P = exp(s − max) cast to E4M3
    after ×256 by hand, o = P̃ V / Σ exp(s − max), all in FP64."""
    q, k, v = make_qkv(24, 40, 16, dtype=torch.float32, seed=3)
    spec = "tiled:qkv_fp8=e4m3,qkv_scale=1,p_fp8=e4m3,p_scale=256,block_k=64"
    out = get_kernel(spec)(q, k, v).double()

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(
            [_round_by_hand(float(e), "e4m3") for e in x.flatten()], dtype=torch.float64
        ).view(x.shape)

    q8, k8, v8 = by_hand(q), by_hand(k), by_hand(v)
    s = q8 @ k8.transpose(-2, -1) / 4.0  # scale 1/√16
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    p8 = by_hand((p * 256).float()) / 256
    expected = p8 @ v8 / p.sum(dim=-1, keepdim=True)
    assert (out - expected).abs().max().item() <= 1e-5
    assert (out - golden_attention(q, k, v).double()).abs().max().item() > 1e-3  # FP8 really is coarse


def _derived_bound(q, k, v, *, u=2.0**-4, p_scale=256.0):
    """``(B, H, N_q, D_v)``: how far the E4M3 kernel's output may lie from the golden value.

    Q, K, V and P̃ round by at most u relative (amax scales keep these entries in E4M3's normal
    range; subnormal leftovers are covered by a 1e-4·max|v| slack). A logit then moves by at most
    ``Δ_i = scale·(2u + u²)·max_j Σ_c |q_ic||k_jc|``, so the softmax weights by a factor within
    ``e^{±2Δ_i}``, and, per output column c, with ``p`` the exact weights:
    ``|o' − o| ≤ [(e^{2Δ}−1)(1+u)² + u + u(1+u)e^{2Δ}]·Σ_j p_j|v_jc|`` plus P's underflow
    ``N·2^-10/S·max_j|v_jc|(1+u)`` and the bf16 output rounding ``2^-8|o|``.
    """
    scale = 1 / math.sqrt(q.shape[-1])
    qd, kd, vd = q.double(), k.double(), v.double()
    delta = (scale * (2 * u + u * u) * (qd.abs() @ kd.abs().transpose(-2, -1))).amax(dim=-1, keepdim=True)
    p = torch.softmax(qd @ kd.transpose(-2, -1) * scale, dim=-1)
    grow = torch.exp(2 * delta)
    factor = (grow - 1) * (1 + u) ** 2 + u + u * (1 + u) * grow
    vmax = vd.abs().amax(dim=-2, keepdim=True)
    n = k.shape[-2]
    golden = p @ vd
    return (
        factor * (p @ vd.abs())
        + n * 2.0**-10 / p_scale * vmax * (1 + u)
        + 2.0**-8 * golden.abs()
        + 1e-4 * vmax
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("scaling", ["tensor", "head", "block"])
def test_fp8_kernel_within_the_derived_bound_of_the_golden(seed, scaling, make_qkv):
    q, k, v = make_qkv(48, 80, 32, dtype=torch.bfloat16, seed=seed)
    q, k = (0.4 * q).bfloat16(), (0.4 * k).bfloat16()  # logits O(0.5): a bound that is not vacuous
    spec = f"tiled:qkv_fp8=e4m3,p_fp8=e4m3,p_scale=256,fp8_scaling={scaling},block_q=16,block_k=32"
    out = get_kernel(spec)(q, k, v)
    error = (out.double() - golden_attention(q, k, v).double()).abs()
    bound = _derived_bound(q, k, v)
    assert torch.all(error <= bound)
    assert (error / bound).max().item() > 0.02  # within 50x of the kernel: not a vacuous bound
    assert error.max().item() > 1e-3  # the FP8 path ran (bf16 flash is ~1e-3 of that)


def test_fp8_gemm_multiplies_fp8_values_and_descales_the_result():
    """Logits near the float32 range: the kernel's GEMM multiplies E4M3 values (products at most
    448², no overflow) and descales the result, as FP8 kernels do. Descaling the operands first
    made a partial sum overflow to ±inf (a NaN or zeroed row, the fuzzer's ``sentinel_halfmax``
    in fp32). Oracle: every entry below is E4M3-exact after its amax scale, so the FP8 kernel's
    logits are the FP64 ones: key 1 is 2^127 above key 0 and the output is v[1] exactly."""
    d, big = 16, 2.0**127
    q = torch.zeros(1, 1, 1, d)
    q[..., :2] = 2.0  # q·k0 = 2·2^127 − 2·2^127 = 0 (both partial products overflow float32)
    k = torch.zeros(1, 1, 2, d)
    k[0, 0, 0, :2] = torch.tensor([big, -big])
    k[0, 0, 1, :2] = torch.tensor([big, -big / 2])  # q·k1 = 2^127
    v = torch.tensor([[-1.0, 2.0], [0.5, -0.25]]).view(1, 1, 2, 2).repeat(1, 1, 1, d // 2)
    golden = golden_attention(q.double(), k.double(), v.double(), scale=1.0)
    assert torch.equal(golden, v[:, :, 1:].double())  # (the FP64 softmax: all weight on key 1)
    spec = "tiled:preset=fa3_fp8,rotation=off,fp8_scaling=tensor"
    with torch.no_grad():
        out = get_kernel(spec)(q, k, v, scale=1.0)
    assert torch.isfinite(out).all()
    assert (out.double() - golden).abs().max().item() <= 2.0**-3  # v[1] rounded to E4M3: exact


def test_reverse_order_avoids_the_sink_collapse():
    """A sink at key 0 with logit 12: forward order makes every later P ≤ e^-12·e^{O(1)} before the
    E4M3 cast (most underflow); reverse order visits the sink last. The reverse output is closer."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=gen) for _ in range(3))
    u = torch.randn(16, generator=gen)
    u /= u.norm()
    q += 4 * u
    k[..., 0, :] = 12 * u
    golden = golden_attention(q, k, v)
    err = {
        order: (get_kernel(f"tiled:p_fp8=e4m3,order={order},block_k=32")(q, k, v) - golden)
        .pow(2)
        .mean()
        .item()
        for order in ("forward", "reverse")
    }
    assert err["forward"] > 3 * err["reverse"]


def test_fp8_specs_resolve_and_describe():
    n = resolve_numerics(torch.bfloat16, preset="fa3_fp8")
    assert (n.score, n.stats, n.acc, n.update, n.order) == (torch.float32,) * 3 + ("fa2", "reverse")
    assert n.describe().endswith("; FP8: QKV e4m3 (block amax), P e4m3 ×256, rotation hadamard (seed 0)")
    custom = resolve_numerics(torch.float16, preset="fa2", qkv_fp8="e5m2", qkv_scale=2.0, p_fp8="off")
    assert custom.fp8.describe() == "QKV e5m2 (tensor static 2), P off, rotation off"
    assert "FP8" not in resolve_numerics(torch.bfloat16).describe()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tiled:qkv_fp8=e3m4", "qkv_fp8='e3m4' must be 'e4m3', 'e5m2' or 'off'"),
        ("tiled:p_fp8=fp8", "p_fp8='fp8' must be"),
        ("tiled:p_fp8=e4m3,p_scale=0", "p_scale=0 must be a finite positive number"),
        ("tiled:fp8_scaling=row", "fp8_scaling='row' must be 'tensor', 'head' or 'block'"),
        ("tiled:qkv_scale=max", "qkv_scale='max' must be 'amax' or a positive number"),
        ("tiled:rotation=random", "rotation='random' must be 'off' or 'hadamard'"),
        ("tiled:rotation=hadamard,rotation_seed=-1", "rotation_seed=-1 must be an integer ≥ 0"),
        ("tiled:preset=fa4", "preset='fa4' must be 'fa2', 'paper' or 'fa3_fp8'"),
    ],
)
def test_bad_fp8_knobs_are_refused_when_parsed(spec, message):
    with pytest.raises(KernelSpecError, match=message):
        get_kernel(spec)


def test_fp8_specs_declare_forward_only_and_power_of_two_head_dims(make_qkv):
    plain, fp8, fa3 = (get_kernel(s) for s in ("tiled", "tiled:qkv_fp8=e4m3", "tiled:preset=fa3_fp8"))
    assert plain.capabilities.has_backward("cpu")
    assert not fp8.capabilities.has_backward("cpu") and not fa3.capabilities.has_backward("cpu")
    assert fp8.capabilities.head_dims is None and 128 in fa3.capabilities.head_dims
    with pytest.raises(KernelUnsupportedError, match="has no backward"):
        fa3.check("cpu", torch.bfloat16, backward=True)
    q, k, v = make_qkv(16, 16, 16, dtype=torch.bfloat16)
    q.requires_grad_(True)
    with pytest.raises(KernelUnsupportedError, match="inputs require grad, but it has no backward"):
        fa3(q, k, v)
    from flashprobe.kernels import tiled_attention

    with pytest.raises(KernelUnsupportedError, match="forward only"):  # called directly, too
        tiled_attention(q, k, v, qkv_fp8="e4m3")
    q40, k40, v40 = make_qkv(8, 8, 40, dtype=torch.bfloat16)
    with pytest.raises(KernelUnsupportedError, match="does not support head dim 40"):
        fa3(q40, k40, v40)
    assert fp8(q40, k40, v40).shape == (1, 2, 8, 40)  # no rotation: any head dim
