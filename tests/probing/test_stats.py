"""Statistics against independent float64 computations, non-finite handling, chunking, DDP layout."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashprobe.probing.shadow as shadow_module
import flashprobe.probing.stats as stats_module
from flashprobe.deviation import deviation_tensors
from flashprobe.kernels import get_kernel, math_attention
from flashprobe.kernels.math import plain_attention
from flashprobe.kernels.reference import BYTES_PER_SCORE
from flashprobe.probing import N_MAX, N_SUMS, ProbeWarning, ShadowAttention, probe
from flashprobe.probing.stats import pair_sums

from .test_sites import Direct

deviation_module = sys.modules["flashprobe.deviation"]  # (the package's `deviation` is the function)


def _qkv(b=2, h=2, n=7, d=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))


def _np_attention(q, k, v, scale):
    """Float64 attention in numpy, with its hand-derived gradients for a given output gradient."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v

    def grads(do):
        do = np.asarray(do, dtype=np.float64)
        dp = do @ np.swapaxes(v, -1, -2)
        ds = p * (dp - (do * out).sum(-1, keepdims=True))
        return ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ do

    return out, grads


def _np_dev(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    fin = np.isfinite(a) & np.isfinite(b)
    d = np.abs(np.where(fin, a - b, 0.0))
    ref = np.where(fin, b, 0.0)
    return {
        "max_abs": d.max(),
        "mean_abs": d.sum() / fin.sum(),
        "rel_l2": math.sqrt((d**2).sum() / (ref**2).sum()),
        "nonfinite": int((~fin).sum()),
    }


def _check(got, want, rel=1e-9):
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-300), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_sums_match_deviation_tensors_with_nonfinite(dtype, monkeypatch) -> None:
    monkeypatch.setitem(deviation_module.SLICE_ELEMENTS, "cpu", 37)  # exercise the slice loop
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64)
    p = (g + 1e-2 * torch.randn(g.shape, generator=gen, dtype=torch.float64)).to(dtype)
    b = (g + 1e-2 * torch.randn(g.shape, generator=gen, dtype=torch.float64)).to(dtype)
    p[0, 0, :3] = float("nan")
    b[1, 2, 4] = float("inf")
    g[2, 1, 0] = float("-inf")
    got = pair_sums(p, b, g)
    for j, (x, y) in enumerate(((p, b), (p, g), (b, g))):
        want = deviation_tensors(x.double(), y)
        for i, name in enumerate(("max_abs", "sum_abs", "sum_sq_diff", "sum_sq_ref", "nonfinite", "count")):
            assert got[i, j].item() == pytest.approx(want[name].item(), rel=1e-12), (j, name)
    assert torch.isfinite(got).all()


def test_forward_stats_against_numpy_float64() -> None:
    q, k, v = _qkv()
    primary = get_kernel("tiled:block_q=3,block_k=4")
    shadow = ShadowAttention(primary=primary, baseline="math", golden=True)
    out = shadow(q, k, v, scale=0.3)
    assert torch.equal(out, primary(q, k, v, scale=0.3))  # the model gets the primary's output
    golden, _ = _np_attention(q, k, v, 0.3)
    base = math_attention(q, k, v, scale=0.3)
    got = shadow.stats()["attention"]["forward"]["out"]
    _check(got["primary_baseline"], _np_dev(out, base))
    _check(got["primary_golden"], _np_dev(out, golden), rel=1e-6)
    _check(got["baseline_golden"], _np_dev(base, golden), rel=1e-6)
    want_ratio = _np_dev(out, golden)["max_abs"] / _np_dev(base, golden)["max_abs"]
    assert got["error_ratio"] == pytest.approx(want_ratio, rel=1e-6)
    assert got["max_call_error_ratio"] == pytest.approx(want_ratio, rel=1e-6)


