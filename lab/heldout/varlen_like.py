"""Packed, paged and KV-cache kernels with flash-attn 2.8's ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` signatures: a control for each and the bugs of empty sequences, pages and
split-KV decoding.

Signatures and conventions (flash-attn 2.8.4, ``flash_attn/flash_attn_interface.py``):

- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
  deterministic=False, return_attn_probs=False, block_table=None)``: q ``(total_q, H_q, D)``, k, v
  ``(total_k, H_k, D)`` or, with ``block_table (B, max_pages)`` int32, pages ``(num_pages, page_size, H_k,
  D)`` (sequence ``b`` then has ``cu_seqlens_k[b+1] − cu_seqlens_k[b]`` keys, token ``t`` in page
  ``block_table[b, t // page_size]``, slot ``t % page_size``); ``cu_seqlens_*`` int32 ``(B + 1,)``. Returns
  ``out (total_q, H_q, D)``, or ``(out, softmax_lse (H_q, total_q), None)`` with ``return_attn_probs``.
  These kernels add a keyword-only ``out=`` (the preallocated output vLLM's flash-attn fork takes) and
  accept any page size (flash-attn 2 itself requires multiples of 256).
- ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
  cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
  causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
  num_splits=0, return_softmax_lse=False)``: q ``(B, N_q, H_q, D)``, caches ``(B_cache, S, H_k, D)`` or
  pages with ``block_table``; new ``k, v (B, N_new, H_k, D)`` are written into the cache in place at
  ``cache_seqlens`` and attended to; returns ``out`` or ``(out, softmax_lse (B, H_q, N_q))``. Rotary and
  ``cache_leftpad`` are refused here (one-line error); forward only.

Causal is aligned bottom-right, a row that sees no key gives 0 and LSE +inf (flash-attn 2's convention,
also after its split-KV combine). The split-KV decode splits every sequence's keys into ``num_splits``
chunks of ``ceil(max kv_len / num_splits)`` keys (0: a heuristic), computes each chunk's normalised
output and LSE into a scratch buffer and merges them, as vLLM's and flash-attn's decode kernels do.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from lab.heldout._online import (
    OnlineSoftmax,
    ScoreSpec,
    alibi_table,
    check_heads,
    check_options,
)
from lab.heldout._table import Contract, HeldOut
from lab.heldout.flash_attn_like import fa2_lse

Kernel = Callable[..., Any]


def _seqlens(cu: torch.Tensor, name: str, total: int | None) -> list[int]:
    """Lengths from cumulative lengths, after checking they are a valid ``cu_seqlens``.

    Raises:
        ValueError: not 1-D int32, not starting at 0, decreasing, or (when ``total`` is given) not
            ending at ``total``.
    """
    if cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be a 1-D int32 tensor (batch_size + 1,); got {cu.dtype} {tuple(cu.shape)}"
        )
    values = cu.tolist()
    if values[0] != 0 or any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name} must start at 0 and never decrease; got {values}")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} must equal the number of packed tokens ({total})")
    return [b - a for a, b in itertools.pairwise(values)]


def _check_table(
    block_table: torch.Tensor, batch: int, lens: list[int], page_size: int, n_pages: int
) -> None:
    """Check a block table covers every sequence with in-range pages (unused tail entries may be anything).

    Raises:
        ValueError: wrong shape or dtype, too few pages for a sequence, or a used entry out of range.
    """
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table must be int32 (batch_size={batch}, max_pages); got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    for b, n in enumerate(lens):
        used = -(-n // page_size)
        if used > block_table.shape[1]:
            raise ValueError(
                f"sequence {b} has {n} keys but block_table holds {block_table.shape[1]} pages of {page_size}"
            )
        pages = block_table[b, :used]
        if used and (int(pages.min()) < 0 or int(pages.max()) >= n_pages):
            raise ValueError(f"block_table[{b}] refers to pages outside [0, {n_pages}): {pages.tolist()}")


class VarlenKernel:
    """Packed/paged attention, one sequence at a time, each through an ``OnlineSoftmax``.

    The methods are the steps a varlen kernel author writes: the key count of a sequence, the page slot
    of a token, whether the rows of a sequence without keys are written.
    """

    attention: OnlineSoftmax = OnlineSoftmax()
    write_rows_without_keys: bool = True

    def kv_len(self, lens_k: list[int], b: int, max_seqlen_k: int) -> int:
        """Number of keys sequence ``b`` attends to."""
        return lens_k[b]

    def page_slot(self, t: torch.Tensor, page_size: int) -> torch.Tensor:
        """Slot of token ``t`` within its page."""
        return t % page_size

    def keys(self, cache: torch.Tensor, table_row: torch.Tensor | None, start: int, n: int) -> torch.Tensor:
        """Keys (or values) ``(n, H_k, D)`` of one sequence: packed from ``start``, or through its pages."""
        if table_row is None:
            return cache[start : start + n]
        t = torch.arange(n)
        page_size = cache.shape[1]
        return cache[table_row[t // page_size].long(), self.page_slot(t, page_size)]


def run_varlen(
    kernel: VarlenKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    block_table: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a ``flash_attn_varlen_func`` call and run it sequence by sequence.

    Returns:
        ``out (total_q, H_q, D_v)`` (``out`` itself when given) and ``lse (H_q, total_q)`` fp32 natural,
        -inf for rows without keys.

    Raises:
        ValueError: malformed lengths, block table, shapes or options.
    """
    if q.dim() != 3 or v.dim() != k.dim() or k.dim() != (4 if block_table is not None else 3):
        raise ValueError(
            "q must be (total_q, nheads, headdim) and k, v (total_k, nheads_k, headdim), or "
            "(num_pages, page_size, nheads_k, headdim) with block_table"
        )
    check_heads(q, k, v)
    check_options(dropout_p, window_size, softcap)
    paged = block_table is not None
    lens_q = _seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    lens_k = _seqlens(cu_seqlens_k, "cu_seqlens_k", None if paged else k.shape[0])
    if len(lens_q) != len(lens_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k describe {len(lens_q)} and {len(lens_k)} sequences")
    if max(lens_q) > max_seqlen_q or max(lens_k) > max_seqlen_k:
        raise ValueError(
            f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k} are below the longest "
            f"sequences ({max(lens_q)}, {max(lens_k)})"
        )
    if paged:
        _check_table(block_table, len(lens_k), lens_k, k.shape[1], k.shape[0])
    h_q, d_v = q.shape[1], v.shape[-1]
    if out is None:
        out = torch.empty(q.shape[0], h_q, d_v, dtype=q.dtype)
    elif out.shape != (q.shape[0], h_q, d_v) or out.dtype != q.dtype:
        raise ValueError(
            f"out must be {q.dtype} {(q.shape[0], h_q, d_v)}; got {out.dtype} {tuple(out.shape)}"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    slopes = alibi_table(alibi_slopes, len(lens_q), h_q)
    window = (int(window_size[0]), int(window_size[1]))
    lse = torch.full((h_q, q.shape[0]), -math.inf)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(lens_q)):
        q0, n_q = starts_q[b], lens_q[b]
        n_k = (
            min(kernel.kv_len(lens_k, b, max_seqlen_k), k.shape[0] - starts_k[b])
            if not paged
            else (kernel.kv_len(lens_k, b, max_seqlen_k))
        )
        if n_q == 0 or (n_k == 0 and not kernel.write_rows_without_keys):
            continue
        row = block_table[b] if paged else None
        kb = kernel.keys(k, row, starts_k[b], n_k)  # (n_k, H_k, D)
        vb = kernel.keys(v, row, starts_k[b], n_k)
        spec = ScoreSpec(
            scale, bool(causal), window, float(softcap), None if slopes is None else slopes[b : b + 1]
        )
        o, l_b = kernel.attention.forward(
            q[q0 : q0 + n_q].transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None], spec
        )
        out[q0 : q0 + n_q] = o[0].transpose(0, 1).to(out.dtype)
        lse[:, q0 : q0 + n_q] = l_b[0].detach()
    return out, lse


