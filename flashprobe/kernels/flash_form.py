"""Plain attention whose backward has the flash form: the second standard way attention differentiates.

Autograd through ``softmax(q·kᵀ·s)·v`` forms ``dS = P ∘ (dP − Σⱼ P dP)`` from the saved
probabilities; flash kernels instead store the row's log-sum-exp in opmath, **recompute**
``P = exp(S − lse)`` and use ``Δ = rowsum(dO ∘ O)``::

    forward:   S = scale · Q Kᵀ (+ an additive mask; masked scores −inf),  lse = logsumexp(S),
               P = exp(S − lse),  O = P V
    backward:  P = exp(S − lse),  dV = Pᵀ dO,  dP = dO Vᵀ,  Δ = rowsum(dO ∘ O),  dS = P ∘ (dP − Δ),
               dQ = scale · dS K,  dK = scale · dSᵀ Q   (dK, dV summed over each GQA group of heads)

Both forms are exact in real arithmetic and round differently; both belong to the baseline's
gradient noise. :class:`FlashForm` holds the steps, one method each, so a variant overrides exactly
the step it changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from flashprobe.kernels._inputs import check_inputs, default_scale

__all__ = ["FlashForm", "FlashFormCall", "flash_form_attention"]


@dataclass(frozen=True)
class FlashFormCall:
    """One call as the steps of :class:`FlashForm` see it, every tensor in the compute dtype.

    Attributes:
        q: ``(B, H, N_q, D)``; k: ``(B, H, N_k, D)``; v: ``(B, H, N_k, D_v)`` (heads repeated).
        scores: ``(B, H, N_q, N_k)`` the scaled scores with the additive mask added.
        valid: ``(B, H, N_q, N_k)`` bool, the positions no mask removes.
        dtype: the inputs' dtype (the output's and the gradients').
        kv_heads: the key/value heads of the inputs.
        lse: ``(B, H, N_q, 1)`` the rows' log-sum-exp in opmath, −inf for a row that sees no key;
            None until the forward has computed it.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor
    valid: torch.Tensor
    scale: float
    dtype: torch.dtype
    kv_heads: int
    lse: torch.Tensor | None = None

    @property
    def masked(self) -> torch.Tensor:
        """``(B, H, N_q, N_k)`` the scores with every removed position at −inf."""
        return self.scores.masked_fill(~self.valid, float("-inf"))