def test_backward_stats_against_hand_computed_gradients() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(b=1, n=6))
    gen = torch.Generator().manual_seed(5)
    grad_out = torch.randn(1, 2, 6, 8, generator=gen)
    model = Direct()
    with probe(model, backward=True) as p:
        out = model(q, k, v)
    out.backward(grad_out)
    primary = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base = dict(
        zip(("dq", "dk", "dv"), torch.autograd.grad(math_attention(*leaves), leaves, grad_out), strict=True)
    )
    _, np_grads = _np_attention(q.detach(), k.detach(), v.detach(), 1 / math.sqrt(8))
    golden = dict(zip(("dq", "dk", "dv"), np_grads(grad_out), strict=True))
    got = p.stats()[p.sites[0]]["backward"]
    assert got["calls"] == 1
    for name in ("dq", "dk", "dv"):
        _check(got[name]["primary_baseline"], _np_dev(primary[name], base[name]))
        _check(got[name]["primary_golden"], _np_dev(primary[name], golden[name]), rel=1e-6)
        _check(got[name]["baseline_golden"], _np_dev(base[name], golden[name]), rel=1e-6)


def test_nonfinite_inputs_are_counted_without_raising() -> None:
    q, k, v = _qkv(b=1)
    q[0, 1, 3, 2] = float("nan")  # poisons one output row of head 1
    shadow = ShadowAttention(baseline="math", golden=True)
    out = shadow(q, k, v)  # no exception
    entry = shadow.stats()["attention"]
    assert entry["nonfinite_inputs"] == {"q": 1, "k": 0, "v": 0, "grad_out": 0}
    fwd = entry["forward"]["out"]
    golden, _ = _np_attention(q, k, v, 1 / math.sqrt(8))
    rows = np.isnan(golden)  # the poisoned row; torch's CPU flash kernel returns 0 there, not NaN
    assert rows.sum() == 8
    finite = ~rows
    for pair in ("primary_baseline", "primary_golden", "baseline_golden"):
        assert fwd[pair]["nonfinite"] == 8, pair
        assert math.isfinite(fwd[pair]["max_abs"]), pair
    want = np.abs(out.double().numpy() - golden)[finite].max()
    assert fwd["primary_golden"]["max_abs"] == pytest.approx(want, rel=1e-9)
    assert math.isfinite(fwd["error_ratio"])
    summary = shadow.summary()
    assert summary.nonfinite == 1 + 3 * 8 and summary.nonfinite_sites == ["attention"]


def test_blocked_references_bound_memory_and_agree(monkeypatch) -> None:
    """The references run in the blocks of flashprobe.kernels.reference: with a budget that fits the
    whole call, one block; with smaller ones, per batch entry and row blocks. Every block keeps
    within the budget's scores, and the statistics agree with the one-block run (golden exactly up
    to float64 rounding; the fp32 baseline sums dk, dv over row blocks, so only its rounding moves)."""
    seen = []
    real = plain_attention

    def spy(q, k, v, **kw):
        if q.dtype == torch.float64:  # the golden's blocks
            seen.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
        return real(q, k, v, **kw)

    monkeypatch.setattr(shadow_module, "plain_attention", spy)
    q, k, v = (t.requires_grad_() for t in _qkv(b=3, n=20))
    grad_out = torch.randn(3, 2, 20, 8, generator=torch.Generator().manual_seed(2))
    results, calls = {}, {}
    # whole call; one batch entry per block; a few query rows per block
    budgets = {"whole": 10**9, "entry": 60_000, "rows": 9_000}
    for name, budget in budgets.items():
        seen.clear()
        shadow = ShadowAttention(baseline="math", backward=True, memory_budget=budget)
        shadow(q, k, v, is_causal=True).backward(grad_out)
        results[name] = shadow.stats()["attention"]
        calls[name] = len(seen)
        assert all(n * BYTES_PER_SCORE[True] <= budget for n in seen)
    # One golden forward per block: with backward=True the forward comparison uses the outputs of
    # the same pass that the gradients need.
    assert calls["whole"] == 1
    assert calls["entry"] == 3
    assert calls["rows"] > 3 * 2
    parts = (("forward", "out"), ("backward", "dq"), ("backward", "dk"), ("backward", "dv"))
    whole = results["whole"]
    for direction, part in parts:
        for pair in ("primary_baseline", "primary_golden", "baseline_golden"):
            got, want = results["entry"][direction][part][pair], whole[direction][part][pair]
            assert got["max_abs"] == pytest.approx(want["max_abs"], rel=1e-6), (part, pair)
            assert got["rel_l2"] == pytest.approx(want["rel_l2"], rel=1e-6), (part, pair)
        rows = results["rows"][direction][part]
        assert rows["primary_golden"]["max_abs"] == pytest.approx(
            whole[direction][part]["primary_golden"]["max_abs"]
        )
        assert (
            0.2
            < rows["baseline_golden"]["max_abs"] / whole[direction][part]["baseline_golden"]["max_abs"]
            < 5
        )


