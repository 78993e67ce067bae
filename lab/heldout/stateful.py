"""Kernels that keep state across calls — a plan cache, a hand-written backward, a reused scratch buffer —
with flash-attn 2.8's signatures: two controls and the bugs that need a second call to show (issue 54).

- ``fa2_planned`` and its bugs follow ``flash_attn_func`` (see ``flash_attn_like``) and keep a plan per
  key, as cuDNN-graph and FlashInfer plan/run wrappers do: the plan holds the softmax scale and the
  strides the kernel was built for, and a later call with the same key replays it on the new tensors.
- ``fa2_handwritten_backward`` and its bug follow ``flash_attn_func`` with a backward written by hand
  (``torch.autograd.Function``), recomputing P from the saved LSE as flash-attn does:
  ``dV = Pᵀ·dO``, ``Δ = rowsum(dO ∘ O)``, ``dS = P ∘ (dO·Vᵀ − Δ)``, ``dQ = dS·K·scale``,
  ``dK = dSᵀ·Q·scale`` (times ``1 − tanh²`` under softcap; K/V gradients summed over each GQA group).
- ``fa2_kvcache_reused_scratch`` follows ``flash_attn_with_kvcache`` (see ``varlen_like``).

``reset_state()`` forgets every plan and scratch buffer (a fresh process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lab.heldout._online import (
    OnlineSoftmax,
    ScoreSpec,
    alibi_table,
    check_dense,
    check_options,
)
from lab.heldout._table import Contract, HeldOut
from lab.heldout.flash_attn_like import fa2_lse
from lab.heldout.varlen_like import SplitKvDecode, as_flash_attn_with_kvcache

Kernel = Callable[..., Any]


# ---- plan caches


@dataclass(frozen=True)
class Plan:
    """What a kernel fixes when it is planned (captured) for a call.

    Attributes:
        scale: the softmax scale baked into the plan.
        strides: the strides of q, k, v the plan reads with.
    """

    scale: float
    strides: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class PlanCache:
    """Plans keyed by what the call looks like; the key is the step a kernel author writes.

    Attributes:
        plans: the plans made so far, by key.
    """

    def __init__(self) -> None:
        self.plans: dict[tuple[Any, ...], Plan] = {}

    def key(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flags: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """Everything the plan depends on: shapes, dtypes, strides, scale, mask flags."""
        return (*(tuple(x.shape) for x in (q, k, v)), q.dtype, *(x.stride() for x in (q, k, v)), scale, flags)

    def plan(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flags: tuple[Any, ...]
    ) -> Plan:
        """The plan for this call: a cached one when the key matches, else a new one."""
        key = self.key(q, k, v, scale, flags)
        if key not in self.plans:
            self.plans[key] = Plan(scale, (q.stride(), k.stride(), v.stride()))
        return self.plans[key]


class PlanKeyWithoutScale(PlanCache):
    """Keys plans without the softmax scale: a later call differing only in scale replays the old scale."""

    def key(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flags: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        return (*(tuple(x.shape) for x in (q, k, v)), q.dtype, *(x.stride() for x in (q, k, v)), flags)


class PlanKeyWithoutStrides(PlanCache):
    """Keys plans without the strides: a later call with the same shapes in another layout (an HND view
    after contiguous NHD, or the reverse) is read through the old strides."""

    def key(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flags: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        return (*(tuple(x.shape) for x in (q, k, v)), q.dtype, scale, flags)


def as_planned(cache: PlanCache, name: str, doc: str) -> Kernel:
    """A function with flash-attn 2.8's ``flash_attn_func`` signature that runs through ``cache``'s plans."""
    impl = OnlineSoftmax()

    def flash_attn_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
        check_dense(q, k, v)
        check_options(dropout_p, window_size, softcap)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        window = (int(window_size[0]), int(window_size[1]))
        flags = (bool(causal), window, float(softcap), alibi_slopes is None)
        plan = cache.plan(q, k, v, scale, flags)
        q, k, v = (
            torch.as_strided(x, x.shape, s, x.storage_offset())
            for x, s in zip((q, k, v), plan.strides, strict=True)
        )
        spec = ScoreSpec(
            plan.scale,
            bool(causal),
            window,
            float(softcap),
            alibi_table(alibi_slopes, q.shape[0], q.shape[2]),
        )
        out, lse = impl.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec)
        out = out.transpose(1, 2).to(q.dtype)
        return (out, fa2_lse(lse), None) if return_attn_probs else out

    flash_attn_func.__name__ = flash_attn_func.__qualname__ = name
    flash_attn_func.__doc__ = doc
    flash_attn_func.plan_cache = cache  # type: ignore[attr-defined]
    return flash_attn_func


fa2_planned = as_planned(
    PlanCache(),
    "fa2_planned",
    """Correct ``flash_attn_func`` that plans each call and caches the plan under a key holding shapes,
    dtype, strides, scale and mask flags.""",
)

fa2_plan_key_no_scale = as_planned(
    PlanKeyWithoutScale(),
    "fa2_plan_key_no_scale",
    """``flash_attn_func`` whose plan cache is keyed without the softmax scale (flashinfer issue 4014:
    a cuDNN graph cache missing the scale).

    Trigger (a sequence): a call, then a call with the same shapes, dtype, layout and flags but another
    ``softmax_scale`` — the second runs with the first scale. Every first call is right.""",
)

fa2_plan_key_no_strides = as_planned(
    PlanKeyWithoutStrides(),
    "fa2_plan_key_no_strides",
    """``flash_attn_func`` whose plan cache is keyed without strides, so a plan made for one layout is
    replayed on another (flashinfer issue 5007: an HND graph replayed on NHD tensors).

    Trigger (a sequence): a call, then a call with the same shapes but other strides (e.g. q, k, v that
    are ``(B, H, N, D)``-contiguous tensors viewed as ``(B, N, H, D)``, after contiguous ones). Every first
    call is right.""",
)


# ---- hand-written backward


def _scores(
    q: torch.Tensor, k: torch.Tensor, spec: ScoreSpec, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final scores ``(B, H_q, N_q, N_k)`` fp32 (−inf where hidden) and ``tanh(raw / softcap)`` if capped."""
    impl = OnlineSoftmax()
    n_q, n_k = q.shape[2], k.shape[2]
    s = (q.float() @ k.float().index_select(1, heads).transpose(-1, -2)) * spec.scale
    t = None
    if spec.softcap > 0:
        t = torch.tanh(s / spec.softcap)
        s = spec.softcap * t
    rows, cols = torch.arange(n_q), torch.arange(n_k)
    if spec.alibi is not None:
        s = s + impl.alibi_bias(rows, cols, n_q, n_k, spec.alibi)
    return s.masked_fill(~impl.visible(rows, cols, n_q, n_k, spec), -math.inf), t


