"""Attention libraries called directly inside an attached model: flash-attn 2, FlashAttention-3, FlashInfer.

Models and libraries that call a fused kernel themselves never reach SDPA: transformers'
``flash_attention_2`` calls ``flash_attn_func`` / ``flash_attn_varlen_func``, inference engines call
FlashInfer's prefill and decode wrappers. While a probe is attached, :mod:`flashprobe.probe.intercept`
swaps the entry points listed here (in the libraries' modules, where they are already imported —
flashprobe never imports them — in transformers' flash-attention helper, and in model modules that
imported them by name), and each call made inside the probed model becomes a site, like an SDPA call:

* the arguments are bound to the **library's own signature** (:func:`inspect.signature` of the
  function found at attach time), so flash-attn 2's and FlashAttention-3's different positional
  orders, and FlashInfer's changes between versions, are read by name;
* the call's tensors are converted to SDPA's ``(B, H, N, D)`` layout for the baseline and the golden
  (:class:`Conversion`), with the library's scale, its grouped key/value heads, and its masks made
  explicit: flash-attn's and FlashInfer's causal mask is aligned bottom-right when ``N_q != N_k``;
  a packed/ragged call (``cu_seqlens``, ``qo_indptr``/``kv_indptr``) is one ``(1, H, total, D)`` call
  whose bool mask keeps each query to its own sequence (:func:`segment_mask`, built on the device,
  no host sync); a **paged KV cache** (FlashInfer's page table, flash-attn's ``block_table``) is
  gathered into one contiguous key/value row per page slot (:func:`gather_pages`), the slots past
  a sequence's length masked out and zeroed;
* the model gets the library's own output (and gradients): flash-attn is called on the shadow's
  (tapped) tensors in its own layout, so its backward is compared too; FlashInfer (no backward) and
  paged calls run with the caller's own arguments and are compared forward;
* arguments SDPA cannot express (sliding windows, ALiBi, soft-capping, RoPE inside the kernel, fp8
  scales, attention sinks, ``seqused_*``, bit-packed masks, a FlashInfer wrapper planned before the
  probe was attached) make the call run unchanged, not compared, with one warning per site naming
  them. Unknown arguments count as expressible only when they are None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from flashprobe.probe import intercept
from flashprobe.probe.call import SdpaCall

__all__ = [
    "DIRECT_CLASSES",
    "DIRECT_FUNCTIONS",
    "Conversion",
    "function_wrapper",
    "gather_pages",
    "patch_class",
    "segment_mask",
    "varlen_mask",
]

# ---------------------------------------------------------------------------------------------
# What is intercepted
# ---------------------------------------------------------------------------------------------

_FA = ("flash_attn", "flash_attn.flash_attn_interface")
_FA3 = ("flash_attn_interface",)  # FlashAttention-3 (hopper/)

#: Direct entry points ``(module, function, form)``, swapped where ``module`` is imported.
DIRECT_FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    *((m, "flash_attn_func", "bnhd") for m in _FA + _FA3),
    *((m, "flash_attn_qkvpacked_func", "qkvpacked") for m in _FA + _FA3),
    *((m, "flash_attn_kvpacked_func", "kvpacked") for m in _FA),
    *((m, "flash_attn_varlen_func", "varlen") for m in _FA + _FA3),
    *((m, "flash_attn_varlen_qkvpacked_func", "varlen_qkvpacked") for m in _FA),
    *((m, "flash_attn_varlen_kvpacked_func", "varlen_kvpacked") for m in _FA),
    *((m, "single_prefill_with_kv_cache", "single_prefill") for m in ("flashinfer", "flashinfer.prefill")),
    *(
        (m, "single_prefill_with_kv_cache_return_lse", "single_prefill")
        for m in ("flashinfer", "flashinfer.prefill")
    ),
    *((m, "single_decode_with_kv_cache", "single_decode") for m in ("flashinfer", "flashinfer.decode")),
)

#: FlashInfer's batch wrappers ``(module, class, form)``: ``plan`` is recorded, ``run`` (and the
#: deprecated ``forward``, which sets ``run``'s settings) is a site.
DIRECT_CLASSES: tuple[tuple[str, str, str], ...] = (
    *((m, "BatchPrefillWithRaggedKVCacheWrapper", "ragged") for m in ("flashinfer", "flashinfer.prefill")),
    *(
        (m, "BatchPrefillWithPagedKVCacheWrapper", "paged_prefill")
        for m in ("flashinfer", "flashinfer.prefill")
    ),
    *((m, "BatchDecodeWithPagedKVCacheWrapper", "paged_decode") for m in ("flashinfer", "flashinfer.decode")),
)

#: Modules that keep the libraries' functions in globals of their own (swapped like model modules).
CALLER_MODULES: tuple[str, ...] = ("transformers.modeling_flash_attention_utils",)

# ---------------------------------------------------------------------------------------------
# Which arguments SDPA can express
# ---------------------------------------------------------------------------------------------

#: Arguments that change nothing the comparison depends on (speed, determinism, output buffers, the
#: extra outputs, sizes the tensors already say, RoPE settings without RoPE).
_ANY_VALUE = frozenset(
    {
        "deterministic", "num_splits", "pack_gqa", "sm_margin", "backend", "use_tensor_cores",
        "use_fp16_qk_reduction", "enable_pdl", "non_blocking", "out", "lse", "rope_scale", "rope_theta",
        "return_attn_probs", "return_lse", "return_softmax_lse", "q_data_type", "kv_data_type",
        "o_data_type", "data_type", "fixed_split_size", "disable_split_kv", "num_qo_heads",
        "num_kv_heads", "head_dim", "head_dim_qk", "head_dim_vo", "page_size", "max_token_per_sequence",
        "max_sequence_kv", "max_seqlen", "max_seqlen_q", "max_seqlen_k",
    }
)  # fmt: skip

#: Arguments expressible only at these values (the feature off).
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "window_size": ((-1, -1),),
    "window_left": (-1, None),
    "window_right": (None, 0, -1),  # one decode query is the last position: no right window
    "softcap": (0, None),
    "logits_soft_cap": (0, None),
    "attention_chunk": (0, None),
    "pos_encoding_mode": ("NONE",),
    "q_len_per_req": (None, 1),
    "token_pos_in_items_len": (0,),
    "q_scale": (None, 1),
    "k_scale": (None, 1),
    "v_scale": (None, 1),
    "o_scale": (None, 1),
    "use_fp16_softmax": (None, False),
    "uses_spcompress": (None, False),
}


def _plain(name: str, value: Any) -> bool:
    """Whether a library argument leaves the call expressible in SDPA's terms."""
    if name in _ANY_VALUE:
        return True
    if isinstance(value, torch.Tensor):
        return False
    if name in _OFF_VALUES:
        try:
            return (tuple(value) if isinstance(value, list | tuple) else value) in _OFF_VALUES[name]
        except TypeError:
            return False
    return value is None