def as_flash_attn_varlen_func(kernel: VarlenKernel, name: str, doc: str) -> Kernel:
    """flash-attn 2.8's ``flash_attn_varlen_func`` signature (plus ``out=``) running ``kernel``."""

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        block_table: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
        result, lse = run_varlen(
            kernel,
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size,
            softcap,
            alibi_slopes,
            block_table,
            out,
        )
        return (result, fa2_lse(lse), None) if return_attn_probs else result

    flash_attn_varlen_func.__name__ = flash_attn_varlen_func.__qualname__ = name
    flash_attn_varlen_func.__doc__ = doc
    return flash_attn_varlen_func


class EmptyMeansMax(VarlenKernel):
    """``kv_len = seqlens_k[b] or max_seqlen_k``: a length of 0 falls back to the longest length, so an
    empty sequence reads the keys packed after its start — its neighbour's."""

    def kv_len(self, lens_k: list[int], b: int, max_seqlen_k: int) -> int:
        return lens_k[b] or max_seqlen_k


class SkipsRowsWithoutKeys(VarlenKernel):
    """Returns early for a sequence without keys, so its output rows are never written."""

    write_rows_without_keys = False


class PageSlotWithinTile(VarlenKernel):
    """Walks keys in 128-token tiles and takes the slot within the tile (``(t % page_size) % 128``), as if
    a tile always started at a page boundary: right for page sizes up to 128."""

    def page_slot(self, t: torch.Tensor, page_size: int) -> torch.Tensor:
        return (t % page_size) % 128


