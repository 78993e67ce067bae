"""Blocked references (flashprobe.kernels.reference): coverage, budgets, and exactness.

The oracle is the same computation done in one piece in float64 (or a coverage count done by hand):
a block's rows are independent of the other rows, so the blocked result must match to rounding.
"""

from __future__ import annotations

import pytest
import torch

from flashprobe.kernels import math_attention
from flashprobe.kernels.reference import (
    BYTES_PER_SCORE,
    CAUSAL_BLOCK_ROWS,
    MAX_BUDGET,
    MIN_BUDGET,
    numerics_flags,
    plan_blocks,
    reference_attention,
    reference_budget,
    reference_gradients,
    reference_numerics,
)


def _coverage(q_shape, k_shape, blocks):
    """How many blocks compute each (batch, kv head, row, key) score."""
    b, _, n_q, _ = q_shape
    h_kv, n_k = k_shape[1], k_shape[2]
    count = torch.zeros(b, h_kv, n_q, n_k, dtype=torch.int32)
    for blk in blocks:
        count[blk.batch, blk.heads, blk.rows, : blk.keys] += 1
    return count


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("q_shape", "k_shape", "budget"),
    [
        ((2, 4, 300, 16), (2, 4, 300, 16), 1 << 40),  # one block
        ((3, 4, 300, 16), (3, 2, 280, 16), 600_000),  # GQA, split by batch / heads
        ((2, 4, 517, 16), (2, 4, 517, 16), 40_000),  # split into rows of one head
        ((1, 2, 256, 8), (1, 2, 700, 8), 1 << 40),  # more keys than rows
        ((1, 2, 700, 8), (1, 2, 256, 8), 1 << 40),  # more rows than keys
    ],
)
def test_blocks_cover_every_visible_score_once(q_shape, k_shape, budget, causal):
    blocks = plan_blocks(q_shape, k_shape, is_causal=causal, budget=budget)
    count = _coverage(q_shape, k_shape, blocks)
    n_q, n_k = q_shape[2], k_shape[2]
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    # every visible score exactly once; a masked-out score at most once (inside a diagonal block)
    assert (count[..., visible] == 1).all()
    assert (count <= 1).all()


def test_a_long_call_takes_at_most_64_blocks_within_the_budget():
    """B = 2, H = 16, N = 8192, D = 128 at the CPU's largest budget (2 GiB): forward and backward."""
    shape = (2, 16, 8192, 128)
    budget = MAX_BUDGET["cpu"]
    for causal in (False, True):
        for backward in (False, True):
            blocks = plan_blocks(shape, shape, is_causal=causal, backward=backward, budget=budget)
            assert len(blocks) <= 64, (causal, backward, len(blocks))
            for blk in blocks:
                heads_q = (blk.batch.stop - blk.batch.start) * (blk.heads.stop - blk.heads.start)
                rows = blk.rows.stop - blk.rows.start
                scores = heads_q * rows * blk.keys * BYTES_PER_SCORE[backward]
                assert scores <= budget, (blk, scores)


def test_causal_blocks_do_no_work_above_the_diagonal_blocks():
    shape = (1, 1, 8192, 64)
    blocks = plan_blocks(shape, shape, is_causal=True, budget=MAX_BUDGET["cpu"])
    assert len(blocks) > 1
    computed = sum((b.rows.stop - b.rows.start) * b.keys for b in blocks)
    visible = 8192 * 8193 // 2
    diagonal_upper = sum((b.rows.stop - b.rows.start) * (b.rows.stop - b.rows.start - 1) // 2 for b in blocks)
    assert computed == visible + diagonal_upper
    assert computed < 0.6 * 8192 * 8192  # about half the full square, not all of it


def _inputs(b, h, h_kv, n_q, n_k, d, d_v, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h_kv, n_k, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h_kv, n_k, d_v, generator=g, dtype=torch.float64)
    return q, k, v


def _one_shot(q, k, v, **kw):
    rep = q.shape[1] // k.shape[1]
    return math_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), **kw)


MASKS = ["none", "causal", "bool", "additive"]