class HandwrittenFlash(torch.autograd.Function):
    """Forward by ``OnlineSoftmax``; backward by hand from the saved LSE, on ``(B, H, N, D)`` tensors.

    ``keep_delta=True`` computes ``Δ = rowsum(dO ∘ O)`` once per forward and keeps it for later backward
    passes through the same forward (the bug); ``False`` recomputes it each time.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ScoreSpec, keep_delta: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = OnlineSoftmax().forward(q, k, v, spec)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.keep_delta, ctx.delta = spec, keep_delta, None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, _d_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        spec: ScoreSpec = ctx.spec
        b, h_q, _, _ = q.shape
        h_k = k.shape[1]
        heads = torch.arange(h_q) // (h_q // h_k)
        s, t = _scores(q, k, spec, heads)
        lse_rows = torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)  # empty rows: P = 0
        p = torch.exp(s - lse_rows[..., None])  # (B, H_q, N_q, N_k)
        d_o = d_out.float()
        if ctx.delta is None or not ctx.keep_delta:
            ctx.delta = (d_o * out.float()).sum(-1)  # (B, H_q, N_q)
        vf = v.float().index_select(1, heads)
        d_s = p * (d_o @ vf.transpose(-1, -2) - ctx.delta[..., None])
        if t is not None:
            d_s = d_s * (1 - t * t)
        dq = (d_s @ k.float().index_select(1, heads)) * spec.scale
        dk = (d_s.transpose(-1, -2) @ q.float()) * spec.scale  # (B, H_q, N_k, D)
        dv = p.transpose(-1, -2) @ d_o
        group = h_q // h_k
        dk = dk.view(b, h_k, group, *dk.shape[2:]).sum(2)
        dv = dv.view(b, h_k, group, *dv.shape[2:]).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def as_handwritten(keep_delta: bool, name: str, doc: str) -> Kernel:
    """A function with flash-attn 2.8's ``flash_attn_func`` signature and a hand-written backward."""

    def flash_attn_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
        check_dense(q, k, v)
        check_options(dropout_p, window_size, softcap)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        window = (int(window_size[0]), int(window_size[1]))
        spec = ScoreSpec(
            scale, bool(causal), window, float(softcap), alibi_table(alibi_slopes, q.shape[0], q.shape[2])
        )
        out, lse = HandwrittenFlash.apply(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec, keep_delta
        )
        out = out.transpose(1, 2)
        return (out, fa2_lse(lse), None) if return_attn_probs else out

    flash_attn_func.__name__ = flash_attn_func.__qualname__ = name
    flash_attn_func.__doc__ = doc
    return flash_attn_func


