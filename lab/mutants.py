"""The mutation suite: attention kernels that each carry one bug of a class real kernels have shipped.

One registry, :data:`MUTANTS`, serves every detector of the project: the probe's tests train with
the mutants as the primary kernel, ``flashprobe fuzz``'s tests run them on the catalogue cases
built for their class, and :mod:`lab.rules` counts how many of them each pass/fail rule
catches. Each :class:`Mutant` has a name, its bug class in words kernel authors use, the
directions it breaks (``out``, ``dq``, ``dk``, ``dv``), what it needs to fire, a small call that
fires it and one that does not (:class:`Case`), and the fuzz cases that catch it (:class:`Catch`).
:func:`register_mutants` registers them as ``bug_<name>`` (importing this module does, so the
commands take ``--import lab.mutants`` from the repository's root); :func:`correct_flash` (the same code
path with no bug) as ``bug_none``; :data:`CORRECT`, correct kernels with production numerics (the
flash-style backward, exp2 with the scale folded into log2(e), split-K with a log-sum-exp
combine), as ``ok_<name>``. :func:`blockwise_attention` is a correct kernel written as Triton
kernels are, with their declared limits (:data:`TRITON_LIKE`).

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
so their gradients are the exact gradients of the buggy forward. **Backward bugs** are the flash
form of :mod:`flashprobe.kernels.flash_form` (a correct forward saving the row log-sum-exp, as
FlashAttention does, its output normalised as flash kernels do, and the flash-style backward that
recomputes ``P`` from the log-sum-exp), computed in fp32, with the one step of
:class:`~flashprobe.kernels.flash_form.FlashForm` that carries the bug overridden::

    dV = Pᵀ dO,  dP = dO Vᵀ,  Δ = rowsum(dO ∘ O),  dS = P ∘ (dP − Δ),
    dQ = scale · dS K,  dK = scale · dSᵀ Q   (summed over the query heads of a GQA group)

The small calls' triggers are chosen so a tiny training loop can hit them by changing its shapes:
a sequence length (``N % 32``, ``N > 64``), the head dim (``D > 64``), the batch size (``B > 1``),
the layout (``q`` a transposed ``(B, N, H, D)`` view), a causal or padding mask, GQA heads or the
dtype; the fuzz-sized bugs (tiles of 128, grids past 1024, 2²⁴ elements) fire on the catalogue's
cases.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from flashprobe.kernels import KernelCapabilities, default_scale, math_attention, register_kernel
from flashprobe.kernels.flash_form import FlashForm, FlashFormCall, flash_form_attention
from lab import contracts

__all__ = [
    "CONTRACT_MUTANTS",
    "CORRECT",
    "CORRECT_CONTRACTS",
    "DIRECTIONS",
    "MUTANTS",
    "TRITON_LIKE",
    "TRITON_LIKE_64",
    "Case",
    "Catch",
    "ContractMutant",
    "Mutant",
    "blockwise_64",
    "blockwise_attention",
    "correct_flash",
    "delta_dropped",
    "kv_tile_zeroed",
    "output_truncated",
    "register_mutants",
    "round_toward_zero",
]

Direction = Literal["out", "dq", "dk", "dv"]
#: the directions a call can be wrong in, in the order :attr:`Mutant.directions` lists them
DIRECTIONS: tuple[Direction, ...] = ("out", "dq", "dk", "dv")

_NEG_INF = float("-inf")


# --- shared pieces (correct) ---


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


def _expand_kv(
    k: torch.Tensor, v: torch.Tensor, heads: int, *, modulo: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with query head ``h`` reading key/value head ``h // (H / H_kv)`` (or the buggy ``h % H_kv``)."""
    kv_heads = k.shape[1]
    if kv_heads == heads:
        return k, v
    h = torch.arange(heads, device=k.device)
    idx = h % kv_heads if modulo else h // (heads // kv_heads)
    return k.index_select(1, idx), v.index_select(1, idx)