def _mask(kind, b, h, n_q, n_k, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        m = torch.rand(b, 1, n_q, n_k, generator=g) > 0.3
        m[0, 0, 3] = False  # a fully masked row
        return m, False
    if kind == "additive":
        return torch.randn(1, h, n_q, n_k, generator=g, dtype=torch.float64), False
    return None, kind == "causal"


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("budget", [1 << 40, 30_000])
def test_blocked_output_equals_the_one_shot_output(kind, budget):
    b, h, h_kv, n_q, n_k = 2, 4, 2, 2 * CAUSAL_BLOCK_ROWS + 37, 2 * CAUSAL_BLOCK_ROWS + 37
    q, k, v = _inputs(b, h, h_kv, n_q, n_k, 16, 12)
    mask, causal = _mask(kind, b, h, n_q, n_k)
    want = _one_shot(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3)
    got = reference_attention(
        math_attention, q, k, v, attn_mask=mask, is_causal=causal, scale=0.3, budget=budget
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def test_blocked_output_casts_to_the_requested_dtype():
    q, k, v = (t.float() for t in _inputs(1, 2, 2, 40, 50, 8, 8))
    got = reference_attention(math_attention, q, k, v, dtype=torch.float64, budget=MIN_BUDGET)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _one_shot(q.double(), k.double(), v.double()), rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("budget", [1 << 40, 30_000])
def test_blocked_gradients_equal_the_one_shot_gradients(kind, budget):
    b, h, h_kv, n_q, n_k = 2, 4, 2, 2 * CAUSAL_BLOCK_ROWS + 19, 2 * CAUSAL_BLOCK_ROWS + 19
    q, k, v = _inputs(b, h, h_kv, n_q, n_k, 8, 6, seed=3)
    mask, causal = _mask(kind, b, h, n_q, n_k)
    grad_out = torch.randn(b, h, n_q, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _one_shot(*leaves, attn_mask=mask, is_causal=causal)
    want = torch.autograd.grad(out, leaves, grad_out)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    got_out = torch.zeros_like(out)
    rep = h // h_kv
    for group in reference_gradients(
        math_attention, q, k, v, grad_out, attn_mask=mask, is_causal=causal, budget=budget
    ):
        for blk, o, g in zip(group.blocks, group.outs, group.dq, strict=True):
            got_out[blk.batch, blk.q_heads(rep), blk.rows] = o
            dq[blk.batch, blk.q_heads(rep), blk.rows] = g
        first = group.blocks[0]
        dk[first.batch, first.heads] = group.dk
        dv[first.batch, first.heads] = group.dv
    torch.testing.assert_close(got_out, out.detach(), rtol=1e-12, atol=1e-13)
    for got, ref in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_gradients_only_for_what_is_needed():
    q, k, v = _inputs(1, 2, 2, 20, 20, 8, 8)
    grad_out = torch.ones(1, 2, 20, 8, dtype=torch.float64)
    (group,) = reference_gradients(math_attention, q, k, v, grad_out, need=("q",))
    assert group.dk is None and group.dv is None and len(group.dq) == 1


def test_outputs_hold_no_autograd_history_unless_asked():
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 2, 20, 20, 8, 8))
    with torch.no_grad():
        assert not reference_attention(math_attention, q, k, v).requires_grad
    out = reference_attention(math_attention, q, k, v)
    assert out.requires_grad  # autograd on and inputs require grad: differentiable
    assert torch.is_grad_enabled()


def test_budget_follows_the_device_and_its_bounds():
    assert reference_budget("cpu", available=4 << 30) == 1 << 30  # a quarter
    assert reference_budget("cpu", available=1 << 20) == MIN_BUDGET
    assert reference_budget("cpu", available=1 << 40) == MAX_BUDGET["cpu"]
    assert reference_budget("cuda", available=1 << 40) == MAX_BUDGET["default"]
    assert MIN_BUDGET <= reference_budget("cpu") <= MAX_BUDGET["cpu"]  # read from /proc/meminfo


def _fp32_backends():
    names = []
    for name in ("cuda", "mkldnn"):
        try:
            getattr(torch.backends, name).matmul.fp32_precision  # noqa: B018
        except Exception:
            continue
        names.append(name)
    return names


@pytest.mark.skipif(not _fp32_backends(), reason="this torch has no per-backend fp32_precision")
def test_reference_numerics_pin_ieee_and_restore_the_settings():
    backends = {n: getattr(torch.backends, n).matmul for n in _fp32_backends()}
    saved = {n: m.fp32_precision for n, m in backends.items()}
    try:
        for matmul in backends.values():
            matmul.fp32_precision = "tf32"
        assert {f"{n}_matmul_fp32_precision": "tf32" for n in backends}.items() <= numerics_flags().items()
        with reference_numerics():
            assert all(m.fp32_precision == "ieee" for m in backends.values())
        assert all(m.fp32_precision == "tf32" for m in backends.values())
        with pytest.raises(RuntimeError), reference_numerics():
            raise RuntimeError("boom")
        assert all(m.fp32_precision == "tf32" for m in backends.values())
    finally:
        for n, m in backends.items():
            m.fp32_precision = saved[n]


@pytest.mark.skipif("mkldnn" not in _fp32_backends(), reason="no oneDNN fp32_precision setting")
def test_a_reduced_precision_setting_does_not_reach_the_float32_reference():
    """With oneDNN's fp32 matmuls allowed to run in bf16 (where the CPU has bf16 units), a float32
    reference computed through reference_attention still equals the IEEE one bit for bit."""
    q, k, v = (t.float() for t in _inputs(1, 2, 2, 64, 64, 64, 64, seed=7))
    ieee = reference_attention(math_attention, q, k, v)
    matmul = torch.backends.mkldnn.matmul
    saved = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        reduced = reference_attention(math_attention, q, k, v)
    finally:
        matmul.fp32_precision = saved
    assert torch.equal(reduced, ieee)
