"""flash-attn 2's and FlashAttention-3's entry points as a source (:mod:`flashprobe.probing.direct`).

Each form of call is read by its own function, by the argument names of the library's signature (as of
flash-attn 2.8's ``flash_attn/flash_attn_interface.py`` and FlashAttention-3's
``hopper/flash_attn_interface.py``): the dense ``flash_attn_func`` and its packed forms, the packed
sequences of ``flash_attn_varlen_func`` and its packed forms (with flash-attn 2's paged ``block_table``),
and flash-attn 2's inference entry point ``flash_attn_with_kvcache`` (a dense or paged cache, the new
keys and values appended in place at ``cache_seqlens``, compared forward). The dense and varlen forms
run flash-attn on the shadow's tensors, so their backward is compared too.

The tests check these forms against CPU stand-ins with the libraries' signatures and semantics
(``tests/probing/_standins.py``), not against the CUDA libraries themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from flashprobe.probing import patching
from flashprobe.probing.direct import (
    Conversion,
    DirectFunctions,
    Expressible,
    Library,
    PagedSlots,
    bottom_right,
    gather_pages,
    own_arguments,
    packed_views,
    segment_mask,
    segments,
    swap_heads,
    unpacked,
    varlen_mask,
    with_arguments,
)

__all__ = ["FUNCTIONS", "SOURCE", "block_table_slots"]

#: flash-attn's arguments that SDPA can express (RoPE, ALiBi, fp8 descales, ``seqused_*``, ``qv`` and
#: ``cache_leftpad`` are tensors: never).
_ANY_VALUE = frozenset(
    {
        "deterministic", "num_splits", "pack_gqa", "sm_margin", "out", "lse", "return_attn_probs",
        "return_softmax_lse", "max_seqlen", "max_seqlen_q", "max_seqlen_k", "rotary_interleaved",
    }
)  # fmt: skip
_ARGUMENTS = Expressible(
    any_value=_ANY_VALUE,
    off_values={"window_size": ((-1, -1),), "softcap": (0, None), "attention_chunk": (0, None)},
)


def _flash_common(named: dict[str, Any]) -> tuple[float, float | None, bool, dict[str, Any]]:
    """Pop flash-attn's dropout, scale and causal flag; also the arguments the library is called with
    again (those left, with the scale and causal flag)."""
    dropout_p = float(named.pop("dropout_p", 0.0) or 0.0)
    scale, causal = named.pop("softmax_scale", None), bool(named.pop("causal", False))
    return dropout_p, scale, causal, {**named, "softmax_scale": scale, "causal": causal}


def _recall(
    lib: Library, other: dict, params: dict, back: Callable, pack: Callable | None = None
) -> Callable:
    """The library called on the shadow's ``q, k, v`` (each brought back to the library's layout by
    ``back``, then ``pack``-ed into its tensor arguments; default: ``q``, ``k``, ``v``) with ``other`` and
    the shadow's dropout: a :attr:`~flashprobe.probing.direct.Conversion.call_library`."""
    pack = pack or (lambda q, k, v: {"q": q, "k": k, "v": v})

    def call(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, dp: float) -> Any:
        return lib(with_arguments(other, params, dp, **pack(*(back(t) for t in (qh, kh, vh)))))

    return call


