"""The held-out kernels against an FP64 per-row loop: every control matches it in bf16, fp16 and fp32 over
several seeds; every bug is wrong on its trigger and right off it; every signature is the real library's.

The oracle is written here, row by row in float64, from the libraries' documented conventions; nothing
from flashprobe's fuzzer, judge or probe is used.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.heldout import CONTRACTS, HELDOUT
from lab.heldout.stateful import reset_state

E4M3 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SEEDS = (0, 1, 2)
# Largest |kernel − FP64| allowed for a correct kernel, relative to max(1, max |ref|): a few units of the
# dtype's rounding (outputs are rounded once; P may be rounded once more).
TOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9, torch.float32: 2e-5}
TOL_FP8 = 2.0**-4  # P rounded to e4m3 (3 mantissa bits), output in bf16


def fn(name: str):
    return HELDOUT[name].fn


# ---- the FP64 oracle: one query row at a time


def ref_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``(B, N_q, H_q, D)`` over k, v ``(B, N_k, H_k, D)`` in float64, row by row.

    Query ``i`` sits at key position ``i + N_k − N_q``; key ``j`` is visible if causal allows
    (``j <= pos``) and ``pos − left <= j <= pos + right``; its score is ``softcap·tanh(scale·q·k/softcap)``
    (or ``scale·q·k``) minus ``slope·|pos − j|``. Query head ``h`` reads K/V head ``h // (H_q / H_k)``.

    Returns:
        ``out (B, N_q, H_q, D_v)`` float64 (0 for a row without keys) and ``lse (B, H_q, N_q)`` natural
        (-inf for a row without keys).
    """
    b_n, n_q, h_q, d = q.shape
    n_k, h_k, d_v = k.shape[1], k.shape[2], v.shape[3]
    scale = d**-0.5 if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(b_n, n_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((b_n, h_q, n_q), -math.inf, dtype=torch.float64)
    j = torch.arange(n_k)
    for b in range(b_n):
        for h in range(h_q):
            kv = h // (h_q // h_k)
            for i in range(n_q):
                pos = i + n_k - n_q
                s = (k[b, :, kv] @ q[b, i, h]) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                if alibi is not None:
                    slope = alibi[h] if alibi.dim() == 1 else alibi[b, h]
                    s = s - float(slope) * (pos - j).abs().double()
                keep = torch.ones(n_k, dtype=torch.bool)
                if causal:
                    keep &= j <= pos
                if window[0] >= 0:
                    keep &= j >= pos - window[0]
                if window[1] >= 0:
                    keep &= j <= pos + window[1]
                if not keep.any():
                    continue
                s_k = s[keep]
                m = s_k.max()
                e = torch.exp(s_k - m)
                lse[b, h, i] = m + torch.log(e.sum())
                out[b, i, h] = (e / e.sum()) @ v[b, keep, kv]
    return out, lse


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


def qkv(
    b: int,
    n_q: int,
    n_k: int,
    h_q: int,
    h_k: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    d_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        randn((b, n_q, h_q, d), dtype, gen),
        randn((b, n_k, h_k, d), dtype, gen),
        randn((b, n_k, h_k, d_v or d), dtype, gen),
    )


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out − ref| (NaN or inf anywhere → inf)."""
    diff = (out.double() - ref.double()).abs()
    return math.inf if not torch.isfinite(diff).all() else float(diff.max()) if diff.numel() else 0.0


def bound(ref: torch.Tensor, dtype: torch.dtype) -> float:
    return TOL[dtype] * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert err(out, ref) <= bound(ref, dtype), f"{err(out, ref):.3g} > {bound(ref, dtype):.3g}"


def assert_wrong(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Wrong by more than the dtype allows: 3× the controls' bound, itself several times their error."""
    assert err(out, ref) > 3 * bound(ref, dtype), f"only {err(out, ref):.3g} off"


def assert_lse(lse: torch.Tensor, ref_lse: torch.Tensor, empty: float) -> None:
    """LSE equal to the golden where finite, ``empty`` (±inf) where the row sees no key."""
    expected = torch.where(ref_lse == -math.inf, torch.full_like(ref_lse, empty), ref_lse)
    finite = torch.isfinite(expected)
    assert torch.equal(lse[~finite].double(), expected[~finite])
    scale = max([1.0, *expected[finite].abs().tolist()])
    assert err(lse[finite], expected[finite]) <= 1e-4 * scale


# ---- the oracle itself


def test_oracle_known_values() -> None:
    """Scores 0 and log 3 weigh 1/4 and 3/4; causal with N_q > N_k leaves the first rows empty."""
    q = torch.tensor([[[[1.0]]]])  # (1, 1, 1, 1)
    k = torch.tensor([[[[0.0]], [[math.log(3.0)]]]])  # (1, 2, 1, 1)
    v = torch.tensor([[[[4.0]], [[8.0]]]])
    out, lse = ref_rows(q, k, v, scale=1.0)
    assert out.item() == pytest.approx(7.0) and lse.item() == pytest.approx(math.log(4.0))
    out, lse = ref_rows(torch.ones(1, 3, 1, 1), k, v, scale=1.0, causal=True)
    assert (
        out[0, 0].item() == 0 and lse[0, 0, 0].item() == -math.inf and out[0, 2].item() == pytest.approx(7.0)
    )


# ---- signatures: the real libraries' parameters, in order, with their defaults

REQUIRED = inspect.Parameter.empty
FA2_FUNC = [
    ("q", REQUIRED),
    ("k", REQUIRED),
    ("v", REQUIRED),
    ("dropout_p", 0.0),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("alibi_slopes", None),
    ("deterministic", False),
    ("return_attn_probs", False),
]
FA2_VARLEN = [
    ("q", REQUIRED),
    ("k", REQUIRED),
    ("v", REQUIRED),
    ("cu_seqlens_q", REQUIRED),
    ("cu_seqlens_k", REQUIRED),
    ("max_seqlen_q", REQUIRED),
    ("max_seqlen_k", REQUIRED),
    ("dropout_p", 0.0),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("alibi_slopes", None),
    ("deterministic", False),
    ("return_attn_probs", False),
    ("block_table", None),
    ("out", None),
]
FA2_KVCACHE = [
    ("q", REQUIRED),
    ("k_cache", REQUIRED),
    ("v_cache", REQUIRED),
    ("k", None),
    ("v", None),
    ("rotary_cos", None),
    ("rotary_sin", None),
    ("cache_seqlens", None),
    ("cache_batch_idx", None),
    ("cache_leftpad", None),
    ("block_table", None),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("rotary_interleaved", True),
    ("alibi_slopes", None),
    ("num_splits", 0),
    ("return_softmax_lse", False),
]
FA3_FUNC = [
    ("q", REQUIRED),
    ("k", REQUIRED),
    ("v", REQUIRED),
    ("softmax_scale", None),
    ("causal", False),
    ("qv", None),
    ("q_descale", None),
    ("k_descale", None),
    ("v_descale", None),
    ("window_size", (-1, -1)),
    ("attention_chunk", 0),
    ("softcap", 0.0),
    ("num_splits", 1),
    ("pack_gqa", None),
    ("deterministic", False),
    ("sm_margin", 0),
    ("return_attn_probs", False),
]
FI_MERGE = [("v_a", REQUIRED), ("s_a", REQUIRED), ("v_b", REQUIRED), ("s_b", REQUIRED)]


def expected_signature(name: str) -> list[tuple[str, object]]:
    api, contract = HELDOUT[name].api, CONTRACTS[name]
    if api == "flash_attn_func":
        return FA3_FUNC if contract.signature == "FlashAttention-3" else FA2_FUNC
    return {
        "flash_attn_varlen_func": FA2_VARLEN,
        "flash_attn_with_kvcache": FA2_KVCACHE,
        "merge_state": FI_MERGE,
    }[api]


@pytest.mark.parametrize("name", sorted(HELDOUT))
def test_signature_is_the_real_librarys(name: str) -> None:
    params = inspect.signature(fn(name)).parameters.values()
    assert [(p.name, p.default) for p in params] == expected_signature(name)
    out_kw = [p for p in params if p.name == "out"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in out_kw)


def test_heldout_kernels_import_nothing_from_flashprobe() -> None:
    """The held-out kernels are written without flashprobe: importing them loads no flashprobe module."""
    code = "import sys, lab.heldout; print(sorted(m for m in sys.modules if m.split('.')[0] == 'flashprobe'))"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert result.stdout.strip() == "[]"


def test_table_rows_are_consistent() -> None:
    apis = {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_state"}
    assert set(HELDOUT) == set(CONTRACTS)
    for name, row in HELDOUT.items():
        assert row.fn.__name__ == name and row.api in apis and row.kind in ("bug", "control") and row.trigger
        if row.kind == "bug":  # each bug names the field report it models
            assert any(w in row.fn.__doc__ for w in ("issue", "PR", "audit")), name
    kinds = [row.kind for row in HELDOUT.values()]
    assert kinds.count("control") == 10 and kinds.count("bug") == 21


# ---- dense controls

DENSE_CONTROLS = ("fa2_online128", "fa2_exp2_block64", "fa2_planned", "fa2_handwritten_backward")
# (B, N_q, N_k, H_q, H_k, D, call options): ragged lengths, N_q != N_k both ways, GQA, every feature.
DENSE_CASES = [
    (2, 37, 200, 4, 2, 32, {}),
    (1, 64, 64, 2, 2, 64, {"causal": True}),
    (2, 50, 20, 4, 1, 16, {"causal": True}),  # N_q > N_k: the first 30 rows see no key
    (1, 40, 150, 4, 4, 24, {"window": (17, 5)}),
    (1, 30, 30, 2, 2, 16, {"window": (0, 0)}),
    (2, 20, 45, 4, 2, 16, {"softcap": 1.5, "alibi": True}),
    (1, 33, 140, 6, 2, 40, {"causal": True, "window": (60, 0), "softcap": 5.0, "alibi": True}),
]


def slopes_for(opts: dict, h_q: int, gen: torch.Generator) -> torch.Tensor | None:
    """ALiBi slopes in (0, 1) when the case asks for ALiBi."""
    return torch.rand(h_q, generator=gen, dtype=torch.float64).float() if opts.get("alibi") else None


def call_dense(kernel, q, k, v, opts: dict, slopes: torch.Tensor | None):
    return kernel(
        q, k, v, causal=opts.get("causal", False), window_size=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap", 0.0), alibi_slopes=slopes, return_attn_probs=True,
    )  # fmt: skip


def ref_of(q, k, v, opts: dict, slopes):
    return ref_rows(
        q, k, v, causal=opts.get("causal", False), window=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap", 0.0), alibi=slopes,
    )  # fmt: skip


@functools.cache
def dense_case(index: int, dtype: torch.dtype, seed: int):
    """Inputs, ALiBi slopes and FP64 golden of ``DENSE_CASES[index]``, computed once for all controls."""
    b, n_q, n_k, h_q, h_k, d, opts = DENSE_CASES[index]
    q, k, v = qkv(b, n_q, n_k, h_q, h_k, d, dtype, seed)
    slopes = slopes_for(opts, h_q, torch.Generator().manual_seed(100 + seed))
    return q, k, v, slopes, *ref_of(q, k, v, opts, slopes)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", DENSE_CONTROLS)
def test_dense_control_matches_fp64(name: str, dtype: torch.dtype, seed: int) -> None:
    reset_state()
    for index, (b, n_q, _, h_q, _, _, opts) in enumerate(DENSE_CASES):
        q, k, v, slopes, ref, ref_lse = dense_case(index, dtype, seed)
        out, lse, s_dmask = call_dense(fn(name), q, k, v, opts, slopes)
        assert out.dtype == dtype and out.shape == ref.shape and s_dmask is None
        assert_matches(out, ref, dtype)
        assert lse.dtype == torch.float32 and lse.shape == (b, h_q, n_q)
        assert_lse(lse, ref_lse, math.inf)  # flash-attn 2: +inf for a row without keys


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", DENSE_CONTROLS)
def test_dense_control_gradients_match_fp64(name: str, dtype: torch.dtype) -> None:
    """dq, dk, dv of the controls (autograd or hand-written) against autograd through the FP64 row loop."""
    reset_state()
    for opts in ({"causal": True, "softcap": 2.0}, {"window": (4, 2), "alibi": True}):
        q, k, v = qkv(1, 9, 14, 4, 2, 8, dtype, seed=3)
        gen = torch.Generator().manual_seed(5)
        d_out = randn((1, 9, 4, 8), torch.float64, gen)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, _, _ = call_dense(fn(name), *leaves, opts, slopes := slopes_for(opts, 4, gen))
        out.backward(d_out.to(dtype))
        ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
        ref, _ = ref_of(*ref_leaves, opts, slopes)
        ref.backward(d_out)
        for got, want in zip(leaves, ref_leaves, strict=True):
            assert got.grad.dtype == dtype
            assert err(got.grad, want.grad) <= 4 * bound(want.grad, dtype)


def test_dense_controls_reject_what_they_cannot_run() -> None:
    q, k, v = qkv(1, 4, 4, 3, 2, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        fn("fa2_online128")(q, k, v)
    q, k, v = qkv(1, 4, 4, 2, 2, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="dropout_p"):
        fn("fa2_online128")(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="alibi_slopes"):
        fn("fa2_exp2_block64")(q, k, v, alibi_slopes=torch.ones(3))


# ---- dense bugs: wrong on the trigger, right off it


def run_pair(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], opts: dict, seed: int = 0, std: float = 1.0
):
    b, n_q, n_k, h_q, h_k, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = randn((b, n_q, h_q, d), dtype, gen, std)
    k = randn((b, n_k, h_k, d), dtype, gen, std)
    v = randn((b, n_k, h_k, d), dtype, gen)
    out, lse, _ = call_dense(fn(name), q, k, v, opts, slopes := slopes_for(opts, h_q, gen))
    ref, ref_lse = ref_of(q, k, v, opts, slopes)
    return out, lse, ref, ref_lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softcap_through_exp(dtype: torch.dtype) -> None:
    # |s / softcap| reaches ~100 > 88.7: exp overflows, the row is NaN
    out, _, ref, _ = run_pair("fa2_softcap_exp", dtype, (1, 8, 16, 2, 2, 16), {"softcap": 0.05}, std=2.0)
    assert out.isnan().any()
    assert_wrong(out, ref, dtype)
    out, _, ref, _ = run_pair("fa2_softcap_exp", dtype, (1, 8, 16, 2, 2, 16), {"softcap": 30.0}, std=2.0)
    assert_matches(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_window_symmetric(dtype: torch.dtype) -> None:
    shape = (1, 40, 40, 2, 2, 16)
    out, _, ref, _ = run_pair("fa2_window_symmetric", dtype, shape, {"window": (8, 2)})
    assert_wrong(out, ref, dtype)
    for opts in ({"window": (6, 6)}, {"window": (8, 0), "causal": True}, {"window": (8, 2), "causal": True}):
        out, _, ref, _ = run_pair("fa2_window_symmetric", dtype, shape, opts)
        assert_matches(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alibi_top_left(dtype: torch.dtype) -> None:
    out, _, ref, _ = run_pair("fa2_alibi_topleft", dtype, (1, 20, 50, 2, 2, 16), {"alibi": True})
    assert_wrong(out, ref, dtype)
    out, _, ref, _ = run_pair(
        "fa2_alibi_topleft", dtype, (1, 20, 50, 2, 2, 16), {"alibi": True, "causal": True}
    )
    assert_wrong(out, ref, dtype)
    out, _, ref, _ = run_pair("fa2_alibi_topleft", dtype, (1, 30, 30, 2, 2, 16), {"alibi": True})
    assert_matches(out, ref, dtype)
    # causal with N_q > N_k: each row's biases shift by one constant, so only the LSE moves
    out, lse, ref, ref_lse = run_pair(
        "fa2_alibi_topleft", dtype, (1, 50, 20, 2, 2, 16), {"alibi": True, "causal": True}
    )
    assert_matches(out, ref, dtype)
    finite = torch.isfinite(ref_lse)
    assert err(lse[finite], ref_lse[finite]) > 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gqa_head_modulo(dtype: torch.dtype) -> None:
    out, _, ref, _ = run_pair("fa2_gqa_head_modulo", dtype, (2, 12, 30, 8, 2, 16), {})
    assert_wrong(out, ref, dtype)
    for h_q, h_k in ((8, 8), (8, 1)):
        out, _, ref, _ = run_pair("fa2_gqa_head_modulo", dtype, (2, 12, 30, h_q, h_k, 16), {})
        assert_matches(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tail_block_unmasked(dtype: torch.dtype) -> None:
    out, _, ref, _ = run_pair("fa2_tail_unmasked", dtype, (1, 16, 140, 2, 2, 16), {})
    assert_wrong(out, ref, dtype)
    out, _, ref, _ = run_pair("fa2_tail_unmasked", dtype, (1, 16, 256, 2, 2, 16), {})
    assert_matches(out, ref, dtype)
    out, _, ref, _ = run_pair("fa2_tail_unmasked", dtype, (1, 200, 200, 2, 2, 16), {"causal": True})
    assert_matches(out, ref, dtype)  # the padding lies right of every causal row


def tile_norms(x: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """Frobenius norm of each (64 rows × D) tile per (batch, head): ``(B, H, tiles)``."""
    t = x.double().transpose(1, 2)  # (B, H, N, D)
    return torch.stack(
        [t[:, :, i : i + rows].flatten(2).norm(dim=-1) for i in range(0, t.shape[2], rows)], -1
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ("fa2_tile_transposed", "fa2_tile_rows_permuted"))
def test_output_tile_moved_keeps_its_norm(name: str, dtype: torch.dtype) -> None:
    out, lse, ref, ref_lse = run_pair(name, dtype, (1, 64, 80, 2, 2, 64), {})
    assert_wrong(out, ref, dtype)
    assert err(tile_norms(out), tile_norms(ref)) <= 4 * bound(ref, dtype) * 64  # same norm per tile
    assert_lse(lse, ref_lse, math.inf)  # the LSE is right
    out, _, ref, _ = run_pair(name, dtype, (1, 63, 80, 2, 2, 64), {})
    assert_matches(out, ref, dtype)
    if name == "fa2_tile_transposed":
        out, _, ref, _ = run_pair(name, dtype, (1, 128, 80, 2, 2, 32), {})
        assert_matches(out, ref, dtype)


# ---- varlen and paged


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def packed_case(
    lens_q: list[int], lens_k: list[int], h_q: int, h_k: int, d: int, dtype: torch.dtype, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    q = randn((sum(lens_q), h_q, d), dtype, gen)
    k = randn((sum(lens_k), h_k, d), dtype, gen)
    v = randn((sum(lens_k), h_k, d), dtype, gen)
    return q, k, v


def varlen_ref(q, k, v, lens_q, lens_k, **opts):
    """Per-sequence FP64 reference of a packed call: ``out (total_q, H_q, D)``, ``lse (H_q, total_q)``."""
    outs, lses = [], []
    cq, ck = [0, *itertools.accumulate(lens_q)], [0, *itertools.accumulate(lens_k)]
    for b in range(len(lens_q)):
        o, lse = ref_rows(
            q[None, cq[b] : cq[b + 1]], k[None, ck[b] : ck[b + 1]], v[None, ck[b] : ck[b + 1]], **opts
        )
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def paginate(k: torch.Tensor, lens_k: list[int], page_size: int, gen: torch.Generator):
    """Scatter packed keys into shuffled pages poisoned with NaN (unused slots, unused pages); the block
    table's unused tail entries are -1."""
    ck = [0, *itertools.accumulate(lens_k)]
    n_pages = [-(-n // page_size) for n in lens_k]
    total = sum(n_pages) + 2  # two pages nobody uses
    order = torch.randperm(total, generator=gen)
    pages = torch.full((total, page_size, *k.shape[1:]), math.nan, dtype=k.dtype)
    table = torch.full((len(lens_k), max(n_pages) + 1), -1, dtype=torch.int32)
    used = 0
    for b in range(len(lens_k)):
        for p in range(n_pages[b]):
            page = int(order[used])
            used += 1
            table[b, p] = page
            chunk = k[ck[b] + p * page_size : min(ck[b] + (p + 1) * page_size, ck[b + 1])]
            pages[page, : len(chunk)] = chunk
    return pages, table


VARLEN_CASES = [
    ([5, 0, 17, 3], [9, 40, 0, 130], {}),
    ([12, 30, 1], [12, 7, 200], {"causal": True}),
    ([20, 9], [33, 60], {"window": (7, 3), "softcap": 3.0}),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_control_packed_matches_fp64(dtype: torch.dtype, seed: int) -> None:
    for lens_q, lens_k, opts in VARLEN_CASES:
        q, k, v = packed_case(lens_q, lens_k, 4, 2, 16, dtype, seed)
        poisoned = torch.full((q.shape[0], 4, 16), math.nan, dtype=dtype)
        out, lse, _ = fn("fa2_varlen_paged")(
            q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), return_attn_probs=True, out=poisoned,
            causal=opts.get("causal", False), window_size=opts.get("window", (-1, -1)),
            softcap=opts.get("softcap", 0.0),
        )  # fmt: skip
        ref, ref_lse = varlen_ref(q, k, v, lens_q, lens_k, **opts)
        assert out is poisoned and lse.shape == (4, q.shape[0])
        assert_matches(out, ref, dtype)  # NaN-poisoned out fully overwritten (zeros where no keys)
        assert_lse(lse, ref_lse, math.inf)


@pytest.mark.parametrize("page_size", (1, 16, 64, 128, 200, 256))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_control_paged_matches_fp64(dtype: torch.dtype, page_size: int) -> None:
    lens_q, lens_k = [4, 1, 9], [300, 0, 129]
    q, k, v = packed_case(lens_q, lens_k, 4, 2, 16, dtype, seed=page_size)
    gen = torch.Generator().manual_seed(7)
    k_pages, table = paginate(k, lens_k, page_size, gen)
    v_pages, _ = paginate(v, lens_k, page_size, torch.Generator().manual_seed(7))
    out = fn("fa2_varlen_paged")(
        q, k_pages, v_pages, cu(lens_q), cu(lens_k), 9, 300, causal=True, block_table=table
    )
    ref, _ = varlen_ref(q, k, v, lens_q, lens_k, causal=True)
    assert_matches(out, ref, dtype)


def test_varlen_control_rejects_malformed_lengths_and_tables() -> None:
    q, k, v = packed_case([3, 4], [5, 6], 2, 2, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="never decrease"):
        fn("fa2_varlen_paged")(q, k, v, torch.tensor([0, 4, 3], dtype=torch.int32), cu([5, 6]), 4, 6)
    with pytest.raises(ValueError, match="must equal the number of packed tokens"):
        fn("fa2_varlen_paged")(q, k, v, cu([3, 4]), cu([5, 5]), 4, 6)
    pages, table = paginate(k, [5, 6], 4, torch.Generator().manual_seed(0))
    table[1, 0] = 99
    with pytest.raises(ValueError, match="outside"):
        fn("fa2_varlen_paged")(q, pages, pages, cu([3, 4]), cu([5, 6]), 4, 6, block_table=table)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_empty_sequence_reads_neighbour(dtype: torch.dtype) -> None:
    name = "fa2_varlen_empty_reads_neighbour"
    for lens_k, trigger in (([0, 30, 12], True), ([20, 30, 12], False), ([20, 30, 0], False)):
        q, k, v = packed_case([6, 5, 4], lens_k, 2, 2, 16, dtype, seed=1)
        out = fn(name)(q, k, v, cu([6, 5, 4]), cu(lens_k), 6, max(lens_k))
        ref, _ = varlen_ref(q, k, v, [6, 5, 4], lens_k)
        (assert_wrong if trigger else assert_matches)(out, ref, dtype)
    # a batch of one: the fallback length is 0 too
    q, k, v = packed_case([6], [0], 2, 2, 16, dtype, seed=1)
    assert_matches(fn(name)(q, k, v, cu([6]), cu([0]), 6, 0), torch.zeros(6, 2, 16), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_rows_without_keys_unwritten(dtype: torch.dtype) -> None:
    name = "fa2_varlen_empty_rows_unwritten"
    q, k, v = packed_case([6, 5], [0, 30], 2, 2, 16, dtype, seed=2)
    out = fn(name)(
        q, k, v, cu([6, 5]), cu([0, 30]), 6, 30, out=torch.full((11, 2, 16), math.nan, dtype=dtype)
    )
    ref, _ = varlen_ref(q, k, v, [6, 5], [0, 30])
    assert out[:6].isnan().all() and not out[6:].isnan().any()
    assert_matches(out[6:], ref[6:], dtype)
    q, k, v = packed_case([6, 5], [3, 30], 2, 2, 16, dtype, seed=2)
    out = fn(name)(
        q, k, v, cu([6, 5]), cu([3, 30]), 6, 30, out=torch.full((11, 2, 16), math.nan, dtype=dtype)
    )
    assert_matches(out, varlen_ref(q, k, v, [6, 5], [3, 30])[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_page_size_above_128(dtype: torch.dtype) -> None:
    name = "fa2_paged_page_gt128"
    for page_size, lens_k, trigger in (
        (256, [200, 40], True),
        (128, [200, 40], False),
        (256, [100, 40], False),
    ):
        q, k, v = packed_case([3, 2], lens_k, 2, 2, 16, dtype, seed=3)
        k_pages, table = paginate(k, lens_k, page_size, torch.Generator().manual_seed(1))
        v_pages, _ = paginate(v, lens_k, page_size, torch.Generator().manual_seed(1))
        out = fn(name)(q, k_pages, v_pages, cu([3, 2]), cu(lens_k), 3, max(lens_k), block_table=table)
        ref, _ = varlen_ref(q, k, v, [3, 2], lens_k)
        (assert_wrong if trigger else assert_matches)(out, ref, dtype)


# ---- KV cache, split-KV


def cache_case(lens: list[int], n_new: int, n_q: int, dtype: torch.dtype, seed: int, capacity: int = 260):
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    k_cache = randn((b, capacity, 2, 16), dtype, gen)
    v_cache = randn((b, capacity, 2, 16), dtype, gen)
    q = randn((b, n_q, 4, 16), dtype, gen)
    k_new = randn((b, n_new, 2, 16), dtype, gen) if n_new else None
    v_new = randn((b, n_new, 2, 16), dtype, gen) if n_new else None
    return q, k_cache, v_cache, k_new, v_new


def kvcache_ref(q, k_cache, v_cache, lens, **opts):
    outs, lses = [], []
    for b, n in enumerate(lens):
        o, lse = ref_rows(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], **opts)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_control_matches_fp64(dtype: torch.dtype, seed: int) -> None:
    for lens, n_new, n_q, splits, opts in (
        ([200, 10, 0], 0, 1, 4, {}),
        ([150, 37], 3, 3, 0, {"causal": True}),
        ([0, 90], 0, 2, 7, {"causal": True, "window": (20, 0), "softcap": 4.0}),
    ):
        q, k_cache, v_cache, k_new, v_new = cache_case(lens, n_new, n_q, dtype, seed)
        before = k_cache.clone()
        out, lse = fn("fa2_kvcache_splitkv")(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
            causal=opts.get("causal", False), window_size=opts.get("window", (-1, -1)),
            softcap=opts.get("softcap", 0.0), num_splits=splits, return_softmax_lse=True,
        )  # fmt: skip
        total = [n + n_new for n in lens]
        if n_new:  # appended in place at cache_seqlens
            for b, n in enumerate(lens):
                assert torch.equal(k_cache[b, n : n + n_new], k_new[b])
                assert torch.equal(k_cache[b, :n], before[b, :n])
        ref, ref_lse = kvcache_ref(q, k_cache, v_cache, total, **opts)
        assert_matches(out, ref, dtype)
        assert_lse(lse, ref_lse, math.inf)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_control_paged(dtype: torch.dtype) -> None:
    lens = [70, 9]
    q, k_cache, v_cache, _, _ = cache_case(lens, 0, 2, dtype, seed=4, capacity=80)
    gen = torch.Generator().manual_seed(2)
    packed_k = torch.cat([k_cache[b, :n] for b, n in enumerate(lens)])
    packed_v = torch.cat([v_cache[b, :n] for b, n in enumerate(lens)])
    k_pages, table = paginate(packed_k, lens, 16, gen)
    v_pages, _ = paginate(packed_v, lens, 16, torch.Generator().manual_seed(2))
    out = fn("fa2_kvcache_splitkv")(q, k_pages, v_pages, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                    block_table=table, num_splits=3)  # fmt: skip
    assert_matches(out, kvcache_ref(q, k_cache, v_cache, lens)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_empty_splits_from_scratch(dtype: torch.dtype) -> None:
    name = "fa2_kvcache_empty_split_scratch"
    for lens, splits, trigger in (
        ([200, 10], 4, True),
        ([3], 8, True),
        ([200, 10], 1, False),
        ([200, 190], 4, False),
    ):
        q, k_cache, v_cache, _, _ = cache_case(lens, 0, 1, dtype, seed=5)
        out = fn(name)(
            q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32), num_splits=splits
        )
        ref, _ = kvcache_ref(q, k_cache, v_cache, lens)
        (assert_wrong if trigger else assert_matches)(out, ref, dtype)


# ---- merge_state


def split_states(dtype: torch.dtype, seed: int, cut: int, n_k: int = 40):
    """Segments [0, cut) and [cut, n_k) of one attention: their (v, s base 2) states, and the whole."""
    q, k, v = qkv(1, 12, n_k, 3, 3, 16, torch.float64, seed)
    whole, whole_lse = ref_rows(q, k, v)
    a, a_lse = ref_rows(q, k[:, :cut], v[:, :cut], scale=16**-0.5)
    b, b_lse = ref_rows(q, k[:, cut:], v[:, cut:], scale=16**-0.5)

    def state(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return o[0].to(dtype), (lse[0].T / math.log(2)).float()  # (seq, heads, dim), (seq, heads) base 2

    return (*state(a, a_lse), *state(b, b_lse)), whole[0], whole_lse[0].T / math.log(2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ("fi_merge_state", "fi_merge_state_logaddexp"))
def test_merge_controls_match_fp64(name: str, dtype: torch.dtype, seed: int) -> None:
    for cut in (0, 13, 40):  # empty A, both non-empty, empty B
        states, whole, whole_s = split_states(dtype, seed, cut)
        v_m, s_m = fn(name)(*states)
        assert v_m.dtype == dtype and s_m.dtype == torch.float32
        assert_matches(v_m, whole, dtype)
        assert err(s_m, whole_s) <= 1e-5 * float(whole_s.abs().max())
    empty_v, empty_s = torch.zeros(4, 2, 8, dtype=dtype), torch.full((4, 2), -math.inf)
    v_m, s_m = fn(name)(empty_v, empty_s, empty_v, empty_s)
    assert torch.equal(v_m, empty_v) and torch.equal(s_m, empty_s)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_natural_log(dtype: torch.dtype) -> None:
    states, whole, whole_s = split_states(dtype, 0, 5)  # LSEs about 3 apart (base 2)
    v_m, s_m = fn("merge_state_natural_log")(*states)
    assert_wrong(v_m, whole, dtype)
    assert err(s_m, whole_s) > 0.1
    states, whole, whole_s = split_states(dtype, 0, 0)  # one state empty
    v_m, s_m = fn("merge_state_natural_log")(*states)
    assert_matches(v_m, whole, dtype)
    assert err(s_m, whole_s) <= 1e-5 * float(whole_s.abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_lse_converted_twice(dtype: torch.dtype) -> None:
    states, whole, whole_s = split_states(dtype, 1, 13)
    v_m, s_m = fn("merge_state_lse_converted_twice")(*states)
    assert_matches(v_m, whole, dtype)  # V right: invisible to an output check
    assert err(s_m, whole_s) > 0.1
    empty_v, empty_s = torch.zeros(4, 2, 8, dtype=dtype), torch.full((4, 2), -math.inf)
    v_m, s_m = fn("merge_state_lse_converted_twice")(empty_v, empty_s, empty_v, empty_s)
    assert torch.equal(s_m, empty_s) and torch.equal(v_m, empty_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_empty_nan(dtype: torch.dtype) -> None:
    empty_v, empty_s = torch.zeros(4, 2, 8, dtype=dtype), torch.full((4, 2), -math.inf)
    v_m, s_m = fn("merge_state_empty_nan")(empty_v, empty_s, empty_v, empty_s)
    assert v_m.isnan().all() and s_m.isnan().all()
    for cut in (0, 13, 40):
        states, whole, whole_s = split_states(dtype, 2, cut)
        v_m, s_m = fn("merge_state_empty_nan")(*states)
        assert_matches(v_m, whole, dtype)
        assert err(s_m, whole_s) <= 1e-5 * float(whole_s.abs().max())


# ---- FP8 (FlashAttention-3 signature)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(batch, head) e4m3 quantisation of ``(B, N, H, D)``: the e4m3 tensor and its ``(B, H)`` descale."""
    descale = x.abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448.0
    return (x / descale[:, None, :, None]).to(E4M3), descale.float()


def dequant(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    return x8.double() * descale.double()[:, None, :, None]


def fp8_random(seed: int, n_q: int = 20, n_k: int = 300, h_q: int = 4, h_k: int = 2, d: int = 32):
    q, k, v = qkv(2, n_q, n_k, h_q, h_k, d, torch.float64, seed)
    (k8, kd), (v8, vd) = quantize(k), quantize(v)
    # q's descale is per KV head too: one scale for each query-head group
    group = q.view(2, n_q, h_k, h_q // h_k, d).abs().amax(dim=(1, 3, 4)).clamp(min=1e-6) / 448.0
    q8 = (q / group.repeat_interleave(h_q // h_k, 1)[:, None, :, None]).to(E4M3)
    qd = group.float()
    q_deq = q8.double() * qd.double().repeat_interleave(h_q // h_k, 1)[:, None, :, None]
    return (q8, k8, v8, qd, kd, vd), (q_deq, dequant(k8, kd), dequant(v8, vd))


def v_one_fixture(logits: list[float], d: int = 16):
    """e4m3 q, k, v with softmax_scale 1: query·key_j = logits[j] exactly, V = 1 (out must be 1)."""
    n = len(logits)
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = 1
    k = torch.zeros(1, n, 1, d)
    k[0, :, 0, 0] = torch.tensor(logits)
    return q.to(E4M3), k.to(E4M3), torch.ones(1, n, 1, d).to(E4M3)


PEAKED = [0.0] + [-7.0] * 1023  # one logit 0, the rest −7: most mass is diffuse
SINK = [4.0] + [-3.0] * 511  # an attention sink first
DIFFUSE = [0.0] * 300


@functools.cache
def fp8_case(seed: int, causal: bool):
    """e4m3 inputs with descales, the dequantised V and the FP64 golden on dequantised inputs (once)."""
    inputs, (q, k, v) = fp8_random(seed)
    return inputs, v, *ref_rows(q, k, v, scale=32**-0.5, causal=causal)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ("fa3_fp8_prescale", "fa4_fp8_lazy_bounded"))
def test_fp8_controls_match_fp64(name: str, seed: int) -> None:
    for causal in (False, True):
        (q8, k8, v8, qd, kd, vd), v, ref, ref_lse = fp8_case(seed, causal)
        out, lse = fn(name)(
            q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, return_attn_probs=True
        )
        assert out.dtype == torch.bfloat16 and lse.shape == (2, 4, 20)
        assert err(out, ref) <= TOL_FP8 * float(v.abs().max())
        assert_lse(lse, ref_lse, -math.inf)
    for logits in (PEAKED, SINK, DIFFUSE, [-7.0] * 200 + [2.0] + [0.0] * 100):
        out = fn(name)(*v_one_fixture(logits), softmax_scale=1.0)
        assert err(out, torch.ones_like(out, dtype=torch.float64)) <= TOL_FP8


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("name", ("fa3_fp8_prescale", "fa3_fp8_no_prescale", "fa4_fp8_lazy_rescale"))
def test_fp8_kernels_on_16_bit_inputs(name: str, dtype: torch.dtype) -> None:
    """16-bit inputs take FA3's 16-bit path (no P cast to e4m3): right for the FP8 bugs too."""
    q, k, v = qkv(2, 20, 300, 4, 2, 32, dtype, seed=9)
    out, lse = fn(name)(q, k, v, causal=True, return_attn_probs=True)
    ref, ref_lse = ref_rows(q, k, v, causal=True)
    assert out.dtype == dtype
    assert_matches(out, ref, dtype)
    assert_lse(lse, ref_lse, -math.inf)  # FlashAttention-3: -inf for a row without keys


def test_fp8_no_prescale_loses_diffuse_mass() -> None:
    out = fn("fa3_fp8_no_prescale")(*v_one_fixture(PEAKED), softmax_scale=1.0)
    expected = 1 / (1 + 1023 * math.exp(-7.0))  # the −7 keys round to 0 in the numerator only
    assert float(out.float().mean()) == pytest.approx(expected, abs=0.02)
    _, lse = fn("fa3_fp8_no_prescale")(*v_one_fixture(PEAKED), softmax_scale=1.0, return_attn_probs=True)
    assert float(lse.flatten()[0]) == pytest.approx(
        math.log(1 + 1023 * math.exp(-7.0)), abs=1e-4
    )  # LSE exact
    inputs, (q, k, v) = fp8_random(0, n_k=64)  # off the trigger: random rows with few keys
    out = fn("fa3_fp8_no_prescale")(
        *inputs[:3], q_descale=inputs[3], k_descale=inputs[4], v_descale=inputs[5]
    )
    assert err(out, ref_rows(q, k, v, scale=32**-0.5)[0]) <= TOL_FP8 * float(v.abs().max())


def test_fp8_lazy_rescale_saturates() -> None:
    late_max = [-7.0] * 256
    late_max[0], late_max[200] = 0.0, 2.0  # block 2 raises the max by 2 (2.9 log2 units < 4)
    out = fn("fa4_fp8_lazy_rescale")(*v_one_fixture(late_max), softmax_scale=1.0)
    assert float(out.float().mean()) < 0.5  # P = 2^(8+2.9) saturated at 448
    early_max = [-7.0] * 256
    early_max[0], early_max[200] = 2.0, 0.0  # the max in the first block: nothing lags
    out = fn("fa4_fp8_lazy_rescale")(*v_one_fixture(early_max), softmax_scale=1.0)
    assert err(out, torch.ones_like(out, dtype=torch.float64)) <= TOL_FP8
    small_rise = [-7.0] * 256
    small_rise[0], small_rise[200] = 0.0, 0.5  # 0.72 log2 units: 2^8.72 < 448
    out = fn("fa4_fp8_lazy_rescale")(*v_one_fixture(small_rise), softmax_scale=1.0)
    assert err(out, torch.ones_like(out, dtype=torch.float64)) <= TOL_FP8


@pytest.mark.parametrize("seed", SEEDS)
def test_fp8_that_computes_in_bf16_beats_any_fp8(seed: int) -> None:
    """Within FP8's tolerance (a tolerance passes it) yet several times closer than a real FP8 P·V."""
    (q8, k8, v8, qd, kd, vd), v, ref, _ = fp8_case(seed, False)
    cheat = err(fn("fa3_fp8_computes_bf16")(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd), ref)
    real = err(fn("fa3_fp8_prescale")(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd), ref)
    assert cheat <= TOL_FP8 * float(v.abs().max())
    assert cheat < real / 3


# ---- state across calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plan_cache_without_scale(dtype: torch.dtype) -> None:
    reset_state()
    name = "fa2_plan_key_no_scale"
    q, k, v = qkv(1, 16, 24, 2, 2, 16, dtype, seed=0)
    assert_matches(fn(name)(q, k, v, softmax_scale=0.25), ref_rows(q, k, v, scale=0.25)[0], dtype)
    assert_wrong(fn(name)(q, k, v, softmax_scale=1.0), ref_rows(q, k, v, scale=1.0)[0], dtype)
    reset_state()
    assert_matches(fn(name)(q, k, v, softmax_scale=1.0), ref_rows(q, k, v, scale=1.0)[0], dtype)
    for scale in (0.25, 1.0):  # the control keys on the scale
        assert_matches(
            fn("fa2_planned")(q, k, v, softmax_scale=scale), ref_rows(q, k, v, scale=scale)[0], dtype
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plan_cache_without_strides(dtype: torch.dtype) -> None:
    reset_state()
    name = "fa2_plan_key_no_strides"
    q, k, v = qkv(2, 16, 24, 4, 2, 16, dtype, seed=0)
    assert_matches(fn(name)(q, k, v), ref_rows(q, k, v)[0], dtype)
    q2, k2, v2 = (
        x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(2, 16, 24, 4, 2, 16, dtype, seed=1)
    )
    assert q2.shape == q.shape and q2.stride() != q.stride()  # same shapes, (B, H, N, D) memory
    assert_wrong(fn(name)(q2, k2, v2), ref_rows(q2, k2, v2)[0], dtype)
    q3, k3, v3 = qkv(2, 16, 24, 4, 2, 16, dtype, seed=2)  # same layout as the plan: right
    assert_matches(fn(name)(q3, k3, v3), ref_rows(q3, k3, v3)[0], dtype)
    for x in ((q, k, v), (q2, k2, v2)):
        assert_matches(fn("fa2_planned")(*x), ref_rows(*x)[0], dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", ("fa2_handwritten_backward", "fa2_stale_dout_backward"))
def test_two_backwards_through_one_forward(name: str, dtype: torch.dtype) -> None:
    q, k, v = qkv(1, 10, 14, 4, 2, 8, dtype, seed=6)
    gen = torch.Generator().manual_seed(8)
    d_outs = [randn((1, 10, 4, 8), torch.float64, gen) for _ in range(2)]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(name)(*leaves, causal=True)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, _ = ref_rows(*ref_leaves, causal=True)
    for call, d_out in enumerate(d_outs):
        for x in (*leaves, *ref_leaves):
            x.grad = None
        out.backward(d_out.to(dtype), retain_graph=True)
        ref.backward(d_out, retain_graph=True)
        errors = [
            err(got.grad, want.grad) / (4 * bound(want.grad, dtype))
            for got, want in zip(leaves, ref_leaves, strict=True)
        ]
        if name == "fa2_stale_dout_backward" and call == 1:  # dq, dk wrong, dv right
            assert errors[0] > 10 and errors[1] > 10 and errors[2] <= 1, errors
        else:
            assert all(e <= 1 for e in errors), errors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kvcache_scratch_reused_across_calls(dtype: torch.dtype) -> None:
    name = "fa2_kvcache_reused_scratch"
    reset_state()
    long_case = cache_case([200, 190], 0, 1, dtype, seed=7)
    short_case = cache_case([200, 10], 0, 1, dtype, seed=8)
    seqlens = {id(long_case): [200, 190], id(short_case): [200, 10]}
    for case, trigger in ((long_case, False), (short_case, True)):
        q, k_cache, v_cache, _, _ = case
        lens = seqlens[id(case)]
        out = fn(name)(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32), num_splits=4)
        (assert_wrong if trigger else assert_matches)(out, kvcache_ref(q, k_cache, v_cache, lens)[0], dtype)
    reset_state()  # the short call first, on fresh scratch: right
    q, k_cache, v_cache, _, _ = short_case
    out = fn(name)(
        q, k_cache, v_cache, cache_seqlens=torch.tensor([200, 10], dtype=torch.int32), num_splits=4
    )
    assert_matches(out, kvcache_ref(q, k_cache, v_cache, [200, 10])[0], dtype)