def _unexpressible(named: dict[str, Any]) -> str | None:
    """The reason a call is not compared, from the arguments left after the conversion took its own."""
    bad = [name for name, value in named.items() if not _plain(name, value)]
    if bad:
        return f"uses arguments SDPA cannot express ({', '.join(bad)})"
    return None


# ---------------------------------------------------------------------------------------------
# Layout conversions
# ---------------------------------------------------------------------------------------------


def _segments(indptr: torch.Tensor, total: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Rows ``0..total-1`` of a packed tensor: each row's sequence (``B`` for rows past
    ``indptr[-1]``), its position in it, and the ``(B + 1,)`` sequence lengths (0 at ``B``)."""
    indptr = indptr.to(device=device, dtype=torch.int64)
    rows = torch.arange(total, device=device)
    seq = torch.searchsorted(indptr[1:].contiguous(), rows, right=True)  # (total,)
    pos = rows - indptr[seq]  # indptr has B + 1 entries: seq == B is in range
    lengths = F.pad(indptr[1:] - indptr[:-1], (0, 1))
    return seq, pos, lengths


def segment_mask(
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    q_len: torch.Tensor,
    k_seq: torch.Tensor,
    k_pos: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool,
    custom: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``(N_q, N_k)`` bool mask of packed sequences: a query sees the keys of its own sequence
    within that sequence's length (and, ``causal``, those up to its position aligned bottom-right, as
    flash-attn and FlashInfer do; or, ``custom``, where FlashInfer's flattened per-sequence mask —
    each sequence's ``(len_q, len_k)`` block row-major, one after the other — says so).

    Args:
        q_seq: ``(N_q,)`` sequence of each query row, ``B`` for none.
        q_pos: ``(N_q,)`` its position within the sequence.
        q_len: ``(B + 1,)`` query lengths (0 at ``B``).
        k_seq, k_pos, k_len: the same for the key rows (slots of a paged cache included).
        causal: bottom-right causal within each sequence (ignored with ``custom``, as FlashInfer does).
        custom: FlashInfer's flattened bool mask, or None.
    """
    mask = (
        (q_seq[:, None] == k_seq[None, :]) & (k_pos < k_len[k_seq])[None, :] & (q_pos < q_len[q_seq])[:, None]
    )
    if custom is not None:
        offsets = F.pad(torch.cumsum(q_len[:-1] * k_len[:-1], 0), (1, 0))  # (B + 1,)
        index = (offsets[q_seq] + q_pos * k_len[q_seq])[:, None] + k_pos[None, :]
        flat = custom.reshape(-1).to(device=mask.device, dtype=torch.bool)
        mask &= flat[index.clamp(0, max(flat.numel() - 1, 0))]
    elif causal:
        mask &= k_pos[None, :] <= (q_pos + k_len[q_seq] - q_len[q_seq])[:, None]
    return mask


def varlen_mask(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, causal: bool
) -> torch.Tensor:
    """The ``(total_q, total_k)`` bool mask of a varlen call (``cu_seqlens``): each query sees its own
    sequence's keys (and, causal, those up to its position aligned bottom-right, as flash-attn does),
    computed on the device (no host sync)."""
    q_seq, q_pos, q_len = _segments(cu_q, total_q, cu_q.device)
    k_seq, k_pos, k_len = _segments(cu_k, total_k, cu_q.device)
    return segment_mask(q_seq, q_pos, q_len, k_seq, k_pos, k_len, causal)