def _bnhd(lib: Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_func(q, k, v, ...)``: ``(B, N, H, D)`` tensors."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return None
    dropout_p, scale, causal, other = _flash_common(named)
    mask, sdpa_causal = bottom_right(q.shape[1], k.shape[1], causal, q.device)
    call = _recall(lib, other, params, swap_heads)
    views = [swap_heads(t) for t in (q, k, v)]  # (B, H, N, D)
    return _ARGUMENTS.reason(named) or _dense(views, mask, sdpa_causal, scale, dropout_p, call)


def _qkvpacked(lib: Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_qkvpacked_func(qkv, ...)``: ``qkv (B, N, 3, H, D)``, or FlashAttention-3's
    ``(B, N, H + 2 H_kv, D)`` with ``num_heads_q=H``."""
    qkv, heads_q = named.pop("qkv", None), named.pop("num_heads_q", None)
    if not isinstance(qkv, torch.Tensor):
        return None
    dropout_p, scale, causal, other = _flash_common(named)
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
    call = _recall(lib, other, params, swap_heads, lambda *ts: {"qkv": pack(*ts)})
    views = [swap_heads(t) for t in parts]
    return _ARGUMENTS.reason(named) or _dense(views, None, causal, scale, dropout_p, call)


def _kvpacked(lib: Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_kvpacked_func(q, kv, ...)``: ``q (B, N_q, H, D)``, ``kv (B, N_k, 2, H_kv, D)``."""
    q, kv = named.pop("q", None), named.pop("kv", None)
    if not (isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor) and q.dim() == 4 and kv.dim() == 5):
        return None
    dropout_p, scale, causal, other = _flash_common(named)
    mask, sdpa_causal = bottom_right(q.shape[1], kv.shape[1], causal, q.device)
    # kv: (B, N_k, 2, H_kv, D)
    call = _recall(lib, other, params, swap_heads, lambda q, k, v: {"q": q, "kv": torch.stack([k, v], dim=2)})
    views = [swap_heads(t) for t in (q, kv[:, :, 0], kv[:, :, 1])]
    return _ARGUMENTS.reason(named) or _dense(views, mask, sdpa_causal, scale, dropout_p, call)


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
    return Conversion(*views, mask, causal, scale, dropout_p, call, swap_heads, swap_heads)


def _varlen(lib: Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
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
    dropout_p, scale, causal, other = _flash_common(named)
    other.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if table is not None:  # paged: compared forward, the library gets its own arguments
        reason = _ARGUMENTS.reason(named)
        if reason or dropout_p:
            return reason or "uses attention dropout with a paged KV cache (not compared)"
        slots = block_table_slots(table, cu_k, k.shape[1])
        q_seq, q_pos, q_len = segments(cu_q, q.shape[0], q.device)
        mask = segment_mask(q_seq, q_pos, q_len, slots.seq, slots.pos, slots.lengths, causal)
        views = [*packed_views(q.detach()), gather_pages(k, slots, "NHD"), gather_pages(v, slots, "NHD")]
        return Conversion.packed(views, mask, scale, 0.0, own_arguments(run))
    mask = varlen_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal)
    call = _recall(lib, other, params, unpacked)
    return _ARGUMENTS.reason(named) or Conversion.packed(packed_views(q, k, v), mask, scale, dropout_p, call)


def _varlen_qkvpacked(
    lib: Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...)``: ``qkv (total, 3, H, D)``."""
    qkv, cu = named.pop("qkv", None), named.pop("cu_seqlens", None)
    if not (isinstance(qkv, torch.Tensor) and isinstance(cu, torch.Tensor) and qkv.dim() == 4):
        return None
    dropout_p, scale, causal, other = _flash_common(named)
    other["cu_seqlens"] = cu
    mask = varlen_mask(cu, cu, qkv.shape[0], qkv.shape[0], causal)
    # qkv: (total, 3, H, D)
    call = _recall(lib, other, params, unpacked, lambda *ts: {"qkv": torch.stack(ts, dim=1)})
    views = packed_views(*qkv.unbind(1))
    return _ARGUMENTS.reason(named) or Conversion.packed(views, mask, scale, dropout_p, call)


def _varlen_kvpacked(
    lib: Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, ...)``: ``q (total_q, H, D)``,
    ``kv (total_k, 2, H_kv, D)``."""
    q, kv = named.pop("q", None), named.pop("kv", None)
    cu_q, cu_k = named.pop("cu_seqlens_q", None), named.pop("cu_seqlens_k", None)
    if not all(isinstance(t, torch.Tensor) for t in (q, kv, cu_q, cu_k)) or kv.dim() != 4:
        return None
    dropout_p, scale, causal, other = _flash_common(named)
    other.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    mask = varlen_mask(cu_q, cu_k, q.shape[0], kv.shape[0], causal)
    # kv: (total_k, 2, H_kv, D)
    call = _recall(lib, other, params, unpacked, lambda q, k, v: {"q": q, "kv": torch.stack([k, v], dim=1)})
    views = packed_views(q, *kv.unbind(1))
    return _ARGUMENTS.reason(named) or Conversion.packed(views, mask, scale, dropout_p, call)


def block_table_slots(block_table: torch.Tensor, cu_k: torch.Tensor, page_size: int) -> PagedSlots:
    """flash-attn's ``block_table (B, max_blocks)``: sequence ``i``'s key ``j`` is row ``j % page_size``
    of block ``block_table[i, j // page_size]``; its length is ``cu_seqlens_k[i+1] - cu_seqlens_k[i]``."""
    device = block_table.device
    b, max_blocks = block_table.shape
    per_seq = max_blocks * page_size
    slot = torch.arange(b * per_seq, device=device)
    cu = cu_k.to(device=device, dtype=torch.int64)
    lengths = F.pad(cu[1:] - cu[:-1], (0, 1))
    return PagedSlots(block_table.reshape(-1).to(torch.int64), slot // per_seq, slot % per_seq, lengths)


def _with_kvcache(lib: Library, named: dict, params: dict, run: Callable[[], Any]) -> Conversion | str | None:
    """``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, ..., cache_seqlens, cache_batch_idx,
    cache_leftpad, block_table, softmax_scale, causal, ...)`` (flash-attn 2): ``q (B, N_q, H, D)``
    against a cache ``(B_cache, S, H_kv, D)`` (rows ``cache_batch_idx``, default ``0..B-1``) or, with
    ``block_table (B, max_blocks)``, a paged cache ``(num_blocks, page_size, H_kv, D)``; sequence ``b``
    holds ``cache_seqlens[b]`` keys (default: all ``S``), then the new ``k``/``v (B, N_new, H_kv, D)``,
    which the library writes into the cache in place; causal aligned bottom-right to that length.

    The keys are gathered as the call sees them (cache rows, then the new keys; the slots past a
    sequence's length masked out and zeroed), before the library runs with the caller's own arguments
    (its in-place append happens once, as in the model); compared forward.
    """
    q, k_cache, v_cache = (named.pop(n, None) for n in ("q", "k_cache", "v_cache"))
    k_new, v_new = named.pop("k", None), named.pop("v", None)
    seqlens, batch_idx = named.pop("cache_seqlens", None), named.pop("cache_batch_idx", None)
    table = named.pop("block_table", None)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k_cache, v_cache)):
        return None
    if (k_new is None) != (v_new is None) or (k_new is not None and seqlens is None):
        return None  # the library refuses these: let it say so
    _, scale, causal, _ = _flash_common(named)
    reason = _ARGUMENTS.reason(named)
    if reason:
        return reason
    if table is not None and batch_idx is not None:
        return None
    b, n_q, device = q.shape[0], q.shape[1], q.device
    if table is not None:
        blocks = table.to(device=device, dtype=torch.int64).clamp(0, k_cache.shape[0] - 1)  # (B, max_blocks)
        keys, values = (c.detach()[blocks].flatten(1, 2) for c in (k_cache, v_cache))  # (B, S, H_kv, D)
    else:
        rows = torch.arange(b, device=device) if batch_idx is None else batch_idx.to(device, torch.int64)
        keys, values = k_cache.detach()[rows], v_cache.detach()[rows]  # (B, S, H_kv, D)
    slots = keys.shape[1]
    pos = torch.arange(slots, device=device)  # (S,)
    if seqlens is None:
        cached = torch.full((b,), slots, device=device, dtype=torch.int64)
    elif isinstance(seqlens, torch.Tensor):
        cached = seqlens.to(device=device, dtype=torch.int64).expand(b)
    else:
        cached = torch.full((b,), int(seqlens), device=device, dtype=torch.int64)
    total = cached
    if k_new is not None:
        n_new = k_new.shape[1]
        total = cached + n_new
        rel = pos[None, :] - cached[:, None]  # (B, S): position among the new keys
        new = ((rel >= 0) & (rel < n_new))[:, :, None, None]
        index = rel.clamp(0, max(n_new - 1, 0))[:, :, None, None]
        keys, values = (
            torch.where(new, t.detach().gather(1, index.expand(-1, -1, *t.shape[2:])), rows_)
            for t, rows_ in ((k_new, keys), (v_new, values))
        )
    valid = pos[None, :] < total[:, None]  # (B, S)
    keys, values = (t.masked_fill(~valid[:, :, None, None], 0) for t in (keys, values))
    mask = valid[:, None, None, :].expand(b, 1, n_q, slots)  # (B, 1, N_q, S)
    if causal:
        q_pos = total[:, None] - n_q + torch.arange(n_q, device=device)  # (B, N_q), bottom-right
        mask = mask & (pos[None, None, :] <= q_pos[:, :, None])[:, None]  # (B, 1, N_q, S)
    return Conversion(
        swap_heads(q.detach()), swap_heads(keys), swap_heads(values), mask, False, scale, 0.0,
        own_arguments(run), swap_heads, swap_heads,
    )  # fmt: skip


_FA2 = ("flash_attn", "flash_attn.flash_attn_interface")
_FA3 = ("flash_attn_interface",)  # FlashAttention-3 (hopper/)

#: The entry points, swapped where their modules are imported.
FUNCTIONS = DirectFunctions(
    (
        *((m, "flash_attn_func", _bnhd) for m in _FA2 + _FA3),
        *((m, "flash_attn_qkvpacked_func", _qkvpacked) for m in _FA2 + _FA3),
        *((m, "flash_attn_kvpacked_func", _kvpacked) for m in _FA2),
        *((m, "flash_attn_varlen_func", _varlen) for m in _FA2 + _FA3),
        *((m, "flash_attn_varlen_qkvpacked_func", _varlen_qkvpacked) for m in _FA2),
        *((m, "flash_attn_varlen_kvpacked_func", _varlen_kvpacked) for m in _FA2),
        *((m, "flash_attn_with_kvcache", _with_kvcache) for m in _FA2),
    ),
    callers=("transformers.modeling_flash_attention_utils",),
)

#: flash-attn 2 and FlashAttention-3.
SOURCE = patching.Source("flash-attn", FUNCTIONS.install, FUNCTIONS.stand_ins)
