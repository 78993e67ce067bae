"""Chunk planning: the reference computations of one call, split to bound their memory.

The baseline and golden references of a call materialise a score matrix. :func:`plan_chunks`
splits the call's ``(B, H, N_q, N_k)`` scores into :class:`Chunk` blocks of at most
``chunk_elements`` scores: whole batch entries when they fit, else groups of heads (exact, heads
are independent), else query rows of one key/value head group. :func:`chunk_mask` gives each
block its part of the mask; a causal call gets an explicit causal mask per row block (its
diagonal depends on where the block starts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashprobe.kernels import causal_mask
from flashprobe.probe.call import Prepared

__all__ = ["Chunk", "chunk_mask", "plan_chunks"]


class Chunk(NamedTuple):
    """A block of the score tensor: batch entries, key/value heads, and query row slices."""

    batch: slice
    heads: slice  # key/value heads; query heads are rep times as many
    rows: list[slice | None]  # [None] = all rows

    def q_heads(self, rep: int) -> slice:
        """The query heads of this chunk's key/value heads, ``rep`` query heads per key/value head."""
        return slice(self.heads.start * rep, self.heads.stop * rep)

    def take(self, x: torch.Tensor, rep: int = 1, rows: slice | None = None) -> torch.Tensor:
        """The chunk of a ``(B, H, N, D)`` tensor; ``rep`` > 1 for tensors with query heads."""
        x = x[self.batch][:, self.q_heads(rep)]
        return x if rows is None else x[:, :, rows]


def plan_chunks(p: Prepared, chunk_elements: int) -> list[Chunk]:
    """Chunks of at most ``chunk_elements`` scores covering every score of ``p`` once.

    Whole batch entries when they fit, else groups of heads (exact, heads are independent), else
    query rows of one head group (at least one row, so a single row may exceed the bound).

    Args:
        p: the prepared call: ``q (B, H, N_q, D)``, ``k (B, H_kv, N_k, D)``, ``rep = H / H_kv``.
        chunk_elements: most score elements one chunk may hold.
    """
    b, h_kv = p.k.shape[:2]
    n_q, n_k = p.q.shape[2], p.k.shape[2]
    budget = chunk_elements
    group = p.rep * n_q * n_k  # scores of one key/value head and its query heads
    every_head = slice(0, h_kv)
    if h_kv * group <= budget:
        step = max(1, budget // max(h_kv * group, 1))
        return [Chunk(slice(i, min(b, i + step)), every_head, [None]) for i in range(0, b, step)]
    if group <= budget:
        step = budget // group
        heads = [slice(j, min(h_kv, j + step)) for j in range(0, h_kv, step)]
        return [Chunk(slice(i, i + 1), hs, [None]) for i in range(b) for hs in heads]
    rows = max(1, budget // max(p.rep * n_k, 1))
    row_slices: list[slice | None] = [slice(r, min(n_q, r + rows)) for r in range(0, n_q, rows)]
    return [Chunk(slice(i, i + 1), slice(j, j + 1), row_slices) for i in range(b) for j in range(h_kv)]


def chunk_mask(p: Prepared, c: Chunk, rs: slice | None) -> tuple[torch.Tensor | None, bool]:
    """The mask and ``is_causal`` flag for query rows ``rs`` (None: all rows) of chunk ``c``.

    Returns:
        ``(mask, is_causal)``: ``p.attn_mask`` restricted to the chunk (broadcastable to the
        chunk's ``(B_c, H_c, N_rows, N_k)`` scores) or None; for a row block of a causal call,
        an explicit ``(N_rows, N_k)`` causal mask and ``False``.
    """
    mask = p.attn_mask
    if mask is not None:
        if mask.shape[0] > 1:
            mask = mask[c.batch]
        if mask.shape[1] > 1:
            mask = mask[:, c.q_heads(p.rep)]
    if rs is None:
        return mask, p.is_causal
    if p.is_causal:
        n_q, n_k = p.q.shape[2], p.k.shape[2]
        return causal_mask(n_q, n_k, p.q.device, q_start=rs.start, q_len=rs.stop - rs.start), False
    if mask is not None and mask.shape[2] > 1:
        mask = mask[:, :, rs]
    return mask, False