def _masks(
    attn_mask: torch.Tensor | None, is_causal: bool, n_q: int, n_k: int, device: torch.device, offset: int = 0
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(keep, bias)``: a bool keep-mask (causal: ``(N_q, N_k)``, True where key ``j <= i + offset``,
    top-left aligned, offset 0 correct; or a bool ``attn_mask``) and an additive float mask."""
    if is_causal:
        i = torch.arange(n_q, device=device).unsqueeze(-1)
        return torch.arange(n_k, device=device).unsqueeze(0) <= i + offset, None
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
    softmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    factor: float = 1.0,
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain autograd attention on equal-head tensors in the compute dtype, output in ``q``'s dtype.

    ``scores(qc, kc)`` replaces the unscaled ``qc @ kcᵀ``; ``mask_value`` is what masked-out
    scores are set to; ``factor`` multiplies the scale and the additive mask (``log2(e)`` for an
    exp2 kernel). Rows whose every score is ``-inf`` give zeros (safe softmax), unless
    ``softmax(s)`` replaces the row softmax (it then gets the scores as they are) or
    ``combine(s, vc)`` the whole ``softmax(s) @ vc``.
    """
    c = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(c), k.to(c), v.to(c)
    if kc.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    s = (qc @ kc.transpose(-2, -1) if scores is None else scores(qc, kc)) * (scale * factor)
    if bias is not None:
        s = s + bias.to(c) * factor
    if keep is not None:
        s = s.masked_fill(~keep, mask_value)
    if softmax is not None:
        return (softmax(s) @ vc).to(q.dtype)
    if combine is not None:
        return combine(s, vc).to(q.dtype)
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
    return _math(q, k, v, keep=keep, bias=bias, scale=default_scale(q.shape[-1], scale), **math_options)


# --- forward bugs ---


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
        return qc[..., :HEAD_DIM_LIMIT] @ kc[..., :HEAD_DIM_LIMIT].transpose(-2, -1)

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
    s = default_scale(q.shape[-1], scale)
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


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _as_if_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``'s storage read with contiguous ``(B, H, N, D)`` strides from its data pointer, as a
    kernel that takes ``data_ptr()`` without checking strides does (differentiably).

    Raises:
        RuntimeError: the read goes past the end of the storage (an expanded tensor), where a GPU
            kernel reads out of bounds.
    """
    if x.is_contiguous():
        return x
    needed = (x.storage_offset() + x.numel()) * x.element_size()
    if x.untyped_storage().nbytes() < needed:
        raise RuntimeError("out-of-bounds read: a stride-0 (expanded) view read as contiguous memory")
    return torch.as_strided(x, x.shape, _contiguous_strides(x.shape), x.storage_offset())


def strides_ignored(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: strides ignored: ``q``, ``k``, ``v`` read as if they were contiguous ``(B, H, N, D)``.

    Trigger: a non-contiguous view, e.g. ``x.view(B, N, H, D).transpose(1, 2)`` as models make it
    (with ``H > 1`` and ``N > 1``; the data is then read in ``(B, N, H, D)`` order), slices of a
    fused projection, or an expanded k/v (read out of bounds: an error). Quiet for contiguous
    tensors and for a contiguous tensor at a storage offset.
    """
    q, k, v = (_as_if_contiguous(t) for t in (q, k, v))
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


def storage_offset_ignored(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: a view's storage offset ignored: ``q``, ``k``, ``v`` read from the start of
    their storage.

    Trigger: a view that does not start its storage (a slice of a larger buffer, of a fused
    projection). Quiet for tensors that own their storage.
    """
    q, k, v = (t.as_strided(t.shape, t.stride(), 0) for t in (q, k, v))
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


def fp32_bf16_scores(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: precision silently lowered: an fp32 call computes q·kᵀ from bf16 ``q``, ``k``.

    Trigger: float32 inputs (the scores carry bf16 rounding, ~3e-3 relative). Quiet for bf16
    inputs (computed as the correct kernel does).
    """

    def scores(qc: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
        return (qc.to(BF16) @ kc.to(BF16).transpose(-2, -1)).to(qc.dtype)

    bug = {"scores": scores} if q.dtype == torch.float32 else {}
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, **bug)


def round_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (any shape) rounded to ``dtype`` toward zero (truncated), not to nearest: the nearest
    value, stepped one ulp toward zero where rounding to nearest went away from zero."""
    nearest = x.to(dtype)
    away = nearest.to(x.dtype).abs() > x.abs()
    return torch.where(away, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)


class _RoundTowardZero(torch.autograd.Function):
    """``x`` rounded to ``dtype`` toward zero (truncation), not to nearest; the gradient passes
    through unchanged, as a kernel's separate backward would compute it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.source = x.dtype
        return round_toward_zero(x, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.to(ctx.source), None


def output_truncated(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: the fp32 result converted to the output dtype by truncation (round toward zero)
    instead of round-to-nearest, as a hand-written conversion that drops the low mantissa bits does.

    Every element is at most one ulp off, always toward zero: each call is within any per-call rule
    (its error is about a rounding's), but the error's sign is systematic, so only the signed bias
    over many calls (:mod:`flashprobe.bias`) sees it. Its gradients are those of the fp32 output
    (right). Trigger: bf16 or fp16 inputs; quiet for fp32 and fp64 (no conversion).
    """
    if q.dtype not in (torch.bfloat16, torch.float16):
        return _forward_bug(q, k, v, attn_mask, is_causal, scale)
    out = _forward_bug(q.float(), k.float(), v.float(), attn_mask, is_causal, scale)  # fp32
    return _RoundTowardZero.apply(out, q.dtype)


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


def falsy_scale(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: ``scale or 1/sqrt(D)``: an explicit ``scale=0.0`` is taken for "not given".

    Trigger: ``scale=0.0`` (uniform attention). Quiet for any other scale.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale or None)


def _unsafe_softmax(s: torch.Tensor) -> torch.Tensor:
    return torch.softmax(s, dim=-1)  # NaN for a row of -inf


def fully_masked_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: NaN for fully masked rows (a softmax without torch's safe convention).

    Trigger: a query row whose every key is masked. Quiet where every row sees a key.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, softmax=_unsafe_softmax)


def causal_bottom_right(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: the causal mask aligned bottom-right (flash-attn's convention) where torch's is
    top-left: query ``i`` sees keys ``j <= i + N_k − N_q``.

    Trigger: ``is_causal=True`` with ``N_q != N_k``. Quiet for ``N_q == N_k``.
    """
    offset = k.shape[-2] - q.shape[-2]
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, causal_offset=offset)


def _softmax_without_max(s: torch.Tensor) -> torch.Tensor:
    e = torch.exp(s)
    return e / e.sum(dim=-1, keepdim=True)


def no_max_subtraction(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: ``exp(s)`` without subtracting the row maximum.

    Trigger: logits above ``log(float max)`` (about 88 in fp32): ``exp`` overflows to Inf, the row
    to NaN. Quiet for small logits.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, softmax=_softmax_without_max)


#: keys per key tile of the fuzz-sized tiled bugs
TILE = 128


def _softmax_without_rescale(s: torch.Tensor) -> torch.Tensor:
    """Each key tile exponentiated with its own maximum, never rescaled to the row's."""
    tiles = []
    for j in range(0, s.shape[-1], TILE):
        part = s[..., j : j + TILE]
        m = part.detach().amax(dim=-1, keepdim=True)
        tiles.append(torch.exp(part - m.masked_fill(m == _NEG_INF, 0.0)))
    e = torch.cat(tiles, dim=-1)
    total = e.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, e / total.masked_fill(total == 0, 1.0), 0.0)


def no_rescale(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: online softmax without rescaling: each key tile of 128 keeps its own maximum.

    Trigger: ``N_k > 128`` with the row maximum changing between tiles (rising logits). Quiet for
    ``N_k <= 128``.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, softmax=_softmax_without_rescale)


def qk_in_fp16(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: ``q·kᵀ`` formed in the 16-bit inputs' dtype before the scale is applied.

    Trigger: fp16 inputs whose unscaled ``q·kᵀ`` exceeds 65504 (Inf, then NaN). Quiet for float32
    (it is then the plain baseline).
    """
    k, v = _expand_kv(k, v, q.shape[1])
    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def additive_mask_ignored(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: an additive (float) ``attn_mask`` dropped, its ``-inf`` entries included.

    Trigger: a float mask. Quiet for bool masks and no mask.
    """
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = None
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


def mask_batch_broadcast(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: batch entry 0's mask used for every entry.

    Trigger: a per-entry mask ``(B, ..., N_q, N_k)`` with ``B > 1`` whose entries differ (a
    padded batch). Quiet for ``B == 1`` or a mask broadcast over the batch.
    """
    if attn_mask is not None and attn_mask.dim() == 4 and attn_mask.shape[0] > 1:
        attn_mask = attn_mask[:1]
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


#: (batch, head) programs the large-grid kernel launches correctly
GRID_LIMIT = 1024


def large_grid_head_mixup(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: launch-grid overflow: (batch, head) slices past 1024 get an earlier slice's output.

    Trigger: ``B · H > 1024``. Quiet below.
    """
    out = _forward_bug(q, k, v, attn_mask, is_causal, scale)
    b, h = out.shape[:2]
    if b * h <= GRID_LIMIT:
        return out
    index = torch.arange(b * h, device=out.device)
    index = torch.where(index >= GRID_LIMIT, index - GRID_LIMIT, index)
    return out.reshape(b * h, *out.shape[2:])[index].reshape(out.shape)


# --- forward bugs of the fuzzer's axes: memory past the tensors, NaN inputs, huge tensors ---


def _allowed(q: torch.Tensor, k: torch.Tensor, attn_mask: Any, is_causal: bool) -> torch.Tensor:
    """Bool, broadcastable to ``(B, H, N_q, N_k)``: where a query may attend to a key."""
    keep, bias = _masks(attn_mask, is_causal, q.shape[-2], k.shape[-2], q.device)
    allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
    if keep is not None:
        allowed = allowed & keep
    if bias is not None:
        allowed = allowed & (bias > _NEG_INF)
    return allowed


def raw_sentinel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: the −5e4 sentinel applied to the *unscaled* ``q·kᵀ``, and the running maximum
    started there.

    Trigger: valid unscaled logits below −5e4 (a large head dim with a small scale reaches them
    first). Quiet for logits above.
    """
    k, v = _expand_kv(k, v, q.shape[1])
    scale = default_scale(q.shape[-1], scale)
    raw = q.float() @ k.float().transpose(-2, -1)
    raw = raw.masked_fill(~_allowed(q, k, attn_mask, is_causal), MASK_SENTINEL)
    m = raw.amax(dim=-1, keepdim=True).clamp_min(MASK_SENTINEL)
    p = torch.where(raw <= MASK_SENTINEL, 0.0, torch.exp((raw - m) * scale))
    out = (p @ v.float()) / p.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return out.to(q.dtype)


def tail_reader(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: unmasked loads of a partial last key tile: the tile is read whole past ``N_k``
    and its extra probabilities zeroed, so ``0 × NaN`` from the memory past the end poisons rows.

    Trigger: ``N_k % 128 != 0`` with non-finite values stored after k, v. Quiet for whole tiles.
    """
    n_k = k.shape[2]
    full = -(-n_k // TILE) * TILE
    k_tile = k.as_strided((*k.shape[:2], full, k.shape[3]), k.stride(), k.storage_offset())
    v_tile = v.as_strided((*v.shape[:2], full, v.shape[3]), v.stride(), v.storage_offset())
    s = (q.float() @ k_tile.float().transpose(-2, -1)) * default_scale(q.shape[-1], scale)
    valid = torch.zeros(*s.shape[:2], 1, full, dtype=torch.bool)
    valid[..., :n_k] = True
    if attn_mask is not None:
        pad = attn_mask.new_zeros(*attn_mask.shape[:-1], full - n_k)
        valid = valid & torch.cat([attn_mask, pad], dim=-1)
    p = torch.softmax(s.masked_fill(~valid, _NEG_INF), dim=-1).nan_to_num(0.0)
    return (p @ v_tile.float()).to(q.dtype)  # p = 0 past N_k; v there is the poison


def nan_swallowed(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: a fully-masked-row guard that catches NaN rows too: a NaN row returned as 0.

    Trigger: NaN in the inputs (the golden is NaN there). Quiet for finite inputs.
    """
    k, v = _expand_kv(k, v, q.shape[1])
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return torch.nan_to_num(out, nan=0.0)


def float_offsets(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: element offsets computed in float32: wrong past 2²⁴ elements.

    Trigger: ``k`` of more than 2²⁴ elements. Quiet below.
    """
    index = torch.arange(k.numel(), dtype=torch.float32).long().clamp_max(k.numel() - 1)
    k = k.contiguous().reshape(-1)[index].view(k.shape)
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


# --- a shape-limited blockwise kernel, written as Triton kernels are, and its bug ---

#: the limits of a typical hand-written Triton attention kernel (:func:`blockwise_attention`)
TRITON_LIKE = KernelCapabilities(
    masks=frozenset({"causal", "key_padding"}),
    seq_multiple=TILE,
    same_length=True,
    backward_masks=frozenset({"causal"}),
    head_dims=frozenset({32, 64, 128}),
)


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    first_block_nan: bool = False,
    block: int = TILE,
    tail_mask_ignored: bool = False,
) -> torch.Tensor:
    """Online-softmax attention over key blocks of 128 in fp32 (differentiable by autograd), written
    the way Triton kernels are; registered with :data:`TRITON_LIKE` limits.

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H_kv, N_k, D)``; v: ``(B, H_kv, N_k, D_v)``.
        attn_mask: a bool key-padding mask ``(B, 1, 1, N_k)``, or None.
        is_causal: top-left causal mask.
        scale: the softmax scale (``1/sqrt(D)`` when None).
        first_block_nan: the bug of :func:`first_block_nan`.
        block: keys per block (64: the kernel of :data:`TRITON_LIKE_64`).
        tail_mask_ignored: the bug of :func:`tail_tile_mask`.

    Returns:
        ``(B, H, N_q, D_v)`` in q's dtype; 0 for rows that see no key.
    """
    scale = default_scale(q.shape[-1], scale)
    k, v = _expand_kv(k, v, q.shape[1])
    valid = _allowed(q, k, attn_mask, is_causal)
    if tail_mask_ignored:  # the last block sees every key below N_k: only causality is applied there
        last = (k.shape[2] - 1) // block * block
        bounds = _allowed(q, k, None, is_causal)  # (N_q, N_k)
        shape = torch.broadcast_shapes(valid.shape, bounds.shape)
        valid = torch.cat([valid.expand(shape)[..., :last], bounds.expand(shape)[..., last:]], dim=-1)
    q32, k32, v32 = q.float(), k.float(), v.float()
    shape = (*q.shape[:3], 1)
    m = q32.new_full(shape, _NEG_INF)
    total = q32.new_zeros(shape)
    acc = q32.new_zeros(*q.shape[:3], v.shape[-1])
    for j in range(0, k.shape[2], block):
        s = (q32 @ k32[:, :, j : j + block].transpose(-2, -1)) * scale
        s = s.masked_fill(~valid[..., j : j + block], _NEG_INF)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        if not first_block_nan:  # a block whose keys are all masked so far: subtract 0, not -inf
            m_new = torch.where(torch.isneginf(m_new), 0.0, m_new)
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        total = total * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ v32[:, :, j : j + block]
        m = m_new
    return (acc / torch.where(total == 0, 1.0, total)).to(q.dtype)


def first_block_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: no guard for a key block in which every key is masked so far: a row whose first
    block is fully masked gets ``exp(-inf − (-inf)) = NaN`` (found in a real Triton kernel).

    Trigger: left padding of a whole key block of 128. Quiet without it.
    """
    return blockwise_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, first_block_nan=True
    )


#: :data:`TRITON_LIKE` with key blocks of 64 and cross-attention lengths (the kernel of
#: :func:`blockwise_64` and :func:`tail_tile_mask`)
TRITON_LIKE_64 = KernelCapabilities(
    masks=frozenset({"causal", "key_padding"}),
    seq_multiple=64,
    backward_masks=frozenset({"causal"}),
    head_dims=frozenset({32, 64, 128}),
)


def blockwise_64(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """:func:`blockwise_attention` over key blocks of 64 (correct; :data:`TRITON_LIKE_64` limits)."""
    return blockwise_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, block=64)


def tail_tile_mask(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: the padding mask not applied in the last key tile (the tail tile bounded by ``N_k``
    alone, as a kernel that masks its last tile by the sequence's end and not by the mask does).

    Trigger: a key-padding mask that cuts the last tile of 64 keys (a partial tile within the
    kernel's multiple). Quiet without a mask, or where the last tile is whole and valid.
    """
    options = {"block": 64, "tail_mask_ignored": True}
    return blockwise_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **options)


def k_strides_from_v(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: k's pointers built from v's strides (FlagAttention's forward, found by issue 54).

    Trigger: k and v with different strides (k contiguous, v a transposed ``(B, N, H, D)`` view).
    Quiet where they share their strides (both contiguous, both views of one fused projection).
    """
    if k.stride() != v.stride():
        last = sum((n - 1) * st for n, st in zip(k.shape, v.stride(), strict=True))  # farthest element read
        if k.untyped_storage().nbytes() < (k.storage_offset() + last + 1) * k.element_size():
            raise RuntimeError("out-of-bounds read: k read with v's strides")
        k = torch.as_strided(k, k.shape, v.stride(), k.storage_offset())
    return _forward_bug(q, k, v, attn_mask, is_causal, scale)


# --- the backward bugs: the flash form (flashprobe.kernels.flash_form) with one step changed ---


def _flash(q, k, v, attn_mask, is_causal, scale, form: FlashForm) -> torch.Tensor:
    _check(q, k, v, attn_mask, is_causal)
    if k.shape[-2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    options = {"attn_mask": attn_mask, "is_causal": is_causal, "scale": scale}
    return flash_form_attention(q, k, v, **options, upcast=True, form=form)


class _KernelForm(FlashForm):
    """The flash form with the forward's output as flash kernels normalise it: ``exp(S − m)`` against
    the row max ``m``, divided by its row sum, then times ``V`` (the recomputed ``P`` of the backward
    comes from the log-sum-exp, as theirs does)."""

    def output(self, call: FlashFormCall) -> torch.Tensor:
        s = call.masked
        m = s.amax(dim=-1, keepdim=True)
        dead = m == _NEG_INF  # every key masked: P = 0, output 0 (safe softmax)
        e = torch.exp(s - m.masked_fill(dead, 0.0))
        denom = e.sum(dim=-1, keepdim=True)
        return (e / denom.masked_fill(dead, 1.0)) @ call.v


_CORRECT_FORM = _KernelForm()


def correct_flash(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct attention with the flash-form backward (the backward bugs' code path), in fp32 for
    16-bit inputs."""
    return _flash(q, k, v, attn_mask, is_causal, scale, _CORRECT_FORM)


class _DqUnscaled(_KernelForm):
    def dq(self, call: FlashFormCall, ds: torch.Tensor) -> torch.Tensor:
        return torch.matmul(ds, call.k)  # the softmax scale lost


def dq_unscaled(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward loses the softmax scale in dq (``dq = dS K``).

    Trigger: any call whose scale is not 1 (every default-scale call with ``D > 1``). Quiet with
    ``scale=1.0``. The forward, dk and dv are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _DqUnscaled())


class _DkPartialTile(_KernelForm):
    def dk(self, call: FlashFormCall, ds: torch.Tensor) -> torch.Tensor:
        dk = super().dk(call, ds)
        n_k = call.k.shape[2]
        if n_k % 32:  # the partial last tile of 32 keys skipped
            dk[..., n_k - n_k % 32 :, :] = 0.0
        return dk


def dk_partial_tile(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward skips the partial last key tile: dk is zero for the last
    ``N_k % 32`` keys.

    Trigger: ``N_k % 32 != 0``. Quiet for ``N_k`` a multiple of 32. The forward, dq and dv are
    right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _DkPartialTile())


class _DqNan(_KernelForm):
    def dq(self, call: FlashFormCall, ds: torch.Tensor) -> torch.Tensor:
        dq = super().dq(call, ds)
        if call.k.shape[2] % TILE == TILE // 2:  # the last tile's missing half read as garbage
            dq = dq + float("nan")
        return dq


def dq_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: length-dependent non-finite gradient: dq is NaN.

    Trigger: ``N_k % 128 == 64`` (a half-filled last key tile of 128). Quiet for any other
    ``N_k % 128``. The forward, dk and dv are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _DqNan())


class _DsBf16(_KernelForm):
    def ds(self, call: FlashFormCall, p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        ds = super().ds(call, p, dp, delta)
        if call.dtype == torch.float32:  # rounded to bf16 in an fp32 call
            ds = ds.to(torch.bfloat16).to(ds.dtype)
        return ds


def ds_bf16(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: precision silently lowered in the backward: dS rounded to bf16 in an fp32 call.

    Trigger: float32 inputs (dq and dk carry bf16 rounding). Quiet for bf16 inputs (whose
    backward is computed in fp32 as the correct kernel's). The forward and dv are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _DsBf16())


class _DvUnmasked(_KernelForm):
    def dv(self, call: FlashFormCall, p: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
        unmasked = self.probs(call, call.scores)  # P from the scores before the bool/causal mask
        return torch.matmul(unmasked.transpose(-2, -1), d_out)


def dv_unmasked(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward ignores the mask for dv (``dV = Pᵀ dO`` with the unmasked ``P``).

    Trigger: ``is_causal=True`` or a bool ``attn_mask`` that masks something. Quiet without
    them (an additive float mask is applied correctly). The forward, dq and dk are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _DvUnmasked())


class _GqaFirstHead(_KernelForm):
    def kv_grads(
        self, call: FlashFormCall, dk: torch.Tensor, dv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if call.kv_heads == call.q.shape[1]:
            return dk, dv
        b, heads, n_k = call.q.shape[0], call.q.shape[1], call.k.shape[2]
        group = (b, call.kv_heads, heads // call.kv_heads, n_k, -1)
        return dk.view(group)[:, :, 0], dv.view(group)[:, :, 0]  # the group's first head, not its sum


def gqa_grad_not_summed(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: grouped-query backward keeps only the first query head of each group in dk
    and dv (no sum over the group).

    Trigger: ``H_kv < H`` **passed un-expanded**. Quiet for ``H_kv == H``. The forward and dq
    are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _GqaFirstHead())


class _DeltaDropped(_KernelForm):
    def ds(self, call: FlashFormCall, p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return (p.to(delta.dtype) * dp.to(delta.dtype)).to(call.q.dtype)  # without − Δ


def delta_dropped(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: a gradient term dropped: ``dS = P ∘ dP`` without ``− rowsum(dO ∘ O)``.

    Trigger: every call (dq and dk are wrong by tens of percent or more; the forward and dv are
    right). A weak-baseline class: in 16 bits the plain baseline's own gradient error is percents,
    so a ratio to it is lenient; the ``absolute`` criterion catches it.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _DeltaDropped())


class _MaskIgnored(_KernelForm):
    def recomputed_probs(self, call: FlashFormCall) -> torch.Tensor:
        return torch.softmax(torch.matmul(call.q, call.k.transpose(-2, -1)) * call.scale, dim=-1)


def backward_mask_ignored(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward without the mask: ``P`` recomputed from the unmasked scores.

    Trigger: any mask (causal, bool or additive) that masks something. Quiet without one. The
    forward is right; every gradient is wrong.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _MaskIgnored())


class _LseUnguarded(_KernelForm):
    def recomputed_probs(self, call: FlashFormCall) -> torch.Tensor:
        assert call.lse is not None
        return torch.exp(call.masked.to(call.lse.dtype) - call.lse).to(call.q.dtype)  # −inf − (−inf): NaN


def fully_masked_backward_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: NaN gradients from fully masked rows: ``P = exp(s − lse)`` recomputed with
    ``lse = -inf`` there (the forward's safe zeros are not carried into the backward).

    Trigger: a query row whose every key is masked. Quiet where every row sees a key.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _LseUnguarded())


class _DvUnnormalised(_KernelForm):
    def dv(self, call: FlashFormCall, p: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
        return torch.matmul((p * p.shape[-1]).transpose(-2, -1), d_out)


def dv_unnormalised(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: dv from unnormalised probabilities (``P · N_k``).

    Trigger: every call with ``N_k > 1``. The forward, dq and dk are right.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _DvUnnormalised())


class _GradOutContiguous(_KernelForm):
    def grad_out(self, call: FlashFormCall, d_out: torch.Tensor) -> torch.Tensor:
        read = d_out.as_strided(d_out.shape, _contiguous_strides(d_out.shape))  # strides ignored
        return super().grad_out(call, read)


def grad_out_contiguous(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: the output gradient ``dO`` read as contiguous ``(B, H, N, D)`` memory.

    Trigger: a non-contiguous ``dO`` (the gradient of a transposed output view). Quiet for a
    contiguous one.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _GradOutContiguous())


class _Fp16Scratch(_KernelForm):
    def ds(self, call: FlashFormCall, p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        ds = super().ds(call, p, dp, delta)
        fp16 = torch.finfo(torch.float16)  # dP and dS kept in fp16's range: overflow to Inf, flush to 0
        ds = torch.where(ds.abs() < fp16.tiny * 2.0**-10, 0.0, ds)
        return torch.where(dp.abs() > fp16.max, float("inf"), ds)


def fp16_scratch(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: backward scratch (``dP``, ``dS``) kept in fp16's range in a float32 call: large
    values overflow to Inf, tiny ones flush to 0.

    Trigger: an output gradient so large that ``dP`` exceeds 65504, or so small that ``dS`` falls
    below fp16's subnormals. Quiet for ordinary gradients.
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _Fp16Scratch())


#: keys per key tile of the tiled bugs
KEY_TILE = 16


class _KvTileZeroed(_KernelForm):
    def kv_grads(
        self, call: FlashFormCall, dk: torch.Tensor, dv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if call.k.shape[2] > 2 * KEY_TILE:  # the second key tile skipped in dk and dv
            dk[..., KEY_TILE : 2 * KEY_TILE, :] = 0.0
            dv[..., KEY_TILE : 2 * KEY_TILE, :] = 0.0
        return super().kv_grads(call, dk, dv)


def kv_tile_zeroed(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Bug class: a localised backward bug: dk and dv are zero for the second key tile
    (keys 16–31).

    Trigger: ``N_k > 32``. Quiet for ``N_k <= 32``. The forward and dq are right; 16 of the keys
    are wrong, which a whole-tensor L2 averages away (the ``row`` criterion catches it).
    """
    return _flash(q, k, v, attn_mask, is_causal, scale, _KvTileZeroed())


# --- localised forward bugs ---

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


# --- correct kernels with production numerics ---

LOG2E = 1.4426950408889634


def _exp2_softmax_v(s2: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """``exp2(s2 − max) @ v`` normalised after the product, 0 for rows that see no key."""
    m = s2.detach().amax(dim=-1, keepdim=True)
    dead = m == _NEG_INF
    p = torch.exp2(s2 - m.masked_fill(dead, 0.0))
    denom = p.sum(dim=-1, keepdim=True)
    return ((p @ vc) / denom.masked_fill(dead, 1.0)).masked_fill(dead, 0.0)


def exp2_folded(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct: FlashAttention's exponent, ``exp2(s·c − m·c)`` with the scale folded into
    ``c = scale · log2(e)`` (FA2/FA3 and the Triton tutorial), in fp32 for 16-bit inputs.

    Its error grows with |logit| (the rounding of ``s·c``, about ``|s|·eps``): right, and the
    judge must pass it, sentinel-range logits (-1e4 … -1e5) included.
    """
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, factor=LOG2E, combine=_exp2_softmax_v)


#: keys per split of the split-K kernel
SPLIT_KEYS = 32


def _split_k_combine(s: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """Each split's normalised output and log-sum-exp, combined by the log-sum-exp weights."""
    outs, lses = [], []
    for start in range(0, s.shape[-1], SPLIT_KEYS):
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
    return (weights * torch.stack(outs)).sum(dim=0).masked_fill(dead, 0.0)


def split_k_lse(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct: flash-decoding's split-K: each split of 32 keys gives its normalised output ``o_i``
    and log-sum-exp ``lse_i``; they are combined as ``Σ exp(lse_i − lse) · o_i`` with
    ``lse = logsumexp_i lse_i`` (in fp32 for 16-bit inputs)."""
    return _forward_bug(q, k, v, attn_mask, is_causal, scale, combine=_split_k_combine)


#: Correct kernels with production numerics, beside :func:`correct_flash`.
CORRECT: dict[str, Callable[..., torch.Tensor]] = {
    "flash_backward": correct_flash,
    "exp2_folded": exp2_folded,
    "split_k_lse": split_k_lse,
}


# --- calls that trigger a bug (or do not) ---


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
        shape = (*self.shapes["q"][:3], self.shapes["v"][3])
        return torch.randn(shape, generator=self._gen(9), dtype=torch.float64).to(self.dtype)


@dataclass(frozen=True)
class Catch:
    """A catalogue case of ``flashprobe fuzz``'s default profile that catches a mutant.

    Attributes:
        case: the :data:`flashprobe.fuzz.CATALOGUE` case's name.
        dtype: the dtype it is checked at (``fp32``, ``bf16``, ``fp16``).
        failure: the failure kind expected there (``values``, ``dq:nonfinite``, ...), or its prefix.
    """

    case: str
    dtype: str = "fp32"
    failure: str = "values"


@dataclass(frozen=True)
class Mutant:
    """One planted bug: a kernel that is correct except for one bug of a class real kernels shipped.

    Attributes:
        name: the bug's name (registered as ``bug_<name>``).
        fn: the kernel, with the SDPA signature.
        bug: the bug class, in the words kernel authors use.
        directions: what it breaks, of ``out``, ``dq``, ``dk``, ``dv``, the first one first (a
            forward bug: ``out``, its gradients then being those of the wrong output; the
            directions before the first are right even when it fires).
        needs: when it fires: the shapes, masks, dtypes or values it needs.
        trigger: a small call that fires it (None where only a catalogue case is built for it).
        quiet: a call that does not (None where there is none).
        catches: the fuzz catalogue cases that catch it.
        capabilities: the limits it is registered with (None: any call).
    """

    name: str
    fn: Callable[..., torch.Tensor]
    bug: str
    directions: tuple[Direction, ...]
    needs: str
    trigger: Case | None = field(default=None, repr=False)
    quiet: Case | None = field(default=None, repr=False)
    catches: tuple[Catch, ...] = ()
    capabilities: KernelCapabilities | None = field(default=None, repr=False)

    @property
    def direction(self) -> Direction:
        """The first direction it corrupts."""
        return self.directions[0]


BF16, FP16 = torch.bfloat16, torch.float16
OUT: tuple[Direction, ...] = ("out",)

#: The mutation suite, by name: every planted bug of the project, one real bug class each.
MUTANTS: dict[str, Mutant] = {
    m.name: m
    for m in (
        # ---- forward bugs: the output is wrong
        Mutant(
            "scale_ignored", scale_ignored, "explicit softmax scale ignored", OUT,
            "scale given and != 1/sqrt(D)", Case(scale=0.5, mask="additive"), Case(mask="additive"),
        ),
        Mutant(
            "falsy_scale", falsy_scale, "`scale or 1/sqrt(d)`: scale=0.0 ignored", OUT, "scale=0.0",
            catches=(Catch("scale_zero"),),
        ),
        Mutant(
            "head_dim_truncated", head_dim_truncated, "head dim over the kernel's limit truncated", OUT,
            "head dim D > 64", Case(d=96, n_q=8), Case(d=64, n_q=8), (Catch("head_dim_160"),),
        ),
        Mutant(
            "causal_off_by_one", causal_off_by_one, "causal mask off by one (next token visible)", OUT,
            "is_causal=True", Case(is_causal=True), Case(),
        ),
        Mutant(
            "causal_bottom_right", causal_bottom_right, "causal mask aligned bottom-right", OUT,
            "is_causal=True with N_q != N_k", catches=(Catch("causal_nq_lt_nk"),),
        ),
        Mutant(
            "keys_truncated", keys_truncated, "long context: keys past the kernel's limit ignored", OUT,
            "N_k > 64", Case(n_q=8, n_k=80), Case(n_q=8, n_k=64), (Catch("long_context_8k"),),
        ),
        Mutant(
            "nan_rows", nan_rows, "length-dependent NaN output rows", OUT, "N_q % 32 == 16 (last 16 rows)",
            Case(n_q=48, dtype=BF16), Case(n_q=40, dtype=BF16),
        ),
        Mutant(
            "gqa_head_mapping", gqa_head_mapping, "GQA: query head h reads k/v head h % H_kv", OUT,
            "1 < H_kv < H, k/v not expanded", Case(h=4, h_kv=2, is_causal=True), Case(h=4, is_causal=True),
            (Catch("gqa_broadcast"),),
        ),
        Mutant(
            "batch_kv_mixup", batch_kv_mixup, "large-grid index mix-up: every entry reads batch 0's k/v",
            OUT, "B > 1",
            Case(b=2, dtype=BF16, mask="key_padding"), Case(b=1, dtype=BF16, mask="key_padding"),
        ),
        Mutant(
            "large_grid_head_mixup", large_grid_head_mixup, "launch grid overflow: heads past 1024 mixed",
            OUT, "B * H > 1024", catches=(Catch("large_grid"),),
        ),
        Mutant(
            "strides_ignored", strides_ignored, "strides ignored: inputs read as contiguous (B, H, N, D)",
            OUT, "a non-contiguous q, k or v (transposed (B, N, H, D) views)",
            Case(layout="bnhd", is_causal=True), Case(layout="bhnd", is_causal=True), (Catch("layout_bnhd"),),
        ),
        Mutant(
            "storage_offset_ignored", storage_offset_ignored, "a view's storage offset ignored", OUT,
            "a view that does not start its storage", catches=(Catch("layout_offset"),),
        ),
        Mutant(
            "fp32_bf16_scores", fp32_bf16_scores, "precision silently lowered: fp32 q·kᵀ in bf16", OUT,
            "float32 inputs", Case(n_q=32), Case(n_q=32, dtype=BF16),
        ),
        Mutant(
            "output_truncated", output_truncated, "output rounded toward zero (a conversion bug): biased",
            OUT, "bf16 or fp16 output; within one ulp per call: only the bias over calls sees it",
        ),
        Mutant(
            "qk_in_fp16", qk_in_fp16, "q·kᵀ formed in fp16 before the scale", OUT,
            "fp16, unscaled q·kᵀ > 65504", catches=(Catch("qk_overflow", "fp16", "nonfinite"),),
        ),
        Mutant(
            "no_max_subtraction", no_max_subtraction, "exp() without the row maximum", OUT,
            "logits > 88 (fp32 exp overflow)", catches=(Catch("large_logits", failure="nonfinite"),),
        ),
        Mutant(
            "no_rescale", no_rescale, "online softmax without rescaling", OUT,
            "N_k > 128, the row maximum rising across key tiles", catches=(Catch("rising_max"),),
        ),
        Mutant(
            "mask_sentinel", mask_sentinel, "the −50,000 mask sentinel (FlashInfer PR 4401)", OUT,
            "fully masked rows (bool mask), or valid logits below −5e4",
            Case(b=2, mask="padded_rows"), Case(b=2, mask="key_padding"),
            (Catch("sentinel_5e4"), Catch("fully_masked_rows", failure="masked_nonzero")),
        ),
        Mutant(
            "raw_sentinel", raw_sentinel, "the −5e4 sentinel on the unscaled q·kᵀ", OUT,
            "valid unscaled logits below −5e4", catches=(Catch("raw_sentinel_5e4", failure="zeros"),),
        ),
        Mutant(
            "fully_masked_nan", fully_masked_nan, "NaN for fully masked rows", OUT, "a fully masked row",
            catches=(Catch("fully_masked_rows", failure="nonfinite"),),
        ),
        Mutant(
            "additive_mask_ignored", additive_mask_ignored, "additive mask dropped", OUT, "a float mask",
            catches=(Catch("fully_masked_additive", failure="masked_nonzero"),),
        ),
        Mutant(
            "mask_batch_broadcast", mask_batch_broadcast, "batch 0's mask used for every entry", OUT,
            "a per-entry mask with B > 1", catches=(Catch("padding_mask", failure="zeros"),),
        ),
        Mutant(
            "first_block_nan", first_block_nan, "NaN when a row's first key block is fully masked", OUT,
            "left padding of a whole key block", catches=(Catch("left_padding", failure="nonfinite"),),
            capabilities=TRITON_LIKE,
        ),
        Mutant(
            "tail_tile_mask", tail_tile_mask, "padding mask ignored in the last key tile", OUT,
            "a key-padding mask that cuts the last tile of 64 keys",
            catches=(Catch("odd_shapes"), Catch("keys_mod128_64")), capabilities=TRITON_LIKE_64,
        ),
        Mutant(
            "k_strides_from_v", k_strides_from_v, "k read with v's strides (FlagAttention)", OUT,
            "k and v with different strides", catches=(Catch("layout_kv_strides"),),
        ),
        Mutant(
            "tail_reader", tail_reader, "unmasked loads of a tail tile: 0 × NaN", OUT,
            "N_k % 128 != 0, NaN stored past k/v", catches=(Catch("poisoned_nan", failure="nonfinite"),),
        ),
        Mutant(
            "nan_swallowed", nan_swallowed, "a NaN row returned as 0", OUT, "NaN in the inputs",
            catches=(Catch("nan_inputs", failure="nan_hidden"),),
        ),
        Mutant(
            "float_offsets", float_offsets, "element offsets computed in fp32", OUT,
            "k of more than 2^24 elements", catches=(Catch("offsets_2e24"),),
        ),
        # ---- localised forward bugs: a few rows, one head, one batch entry
        Mutant(
            "tail_rows_stale", tail_rows_stale, "wrong tail query rows (a stale row tile)", OUT,
            "N_q % 16 != 0, N_q > 16", Case(n_q=40, n_k=77, dtype=BF16), Case(n_q=48, n_k=77, dtype=BF16),
        ),
        Mutant(
            "one_head_wrong", one_head_wrong, "one wrong head (the last reads head 0's values)", OUT, "H > 1",
            Case(h=4, n_q=32, is_causal=True, dtype=FP16), Case(h=1, n_q=32, is_causal=True),
        ),
        Mutant(
            "one_batch_wrong", one_batch_wrong, "one wrong batch entry (the last's values reversed)", OUT,
            "B > 1", Case(b=3, n_q=24, mask="key_padding", dtype=BF16), Case(b=1, n_q=24, mask="key_padding"),
        ),
        # ---- backward bugs: the forward is right
        Mutant(
            "dq_unscaled", dq_unscaled, "dq without the softmax scale", ("dq",), "scale != 1",
            Case(is_causal=True), Case(is_causal=True, scale=1.0),
            (Catch("odd_shapes", failure="dq:values"),),
        ),
        Mutant(
            "dk_partial_tile", dk_partial_tile, "dk zero for a partial last key tile", ("dk",),
            "N_k % 32 != 0", Case(n_q=24, n_k=40), Case(n_q=24, n_k=32),
            (Catch("odd_shapes", failure="dk:"),),
        ),
        Mutant(
            "dq_nan", dq_nan, "length-dependent NaN dq", ("dq",), "N_k % 128 == 64",
            Case(n_q=16, n_k=64, dtype=BF16), Case(n_q=16, n_k=48, dtype=BF16),
            (Catch("keys_mod128_64", failure="dq:nonfinite"),),
        ),
        Mutant(
            "ds_bf16", ds_bf16, "precision silently lowered: dS rounded to bf16", ("dq", "dk"),
            "float32 inputs", Case(n_q=32, mask="key_padding", b=2),
            Case(n_q=32, mask="key_padding", b=2, dtype=BF16), (Catch("odd_shapes", failure="dq:values"),),
        ),
        Mutant(
            "dv_unmasked", dv_unmasked, "dv ignores the mask", ("dv",), "is_causal=True or a bool mask",
            Case(is_causal=True, layout="bnhd"), Case(layout="bnhd"),
        ),
        Mutant(
            "backward_mask_ignored", backward_mask_ignored, "backward without the mask",
            ("dq", "dk", "dv"), "any mask", catches=(Catch("padding_mask", failure="dq:masked"),),
        ),
        Mutant(
            "fully_masked_backward_nan", fully_masked_backward_nan, "NaN gradients of fully masked rows",
            ("dq", "dk", "dv"), "a fully masked row",
            catches=(Catch("fully_masked_rows", failure="dq:nonfinite"),),
        ),
        Mutant(
            "gqa_grad_not_summed", gqa_grad_not_summed, "GQA dk/dv not summed over the group",
            ("dk", "dv"), "H_kv < H, k/v not expanded", Case(h=4, h_kv=1, mask="additive"),
            Case(h=4, mask="additive"), (Catch("gqa_broadcast", failure="dk:values"),),
        ),
        Mutant(
            "dv_unnormalised", dv_unnormalised, "dv from unnormalised probabilities", ("dv",), "N_k > 1",
            catches=(Catch("odd_shapes", failure="dv:values"),),
        ),
        Mutant(
            "grad_out_contiguous", grad_out_contiguous, "dO read as contiguous memory", ("dq", "dk", "dv"),
            "a non-contiguous dO", catches=(Catch("grad_out_transposed", failure="d"),),
        ),
        Mutant(
            "fp16_scratch", fp16_scratch, "backward scratch in fp16's range (overflow, flush to 0)",
            ("dq", "dk"), "dO so large dP > 65504, or so small dS < fp16 subnormals",
            catches=(Catch("grad_out_tiny", failure="d"), Catch("grad_out_huge", failure="d")),
        ),
        # ---- weak-baseline and localised backward bugs
        Mutant(
            "delta_dropped", delta_dropped, "a gradient term dropped: dS without rowsum(dO·O)", ("dq", "dk"),
            "every call", Case(n_q=24, n_k=40, dtype=FP16),
        ),
        Mutant(
            "kv_tile_zeroed", kv_tile_zeroed, "a zeroed key tile in dk and dv (keys 16-31)", ("dk", "dv"),
            "N_k > 32", Case(n_q=24, n_k=77, b=2, dtype=BF16), Case(n_q=24, n_k=32, b=2, dtype=BF16),
        ),
    )
}  # fmt: skip


# ---- the contract apis: one planted bug per field-bug class, a step of a correct stand-in overridden


class _SoftcapExp(contracts.FlashAttn):
    def cap(self, s, softcap):  # tanh through exp: inf / inf once |s / cap| > 44 (vllm 56578)
        e = torch.exp(2.0 * s / softcap)
        return softcap * (e - 1.0) / (e + 1.0)


class _WindowSymmetric(contracts.FlashAttn):
    def keep(self, dist, causal, window):  # (left, left) where the api says (left, right) (vllm PR 49202)
        return super().keep(dist, causal, (window[0], window[0]))


class _AlibiTopLeft(contracts.FlashAttn):
    def alibi(self, slopes, n_q, n_k):  # |j − i|: anchored top-left when N_q != N_k
        d = (
            torch.arange(n_k, device=slopes.device)[None, :]
            - torch.arange(n_q, device=slopes.device)[:, None]
        )
        return -slopes.view(-1, 1, 1) * d.abs()


class _GqaQueryHead(contracts.FlashAttn):
    def kv_heads(self, h, h_kv, device):  # K/V indexed h % H_kv (LMCache PR 3092)
        return torch.arange(h, device=device) % h_kv


class _TailTileDropped(contracts.FlashAttn):
    tile = 128

    def keep(self, dist, causal, window):  # keys past the last whole tile of 128 ignored (pytorch 159247)
        keep = super().keep(dist, causal, window)
        n_k = dist.shape[1]
        if n_k > self.tile and n_k % self.tile:
            keep = keep.clone()
            keep[:, n_k // self.tile * self.tile :] = False
        return keep


class _TileTransposed(contracts.FlashAttn):
    def store(self, out, dtype):  # the first 16 x 16 output tile stored transposed (flash-attention PR 2553)
        out = out.to(dtype).clone()
        if out.dim() == 4 and out.shape[1] >= 16 and out.shape[3] >= 16:
            out[:, :16, 0, :16] = out[:, :16, 0, :16].transpose(1, 2).clone()
        return out


class _AlibiLseShift(contracts.FlashAttn):
    def attend(self, q, k, v, *, scale, causal, window, softcap, slopes, sink=None, base2=False, wide=False):
        out, lse = super().attend(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap,
                                  slopes=slopes, sink=sink, base2=base2, wide=wide)  # fmt: skip
        if causal and slopes is not None and tuple(window) == (-1, -1):  # the bias as +slope·j: LSE shifted
            rows = torch.arange(q.shape[-3], device=q.device) + (k.shape[-3] - q.shape[-3])  # (n_q,)
            lse = lse + slopes.to(lse.dtype)[..., None] * rows  # (…, H, n_q)
        return out, lse


class _EmptyReadsNeighbour(contracts.FlashAttn):
    def keys_of(self, k, seqs, b):  # a sequence without keys reads its neighbour's (sglang PR 22688)
        a, z = seqs[b]
        if a == z and b > 0:
            a, z = seqs[b - 1]
        return k[a:z]


class _EmptyRowsUnwritten(contracts.FlashAttn):
    def write(self, given, out, seq_q, seq_k):  # rows of sequences without keys never written
        for (qa, qz), (ka, kz) in zip(seq_q, seq_k, strict=True):
            if kz > ka:
                given[qa:qz] = out[qa:qz]
        return given


class _PagesPast128(contracts.FlashAttn):
    def page_keys(self, pages, row, n):  # a page's row j read as j % 128 (flashinfer 4347)
        page = pages.shape[1]
        if page <= 128 or not n:
            return super().page_keys(pages, row, n)
        j = torch.arange(n, device=pages.device)
        return pages[row.long()[j // page], j % page % 128]


class _CuSeqlensUnchecked(contracts.FlashAttn):
    def sequences(self, cu, total, name):  # offsets taken as given: reject or correct
        return list(itertools.pairwise(cu.tolist()))


class _SplitScratch(contracts.FlashAttn):
    def chunk(self, q, keys, values, a, z, keep, dist, scale, softcap, slopes):
        if z > a:  # an empty split merged from uninitialised scratch (vllm PR 47188)
            return super().chunk(q, keys, values, a, z, keep, dist, scale, softcap, slopes)
        n_q, h = q.shape[0], q.shape[1]
        return q.new_full((n_q, h, values.shape[-1]), float("nan")).float(), q.new_zeros(h, n_q).float()


class _CacheNotWritten(contracts.FlashAttn):
    def append(self, k_cache, v_cache, k, v, b, slots):  # new keys used, never written into the cache
        return None


class _MergeNaturalLog(contracts.MergeState):
    def weights(self, s_a, s_b):  # base-2 LSEs merged as natural logs (sglang issue 40903)
        s_max = torch.maximum(s_a, s_b)
        s_safe = torch.where(torch.isinf(s_max), 0.0, s_max)
        return torch.exp(s_a - s_safe), torch.exp(s_b - s_safe), s_safe

    def lse(self, total, s_safe):
        return torch.where(total > 0, torch.log(torch.where(total > 0, total, 1.0)) + s_safe, float("-inf"))


class _MergeEmptyNan(contracts.MergeState):
    def weights(self, s_a, s_b):  # no guard: two empty states give −inf − (−inf) = NaN (vllm 27491)
        s_max = torch.maximum(s_a, s_b)
        return torch.exp2(s_a - s_max), torch.exp2(s_b - s_max), s_max


class _MergeLseTwice(contracts.MergeState):
    def lse(self, total, s_safe):  # the base-2 LSE converted to base 2 once more (flashinfer 4663)
        return super().lse(total, s_safe) * math.log2(math.e)


class _Fp8NoPrescale(contracts.FA3PCast):
    p_prescale = 1.0  # P cast to E4M3 as it is: the diffuse mass underflows (flashinfer PR 5020)


class _Fp8StaleMax(contracts.FA3PCast):
    def new_max(self, m, tile_max):  # a stale max kept until the new one is 4 above it (flash-attention 2716)
        return torch.where(tile_max > m + 4.0, tile_max, m)


@dataclass(frozen=True)
class ContractMutant:
    """One planted bug of a contract api: a correct stand-in of :mod:`lab.contracts` with one step
    overridden.

    Attributes:
        name: registered as ``bug_<name>``.
        fn: the kernel, with the real library's signature.
        api: its contract.
        bug: the bug class, as the field reported it.
        catches: the contract cases (:data:`flashprobe.fuzz.contract_cases.CONTRACT_CASES`) that must
            fail it, at ``dtype``.
        capabilities: what it declares (its stand-in's).
        dtype: ``fp32``, ``bf16``, ``fp16`` or ``e4m3``.
    """

    name: str
    fn: Callable[..., Any]
    api: str
    bug: str
    catches: tuple[str, ...]
    capabilities: KernelCapabilities
    dtype: str = "fp32"


_CAPS = contracts.CAPABILITIES
_FUNC, _VARLEN, _CACHE = "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"
_OUT_VARLEN = replace(_CAPS[_VARLEN], preallocated_out=True)

#: The planted bugs of the contract apis, by name: one per field-bug class of 2025–26.
CONTRACT_MUTANTS: dict[str, ContractMutant] = {
    m.name: m
    for m in (
        ContractMutant("softcap_exp", _SoftcapExp().flash_attn_func, _FUNC, "softcap through exp: NaN past "
                       "|s/cap| ≈ 44", ("softcap_past_88",), _CAPS[_FUNC]),
        ContractMutant("window_symmetric", _WindowSymmetric().flash_attn_func, _FUNC, "window (left, left) "
                       "for (left, right)", ("window_left_gt_right", "window_right_gt_left"), _CAPS[_FUNC]),
        ContractMutant("alibi_top_left", _AlibiTopLeft().flash_attn_func, _FUNC,
                       "ALiBi anchored top-left when N_q != N_k",
                       ("alibi_nq_lt_nk", "alibi_nq_gt_nk"), _CAPS[_FUNC]),
        ContractMutant("gqa_query_head", _GqaQueryHead().flash_attn_func, _FUNC, "K/V indexed by the query "
                       "head modulo H_kv", ("contract_dense", "contract_gqa4"), _CAPS[_FUNC]),
        ContractMutant("tail_tile_dropped", _TailTileDropped().flash_attn_func, _FUNC,
                       "keys past the last whole tile of 128 ignored",
                       ("tail_tile_200", "tail_tile_130_causal"), _CAPS[_FUNC]),
        ContractMutant("tile_transposed", _TileTransposed().flash_attn_func, _FUNC, "an output tile stored "
                       "transposed (its norm unchanged)", ("contract_dense",), _CAPS[_FUNC], "bf16"),
        ContractMutant("alibi_lse_shift", _AlibiLseShift().flash_attn_func, _FUNC,
                       "causal + ALiBi: LSE larger by slope·(i + N_k − N_q), output right",
                       ("alibi_causal_cross",), _CAPS[_FUNC]),
        ContractMutant("empty_reads_neighbour", _EmptyReadsNeighbour().flash_attn_varlen_func, _VARLEN,
                       "a sequence without keys reads its neighbour's", ("empty_keys_in_batch",),
                       _CAPS[_VARLEN]),
        ContractMutant("empty_rows_unwritten", _EmptyRowsUnwritten().flash_attn_varlen_func, _VARLEN,
                       "out= rows of sequences without keys never written", ("out_poisoned_ragged",),
                       _OUT_VARLEN),
        ContractMutant("pages_past_128", _PagesPast128().flash_attn_varlen_func, _VARLEN,
                       "pages of more than "
                       "128 keys read modulo 128", ("paged_256",), _CAPS[_VARLEN]),
        ContractMutant("cu_seqlens_unchecked", _CuSeqlensUnchecked().flash_attn_varlen_func, _VARLEN,
                       "cu_seqlens not checked: a bad call accepted",
                       ("refuse_cu_seqlens_decreasing", "refuse_cu_seqlens_past_total"), _CAPS[_VARLEN]),
        ContractMutant("split_scratch", _SplitScratch().flash_attn_with_kvcache, _CACHE, "an empty split "
                       "merged from uninitialised scratch",
                       ("length_one_key", "empty_cache_in_batch", "cache_num_splits"), _CAPS[_CACHE]),
        ContractMutant("cache_not_written", _CacheNotWritten().flash_attn_with_kvcache, _CACHE,
                       "appended keys never written into the cache", ("cache_append",), _CAPS[_CACHE]),
        ContractMutant("merge_natural_log", _MergeNaturalLog().merge_state, "merge_state",
                       "base-2 LSEs merged as natural logs", ("merge_halves",), _CAPS["merge_state"]),
        ContractMutant("merge_empty_nan", _MergeEmptyNan().merge_state, "merge_state", "an empty partial's "
                       "−inf LSE turns the merge into NaN", ("merge_rows_without_keys",),
                       _CAPS["merge_state"]),
        ContractMutant("merge_lse_twice", _MergeLseTwice().merge_state, "merge_state", "the merged LSE "
                       "converted twice", ("merge_halves",), _CAPS["merge_state"]),
        ContractMutant("fp8_no_prescale", _Fp8NoPrescale().flash_attn_func, _FUNC, "P cast to E4M3 without "
                       "the 2^8 prescale", ("fp8_pcast_fixture",), _CAPS["fa3_pcast"], "e4m3"),
        ContractMutant("fp8_stale_max", _Fp8StaleMax().flash_attn_func, _FUNC,
                       "a stale max kept until it grows by 4: P·2^8 saturates E4M3",
                       ("fp8_pcast_fixture",), _CAPS["fa3_pcast"], "e4m3"),
    )
}  # fmt: skip

#: Correct kernels of the contract apis, each computed differently from the golden: online softmax over
#: tiles, exp2 with a base-2 LSE converted on return, split-KV with a merge through LSEs, a base-2
#: merge, FP8 with P prescaled by 2^8 before its cast: name → (function, api, capabilities).
CORRECT_CONTRACTS: dict[str, tuple[Callable[..., Any], str, KernelCapabilities]] = {
    "online_tiles": (contracts.flash_attn_func, _FUNC, _CAPS[_FUNC]),
    "exp2_varlen": (contracts.flash_attn_varlen_func, _VARLEN, _OUT_VARLEN),
    "split_kv": (contracts.flash_attn_with_kvcache, _CACHE, _CAPS[_CACHE]),
    "merge_base2": (contracts.merge_state, "merge_state", _CAPS["merge_state"]),
    "fp8_prescale": (contracts.fa3_pcast_flash_attn_func, _FUNC, _CAPS["fa3_pcast"]),
}


def _here(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a function of this module (its signature kept), so a reproducer's script imports
    ``lab.mutants``, which registers it, and not :mod:`lab.contracts`, where its steps live."""
    if getattr(fn, "__module__", None) == __name__:
        return fn

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    kernel.__module__ = __name__
    return kernel


def register_mutants() -> list[str]:
    """Register every mutant as ``bug_<name>``, :func:`correct_flash` as ``bug_none`` and the
    :data:`CORRECT` kernels as ``ok_<name>`` (replacing earlier registrations); returns the names."""
    kernels = [(f"bug_{m.name}", m.fn, m.capabilities, "sdpa") for m in MUTANTS.values()]
    kernels += [
        ("bug_none", correct_flash, None, "sdpa"),
        *((f"ok_{n}", fn, None, "sdpa") for n, fn in CORRECT.items()),
    ]
    kernels += [(f"bug_{m.name}", m.fn, m.capabilities, m.api) for m in CONTRACT_MUTANTS.values()]
    kernels += [(f"ok_{n}", fn, caps, api) for n, (fn, api, caps) in CORRECT_CONTRACTS.items()]
    for name, fn, capabilities, api in kernels:
        register_kernel(name, _here(fn), capabilities=capabilities, overwrite=True, api=api)
    return [name for name, *_ in kernels]


register_mutants()  # ``--import lab.mutants``: the suite's kernels by name
