"""The flash form of attention (``flashprobe.kernels.flash_form``) against float64 autograd through
plain ``softmax(q kᵀ · scale + mask) v`` written out here, as the oracle: outputs and gradients, with
masks, causal calls, grouped-query heads and fully masked rows; ``upcast`` against the same call
computed from float32 copies; a step overridden in a :class:`FlashForm` subclass changes that
gradient and nothing else."""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.kernels import FlashForm, FlashFormCall, KernelInputError, flash_form_attention


def _oracle(q, k, v, mask, is_causal, scale):
    """Float64 autograd through plain attention (GQA by repeating k, v; fully masked rows 0)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-2, -1) * scale
    valid = torch.ones_like(s, dtype=torch.bool)
    if is_causal:
        valid = valid & torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        valid = valid & mask
    elif mask is not None:
        s = s + mask
        valid = valid & (mask > float("-inf"))
    s = s.masked_fill(~valid, float("-inf"))
    dead = ~valid.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return p @ v


def _inputs(h_kv: int, mask: str | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 13, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, h_kv, 21, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    m = None
    if mask in ("bool", "dead"):
        m = torch.rand(2, 1, 13, 21, generator=gen) > 0.4
        if mask == "dead":
            m[:, :, 5] = False  # row 5 sees no key
    elif mask == "additive":
        m = torch.randn(1, 4, 13, 21, generator=gen, dtype=torch.float64)
        m = m.masked_fill(torch.rand(1, 4, 13, 21, generator=gen) < 0.2, float("-inf"))
        m[..., 0] = 0.0
    return q, k, v, m


@pytest.mark.parametrize("h_kv", [4, 2, 1])
@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive", "dead"])
def test_outputs_and_gradients_are_exact_in_float64(h_kv: int, mask: str | None) -> None:
    q, k, v, m = _inputs(h_kv, None if mask == "causal" else mask)
    causal, scale = mask == "causal", 0.3
    go = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (flash_form_attention, None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if fn is None:
            out = _oracle(*leaves, m, causal, scale)
        else:
            out = fn(*leaves, attn_mask=m, is_causal=causal, scale=scale)
        results.append((out, *torch.autograd.grad(out, leaves, go)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if mask == "dead":  # the row that sees no key: output 0 and no gradient into it
        assert results[0][0][:, :, 5].abs().max() == 0 and results[0][1][:, :, 5].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_computes_in_float32_and_returns_the_inputs_dtype(dtype: torch.dtype) -> None:
    q, k, v, m = _inputs(2, "bool")
    q, k, v = (t.to(dtype) for t in (q, k, v))
    go = torch.randn(2, 4, 13, 8, generator=torch.Generator().manual_seed(2)).to(dtype)
    low = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_form_attention(*low, attn_mask=m, upcast=True)
    grads = torch.autograd.grad(out, low, go)
    wide = [t.float().requires_grad_() for t in (q, k, v)]  # the same call from float32 copies
    out32 = flash_form_attention(*wide, attn_mask=m)
    grads32 = torch.autograd.grad(out32, wide, go.float())
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert torch.equal(out, out32.to(dtype))
    for g, g32 in zip(grads, grads32, strict=True):
        assert torch.equal(g, g32.to(dtype))


class _NoScaleInDq(FlashForm):
    def dq(self, call: FlashFormCall, ds: torch.Tensor) -> torch.Tensor:
        return torch.matmul(ds, call.k)


def test_a_step_overridden_changes_that_gradient_only() -> None:
    q, k, v, m = _inputs(2, "additive")
    go = torch.randn(2, 4, 13, 8, dtype=torch.float64)
    found = []
    for form in (None, _NoScaleInDq()):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_form_attention(*leaves, attn_mask=m, scale=0.25, form=form)
        found.append((out, *torch.autograd.grad(out, leaves, go)))
    (out, dq, dk, dv), (out_b, dq_b, dk_b, dv_b) = found
    assert torch.equal(out, out_b) and torch.equal(dk, dk_b) and torch.equal(dv, dv_b)
    torch.testing.assert_close(dq_b * 0.25, dq, rtol=1e-12, atol=1e-14)  # dq without its scale


def test_the_default_scale_and_refused_inputs() -> None:
    q, k, v, _ = _inputs(4, None)
    torch.testing.assert_close(
        flash_form_attention(q, k, v), _oracle(q, k, v, None, False, 1 / math.sqrt(8)), rtol=1e-12, atol=1e-12
    )
    with pytest.raises(KernelInputError, match="head counts differ"):
        flash_form_attention(q, k[:, :3], v[:, :3])