def test_stat_tensors_reduce_like_one_run() -> None:
    """Two 'ranks' reduced with MAX over [:N_MAX] and SUM over [N_MAX:N_SUMS] equal one probe over
    both (no call fails: the arg fields are equal on both ranks)."""
    batches = [_qkv(seed=s) for s in (1, 2)]
    ranks = []
    for batch in batches:
        shadow = ShadowAttention()
        shadow(*batch)
        ranks.append(shadow.stat_tensors()["attention"])
    reduced = torch.cat(
        (
            torch.maximum(ranks[0][:N_MAX], ranks[1][:N_MAX]),
            ranks[0][N_MAX:N_SUMS] + ranks[1][N_MAX:N_SUMS],
            ranks[0][N_SUMS:],
        )
    )
    both = ShadowAttention()
    for batch in batches:
        both(*batch)
    got = both.stats({"attention": reduced})["attention"]
    want = both.stats()["attention"]
    assert got["forward"]["calls"] == 2
    for pair in ("primary_baseline", "primary_golden", "baseline_golden"):
        for key, value in want["forward"]["out"][pair].items():
            assert got["forward"]["out"][pair][key] == pytest.approx(value, rel=1e-12)
    flat = both.stats(flat=True)["attention"]
    assert flat["forward.out.primary_golden.max_abs"] == want["forward"]["out"]["primary_golden"]["max_abs"]