fa2_handwritten_backward = as_handwritten(
    False,
    "fa2_handwritten_backward",
    """Correct ``flash_attn_func`` with a hand-written backward (P recomputed from the LSE, Δ from this
    backward's dO).""",
)

fa2_stale_dout_backward = as_handwritten(
    True,
    "fa2_stale_dout_backward",
    """``flash_attn_func`` whose backward keeps ``Δ = rowsum(dO ∘ O)`` from the first backward through a
    forward, so a later backward reads a stale dO there: dq and dk wrong, dv right (flash-attention PR
    2481).

    Trigger (a sequence): one forward, then two backward passes with different dO (``retain_graph``).
    The first backward is right.""",
)


# ---- reused scratch


class ReusedScratch(SplitKvDecode):
    """Split-KV decode whose partial buffers are allocated once (initialised to (0, -inf)) and reused by
    every later call; a split without keys returns before writing, so the merge reads the previous call's
    partial in its slot."""

    writes_empty_splits = False

    def __init__(self) -> None:
        self.o_buf, self.lse_buf = torch.zeros(0), torch.zeros(0)

    def scratch(
        self, shape_o: tuple[int, ...], shape_lse: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_o, n_lse = math.prod(shape_o), math.prod(shape_lse)
        if self.o_buf.numel() < n_o:
            self.o_buf = torch.zeros(n_o)
        if self.lse_buf.numel() < n_lse:
            self.lse_buf = torch.full((n_lse,), -math.inf)
        return self.o_buf[:n_o].view(shape_o), self.lse_buf[:n_lse].view(shape_lse)


_REUSED = ReusedScratch()

fa2_kvcache_reused_scratch = as_flash_attn_with_kvcache(
    _REUSED,
    "fa2_kvcache_reused_scratch",
    """``flash_attn_with_kvcache`` whose split-KV scratch is reused across calls and whose empty splits
    never write it, so they are merged from the previous call's partials (vllm PR 47188: empty trailing
    splits merged from scratch memory).

    Trigger (a sequence): a call whose splits all hold keys, then one (same or smaller shapes) where a
    split is empty (a shorter sequence in the batch, or ``num_splits`` above the number of keys). The
    first call is right.""",
)


def reset_state() -> None:
    """Forget every plan and scratch buffer these kernels keep (as a fresh process)."""
    for fn in (fa2_planned, fa2_plan_key_no_scale, fa2_plan_key_no_strides):
        fn.plan_cache.plans.clear()  # type: ignore[attr-defined]
    _REUSED.o_buf, _REUSED.lse_buf = torch.zeros(0), torch.zeros(0)


HELDOUT: dict[str, HeldOut] = {
    "fa2_planned": HeldOut(fa2_planned, "flash_attn_func", "control", "plan cache keyed on everything"),
    "fa2_plan_key_no_scale": HeldOut(
        fa2_plan_key_no_scale, "flash_attn_func", "bug", "2 calls: same shapes, another softmax_scale"
    ),
    "fa2_plan_key_no_strides": HeldOut(
        fa2_plan_key_no_strides,
        "flash_attn_func",
        "bug",
        "2 calls: same shapes, other strides (NHD vs HND view)",
    ),
    "fa2_handwritten_backward": HeldOut(
        fa2_handwritten_backward, "flash_attn_func", "control", "hand-written backward from the LSE"
    ),
    "fa2_stale_dout_backward": HeldOut(
        fa2_stale_dout_backward,
        "flash_attn_func",
        "bug",
        "1 forward, 2 backwards with different dO: dq, dk wrong",
    ),
    "fa2_kvcache_reused_scratch": HeldOut(
        fa2_kvcache_reused_scratch,
        "flash_attn_with_kvcache",
        "bug",
        "2 calls: all splits full, then a split without keys",
    ),
}

CONTRACTS: dict[str, Contract] = {
    "fa2_planned": Contract("flash-attn 2.8"),
    "fa2_plan_key_no_scale": Contract("flash-attn 2.8", calls=2),
    "fa2_plan_key_no_strides": Contract("flash-attn 2.8", calls=2),
    "fa2_handwritten_backward": Contract("flash-attn 2.8", backward="hand-written"),
    "fa2_stale_dout_backward": Contract("flash-attn 2.8", backward="hand-written", calls=2),
    "fa2_kvcache_reused_scratch": Contract("flash-attn 2.8", backward=None, calls=2),
}