fa2_varlen_paged = as_flash_attn_varlen_func(
    VarlenKernel(),
    "fa2_varlen_paged",
    """Correct ``flash_attn_varlen_func``: packed or paged (any page size) K/V, one online softmax per
    sequence, every output row written (zeros for a sequence without keys), ``out=`` honoured.""",
)

fa2_varlen_empty_reads_neighbour = as_flash_attn_varlen_func(
    EmptyMeansMax(),
    "fa2_varlen_empty_reads_neighbour",
    """``flash_attn_varlen_func`` where a sequence with ``kv_len == 0`` reads its neighbour's keys
    (sglang PR 22688).

    Trigger: batch > 1 with a sequence of ``kv_len 0`` (and ``q_len > 0``) followed by a sequence with
    keys (packed K/V). Right when no sequence is empty or the empty one is last.""",
)

fa2_varlen_empty_rows_unwritten = as_flash_attn_varlen_func(
    SkipsRowsWithoutKeys(),
    "fa2_varlen_empty_rows_unwritten",
    """``flash_attn_varlen_func`` that never writes the output rows of a sequence without keys, so a
    preallocated ``out=`` keeps whatever it held (NaN if poisoned) and a fresh one holds ``torch.empty``
    garbage (flashinfer PR 4975's class: rows with ``seq_lens == 0`` left untouched).

    Trigger: a sequence with ``q_len > 0`` and ``kv_len == 0``. Right otherwise.""",
)

fa2_paged_page_gt128 = as_flash_attn_varlen_func(
    PageSlotWithinTile(),
    "fa2_paged_page_gt128",
    """Paged ``flash_attn_varlen_func`` wrong for page sizes above 128 (flashinfer issue 4347).

    Trigger: ``block_table`` with ``page_size > 128`` and a sequence holding a key at a slot >= 128 of
    a page (``kv_len > 128``). Right for page sizes 1 ... 128 and for packed K/V.""",
)


# ---- flash_attn_with_kvcache: split-KV decode


class Block64(OnlineSoftmax):
    """Online softmax over 64-key blocks (a decode kernel's tile)."""

    block_n = 64