@dataclasses.dataclass(frozen=True)
class _PagedSlots:
    """Where each key slot of a gathered paged cache comes from: ``page`` (a page id of the cache, for
    every ``page_size`` slots), its sequence, position and validity, and the sequences' lengths."""

    page: torch.Tensor  # (S / page_size,) long
    seq: torch.Tensor  # (S,)
    pos: torch.Tensor  # (S,)
    lengths: torch.Tensor  # (B + 1,)

    @property
    def valid(self) -> torch.Tensor:
        return self.pos < self.lengths[self.seq]


def _flashinfer_slots(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    page_size: int,
    device: torch.device,
) -> _PagedSlots:
    """FlashInfer's page table: request ``i`` holds pages ``indices[indptr[i]:indptr[i+1]]``, its last
    one filled to ``last_page_len[i]``."""
    seq_of_page, _, pages_per_seq = _segments(indptr, indices.shape[0], device)
    last = F.pad(last_page_len.to(device=device, dtype=torch.int64), (0, 1))
    lengths = ((pages_per_seq - 1) * page_size + last).clamp(min=0)
    lengths[-1] = 0
    indptr64 = indptr.to(device=device, dtype=torch.int64)
    slot = torch.arange(indices.shape[0] * page_size, device=device)
    rank = slot // page_size  # which entry of indices
    seq = seq_of_page[rank]
    pos = (rank - indptr64[seq]) * page_size + slot % page_size
    return _PagedSlots(indices.to(device=device, dtype=torch.int64), seq, pos, lengths)