def test_sdpa_arguments_are_forwarded_faithfully() -> None:
    """GQA, additive and bool masks, scale and 3-D inputs reach the kernel as SDPA sees them."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k, v = torch.randn(2, 2, 7, 8, generator=gen), torch.randn(2, 2, 7, 6, generator=gen)
    additive = torch.randn(5, 7, generator=gen)
    keep = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
    model = Direct()
    cases = [
        dict(enable_gqa=True, attn_mask=additive, scale=0.2),
        dict(enable_gqa=True, attn_mask=keep),
        dict(enable_gqa=True, is_causal=True),
    ]
    for kwargs in cases:
        want = F.scaled_dot_product_attention(q, k, v, **kwargs)
        shadow = ShadowAttention(primary="math")
        assert torch.allclose(shadow(q, k, v, **kwargs), want, atol=1e-6), kwargs
        assert shadow.stats()["attention"]["forward"]["out"]["primary_baseline"]["max_abs"] == 0
    q3, k3, v3 = q[0], k[0].repeat_interleave(2, 0), v[0].repeat_interleave(2, 0)  # (H, N, D)
    with probe(model, primary="math") as p:
        got = F.scaled_dot_product_attention(q3, k3, v3)  # outside: untouched
        assert torch.allclose(model.forward.__func__(model, q3, k3, v3), got)
    assert p.calls == {}  # forward called directly, not through __call__: not attributed


def test_without_golden_and_with_dropout_skip() -> None:
    q, k, v = _qkv()
    shadow = ShadowAttention(primary="tiled", golden=False)
    assert shadow.summary().max_error_ratio is None  # nothing recorded yet
    shadow(q, k, v)
    out = shadow.stats()["attention"]["forward"]["out"]
    assert out["primary_golden"] is None and out["baseline_golden"] is None and out["error_ratio"] is None
    assert 0 < out["primary_baseline"]["max_abs"] < 1e-5
    skipping = ShadowAttention(dropout="skip")
    with pytest.warns(ProbeWarning, match="skipping"):
        skipping(q, k, v, dropout_p=0.5)
    entry = skipping.stats()["attention"]
    assert entry["dropout_calls"] == 1 and entry["forward"]["calls"] == 0


def test_backward_mode_compares_the_forward_even_without_a_backward() -> None:
    """With backward=True the forward comparison waits for the backward; a call whose backward never
    comes (graph dropped, or no gradient reaching its output) is still compared, exactly once."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    shadow = ShadowAttention(baseline="math", backward=True)
    out = shadow(q, k, v)
    del out  # graph freed without backward: its finalizer queues the forward comparison
    other = shadow(q, k, v)
    (q * 2).sum().backward()  # a backward runs, but no gradient reaches `other`
    assert shadow.stats()["attention"]["forward"]["calls"] == 1  # `other` may still get one
    del other
    stats = shadow.stats()["attention"]
    assert stats["forward"]["calls"] == 2 and stats["backward"]["calls"] == 0
    with_backward = ShadowAttention(baseline="math", backward=True)
    with_backward(q, k, v).sum().backward()
    got = with_backward.stats()["attention"]
    assert got["forward"]["calls"] == got["backward"]["calls"] == 1
    # The deferred forward comparison equals the one made at once without backward.
    plain = ShadowAttention(baseline="math", backward=False)
    plain(q, k, v)
    assert got["forward"] == plain.stats()["attention"]["forward"]


def test_one_nan_token_counts_once() -> None:
    """nonfinite_inputs counts positions (batch entry x token), not elements (heads x channels)."""
    q, k, v = _qkv(b=2, h=2, n=5, d=8)
    q[1, :, 3, :] = float("nan")  # one token of one sequence, every head and channel
    k[0, 1, 2, 4] = float("inf")  # one element
    shadow = ShadowAttention(baseline="math", golden=True)
    shadow(q, k, v)
    assert shadow.stats()["attention"]["nonfinite_inputs"] == {"q": 1, "k": 1, "v": 0, "grad_out": 0}