class SplitKvDecode:
    """Split-KV attention over a KV cache: per-split partials in scratch buffers, then a merge.

    The methods are the steps a decode-kernel author writes: the scratch the partials live in and
    whether a split without keys writes its (0, -inf) partial.
    """

    attention: OnlineSoftmax = Block64()
    writes_empty_splits: bool = True

    def scratch(
        self, shape_o: tuple[int, ...], shape_lse: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh partial-output and partial-LSE buffers for one call."""
        return torch.zeros(shape_o), torch.full(shape_lse, -math.inf)

    def merge(self, o_part: torch.Tensor, lse_part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge normalised partials ``(S, ..., D_v)`` and their natural LSEs ``(S, ...)``."""
        m = lse_part.amax(0)
        m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
        w = torch.exp(lse_part - m_safe)  # (S, ...); 0 for empty partials
        total = w.sum(0)
        empty = total == 0
        total_safe = torch.where(empty, torch.ones_like(total), total)
        out = (w[..., None] * o_part).sum(0) / total_safe[..., None]
        lse = torch.where(empty, torch.full_like(m, -math.inf), m_safe + torch.log(total_safe))
        return out, lse


def _auto_splits(max_len: int) -> int:
    return max(1, min(4, -(-max_len // 128)))


def run_kvcache(
    decoder: SplitKvDecode,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: int | torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a ``flash_attn_with_kvcache`` call, append ``k, v`` to the cache and decode by splits.

    Returns:
        ``out (B, N_q, H_q, D_v)`` in q's dtype and ``lse (B, H_q, N_q)`` fp32 natural, -inf if empty.

    Raises:
        ValueError: malformed shapes, lengths, indices or options.
    """
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise ValueError("q must be (batch, seqlen, nheads, headdim) and k_cache, v_cache 4-d of one shape")
    check_heads(q[0], k_cache[0], v_cache[0])
    check_options(0.0, window_size, softcap)
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (new keys and values) or neither")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 picks a heuristic); got {num_splits}")
    batch, n_q, h_q, _ = q.shape
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required to append k, v to the cache")
        lens = [capacity] * batch
    else:
        lens = [cache_seqlens] * batch if isinstance(cache_seqlens, int) else cache_seqlens.tolist()
        if len(lens) != batch or min(lens) < 0:
            raise ValueError(f"cache_seqlens must be an int or (batch={batch},) non-negative; got {lens}")
    n_new = 0 if k is None else k.shape[1]
    if k is not None and (
        k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] or v.shape[:-1] != k.shape[:-1]
    ):
        raise ValueError(
            f"k, v must be (batch, seqlen_new, nheads_k, headdim) = ({batch}, ., "
            f"{k_cache.shape[2]}, {k_cache.shape[3]}); got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if max(lens) + n_new > capacity:
        raise ValueError(
            f"cache_seqlens + seqlen_new = {max(lens) + n_new} exceeds the cache ({capacity} slots)"
        )
    rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()
    if not paged and (len(rows) != batch or any(not 0 <= r < k_cache.shape[0] for r in rows)):
        raise ValueError(f"cache_batch_idx must hold {batch} rows in [0, {k_cache.shape[0]}); got {rows}")
    kv_lens = [n + n_new for n in lens]
    if paged:
        _check_table(block_table, batch, kv_lens, k_cache.shape[1], k_cache.shape[0])
    pager = VarlenKernel()
    if k is not None:  # append the new keys and values in place
        for b in range(batch):
            slots = torch.arange(lens[b], lens[b] + n_new)
            if paged:
                page_size = k_cache.shape[1]
                pages = block_table[b][slots // page_size].long()
                k_cache[pages, slots % page_size] = k[b]
                v_cache[pages, slots % page_size] = v[b]
            else:
                k_cache[rows[b], slots] = k[b]
                v_cache[rows[b], slots] = v[b]
    splits = num_splits or _auto_splits(max(kv_lens))
    chunk = max(1, -(-max(kv_lens) // splits))
    d_v = v_cache.shape[-1]
    o_part, lse_part = decoder.scratch((splits, batch, h_q, n_q, d_v), (splits, batch, h_q, n_q))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    slopes = alibi_table(alibi_slopes, batch, h_q)
    window = (int(window_size[0]), int(window_size[1]))
    for b in range(batch):
        if paged:
            kb, vb = (pager.keys(c, block_table[b], 0, kv_lens[b]) for c in (k_cache, v_cache))
        else:
            kb, vb = k_cache[rows[b], : kv_lens[b]], v_cache[rows[b], : kv_lens[b]]
        spec = ScoreSpec(
            scale, bool(causal), window, float(softcap), None if slopes is None else slopes[b : b + 1]
        )
        for s in range(splits):
            lo, hi = min(s * chunk, kv_lens[b]), min((s + 1) * chunk, kv_lens[b])
            if hi == lo and not decoder.writes_empty_splits:
                continue
            o, l_s = decoder.attention.forward(
                q[b : b + 1].transpose(1, 2),
                kb[lo:hi].transpose(0, 1)[None],
                vb[lo:hi].transpose(0, 1)[None],
                spec,
                key_start=lo,
                n_k_total=kv_lens[b],
            )
            o_part[s, b], lse_part[s, b] = o[0], l_s[0]
    out, lse = decoder.merge(o_part, lse_part)
    return out.transpose(1, 2).to(q.dtype), lse


def as_flash_attn_with_kvcache(decoder: SplitKvDecode, name: str, doc: str) -> Kernel:
    """A function with flash-attn 2.8's ``flash_attn_with_kvcache`` signature running ``decoder``."""

    def flash_attn_with_kvcache(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        rotary_cos: torch.Tensor | None = None,
        rotary_sin: torch.Tensor | None = None,
        cache_seqlens: int | torch.Tensor | None = None,
        cache_batch_idx: torch.Tensor | None = None,
        cache_leftpad: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        rotary_interleaved: bool = True,
        alibi_slopes: torch.Tensor | None = None,
        num_splits: int = 0,
        return_softmax_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if rotary_cos is not None or rotary_sin is not None or cache_leftpad is not None:
            raise ValueError("rotary embedding and cache_leftpad are not supported by this kernel; pass None")
        with torch.no_grad():  # forward only, as flash-attn's
            out, lse = run_kvcache(
                decoder,
                q,
                k_cache,
                v_cache,
                k,
                v,
                cache_seqlens,
                cache_batch_idx,
                block_table,
                softmax_scale,
                causal,
                window_size,
                softcap,
                alibi_slopes,
                num_splits,
            )
        return (out, fa2_lse(lse)) if return_softmax_lse else out

    flash_attn_with_kvcache.__name__ = flash_attn_with_kvcache.__qualname__ = name
    flash_attn_with_kvcache.__doc__ = doc
    return flash_attn_with_kvcache


class ZeroScratchSkipsEmptySplits(SplitKvDecode):
    """Partials live in zero-filled scratch and a split without keys returns before writing: the merge
    reads its LSE as 0 (not -inf) and gives its zero output a weight ``exp(0 − lse)``."""

    writes_empty_splits = False

    def scratch(
        self, shape_o: tuple[int, ...], shape_lse: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(shape_o), torch.zeros(shape_lse)


fa2_kvcache_splitkv = as_flash_attn_with_kvcache(
    SplitKvDecode(),
    "fa2_kvcache_splitkv",
    """Correct ``flash_attn_with_kvcache``: appends k, v in place, splits the keys into ``num_splits``
    chunks (64-key blocks each), writes (0, -inf) for empty splits and merges with a guarded max.""",
)

fa2_kvcache_empty_split_scratch = as_flash_attn_with_kvcache(
    ZeroScratchSkipsEmptySplits(),
    "fa2_kvcache_empty_split_scratch",
    """``flash_attn_with_kvcache`` merging empty trailing splits from scratch that was never written
    (vllm PR 47188; zero-filled memory stands in for the uninitialised buffer).

    Trigger: a split with no keys — ``num_splits > 1`` with ragged ``cache_seqlens`` (a sequence shorter
    than ``(num_splits − 1) · ceil(max_len / num_splits)``) or more splits than keys. The output of such a
    row shrinks by ``1 / (1 + n_empty · exp(−lse))``; the LSE moves the same way. Right when every split
    has keys (e.g. ``num_splits=1``, equal lengths).""",
)


HELDOUT: dict[str, HeldOut] = {
    "fa2_varlen_paged": HeldOut(
        fa2_varlen_paged,
        "flash_attn_varlen_func",
        "control",
        "one online softmax per sequence, any page size",
    ),
    "fa2_varlen_empty_reads_neighbour": HeldOut(
        fa2_varlen_empty_reads_neighbour,
        "flash_attn_varlen_func",
        "bug",
        "batch > 1, a sequence with kv_len 0 followed by one with keys",
    ),
    "fa2_varlen_empty_rows_unwritten": HeldOut(
        fa2_varlen_empty_rows_unwritten,
        "flash_attn_varlen_func",
        "bug",
        "a sequence with q_len > 0 and kv_len 0 (its rows keep out='s contents)",
    ),
    "fa2_paged_page_gt128": HeldOut(
        fa2_paged_page_gt128, "flash_attn_varlen_func", "bug", "page_size > 128 and kv_len > 128"
    ),
    "fa2_kvcache_splitkv": HeldOut(
        fa2_kvcache_splitkv, "flash_attn_with_kvcache", "control", "split-KV decode with a guarded merge"
    ),
    "fa2_kvcache_empty_split_scratch": HeldOut(
        fa2_kvcache_empty_split_scratch,
        "flash_attn_with_kvcache",
        "bug",
        "a split without keys (num_splits > 1 and ragged cache_seqlens, or splits > keys)",
    ),
}

CONTRACTS: dict[str, Contract] = {
    "fa2_varlen_paged": Contract("flash-attn 2.8", out_kwarg=True),
    "fa2_varlen_empty_reads_neighbour": Contract("flash-attn 2.8", out_kwarg=True),
    "fa2_varlen_empty_rows_unwritten": Contract("flash-attn 2.8", out_kwarg=True),
    "fa2_paged_page_gt128": Contract("flash-attn 2.8", out_kwarg=True),
    "fa2_kvcache_splitkv": Contract("flash-attn 2.8", backward=None),
    "fa2_kvcache_empty_split_scratch": Contract("flash-attn 2.8", backward=None),
}
