"""Deliberately buggy attention kernels: one bug each, of a class real kernels have shipped.

Every kernel has the SDPA signature ``fn(q, k, v, *, attn_mask=None, is_causal=False, scale=None)``
on ``(B, H, N, D)`` tensors and is correct except for its one bug:

* key/value may have fewer heads than the queries (grouped-query attention, ``H % H_kv == 0``;
  query head ``h`` reads key/value head ``h // (H / H_kv)``, as torch's ``enable_gqa``);
* ``attn_mask`` is bool (``True`` = attend) or additive float, broadcastable to
  ``(B, H, N_q, N_k)``; ``is_causal`` is top-left aligned (query ``i`` sees keys ``j <= i``), as
  torch SDPA; a row with every key masked gives zeros (torch's safe softmax);
* ``scale`` defaults to ``1/sqrt(D)``;
* bf16/fp16 inputs are computed in fp32 (fp64 inputs in fp64), the output is in the inputs' dtype;
* every kernel is differentiable.

**Forward bugs** run plain autograd through a correct math implementation with the bug inserted,
so their gradients are the exact gradients of the buggy forward. **Backward bugs** share
:class:`_FlashAttention`, a ``torch.autograd.Function`` with a correct forward (saving the row
log-sum-exp, as FlashAttention does) and a hand-written flash-style backward that recomputes
``P`` from the log-sum-exp::

    dV = Pᵀ dO,  dP = dO Vᵀ,  Δ = rowsum(dO ∘ O),  dS = P ∘ (dP − Δ),
    dQ = scale · dS K,  dK = scale · dSᵀ Q   (summed over the query heads of a GQA group)

with the one bug inserted. :func:`correct_flash` is that code path with no bug.

:data:`BUGS` maps each bug's name to a :class:`BugSpec`: the kernel, the first direction it
corrupts (``"out"``, ``"dq"``, ``"dk"``, ``"dv"``, in that order), its trigger in words, one call
that triggers it (:meth:`BugSpec.trigger_case`) and, where one exists, one that does not
(:meth:`BugSpec.quiet_case`). :func:`register_buggy_kernels` registers them as ``bug_<name>``,
:func:`correct_flash` as ``bug_none`` and the correct kernels with production numerics
(:data:`CORRECT`: the flash-style backward, exp2 with the scale folded into log2(e), split-K with a
log-sum-exp combine) as ``ok_<name>``.

Triggers are chosen so a tiny training loop can hit them by changing its shapes: a sequence length
(``N % 32``, ``N > 64``), the head dim (``D > 64``), the batch size (``B > 1``), the layout
(``q`` a transposed ``(B, N, H, D)`` view), a causal or padding mask, GQA heads or the dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "BUGS",
    "CORRECT",
    "DIRECTIONS",
    "BugSpec",
    "Case",
    "correct_flash",
    "register_buggy_kernels",
]

Direction = Literal["out", "dq", "dk", "dv"]
#: the directions a call can be wrong in, in the order :attr:`BugSpec.direction` counts "first"
DIRECTIONS: tuple[Direction, ...] = ("out", "dq", "dk", "dv")

_NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# shared pieces (correct)
# ----------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any, is_causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating (B, H, N, D) tensor, got {tuple(t.shape)} {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"key/value heads ({k.shape[1]}) must divide the query heads ({q.shape[1]})")
    if q.shape[0] != k.shape[0] or k.shape[2] != v.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if attn_mask is not None and is_causal:
        raise ValueError("pass either attn_mask or is_causal=True, not both (as torch SDPA)")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _kv_index(heads: int, kv_heads: int, device: torch.device, *, modulo: bool = False) -> torch.Tensor:
    """The key/value head each query head reads: ``h // (H / H_kv)`` (or the buggy ``h % H_kv``)."""
    h = torch.arange(heads, device=device)
    return h % kv_heads if modulo else h // (heads // kv_heads)


