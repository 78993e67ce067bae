"""The baseline's backward in flash form: the second standard way plain attention differentiates.

Autograd through ``softmax(q·kᵀ·s)·v`` forms ``dS = P ∘ (dP − Σⱼ P dP)`` from the saved
probabilities. Flash kernels (FlashAttention-2, torch's CPU flash backward) instead store the
row's log-sum-exp in opmath (fp32 for 16-bit and fp32 inputs), **recompute** ``P = exp(S − lse)``
and use ``D = rowsum(dO ∘ O)``. Both are exact in real arithmetic and round differently: with one
valid key the first gives exactly 0, the second rounding noise; with logits of magnitude 3e4 the
fp32 log-sum-exp carries a relative error of ~eps·3e4 into every recomputed probability. Like the
two scale placements of the forward, both forms belong to the baseline's gradient noise
(:func:`~flashprobe.fuzz.references.gradient_references`).
"""

from __future__ import annotations

from typing import Any

import torch

from flashprobe.kernels import check_inputs, default_scale

__all__ = ["flash_form_attention"]


def _scores(
    q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, H, N_q, N_k)`` scaled, masked scores in the dtype and the bool of valid positions."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    valid = torch.ones(s.shape, dtype=torch.bool, device=s.device)
    if is_causal:
        valid = valid & torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            valid = valid & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
            valid = valid & (attn_mask > float("-inf"))
    return s.masked_fill(~valid, float("-inf")), valid


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(s − lse)`` in opmath, 0 where ``s`` is −inf (rows that see no key included)."""
    p = torch.exp(s.to(lse.dtype) - lse)
    return torch.where(torch.isfinite(lse), p, 0.0)


class _FlashForm(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scale: float,
    ) -> torch.Tensor:
        s, _ = _scores(q, k, mask, is_causal, scale)
        opmath = torch.promote_types(q.dtype, torch.float32)
        lse = torch.logsumexp(s.to(opmath), dim=-1, keepdim=True)  # (B, H, N_q, 1)
        p = _probs(s, lse).to(q.dtype)
        out = torch.matmul(p, v)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        s, _ = _scores(q, k, mask, ctx.is_causal, ctx.scale)
        p = _probs(s, lse).to(q.dtype)  # recomputed from the stored log-sum-exp
        d_out = d_out.to(q.dtype)
        dv = torch.matmul(p.transpose(-2, -1), d_out)
        dp = torch.matmul(d_out, v.transpose(-2, -1))
        d = (d_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1, keepdim=True)  # rowsum(dO ∘ O)
        ds = (p.to(lse.dtype) * (dp.to(lse.dtype) - d)).to(q.dtype)
        dq = torch.matmul(ds, k) * ctx.scale
        dk = torch.matmul(ds.transpose(-2, -1), q) * ctx.scale
        return dq, dk, dv, None, None, None


def flash_form_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain attention in the inputs' dtype whose backward has the flash form (module docstring).

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H, N_k, D)``; v: ``(B, H, N_k, D_v)``.
        attn_mask: bool (``True`` = attend) or additive, broadcastable to ``(B, H, N_q, N_k)``.
        is_causal: top-left aligned causal mask.
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(B, H, N_q, D_v)`` in the inputs' dtype; fully masked rows give 0.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="flash_form")
    return _FlashForm.apply(q, k, v, attn_mask, is_causal, default_scale(q.shape[-1], scale))