class FlashForm:
    """The steps of attention in flash form (module docstring), one method per step; a subclass
    that overrides one step computes the same attention with that step changed."""

    def call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float,
        compute: torch.dtype,
    ) -> FlashFormCall:
        """The call in the compute dtype: k and v repeated to the query heads, the scores and the
        valid positions."""
        dtype, kv_heads = q.dtype, k.shape[1]
        rep = q.shape[1] // kv_heads
        if rep > 1:  # query head h reads key/value head h // rep
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, N_q, N_k)
        valid = torch.ones(s.shape, dtype=torch.bool, device=s.device)
        if is_causal:
            valid = valid & torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                valid = valid & attn_mask
            else:
                s = s + attn_mask.to(s.dtype)
                valid = valid & (attn_mask > float("-inf"))
        return FlashFormCall(q, k, v, s, valid, scale, dtype, kv_heads)

    def probs(self, call: FlashFormCall, s: torch.Tensor) -> torch.Tensor:
        """``P = exp(s − lse)`` ``(B, H, N_q, N_k)`` from the scores ``s`` and ``call.lse``, in the
        compute dtype; 0 where ``s`` is −inf and in rows that see no key."""
        assert call.lse is not None  # set by the forward
        p = torch.exp(s.to(call.lse.dtype) - call.lse)
        return torch.where(torch.isfinite(call.lse), p, 0.0).to(call.q.dtype)

    def output(self, call: FlashFormCall) -> torch.Tensor:
        """The forward's ``O = P V``, ``(B, H, N_q, D_v)`` in the compute dtype (0 for a row that sees
        no key), with ``call.lse`` set."""
        return torch.matmul(self.probs(call, call.masked), call.v)

    def recomputed_probs(self, call: FlashFormCall) -> torch.Tensor:
        """The backward's ``P``, recomputed from the masked scores and the stored log-sum-exp."""
        return self.probs(call, call.masked)

    def grad_out(self, call: FlashFormCall, d_out: torch.Tensor) -> torch.Tensor:
        """The output gradient ``dO`` ``(B, H, N_q, D_v)`` as the backward reads it, in the compute dtype."""
        return d_out.to(call.q.dtype)

    def dv(self, call: FlashFormCall, p: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
        """``dV = Pᵀ dO``, ``(B, H, N_k, D_v)``."""
        return torch.matmul(p.transpose(-2, -1), d_out)

    def delta(self, call: FlashFormCall, d_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``Δ = rowsum(dO ∘ O)``, ``(B, H, N_q, 1)`` in opmath, from the output ``O`` as stored."""
        assert call.lse is not None  # set by the forward
        wide = call.lse.dtype
        return (d_out.to(wide) * out.to(wide)).sum(-1, keepdim=True)

    def ds(self, call: FlashFormCall, p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``dS = P ∘ (dP − Δ)``, ``(B, H, N_q, N_k)`` in the compute dtype."""
        return (p.to(delta.dtype) * (dp.to(delta.dtype) - delta)).to(call.q.dtype)

    def dq(self, call: FlashFormCall, ds: torch.Tensor) -> torch.Tensor:
        """``dQ = scale · dS K``, ``(B, H, N_q, D)``."""
        return torch.matmul(ds, call.k) * call.scale

    def dk(self, call: FlashFormCall, ds: torch.Tensor) -> torch.Tensor:
        """``dK = scale · dSᵀ Q``, ``(B, H, N_k, D)`` (per query head)."""
        return torch.matmul(ds.transpose(-2, -1), call.q) * call.scale

    def kv_grads(
        self, call: FlashFormCall, dk: torch.Tensor, dv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``dK`` and ``dV`` per key/value head: summed over the query heads of each group."""
        if call.kv_heads == call.q.shape[1]:
            return dk, dv
        b, heads, n_k = call.q.shape[0], call.q.shape[1], call.k.shape[2]
        group = (b, call.kv_heads, heads // call.kv_heads, n_k, -1)
        return dk.view(group).sum(2), dv.view(group).sum(2)


class _FlashFormFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scale: float,
        compute: torch.dtype,
        form: FlashForm,
    ) -> torch.Tensor:
        call = form.call(q, k, v, mask, is_causal, scale, compute)
        opmath = torch.promote_types(compute, torch.float32)
        lse = torch.logsumexp(call.masked.to(opmath), dim=-1, keepdim=True)  # (B, H, N_q, 1)
        out = form.output(replace(call, lse=lse))  # (B, H, N_q, D_v), compute dtype
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale, ctx.compute, ctx.form = is_causal, scale, compute, form
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        form: FlashForm = ctx.form
        call = replace(form.call(q, k, v, mask, ctx.is_causal, ctx.scale, ctx.compute), lse=lse)
        p = form.recomputed_probs(call)
        d_out = form.grad_out(call, d_out)
        dv = form.dv(call, p, d_out)
        dp = torch.matmul(d_out, call.v.transpose(-2, -1))  # (B, H, N_q, N_k)
        ds = form.ds(call, p, dp, form.delta(call, d_out, out))
        dq = form.dq(call, ds)
        dk, dv = form.kv_grads(call, form.dk(call, ds), dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


#: the steps as written in the module docstring
_PLAIN = FlashForm()


def flash_form_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    upcast: bool = False,
    form: FlashForm | None = None,
) -> torch.Tensor:
    """Plain attention whose backward has the flash form (module docstring), on ``q (B, H, N_q, D)``,
    ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` with SDPA's mask arguments; ``(B, H, N_q, D_v)``
    in the inputs' dtype (fully masked rows give 0). ``upcast`` computes in at least float32; ``form``
    gives the steps (default :class:`FlashForm`)."""
    check_inputs(q, k, v, attn_mask, is_causal, kernel="flash_form", gqa=True)
    compute = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    scale = default_scale(q.shape[-1], scale)
    return _FlashFormFunction.apply(q, k, v, attn_mask, is_causal, scale, compute, form or _PLAIN)