def _expand_kv(
    k: torch.Tensor, v: torch.Tensor, heads: int, *, modulo: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if k.shape[1] == heads:
        return k, v
    idx = _kv_index(heads, k.shape[1], k.device, modulo=modulo)
    return k.index_select(1, idx), v.index_select(1, idx)


def _causal_keep(n_q: int, n_k: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """``(N_q, N_k)`` bool, True where key ``j <= i + offset`` (top-left aligned; offset 0 correct)."""
    i = torch.arange(n_q, device=device).unsqueeze(-1)
    j = torch.arange(n_k, device=device).unsqueeze(0)
    return j <= i + offset


def _masks(
    attn_mask: torch.Tensor | None, is_causal: bool, n_q: int, n_k: int, device: torch.device, offset: int = 0
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(keep, bias)``: a bool keep-mask (causal or bool ``attn_mask``) and an additive float mask."""
    if is_causal:
        return _causal_keep(n_q, n_k, device, offset), None
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    return None, attn_mask


def _math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    keep: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
    mask_value: float = _NEG_INF,
    scores: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain autograd attention on equal-head tensors in the compute dtype, output in ``q``'s dtype.

    ``scores(qc, kc)`` replaces the unscaled ``qc @ kcᵀ``; ``mask_value`` is what masked-out
    scores are set to. Rows whose every score is ``-inf`` give zeros (safe softmax).
    """
    c = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(c), k.to(c), v.to(c)
    if kc.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    s = (qc @ kc.transpose(-2, -1) if scores is None else scores(qc, kc)) * scale
    if bias is not None:
        s = s + bias.to(c)
    if keep is not None:
        s = s.masked_fill(~keep, mask_value)
    dead = s.detach().amax(dim=-1, keepdim=True) == _NEG_INF
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return (p @ vc).to(q.dtype)


def _forward_bug(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    *,
    kv_modulo: bool = False,
    causal_offset: int = 0,
    **math_options: Any,
) -> torch.Tensor:
    _check(q, k, v, attn_mask, is_causal)
    k, v = _expand_kv(k, v, q.shape[1], modulo=kv_modulo)
    keep, bias = _masks(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device, causal_offset)
    return _math(q, k, v, keep=keep, bias=bias, scale=_scale(q.shape[-1], scale), **math_options)


# ----------------------------------------------------------------------------------------------
# forward bugs
# ----------------------------------------------------------------------------------------------


def scale_ignored(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: explicit ``scale`` argument ignored (always ``1/sqrt(D)``).

    Trigger: ``scale`` is given and differs from ``1/sqrt(D)`` (e.g. a model with a learned or
    ``1/D`` scale, or muP). Quiet with ``scale=None``.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, None)


#: channels of the head dim the truncated kernel reads in q·kᵀ
HEAD_DIM_LIMIT = 64


def head_dim_truncated(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: head dim over the kernel's limit truncated (scaled down from "D > 128").

    Trigger: ``D > 64``: the channels beyond the first 64 are ignored in q·kᵀ (the scale still
    uses the full ``D``; values are read in full). Quiet for ``D <= 64``.
    """

    def scores(qc: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
        n = HEAD_DIM_LIMIT
        return qc[..., :n] @ kc[..., :n].transpose(-2, -1)

    return _forward_bug(q, k, v, attn_mask, is_causal, scale, scores=scores)


def causal_off_by_one(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: causal mask off by one: the next token is visible (query ``i`` sees ``j <= i+1``).

    Trigger: every ``is_causal=True`` call with ``N_k >= 2``. Quiet without ``is_causal``.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, causal_offset=1)


#: keys the long-context kernel reads
KEY_LIMIT = 64


def keys_truncated(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: long context: keys beyond the kernel's limit ignored (scaled down).

    Trigger: ``N_k > 64``: keys 64 and above are dropped (and get zero gradients). Quiet for
    ``N_k <= 64``.
    """
    _check(q, k, v, attn_mask, is_causal)
    n_k = k.shape[-2]
    k, v = _expand_kv(k, v, q.shape[1])
    keep, bias = _masks(attn_mask, is_causal, q.shape[-2], n_k, q.device)
    cut = slice(0, KEY_LIMIT)
    keep = keep if keep is None or keep.shape[-1] == 1 else keep[..., cut]
    bias = bias if bias is None or bias.shape[-1] == 1 else bias[..., cut]
    s = _scale(q.shape[-1], scale)
    return _math(q, k[..., cut, :], v[..., cut, :], keep=keep, bias=bias, scale=s)


def nan_rows(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: length-dependent non-finite output.

    Trigger: ``N_q % 32 == 16``: the last 16 query rows (a half-filled last row tile of 32) are
    NaN in the output. Quiet for any other ``N_q % 32``.
    """
    out = _forward_bug(q, k, v, attn_mask, is_causal, scale)
    n_q = q.shape[-2]
    if n_q % 32 == 16:
        rows = torch.arange(n_q, device=q.device) >= n_q - 16
        out = out.masked_fill(rows.unsqueeze(-1), float("nan"))
    return out


def gqa_head_mapping(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: grouped-query head mapping wrong: query head ``h`` reads key/value head
    ``h % H_kv`` instead of ``h // (H / H_kv)``.

    Trigger: ``1 < H_kv < H`` **passed un-expanded** (with ``H_kv == 1`` or ``H_kv == H`` both maps
    agree). Quiet for ``H_kv == H``.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, kv_modulo=True)


def batch_kv_mixup(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: large-grid index mixup: every batch entry attends to batch 0's keys and values.

    Trigger: ``B > 1`` (entry 0 stays right). Quiet for ``B == 1``.
    """
    k = k[:1].expand_as(k)
    v = v[:1].expand_as(v)
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


def _as_if_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``'s storage read with contiguous ``(B, H, N, D)`` strides from its data pointer, as a
    kernel that takes ``data_ptr()`` without checking strides does (differentiably)."""
    if x.is_contiguous():
        return x
    strides, acc = [], 1
    for n in reversed(x.shape):
        strides.append(acc)
        acc *= n
    needed = (x.storage_offset() + x.numel()) * x.element_size()
    if x.untyped_storage().nbytes() < needed:  # an expanded tensor: a real kernel reads past it
        return x.contiguous()
    return torch.as_strided(x, x.shape, tuple(reversed(strides)), x.storage_offset())


def q_assumed_contiguous(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: strides ignored: ``q`` read as if it were contiguous ``(B, H, N, D)``.

    Trigger: ``q`` a non-contiguous view, e.g. ``x.view(B, N, H, D).transpose(1, 2)`` as models
    make it (with ``H > 1`` and ``N > 1``; the data is then read in ``(B, N, H, D)`` order).
    Quiet for a contiguous ``q``. (``k``/``v`` are read correctly.)
    """
    return _forward_bug(_as_if_contiguous(q), k, v, attn_mask, is_causal, scale)


def fp32_bf16_scores(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: precision silently lowered: an fp32 call computes q·kᵀ from bf16 ``q``, ``k``.

    Trigger: float32 inputs (the scores carry bf16 rounding, ~3e-3 relative). Quiet for bf16
    inputs (computed as the correct kernel does).
    """

    def scores(qc: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
        bf = torch.bfloat16
        return (qc.to(bf) @ kc.to(bf).transpose(-2, -1)).to(qc.dtype)

    bug = {"scores": scores} if q.dtype == torch.float32 else {}
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, **bug)


#: what the sentinel kernel sets masked-out scores to
MASK_SENTINEL = -5e4


def mask_sentinel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: the -50,000 sentinel: masked-out scores (bool mask, causal) set to ``-5e4``
    instead of ``-inf``.

    Partially masked rows are right (``exp(-5e4 - max)`` is 0). Trigger: a row whose every key is
    masked: a padded batch with a bool mask that masks padded *queries* too
    (``valid_q[:, None] & valid_k[None, :]``, shape ``(B, 1, N, N)``) gets the mean of all values
    in its padded rows instead of zeros (and nonzero gradients from them). Quiet for a key-padding
    mask ``(B, 1, 1, N)`` with a valid key in every entry, and for causal calls. Additive float
    masks are added as given.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, mask_value=MASK_SENTINEL)


# ----------------------------------------------------------------------------------------------
# the flash-style autograd kernel and its backward bugs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Backward:
    """The bug inserted into :class:`_FlashAttention`'s backward (all off: correct)."""

    dq_unscaled: bool = False
    dk_tile_32: bool = False
    dq_nan_64: bool = False
    ds_bf16: bool = False
    dv_unmasked: bool = False
    gqa_first_head: bool = False
    drop_delta: bool = False
    kv_tile_zeroed: bool = False


_CORRECT = _Backward()


def _flash_scores(
    qc: torch.Tensor, kc: torch.Tensor, keep: torch.Tensor | None, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked, unmasked)`` scaled scores; ``unmasked`` has the additive mask but not ``keep``."""
    s = (qc @ kc.transpose(-2, -1)) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    return (s if keep is None else s.masked_fill(~keep, _NEG_INF)), s


class _FlashAttention(torch.autograd.Function):
    """Attention with a hand-written flash-style backward; ``bug`` selects one backward bug."""

    @staticmethod
    def forward(ctx, q, k, v, keep, bias, scale, bug):  # type: ignore[override]
        c = _compute_dtype(q.dtype)
        heads = q.shape[1]
        qc = q.to(c)
        kc, vc = (t.to(c) for t in _expand_kv(k, v, heads))
        s, _ = _flash_scores(qc, kc, keep, bias, scale)
        m = s.amax(dim=-1, keepdim=True)
        dead = m == _NEG_INF  # every key masked: P = 0, output 0 (safe softmax)
        m = m.masked_fill(dead, 0.0)
        e = torch.exp(s - m)
        denom = e.sum(dim=-1, keepdim=True)
        lse = (m + torch.log(denom)).masked_fill(dead, float("inf"))  # exp(s - inf) = 0
        o = (e / denom.masked_fill(dead, 1.0)) @ vc
        ctx.save_for_backward(q, k, v, keep, bias, o, lse)
        ctx.scale, ctx.bug = scale, bug
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, keep, bias, o, lse = ctx.saved_tensors
        scale, bug = ctx.scale, ctx.bug
        c = o.dtype
        b, heads = q.shape[0], q.shape[1]
        kv_heads, n_k = k.shape[1], k.shape[2]
        qc = q.to(c)
        kc, vc = (t.to(c) for t in _expand_kv(k, v, heads))
        do = grad_out.to(c)
        s, s_unmasked = _flash_scores(qc, kc, keep, bias, scale)
        p = torch.exp(s - lse)  # recomputed from the log-sum-exp, as FlashAttention does
        p_v = torch.exp(s_unmasked - lse) if bug.dv_unmasked else p
        dv = p_v.transpose(-2, -1) @ do
        dp = do @ vc.transpose(-2, -1)
        delta = (do * o).sum(dim=-1, keepdim=True)
        ds = p * (dp if bug.drop_delta else dp - delta)
        if bug.ds_bf16 and q.dtype == torch.float32:
            ds = ds.to(torch.bfloat16).to(c)
        dq = (ds @ kc) * (1.0 if bug.dq_unscaled else scale)
        dk = (ds.transpose(-2, -1) @ qc) * scale
        if bug.dq_nan_64 and n_k % 64 == 32:  # the last key tile's missing half read as garbage
            dq = dq + float("nan")
        if bug.dk_tile_32 and n_k % 32:
            dk[..., n_k - n_k % 32 :, :] = 0.0
        if bug.kv_tile_zeroed and n_k > 2 * KEY_TILE:  # the second key tile skipped in dk and dv
            dk[..., KEY_TILE : 2 * KEY_TILE, :] = 0.0
            dv[..., KEY_TILE : 2 * KEY_TILE, :] = 0.0
        if kv_heads != heads:
            rep = heads // kv_heads
            dk = dk.view(b, kv_heads, rep, n_k, -1)
            dv = dv.view(b, kv_heads, rep, n_k, -1)
            dk, dv = (dk[:, :, 0], dv[:, :, 0]) if bug.gqa_first_head else (dk.sum(2), dv.sum(2))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _flash(q, k, v, attn_mask, is_causal, scale, bug: _Backward) -> torch.Tensor:
    _check(q, k, v, attn_mask, is_causal)
    keep, bias = _masks(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    if k.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    return _FlashAttention.apply(q, k, v, keep, bias, _scale(q.shape[-1], scale), bug)


def correct_flash(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct attention with a hand-written flash-style backward (the backward bugs' code path)."""
    return _flash(q, k, v, attn_mask, is_causal, scale, _CORRECT)


def dq_unscaled(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward loses the softmax scale in dq (``dq = dS K``).

    Trigger: any call whose scale is not 1 (every default-scale call with ``D > 1``). Quiet with
    ``scale=1.0``. The forward, dk and dv are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(dq_unscaled=True))


def dk_partial_tile(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward skips the partial last key tile: dk is zero for the last
    ``N_k % 32`` keys.

    Trigger: ``N_k % 32 != 0``. Quiet for ``N_k`` a multiple of 32. The forward, dq and dv are
    right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(dk_tile_32=True))


def dq_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: length-dependent non-finite gradient: dq is NaN.

    Trigger: ``N_k % 64 == 32`` (a half-filled last key tile of 64). Quiet for any other
    ``N_k % 64``. The forward, dk and dv are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(dq_nan_64=True))


def ds_bf16(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: precision silently lowered in the backward: dS rounded to bf16 in an fp32 call.

    Trigger: float32 inputs (dq and dk carry bf16 rounding). Quiet for bf16 inputs (whose
    backward is computed in fp32 as the correct kernel's). The forward and dv are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(ds_bf16=True))


def dv_unmasked(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward ignores the mask for dv (``dV = Pᵀ dO`` with the unmasked ``P``).

    Trigger: ``is_causal=True`` or a bool ``attn_mask`` that masks something. Quiet without
    them (an additive float mask is applied correctly). The forward, dq and dk are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(dv_unmasked=True))


def gqa_grad_not_summed(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: grouped-query backward keeps only the first query head of each group in dk
    and dv (no sum over the group).

    Trigger: ``H_kv < H`` **passed un-expanded**. Quiet for ``H_kv == H``. The forward and dq
    are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(gqa_first_head=True))


def delta_dropped(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: a gradient term dropped: ``dS = P ∘ dP`` without ``− rowsum(dO ∘ O)``.

    Trigger: every call (dq and dk are wrong by tens of percent or more; the forward and dv are
    right). A weak-baseline class: in 16 bits the plain baseline's own gradient error is percents,
    so a ratio to it is lenient; the ``absolute`` criterion catches it.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(drop_delta=True))


#: keys per key tile of the tiled bugs
KEY_TILE = 16


def kv_tile_zeroed(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: a localised backward bug: dk and dv are zero for the second key tile
    (keys 16–31).

    Trigger: ``N_k > 32``. Quiet for ``N_k <= 32``. The forward and dq are right; 16 of the keys
    are wrong, which a whole-tensor L2 averages away (the ``row`` criterion catches it).
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Backward(kv_tile_zeroed=True))


# ----------------------------------------------------------------------------------------------
# localised forward bugs
# ----------------------------------------------------------------------------------------------

#: query rows per row tile of the tail-row bug
ROW_TILE = 16


def tail_rows_stale(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: wrong tail query rows: the rows of a partial last row tile get the rows one tile
    above (a stale tile buffer).

    Trigger: ``N_q % 16 != 0`` and ``N_q > 16``. Quiet for ``N_q`` a multiple of 16.
    """
    out = _forward_bug(q, k, v, attn_mask, is_causal, scale)
    n_q = q.shape[-2]
    tail = n_q % ROW_TILE
    if not tail or n_q <= ROW_TILE:
        return out
    index = torch.arange(n_q, device=q.device)
    index[n_q - tail :] -= ROW_TILE
    return out.index_select(-2, index)


def one_head_wrong(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: one wrong head: the last query head reads the first head's values.

    Trigger: ``H > 1`` (with equal key/value heads). Quiet for one head. The other heads are right.
    """
    k, v = _expand_kv(k, v, q.shape[1])
    if q.shape[1] > 1:
        heads = torch.arange(q.shape[1], device=q.device)
        heads[-1] = 0
        v = v.index_select(1, heads)
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


def one_batch_wrong(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: one wrong batch entry: the last entry reads its values in reverse key order.

    Trigger: ``B > 1``. Quiet for ``B == 1``. The other entries are right.
    """
    if q.shape[0] > 1:
        v = torch.cat((v[:-1], v[-1:].flip(-2)))
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


# ----------------------------------------------------------------------------------------------
# correct kernels with production numerics
# ----------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634


def exp2_folded(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct: FlashAttention's exponent, ``exp2(s·c − m·c)`` with the scale folded into
    ``c = scale · log2(e)`` (FA2/FA3 and the Triton tutorial), in fp32 for 16-bit inputs.

    Its error grows with |logit| (the rounding of ``s·c``, about ``|s|·eps``): right, and the
    judge must pass it, sentinel-range logits (-1e4 … -1e5) included.
    """
    _check(q, k, v, attn_mask, is_causal)
    k, v = _expand_kv(k, v, q.shape[1])
    keep, bias = _masks(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    c = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(c), k.to(c), v.to(c)
    if kc.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    s2 = (qc @ kc.transpose(-2, -1)) * (_scale(q.shape[-1], scale) * LOG2E)
    if bias is not None:
        s2 = s2 + bias.to(c) * LOG2E
    if keep is not None:
        s2 = s2.masked_fill(~keep, _NEG_INF)
    m = s2.detach().amax(dim=-1, keepdim=True)
    dead = m == _NEG_INF
    p = torch.exp2(s2 - m.masked_fill(dead, 0.0))
    denom = p.sum(dim=-1, keepdim=True)
    out = (p @ vc) / denom.masked_fill(dead, 1.0)
    return out.masked_fill(dead, 0.0).to(q.dtype)


#: keys per split of the split-K kernel
SPLIT_KEYS = 32


def split_k_lse(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct: flash-decoding's split-K: each split of 32 keys gives its normalised output ``o_i``
    and log-sum-exp ``lse_i``; they are combined as ``Σ exp(lse_i − lse) · o_i`` with
    ``lse = logsumexp_i lse_i`` (in fp32 for 16-bit inputs)."""
    _check(q, k, v, attn_mask, is_causal)
    k, v = _expand_kv(k, v, q.shape[1])
    n_q, n_k = q.shape[-2], k.shape[-2]
    keep, bias = _masks(attn_mask, is_causal, n_q, n_k, q.device)
    c = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(c), k.to(c), v.to(c)
    if n_k == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    s = (qc @ kc.transpose(-2, -1)) * _scale(q.shape[-1], scale)
    if bias is not None:
        s = s + bias.to(c)
    if keep is not None:
        s = s.masked_fill(~keep, _NEG_INF)
    outs, lses = [], []
    for start in range(0, n_k, SPLIT_KEYS):
        part = s[..., start : start + SPLIT_KEYS]
        m = part.detach().amax(dim=-1, keepdim=True)
        dead = m == _NEG_INF
        e = torch.exp(part - m.masked_fill(dead, 0.0))
        denom = e.sum(dim=-1, keepdim=True)
        outs.append((e @ vc[..., start : start + SPLIT_KEYS, :]) / denom.masked_fill(dead, 1.0))
        lses.append((m + torch.log(denom.masked_fill(dead, 1.0))).masked_fill(dead, _NEG_INF))
    lse = torch.stack(lses)  # (splits, B, H, N_q, 1)
    top = lse.detach().amax(dim=0)
    dead = top == _NEG_INF
    weights = torch.exp(lse - top.masked_fill(dead, 0.0))  # exp(lse_i - max): 0 for empty splits
    weights = weights / weights.sum(dim=0).masked_fill(dead, 1.0)
    out = (weights * torch.stack(outs)).sum(dim=0)
    return out.masked_fill(dead, 0.0).to(q.dtype)


#: Correct kernels with production numerics, beside :func:`correct_flash`.
CORRECT: dict[str, Callable[..., torch.Tensor]] = {
    "flash_backward": correct_flash,
    "exp2_folded": exp2_folded,
    "split_k_lse": split_k_lse,
}


# ----------------------------------------------------------------------------------------------
# calls that trigger a bug (or do not)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One attention call's shapes and arguments; :meth:`tensors` and :meth:`kwargs` make it.

    Attributes:
        b, h, n_q, d: batch, query heads, query rows, head dim.
        h_kv: key/value heads (default ``h``); passed un-expanded.
        n_k: keys (default ``n_q``).
        d_v: value head dim (default ``d``).
        dtype: the inputs' dtype.
        is_causal: top-left causal call.
        mask: ``None``; ``"key_padding"`` (bool ``(B, 1, 1, N_k)``, entry ``i`` has its last
            ``3 i`` keys padded); ``"padded_rows"`` (bool ``(B, 1, N_q, N_k)``, padded queries
            *and* keys masked: padded query rows are fully masked); ``"additive"`` (float
            ``(1, H, N_q, N_k)``, a random bias with some ``-inf``, no row fully masked).
        scale: the ``scale`` argument.
        layout: ``"bhnd"`` (contiguous) or ``"bnhd"`` (q, k, v transposed views of contiguous
            ``(B, N, H, D)`` tensors, as models make them).
        seed: for the random inputs.
    """

    b: int = 1
    h: int = 2
    n_q: int = 16
    d: int = 16
    h_kv: int | None = None
    n_k: int | None = None
    d_v: int | None = None
    dtype: torch.dtype = torch.float32
    is_causal: bool = False
    mask: Literal["key_padding", "padded_rows", "additive"] | None = None
    scale: float | None = None
    layout: Literal["bhnd", "bnhd"] = "bhnd"
    seed: int = 0

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``q``, ``k``, ``v`` shapes ``(B, H, N, D)``."""
        n_k, h_kv = self.n_k or self.n_q, self.h_kv or self.h
        return {
            "q": (self.b, self.h, self.n_q, self.d),
            "k": (self.b, h_kv, n_k, self.d),
            "v": (self.b, h_kv, n_k, self.d_v or self.d),
        }

    def _gen(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(1000 * self.seed + salt)

    def tensors(self, *, requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)``, standard normal, in :attr:`dtype` and :attr:`layout`; with
        ``requires_grad`` they are views of leaves that require grad (use ``torch.autograd.grad``)."""
        out = []
        for salt, shape in enumerate(self.shapes.values()):
            b, h, n, d = shape
            base = torch.randn(b, n, h, d, generator=self._gen(salt), dtype=torch.float64).to(self.dtype)
            base.requires_grad_(requires_grad)
            t = base.transpose(1, 2)
            out.append(t if self.layout == "bnhd" else t.contiguous())
        return out[0], out[1], out[2]

    def attn_mask(self) -> torch.Tensor | None:
        n_q, n_k = self.shapes["q"][2], self.shapes["k"][2]
        if self.mask is None:
            return None
        if self.mask == "key_padding":
            valid_k = torch.arange(n_k) < (n_k - 3 * torch.arange(self.b)).clamp(min=1).unsqueeze(-1)
            return valid_k[:, None, None, :]  # (B, 1, 1, N_k)
        if self.mask == "padded_rows":
            lengths = (n_q - 5 * torch.arange(self.b)).clamp(min=1)
            valid_q = torch.arange(n_q) < lengths.unsqueeze(-1)  # (B, N_q)
            valid_k = torch.arange(n_k) < lengths.clamp(max=n_k).unsqueeze(-1)  # (B, N_k)
            return (valid_q[:, :, None] & valid_k[:, None, :])[:, None]  # (B, 1, N_q, N_k)
        bias = torch.randn(1, self.h, n_q, n_k, generator=self._gen(7), dtype=torch.float64)
        bias = bias.masked_fill(torch.rand(bias.shape, generator=self._gen(8)) < 0.2, _NEG_INF)
        bias[..., 0] = 0.0  # no row fully masked
        return bias.to(self.dtype)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the call: ``attn_mask``, ``is_causal``, ``scale``."""
        return {"attn_mask": self.attn_mask(), "is_causal": self.is_causal, "scale": self.scale}

    def grad_out(self) -> torch.Tensor:
        """A fixed random output gradient ``(B, H, N_q, D_v)`` in :attr:`dtype`."""
        b, h, n_q, _ = self.shapes["q"]
        d_v = self.shapes["v"][3]
        return torch.randn(b, h, n_q, d_v, generator=self._gen(9), dtype=torch.float64).to(self.dtype)


@dataclass(frozen=True)
class BugSpec:
    """One buggy kernel: what it corrupts first, when, and calls that do and do not trigger it.

    Attributes:
        name: the bug's name (registered as ``bug_<name>``).
        fn: the kernel.
        direction: the first of ``out``, ``dq``, ``dk``, ``dv`` the bug corrupts (forward bugs:
            ``out``; the directions before it are right even when it fires).
        trigger: when it fires, in words.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    direction: Direction
    trigger: str
    trigger_call: Case = field(repr=False)
    quiet_call: Case | None = field(default=None, repr=False)

    def trigger_case(self) -> Case:
        """A call that triggers the bug."""
        return self.trigger_call

    def quiet_case(self) -> Case | None:
        """A call that does not trigger it (None where there is none)."""
        return self.quiet_call


BF16 = torch.bfloat16

BUGS: dict[str, BugSpec] = {
    spec.name: spec
    for spec in (
        BugSpec(
            "scale_ignored", scale_ignored, "out", "scale given and != 1/sqrt(D)",
            Case(scale=0.5, mask="additive"), Case(mask="additive"),
        ),
        BugSpec(
            "head_dim_truncated", head_dim_truncated, "out", "head dim D > 64",
            Case(d=96, n_q=8), Case(d=64, n_q=8),
        ),
        BugSpec(
            "causal_off_by_one", causal_off_by_one, "out", "is_causal=True (next token visible)",
            Case(is_causal=True), Case(),
        ),
        BugSpec(
            "keys_truncated", keys_truncated, "out", "N_k > 64 (keys beyond 64 ignored)",
            Case(n_q=8, n_k=80), Case(n_q=8, n_k=64),
        ),
        BugSpec(
            "nan_rows", nan_rows, "out", "N_q % 32 == 16 (last 16 rows NaN)",
            Case(n_q=48, dtype=BF16), Case(n_q=40, dtype=BF16),
        ),
        BugSpec(
            "gqa_head_mapping", gqa_head_mapping, "out", "1 < H_kv < H, un-expanded k/v",
            Case(h=4, h_kv=2, is_causal=True), Case(h=4, is_causal=True),
        ),
        BugSpec(
            "batch_kv_mixup", batch_kv_mixup, "out", "B > 1 (entries use batch 0's k/v)",
            Case(b=2, dtype=BF16, mask="key_padding"), Case(b=1, dtype=BF16, mask="key_padding"),
        ),
        BugSpec(
            "q_assumed_contiguous", q_assumed_contiguous, "out", "q non-contiguous (transposed (B,N,H,D))",
            Case(layout="bnhd", is_causal=True), Case(layout="bhnd", is_causal=True),
        ),
        BugSpec(
            "fp32_bf16_scores", fp32_bf16_scores, "out", "float32 inputs (q·kᵀ in bf16)",
            Case(n_q=32), Case(n_q=32, dtype=BF16),
        ),
        BugSpec(
            "mask_sentinel", mask_sentinel, "out", "fully masked rows: padded queries in a bool mask",
            Case(b=2, mask="padded_rows"), Case(b=2, mask="key_padding"),
        ),
        BugSpec(
            "dq_unscaled", dq_unscaled, "dq", "scale != 1 (any default-scale call)",
            Case(is_causal=True), Case(is_causal=True, scale=1.0),
        ),
        BugSpec(
            "dk_partial_tile", dk_partial_tile, "dk", "N_k % 32 != 0 (dk zero in the last tile)",
            Case(n_q=24, n_k=40), Case(n_q=24, n_k=32),
        ),
        BugSpec(
            "dq_nan", dq_nan, "dq", "N_k % 64 == 32 (dq NaN)",
            Case(n_q=16, n_k=32, dtype=BF16), Case(n_q=16, n_k=48, dtype=BF16),
        ),
        BugSpec(
            "ds_bf16", ds_bf16, "dq", "float32 inputs (dS rounded to bf16)",
            Case(n_q=32, mask="key_padding", b=2), Case(n_q=32, mask="key_padding", b=2, dtype=BF16),
        ),
        BugSpec(
            "dv_unmasked", dv_unmasked, "dv", "is_causal=True or a bool mask (dv from unmasked P)",
            Case(is_causal=True, layout="bnhd"), Case(layout="bnhd"),
        ),
        BugSpec(
            "gqa_grad_not_summed", gqa_grad_not_summed, "dk", "H_kv < H, un-expanded k/v",
            Case(h=4, h_kv=1, mask="additive"), Case(h=4, mask="additive"),
        ),
        BugSpec(
            "delta_dropped", delta_dropped, "dq", "every call (dS without rowsum(dO·O))",
            Case(n_q=24, n_k=40, dtype=torch.float16),
        ),
        BugSpec(
            "kv_tile_zeroed", kv_tile_zeroed, "dk", "N_k > 32 (dk, dv zero for keys 16-31)",
            Case(n_q=24, n_k=77, b=2, dtype=BF16), Case(n_q=24, n_k=32, b=2, dtype=BF16),
        ),
        BugSpec(
            "tail_rows_stale", tail_rows_stale, "out", "N_q % 16 != 0, N_q > 16 (tail rows stale)",
            Case(n_q=40, n_k=77, dtype=BF16), Case(n_q=48, n_k=77, dtype=BF16),
        ),
        BugSpec(
            "one_head_wrong", one_head_wrong, "out", "H > 1 (last head reads head 0's values)",
            Case(h=4, n_q=32, is_causal=True, dtype=torch.float16), Case(h=1, n_q=32, is_causal=True),
        ),
        BugSpec(
            "one_batch_wrong", one_batch_wrong, "out", "B > 1 (last entry's values reversed)",
            Case(b=3, n_q=24, mask="key_padding", dtype=BF16), Case(b=1, n_q=24, mask="key_padding"),
        ),
    )
}  # fmt: skip


def register_buggy_kernels() -> list[str]:
    """Register every buggy kernel as ``bug_<name>`` and :func:`correct_flash` as ``bug_none``
    (replacing earlier registrations); returns the names registered."""
    from flashprobe import register_kernel

    names = []
    for spec in BUGS.values():
        register_kernel(f"bug_{spec.name}", spec.fn, overwrite=True)
        names.append(f"bug_{spec.name}")
    register_kernel("bug_none", correct_flash, overwrite=True)
    names.append("bug_none")
    for name, fn in CORRECT.items():
        register_kernel(f"ok_{name}", fn, overwrite=True)
        names.append(f"ok_{name}")
    return names