def _block_table_slots(block_table: torch.Tensor, cu_k: torch.Tensor, page_size: int) -> _PagedSlots:
    """flash-attn's ``block_table (B, max_blocks)``: sequence ``i``'s key ``j`` is row ``j % page_size``
    of block ``block_table[i, j // page_size]``; its length is ``cu_seqlens_k[i+1] - cu_seqlens_k[i]``."""
    device = block_table.device
    b, max_blocks = block_table.shape
    per_seq = max_blocks * page_size
    slot = torch.arange(b * per_seq, device=device)
    cu = cu_k.to(device=device, dtype=torch.int64)
    lengths = F.pad(cu[1:] - cu[:-1], (0, 1))
    return _PagedSlots(block_table.reshape(-1).to(torch.int64), slot // per_seq, slot % per_seq, lengths)


def gather_pages(cache: torch.Tensor, slots: _PagedSlots, layout: str) -> torch.Tensor:
    """The keys (or values) of a paged cache as one ``(1, H_kv, S, D)`` tensor, one row per slot of
    ``slots`` (a copy, detached; slots past their sequence's length are zero, whatever the cache held
    there).

    Args:
        cache: ``(num_pages, page_size, H_kv, D)`` (``"NHD"``) or ``(num_pages, H_kv, page_size, D)``
            (``"HND"``).
        slots: where each slot comes from.
        layout: ``"NHD"`` or ``"HND"``.
    """
    cache = cache.detach()
    if layout == "HND":
        cache = cache.transpose(1, 2)  # (num_pages, page_size, H_kv, D)
    page = slots.page.clamp(0, cache.shape[0] - 1)  # unused table entries may hold anything
    rows = cache[page].reshape(-1, cache.shape[2], cache.shape[3])  # (S, H_kv, D)
    rows = rows.masked_fill(~slots.valid[:, None, None], 0)
    return rows.transpose(0, 1).unsqueeze(0)  # (1, H_kv, S, D)


def _bottom_right(n_q: int, n_k: int, causal: bool, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """SDPA's mask and causal flag for a library's causal flag (aligned bottom-right when N_q != N_k)."""
    if causal and n_q != n_k:
        return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(diagonal=n_k - n_q), False
    return None, bool(causal)


# ---------------------------------------------------------------------------------------------
# One call, converted
# ---------------------------------------------------------------------------------------------

_Library = Callable[[dict[str, Any]], Any]


@dataclasses.dataclass
class Conversion:
    """One library call in SDPA's terms.

    Attributes:
        q: ``(B, H, N_q, D)`` for the shadow; k, v: ``(B, H_kv, N_k, D)``.
        mask: bool mask broadcastable to ``(B, H, N_q, N_k)``, or None.
        causal: SDPA's top-left causal flag.
        scale: the softmax scale (None: ``1/sqrt(D)``).
        dropout_p: the call's attention dropout.
        call_library: runs the library on the shadow's ``(q, k, v, dropout_p)``; returns its raw result.
        to_shadow: the library's output → ``(B, H, N_q, D_v)``.
        to_library: ``(B, H, N_q, D_v)`` → the library's layout.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float | None
    dropout_p: float
    call_library: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Any]
    to_shadow: Callable[[torch.Tensor], torch.Tensor]
    to_library: Callable[[torch.Tensor], torch.Tensor]
    extras: tuple[Any, ...] | None = None

    def primary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """The library's output on these tensors, in the shadow's layout; extra outputs (``lse``, attention
        probabilities) of the first call — the one the model gets — are kept for :meth:`back`."""
        result = self.call_library(q, k, v, dropout_p)
        if isinstance(result, tuple | list):
            if self.extras is None:
                self.extras = tuple(result[1:])
            result = result[0]
        return self.to_shadow(result)

    def back(self, out: torch.Tensor) -> Any:
        """The shadow's returned ``(B, H, N_q, D_v)`` output as the library would have returned it."""
        out = self.to_library(out)
        return out if self.extras is None else (out, *self.extras)


class _DirectPrimary:
    """The library as the probe's primary (a route): ``run(call)`` calls it on the call's (possibly tapped)
    tensors with the call's dropout (0 for the dropout-free comparison of a dropout call)."""

    def __init__(self, conversion: Conversion) -> None:
        self._conversion = conversion

    def run(self, call: SdpaCall) -> torch.Tensor:
        return self._conversion.primary(call.query, call.key, call.value, call.dropout_p)


def _own_arguments(
    run: Callable[[], Any],
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Any]:
    """A primary that calls the library with the caller's own arguments (forward-only comparisons)."""
    return lambda q, k, v, dropout_p: run()


def _with(
    named: dict[str, Any], params: dict[str, inspect.Parameter], dropout_p: float, **tensors: Any
) -> dict:
    """The caller's arguments by name with ``tensors`` replaced and the dropout the shadow asks for."""
    kwargs = {**named, **tensors}
    if "dropout_p" in params:
        kwargs["dropout_p"] = dropout_p
    return kwargs


def _is_fp8(*tensors: torch.Tensor) -> bool:
    return any(t.dtype.itemsize == 1 and t.is_floating_point() for t in tensors)


# --- flash-attn ---------------------------------------------------------------------------------


def _flash_common(named: dict[str, Any]) -> tuple[float, float | None, bool]:
    """Pop flash-attn's dropout, scale and causal flag."""
    dropout_p = named.pop("dropout_p", 0.0) or 0.0
    return float(dropout_p), named.pop("softmax_scale", None), bool(named.pop("causal", False))


def _bnhd(lib: _Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_func(q, k, v, ...)``: ``(B, N, H, D)`` tensors."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    dropout_p, scale, causal = _flash_common(named)
    mask, sdpa_causal = _bottom_right(q.shape[1], k.shape[1], causal, q.device)
    other = {**named, "softmax_scale": scale, "causal": causal}

    def call(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dp: float) -> Any:
        tensors = {n: t.transpose(1, 2) for n, t in zip("qkv", (qh, kh, vh), strict=True)}  # (B, N, H, D)
        return lib(_with(other, params, dp, **tensors))

    views = [_swap_heads(t) for t in (q, k, v)]  # (B, H, N, D)
    return _unexpressible(named) or _dense(views, mask, sdpa_causal, scale, dropout_p, call)


def _qkvpacked(lib: _Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_qkvpacked_func(qkv, ...)``: ``qkv (B, N, 3, H, D)``, or FlashAttention-3's
    ``(B, N, H + 2 H_kv, D)`` with ``num_heads_q=H``."""
    qkv, heads_q = named.pop("qkv", None), named.pop("num_heads_q", None)
    if not isinstance(qkv, torch.Tensor):
        return None
    dropout_p, scale, causal = _flash_common(named)
    other = {**named, "softmax_scale": scale, "causal": causal}
    if heads_q is not None:
        other["num_heads_q"] = heads_q
    if qkv.dim() == 5:
        parts = qkv.unbind(2)  # (B, N, H, D) each

        def pack(*ts: torch.Tensor) -> torch.Tensor:
            return torch.stack(ts, dim=2)
    elif qkv.dim() == 4 and isinstance(heads_q, int):
        h_kv = (qkv.shape[2] - heads_q) // 2
        parts = qkv.split([heads_q, h_kv, h_kv], dim=2)

        def pack(*ts: torch.Tensor) -> torch.Tensor:
            return torch.cat(ts, dim=2)
    else:
        return None

    def call(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dp: float) -> Any:
        return lib(_with(other, params, dp, qkv=pack(*(t.transpose(1, 2) for t in (qh, kh, vh)))))

    views = [_swap_heads(t) for t in parts]
    return _unexpressible(named) or _dense(views, None, causal, scale, dropout_p, call)


def _kvpacked(lib: _Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_kvpacked_func(q, kv, ...)``: ``q (B, N_q, H, D)``, ``kv (B, N_k, 2, H_kv, D)``."""
    q, kv = named.pop("q", None), named.pop("kv", None)
    if not (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor) and q.dim() == 4 and kv.dim() == 5):
        return None
    dropout_p, scale, causal = _flash_common(named)
    mask, sdpa_causal = _bottom_right(q.shape[1], kv.shape[1], causal, q.device)
    other = {**named, "softmax_scale": scale, "causal": causal}

    def call(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dp: float) -> Any:
        packed = torch.stack([kh.transpose(1, 2), vh.transpose(1, 2)], dim=2)  # (B, N_k, 2, H_kv, D)
        return lib(_with(other, params, dp, q=qh.transpose(1, 2), kv=packed))

    views = [_swap_heads(t) for t in (q, kv[:, :, 0], kv[:, :, 1])]
    return _unexpressible(named) or _dense(views, mask, sdpa_causal, scale, dropout_p, call)


def _swap_heads(t: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, D)`` ↔ ``(B, H, N, D)``, a view."""
    return t.transpose(1, 2)


def _dense(
    views: Sequence[torch.Tensor],
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Any],
) -> Conversion:
    """The :class:`Conversion` of a dense ``(B, N, H, D)`` call: ``views`` are its ``(B, H, N, D)``
    q, k, v, and its output is ``(B, N_q, H, D_v)``."""
    return Conversion(*views, mask, causal, scale, dropout_p, call, _swap_heads, _swap_heads)


def _packed_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``(total, H, D)`` → ``(1, H, total, D)`` views."""
    return [t.unsqueeze(0).transpose(1, 2) for t in tensors]


def _unpacked(o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2)[0]  # (1, H, total, D) → (total, H, D)


def _varlen(lib: _Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``
    (flash-attn 2; FlashAttention-3's has ``seqused_q, seqused_k`` before ``softmax_scale``): packed
    ``(total, H, D)`` tensors, or, with flash-attn 2's ``block_table``, a paged key/value cache
    ``(num_blocks, page_size, H_kv, D)``."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    cu_q, cu_k = named.pop("cu_seqlens_q", None), named.pop("cu_seqlens_k", None)
    table = named.pop("block_table", None)
    tensors = (q, k, v, cu_q, cu_k)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or q.dim() != 3:
        return None
    dropout_p, scale, causal = _flash_common(named)
    other = {**named, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "softmax_scale": scale, "causal": causal}
    if table is not None:  # paged: compared forward, the library gets its own arguments
        reason = _unexpressible(named)
        if reason or dropout_p:
            return reason or "uses attention dropout with a paged KV cache (not compared)"
        slots = _block_table_slots(table, cu_k, k.shape[1])
        q_seq, q_pos, q_len = _segments(cu_q, q.shape[0], q.device)
        mask = segment_mask(q_seq, q_pos, q_len, slots.seq, slots.pos, slots.lengths, causal)
        keys, values = gather_pages(k, slots, "NHD"), gather_pages(v, slots, "NHD")
        return Conversion(
            *_packed_views(q.detach()), keys, values, mask, False, scale, 0.0, _own_arguments(run),
            lambda o: o.unsqueeze(0).transpose(1, 2), _unpacked,
        )  # fmt: skip
    mask = varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal)

    def call(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dp: float) -> Any:
        return lib(_with(other, params, dp, q=_unpacked(qh), k=_unpacked(kh), v=_unpacked(vh)))

    return _unexpressible(named) or Conversion(
        *_packed_views(q, k, v),
        mask,
        False,
        scale,
        dropout_p,
        call,
        lambda o: o.unsqueeze(0).transpose(1, 2),
        _unpacked,
    )


def _varlen_qkvpacked(
    lib: _Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...)``: ``qkv (total, 3, H, D)``."""
    qkv, cu = named.pop("qkv", None), named.pop("cu_seqlens", None)
    if not (isinstance(qkv, torch.Tensor) and isinstance(cu, torch.Tensor) and qkv.dim() == 4):
        return None
    dropout_p, scale, causal = _flash_common(named)
    other = {**named, "cu_seqlens": cu, "softmax_scale": scale, "causal": causal}
    mask = varlen_mask(cu, cu, qkv.shape[0], qkv.shape[0], causal)

    def call(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dp: float) -> Any:
        packed = torch.stack([_unpacked(t) for t in (qh, kh, vh)], dim=1)  # (total, 3, H, D)
        return lib(_with(other, params, dp, qkv=packed))

    return _unexpressible(named) or Conversion(
        *_packed_views(*qkv.unbind(1)), mask, False, scale, dropout_p, call,
        lambda o: o.unsqueeze(0).transpose(1, 2), _unpacked,
    )  # fmt: skip


def _varlen_kvpacked(
    lib: _Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, ...)``: ``q (total_q, H, D)``,
    ``kv (total_k, 2, H_kv, D)``."""
    q, kv = named.pop("q", None), named.pop("kv", None)
    cu_q, cu_k = named.pop("cu_seqlens_q", None), named.pop("cu_seqlens_k", None)
    if not all(isinstance(t, torch.Tensor) for t in (q, kv, cu_q, cu_k)) or kv.dim() != 4:
        return None
    dropout_p, scale, causal = _flash_common(named)
    other = {**named, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "softmax_scale": scale, "causal": causal}
    mask = varlen_mask(cu_q, cu_k, q.shape[0], kv.shape[0], causal)

    def call(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dp: float) -> Any:
        packed = torch.stack([_unpacked(kh), _unpacked(vh)], dim=1)  # (total_k, 2, H_kv, D)
        return lib(_with(other, params, dp, q=_unpacked(qh), kv=packed))

    return _unexpressible(named) or Conversion(
        *_packed_views(q, *kv.unbind(1)), mask, False, scale, dropout_p, call,
        lambda o: o.unsqueeze(0).transpose(1, 2), _unpacked,
    )  # fmt: skip


# --- FlashInfer ---------------------------------------------------------------------------------

_LAYOUTS = ("NHD", "HND")


def _kv_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A FlashInfer ``(N, H_kv, D)`` (NHD) or ``(H_kv, N, D)`` (HND) tensor as ``(1, H_kv, N, D)``,
    detached."""
    t = t.detach()
    return (t.transpose(0, 1) if layout == "NHD" else t).unsqueeze(0)


def _forward_only(q: torch.Tensor, *kv: torch.Tensor) -> str | None:
    if _is_fp8(q, *kv):
        return "has fp8 inputs (the baseline runs in the inputs' dtype; compare 16-bit calls)"
    return None


def _single_prefill(
    lib: _Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``single_prefill_with_kv_cache(q, k, v, ...)``: ``q (N_q, H, D)``, ``k``/``v`` NHD
    ``(N_k, H_kv, D)`` or HND ``(H_kv, N_k, D)``; a bool ``custom_mask (N_q, N_k)`` replaces ``causal``."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return None
    layout, custom = named.pop("kv_layout", "NHD"), named.pop("custom_mask", None)
    causal, scale = bool(named.pop("causal", False)), named.pop("sm_scale", None)
    if layout not in _LAYOUTS:
        return f"uses kv_layout={layout!r}"
    reason = _unexpressible(named) or _forward_only(q, k, v)
    if reason:
        return reason
    keys, values = _kv_view(k, layout), _kv_view(v, layout)
    n_q, n_k = q.shape[0], keys.shape[2]
    if custom is not None:
        mask, sdpa_causal = custom.to(device=q.device, dtype=torch.bool).reshape(n_q, n_k), False
    else:
        mask, sdpa_causal = _bottom_right(n_q, n_k, causal, q.device)
    return Conversion(
        q.detach().transpose(0, 1).unsqueeze(0), keys, values, mask, sdpa_causal, scale, 0.0,
        _own_arguments(run), lambda o: o.transpose(0, 1).unsqueeze(0), lambda o: o[0].transpose(0, 1),
    )  # fmt: skip


def _single_decode(
    lib: _Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``single_decode_with_kv_cache(q, k, v, ...)``: one query ``q (H, D)`` against all of ``k``/``v``."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    if not (
        isinstance(q, torch.Tensor) and q.dim() == 2 and all(isinstance(t, torch.Tensor) for t in (k, v))
    ):
        return None
    layout, scale = named.pop("kv_layout", "NHD"), named.pop("sm_scale", None)
    if layout not in _LAYOUTS:
        return f"uses kv_layout={layout!r}"
    reason = _unexpressible(named) or _forward_only(q, k, v)
    if reason:
        return reason
    return Conversion(
        q.detach()[None, :, None, :], _kv_view(k, layout), _kv_view(v, layout), None, False, scale, 0.0,
        _own_arguments(run), lambda o: o[None, :, None, :], lambda o: o[0, :, 0, :],
    )  # fmt: skip


@dataclasses.dataclass
class _Plan:
    """A FlashInfer wrapper's last ``plan()`` (its arguments by name), the settings its deprecated
    ``forward()`` set since, and the page slots and masks computed from them (per device)."""

    named: dict[str, Any]
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    cache: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        return {**self.named, **self.overrides}

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


#: Plans recorded while a probe is attached, per wrapper instance (forgotten when the last probe detaches:
#: a plan made while none is attached is not seen, and a stale one must not be used).
_PLANS: weakref.WeakKeyDictionary[Any, _Plan] = weakref.WeakKeyDictionary()

_NO_PLAN = (
    "runs with a plan() made before the probe was attached, so its sequences are unknown; call plan() "
    "while the probe is attached (e.g. inside the `with probe(...)` block)"
)


def forget_plans() -> None:
    """Drop every recorded plan (called when the last handle detaches)."""
    _PLANS.clear()


def _wrapper_plan(named: dict[str, Any]) -> tuple[Any, _Plan | None]:
    wrapper = named.pop("self", None)
    try:
        return wrapper, _PLANS.get(wrapper)
    except TypeError:  # not weak-referenceable
        return wrapper, None


def _paged_cache(cache: Any, layout: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(k_cache, v_cache, page_size)`` of a paged KV cache: a ``(k, v)`` pair of 4-D tensors or one
    5-D tensor with k and v at index 1."""
    if isinstance(cache, tuple | list) and len(cache) == 2:
        k, v = cache
    elif isinstance(cache, torch.Tensor) and cache.dim() == 5:
        k, v = cache[:, 0], cache[:, 1]
    else:
        return None
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4):
        return None
    return k, v, k.shape[1] if layout == "NHD" else k.shape[2]


def _batch(named: dict, run: Callable[[], Any], form: str) -> Conversion | str | None:
    """A FlashInfer batch wrapper's ``run``: ragged ``(q, k, v)`` or paged ``(q, paged_kv_cache)``, with
    the sequences, mask and scale of its recorded plan."""
    wrapper, plan = _wrapper_plan(named)
    if plan is None:
        return _NO_PLAN
    layout = getattr(wrapper, "_kv_layout", "NHD")
    q = named.pop("q", None)
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or layout not in _LAYOUTS:
        return None if layout in _LAYOUTS else f"uses kv_layout={layout!r}"
    settings = plan.settings()
    custom = settings.pop("custom_mask", None)
    causal, scale = bool(settings.pop("causal", False)), settings.pop("sm_scale", None)
    device = q.device
    if form == "ragged":
        k, v = named.pop("k", None), named.pop("v", None)
        qo, kv = settings.pop("qo_indptr", None), settings.pop("kv_indptr", None)
        if not all(isinstance(t, torch.Tensor) for t in (k, v, qo, kv)):
            return None
        keys, values = _kv_view(k, layout), _kv_view(v, layout)
        total_k = keys.shape[2]

        def key_rows() -> tuple[torch.Tensor, ...]:
            return _segments(kv, total_k, device)
    else:
        parts = _paged_cache(named.pop("paged_kv_cache", None), layout)
        prefix = "paged_kv_" if form == "paged_prefill" else ""
        indptr, indices = settings.pop(f"{prefix}indptr", None), settings.pop(f"{prefix}indices", None)
        last = settings.pop(f"{prefix}last_page_len", None)
        qo = settings.pop("qo_indptr", None)
        if parts is None or not all(isinstance(t, torch.Tensor) for t in (indptr, indices, last)):
            return None
        k_cache, v_cache, page_size = parts
        slots = plan.cached(
            ("slots", device), lambda: _flashinfer_slots(indptr, indices, last, page_size, device)
        )

        def key_rows() -> tuple[torch.Tensor, ...]:
            return slots.seq, slots.pos, slots.lengths

    reason = _unexpressible(named) or _unexpressible(settings) or _forward_only(q)
    if reason:
        return reason
    if form == "paged_decode":  # one query per request
        qo = torch.arange(q.shape[0] + 1, device=device)
    elif not isinstance(qo, torch.Tensor):
        return None
    if form != "ragged":
        keys, values = gather_pages(k_cache, slots, layout), gather_pages(v_cache, slots, layout)

    def make_mask() -> torch.Tensor:
        q_seq, q_pos, q_len = _segments(qo, q.shape[0], device)
        k_seq, k_pos, k_len = key_rows()
        return segment_mask(q_seq, q_pos, q_len, k_seq, k_pos, k_len, causal, custom)

    mask = plan.cached(("mask", device, q.shape[0], keys.shape[2], causal), make_mask)
    return Conversion(
        *_packed_views(q.detach()), keys, values, mask, False, scale, 0.0, _own_arguments(run),
        lambda o: o.unsqueeze(0).transpose(1, 2), _unpacked,
    )  # fmt: skip


def _ragged(lib: _Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``BatchPrefillWithRaggedKVCacheWrapper.run(q, k, v, ...)``: ``q (total_q, H, D)``, ``k``/``v``
    ``(total_k, H_kv, D)`` (NHD; HND ``(H_kv, total_k, D)``), sequences from
    ``plan(qo_indptr, kv_indptr)``."""
    return _batch(named, run, "ragged")


def _paged_prefill(
    lib: _Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``BatchPrefillWithPagedKVCacheWrapper.run(q, paged_kv_cache, ...)``: pages from
    ``plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, ...)``."""
    return _batch(named, run, "paged_prefill")


def _paged_decode(
    lib: _Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``BatchDecodeWithPagedKVCacheWrapper.run(q, paged_kv_cache, ...)``: ``q (B, H, D)``, one query per
    request, pages from ``plan(indptr, indices, last_page_len, ...)``."""
    return _batch(named, run, "paged_decode")


_FORMS: dict[str, Callable[..., Conversion | str | None]] = {
    "bnhd": _bnhd,
    "qkvpacked": _qkvpacked,
    "kvpacked": _kvpacked,
    "varlen": _varlen,
    "varlen_qkvpacked": _varlen_qkvpacked,
    "varlen_kvpacked": _varlen_kvpacked,
    "single_prefill": _single_prefill,
    "single_decode": _single_decode,
    "ragged": _ragged,
    "paged_prefill": _paged_prefill,
    "paged_decode": _paged_decode,
}

# ---------------------------------------------------------------------------------------------
# The replacements
# ---------------------------------------------------------------------------------------------

_EXTRA_OUTPUTS = ("return_lse", "return_attn_probs", "return_softmax_lse")


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[dict[str, Any], bool] | None:
    """The caller's arguments by the library's parameter names (``**kwargs`` merged; extra positional
    arguments kept under ``*name``, which no conversion expresses), and whether the call returns extra
    outputs (``return_lse``, ... with their defaults applied); None when they do not bind."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            named.update(named.pop(param.name, {}))
        elif param.kind is param.VAR_POSITIONAL and named.pop(param.name, ()):
            named[f"*{param.name}"] = bound.arguments[param.name]
    bound.apply_defaults()
    extras = any(bound.arguments.get(n) or named.get(n) for n in _EXTRA_OUTPUTS)
    return named, extras


def _context(frame: Any) -> Any:
    """The probe resolution of a direct call made from ``frame``, or None to run it unchanged."""
    if intercept._state.busy or torch.compiler.is_compiling():
        return None
    res = intercept._find(frame)
    return None if res is None or res.probe is None else res


def _probe_call(
    res: Any,
    what: str,
    original: Callable[..., Any],
    signature: inspect.Signature,
    convert: Callable[..., Conversion | str | None],
    args: tuple,
    kwargs: dict,
) -> Any:
    """One direct call at ``res.site``: converted and handed to the probe, or run unchanged."""

    def run() -> Any:  # the caller's arguments, exactly
        return original(*args, **kwargs)

    if res.probe.shadow.primary is None and not res.probe.will_compare(res.site):
        res.probe.count_call(res.site)  # not sampled: no conversion, the library's own call
        return run()
    bound = _bind(signature, args, kwargs)
    if bound is None:
        return run()
    named, extras = bound
    try:
        conversion = convert(lambda kw: original(**kw), named, dict(signature.parameters), run)
    except Exception as err:  # a layout this conversion does not know: never break the model's call
        conversion = f"could not be converted ({type(err).__name__}: {err})"
    if conversion is None:
        return run()
    if not isinstance(conversion, str):
        conversion = _shape_problem(conversion) or conversion
    if not isinstance(conversion, str) and extras and res.probe.shadow.primary is not None:
        conversion = "returns extra outputs (lse), which an explicit primary kernel cannot give"
    if isinstance(conversion, str):
        res.probe.warn_once(
            ("direct-unsupported", res.site, what),
            f"flashprobe: the {what} call at site {res.site!r} {conversion}; it runs unchanged and is not "
            "compared",
        )
        return run()
    c = conversion
    call = SdpaCall(c.q, c.k, c.v, c.mask, c.dropout_p, c.causal, c.scale, c.k.shape[1] != c.q.shape[1])
    intercept._state.busy = True
    try:
        out = res.probe.handle(res.site, call, _DirectPrimary(c))
    finally:
        intercept._state.busy = False
    return c.back(out)


def _shape_problem(c: Conversion) -> str | None:
    """Why the converted tensors are not one SDPA call (the references would not match the library's
    call: never compared), or None."""
    q, k, v = c.q, c.k, c.v
    ok = q.dim() == k.dim() == v.dim() == 4 and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
    ok = (
        ok
        and q.shape[0] == k.shape[0] == v.shape[0]
        and k.shape[:3] == v.shape[:3]
        and q.shape[3] == k.shape[3]
    )
    ok = ok and (c.mask is None or tuple(c.mask.shape[-2:]) == (q.shape[2], k.shape[2]))
    if ok:
        return None
    mask = "" if c.mask is None else f", mask {tuple(c.mask.shape)}"
    return (
        f"has shapes the conversion cannot compare (q {tuple(q.shape)}, k {tuple(k.shape)}, "
        f"v {tuple(v.shape)}{mask} as (B, H, N, D))"
    )


def _mark(wrapper: Any, original: Any) -> Any:
    wrapper.__flashprobe_original__ = original
    return wrapper


def original_of(fn: Any) -> Any:
    """The library's function behind a flashprobe replacement (``fn`` itself when it is none)."""
    return getattr(fn, "__flashprobe_original__", fn)


def function_wrapper(original: Callable[..., Any], form: str, what: str) -> Callable[..., Any]:
    """The probed replacement of one library entry point (or method) of ``form``: each call made inside
    a probed model is a site; any other call runs the original unchanged. It has the original's name,
    docstring and signature (``__wrapped__``), which callers such as transformers inspect."""
    signature = _signature(original)
    convert = _FORMS[form]

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        res = _context(sys._getframe(1))
        if res is None or signature is None:
            return original(*args, **kwargs)
        return _probe_call(res, what, original, signature, convert, args, kwargs)

    return _mark(wrapper, original)


def _plan_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``plan`` recorded (its arguments by name, per wrapper instance), then run."""
    signature = _signature(original)

    @functools.wraps(original)
    def plan(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        bound = None if signature is None else _bind(signature, args, kwargs)
        if bound is not None:
            named = bound[0]
            wrapper = named.pop("self", None)
            with contextlib.suppress(TypeError):  # not weak-referenceable: its runs are not compared
                _PLANS[wrapper] = _Plan(named)
        return result

    return _mark(plan, original)


#: The settings the deprecated ``forward`` keeps on the wrapper for its and later runs (the rest of its
#: arguments it passes on to ``run``).
_FORWARD_SETTINGS = frozenset(
    {"causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap", "sm_scale",
     "rope_scale", "rope_theta"}
)  # fmt: skip


def _forward_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """The deprecated ``forward``: it sets the wrapper's mask and scale settings (kept for later runs),
    then calls ``run``; those settings (defaults included) override the recorded plan's."""
    signature = _signature(original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                plan = _PLANS.get(bound.arguments.get("self"))
            except TypeError:
                plan = None
            if plan is not None:
                plan.overrides = {k: v for k, v in bound.arguments.items() if k in _FORWARD_SETTINGS}
                plan.cache.clear()
        return original(*args, **kwargs)

    return _mark(forward, original)


def patch_class(cls: type, form: str, what: str) -> dict[str, Any]:
    """``{attribute: replacement}`` for a FlashInfer wrapper class: ``plan`` recorded, ``run`` a site,
    ``forward``/``forward_return_lse`` setting ``run``'s settings, ``run_return_lse`` (a
    ``partialmethod`` of the original ``run``) rebuilt on the replacement."""
    out: dict[str, Any] = {}
    run = getattr(cls, "run", None)
    if not callable(getattr(cls, "plan", None)) or not callable(run):
        return out
    out["plan"] = _plan_wrapper(cls.plan)
    out["run"] = function_wrapper(run, form, f"{what}.run")
    for name in ("forward", "forward_return_lse"):
        if callable(getattr(cls, name, None)):
            out[name] = _forward_wrapper(getattr(cls, name))
    partial = cls.__dict__.get("run_return_lse")
    if isinstance(partial, functools.partialmethod):
        out["run_return_lse"] = functools.partialmethod(out["run"], *partial.args, **partial.keywords)
    return out