@pytest.mark.parametrize("free", [True, False])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("nonfinite", [True, False])
@pytest.mark.parametrize("golden", [True, False])
@pytest.mark.parametrize("chunk", [1, 16, 37, 1 << 16])
def test_pair_sums_against_numpy_oracle(golden, chunk, nonfinite, strided, free, monkeypatch) -> None:
    """Every row of :func:`pair_sums`, ``max_ref`` included, from an independent numpy float64
    computation, with non-finite values of every kind on and around slice boundaries, or none;
    at each slice size; contiguous tensors, or strided views (as autograd hands gradients over);
    with host reads free (the CPU: finite slices skip masking) or not (as on a device)."""
    monkeypatch.setitem(deviation_module.SLICE_ELEMENTS, "cpu", chunk)
    monkeypatch.setattr(deviation_module, "FREE_READS", frozenset({"cpu"} if free else ()))
    gen = torch.Generator().manual_seed(3)
    g = 3.0 * torch.randn(2, 3, 41, generator=gen, dtype=torch.float64)
    p = (g + 1e-3 * torch.randn(g.shape, generator=gen, dtype=torch.float64)).float()
    b = (g + 1e-3 * torch.randn(g.shape, generator=gen, dtype=torch.float64)).float()
    flat_p, flat_b, flat_g = p.view(-1), b.view(-1), g.view(-1)
    if nonfinite:
        flat_p[[0, 15, 16, 36]] = float("nan")
        flat_b[[16, 17, 37, 200]] = float("inf")
        flat_b[[90]] = float("-inf")
        flat_g[[36, 37, 100]] = float("-inf")
        flat_g[[101]] = float("nan")
        flat_p[[100]] = float("-inf")
    if strided:
        p, b, g = (t.transpose(0, 2) for t in (p, b, g))
    got = pair_sums(p, b, g if golden else None).numpy()
    pairs = [(p, b), (p, g), (b, g)] if golden else [(p, b)]
    assert got.shape == (7, len(pairs))
    for j, (x, y) in enumerate(pairs):
        x64, y64 = x.double().numpy().ravel(), y.double().numpy().ravel()
        fin = np.isfinite(x64) & np.isfinite(y64)
        with np.errstate(invalid="ignore"):  # inf - inf where the pair is not finite
            d = np.abs(np.where(fin, x64 - y64, 0.0))
        ref = np.abs(np.where(fin, y64, 0.0))
        want = [d.max(), d.sum(), (d**2).sum(), (ref**2).sum(), (~fin).sum(), fin.sum(), ref.max()]
        for i, value in enumerate(want):
            assert got[i, j] == pytest.approx(value, rel=1e-12, abs=1e-300), (j, i)


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_pair_sums_skip_masking_without_changing_a_bit(dtype, chunk, monkeypatch) -> None:
    """On finite data, the statistics read where reads are free (masking skipped, the golden pairs
    sharing one reference row) equal, bit for bit, those of the always-masked path a device runs;
    for strided views and their contiguous copies alike, sizes that are no multiple of anything."""
    monkeypatch.setitem(deviation_module.SLICE_ELEMENTS, "cpu", chunk)
    gen = torch.Generator().manual_seed(11)
    shapes = [(1, 1), (3, 5, 7), (2, 3, 67, 13)] + ([(4, 4, 128, 65)] if chunk > 1000 else [])
    for shape in shapes:
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        p = (g + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
        b = (g + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
        for args in [(p, b, g), (p, b, None), (p.mT, b.mT, g.mT)]:
            monkeypatch.setattr(deviation_module, "FREE_READS", frozenset({"cpu"}))
            read = pair_sums(*args)
            contiguous = pair_sums(*(None if t is None else t.contiguous() for t in args))
            monkeypatch.setattr(deviation_module, "FREE_READS", frozenset())
            masked = pair_sums(*args)
            assert torch.equal(read, masked), (shape, args[2] is None)
            assert torch.equal(read, contiguous), (shape, args[2] is None)


def test_pair_sums_of_empty_tensors_are_zero() -> None:
    empty = torch.empty(0, 4)
    got = pair_sums(empty, empty, empty.double())
    assert got.shape == (7, 3)
    assert (got == 0).all()


@pytest.mark.parametrize("free", [True, False])
def test_nonfinite_positions_count_tokens_and_an_overflowing_sum_is_not_a_nan(free, monkeypatch) -> None:
    """Finite values near the float32 (or float64) maximum whose sums overflow count as finite;
    with host reads free (a finite plain sum answers 0 at once) or not (as on a device)."""
    monkeypatch.setattr(deviation_module, "FREE_READS", frozenset({"cpu"} if free else ()))
    big = torch.full((2, 3, 5, 4), 3e38)
    assert torch.isinf(big.sum())
    assert stats_module.count_nonfinite_positions(big).item() == 0
    huge = torch.full((2, 3, 5, 4), 1e308, dtype=torch.float64)  # its float64 sums overflow too
    huge[:, 1] = -1e308
    assert stats_module.count_nonfinite_positions(huge).item() == 0
    x = torch.randn(2, 3, 5, 4)
    assert stats_module.count_nonfinite_positions(x).item() == 0
    x[0, :, 1, :] = float("nan")  # one token, every head and channel: counts once
    x[1, 2, 4, 0] = float("-inf")
    x[1, 0, 4, 3] = float("inf")  # same token as the -inf
    assert stats_module.count_nonfinite_positions(x).item() == 2
    assert (
        stats_module.count_nonfinite_positions(
            x.to(torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
        ).item()
        == 2
    )
