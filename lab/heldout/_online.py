"""The blocked online-softmax forward the held-out kernels are built on, one overridable method per step.

A real flash kernel walks the keys in blocks, keeps a running row max ``m``, row sum ``l`` and output
accumulator in fp32, and rescales them whenever the max grows. ``OnlineSoftmax.forward`` does the same
in plain PyTorch on ``(B, H, N, D)`` tensors; every step a kernel author can get wrong is a method
(which K/V head serves a query head, softcap, ALiBi, the visible-key mask, the tail of the last block,
the max used for the exponentials, the operand P of P·V, the store of the output tile), so a buggy
kernel is this class with one method written the wrong way.

Conventions (flash-attn's): keys and queries are aligned bottom-right (query ``i`` sits at key position
``i + N_k - N_q``); ``window=(left, right)`` keeps keys in ``[pos - left, pos + right]``, ``-1`` meaning
unbounded; the score of a visible key is ``softcap * tanh(scale * q·k / softcap)`` (when ``softcap > 0``)
plus ``-slope * |pos - j|`` (ALiBi). A row that sees no key returns zeros and an LSE of ``-inf``.

The running max is taken from detached scores: softmax is shift-invariant, so autograd through
``forward`` gives exact gradients while the max stays out of the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
E4M3_MAX = 448.0


@dataclass(frozen=True)
class ScoreSpec:
    """What surrounds the scores of one call.

    Attributes:
        scale: the softmax scale multiplying ``q·k``.
        causal: bottom-right causal mask.
        window: ``(left, right)``; ``-1`` is unbounded on that side.
        softcap: ``> 0`` applies ``softcap * tanh(s / softcap)``.
        alibi: ALiBi slopes ``(B, H_q)`` fp32, or None.
    """

    scale: float
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: torch.Tensor | None = None


class OnlineSoftmax:
    """Attention forward over blocks of ``block_n`` keys with fp32 running max, sum and accumulator.

    Attributes:
        block_n: keys per block (the K/V tile).
        block_m: query rows per output tile (used by ``store``).
        base2: compute the exponentials as ``exp2(s·log2 e − m·log2 e)`` (flash-attn's form).
        p_in_input_dtype: round P to the input dtype before P·V, as flash-attn 2 does (else P stays
            fp32).
        p_offset_log2: P is computed as ``2^offset · exp(s − m)`` (FP8 kernels use 8); the row sum
            carries the same factor, so it cancels in the output and is removed from the LSE.
    """

    block_n: int = 128
    block_m: int = 64
    base2: bool = False
    p_in_input_dtype: bool = False
    p_offset_log2: float = 0.0

    # ---- the steps a kernel author writes -------------------------------------------------------------

    def kv_heads(self, h_q: int, h_k: int) -> torch.Tensor:
        """K/V head serving each query head: ``(H_q,)`` int64; grouped, as flash-attn's GQA."""
        return torch.arange(h_q) // (h_q // h_k)

    def soft_cap(self, s: torch.Tensor, cap: float) -> torch.Tensor:
        """``cap * tanh(s / cap)``."""
        return cap * torch.tanh(s / cap)

    def alibi_bias(
        self, rows: torch.Tensor, cols: torch.Tensor, n_q: int, n_k: int, slopes: torch.Tensor
    ) -> torch.Tensor:
        """``-slope * |i + N_k - N_q - j|``: ``(B, H_q, rows, cols)`` from slopes ``(B, H_q)``."""
        dist = (rows[:, None] + (n_k - n_q) - cols[None, :]).abs().float()  # (rows, cols)
        return -slopes[:, :, None, None] * dist

    def window_sides(self, window: tuple[int, int]) -> tuple[int, int]:
        """The (left, right) extents the mask uses."""
        return window

    def visible(
        self, rows: torch.Tensor, cols: torch.Tensor, n_q: int, n_k: int, spec: ScoreSpec
    ) -> torch.Tensor:
        """Bool ``(rows, cols)``: key ``j`` is visible to query ``i`` (causal and window, bottom-right)."""
        pos = rows[:, None] + (n_k - n_q)  # (rows, 1) the query's key position
        keep = torch.ones(len(rows), len(cols), dtype=torch.bool)
        left, right = self.window_sides(spec.window)
        if spec.causal:
            keep &= cols[None, :] <= pos
        if left >= 0:
            keep &= cols[None, :] >= pos - left
        if right >= 0:
            keep &= cols[None, :] <= pos + right
        return keep

    def in_range(self, cols: torch.Tensor, n_k: int) -> torch.Tensor:
        """Bool ``(cols,)``: the column is a real key, not the zero padding of the last block."""
        return cols < n_k

    def running_max(self, m: torch.Tensor, block_max: torch.Tensor) -> torch.Tensor:
        """The max the exponentials of this block are taken against (exact: the true running max)."""
        return torch.maximum(m, block_max)

    def p_operand(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """P as the P·V product reads it, given the input dtype (fp32, or rounded to ``dtype``)."""
        return p.to(dtype).float() if self.p_in_input_dtype else p

    def store(self, out: torch.Tensor) -> torch.Tensor:
        """The epilogue writing the normalised ``(B, H_q, N_q, D_v)`` output tiles (identity)."""
        return out

    # ---- the loop ----------------------------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: ScoreSpec,
        *,
        key_start: int = 0,
        n_k_total: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q`` over ``k, v``.

        Args:
            q: ``(B, H_q, N_q, D)`` any float dtype (read as fp32).
            k: ``(B, H_k, N_k, D)`` with ``H_q % H_k == 0``.
            v: ``(B, H_k, N_k, D_v)``.
            spec: scale, mask and score modifiers.
            key_start: absolute position of ``k[:, :, 0]`` (a chunk of a longer key sequence).
            n_k_total: length of the whole key sequence the mask aligns to (default ``key_start + N_k``).

        Returns:
            ``out (B, H_q, N_q, D_v)`` fp32 and ``lse (B, H_q, N_q)`` fp32, natural log, ``-inf`` (and a
            zero output row) where a query sees no key.
        """
        b, h_q, n_q, _ = q.shape
        h_k, n_k, d_v = k.shape[1], k.shape[2], v.shape[3]
        n_total = key_start + n_k if n_k_total is None else n_k_total
        heads = self.kv_heads(h_q, h_k)
        qf = q.float()
        kf = k.float().index_select(1, heads)  # (B, H_q, N_k, D)
        vf = v.float().index_select(1, heads)  # (B, H_q, N_k, D_v)
        n_pad = -n_k % self.block_n
        if n_pad:
            kf = torch.nn.functional.pad(kf, (0, 0, 0, n_pad))
            vf = torch.nn.functional.pad(vf, (0, 0, 0, n_pad))
        rows = torch.arange(n_q)
        m = torch.full((b, h_q, n_q), -math.inf)
        l_sum = torch.zeros(b, h_q, n_q)
        acc = torch.zeros(b, h_q, n_q, d_v)
        for j0 in range(0, n_k + n_pad, self.block_n):
            kb, vb = kf[:, :, j0 : j0 + self.block_n], vf[:, :, j0 : j0 + self.block_n]
            cols_local = torch.arange(j0, j0 + kb.shape[2])
            cols = cols_local + key_start
            s = (qf @ kb.transpose(-1, -2)) * spec.scale  # (B, H_q, N_q, block)
            if spec.softcap > 0:
                s = self.soft_cap(s, spec.softcap)
            if spec.alibi is not None:
                s = s + self.alibi_bias(rows, cols, n_q, n_total, spec.alibi)
            keep = self.visible(rows, cols, n_q, n_total, spec) & self.in_range(cols_local, n_k)[None, :]
            s = s.masked_fill(~keep, -math.inf)
            with torch.no_grad():
                m_new = self.running_max(m, s.amax(-1))
                m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
                alpha = self._exp(m - m_use)
            p = self._exp(s - m_use[..., None]) * 2.0**self.p_offset_log2
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + self.p_operand(p, v.dtype) @ vb
            m = m_new
        empty = l_sum == 0
        l_safe = torch.where(empty, torch.ones_like(l_sum), l_sum)
        out = torch.where(empty[..., None], torch.zeros_like(acc), acc / l_safe[..., None])
        m_fin = torch.where(m == -math.inf, torch.zeros_like(m), m)
        lse = m_fin + torch.log(l_safe) - self.p_offset_log2 * LN2
        lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
        return self.store(out), lse

    def _exp(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp2(x * LOG2E) if self.base2 else torch.exp(x)


def cast_e4m3(p: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn with saturation at ±448 (the ``satfinite`` conversion), returned as fp32."""
    return p.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def check_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Reject what a ``(B, N, H, D)`` kernel cannot run, naming the problem.

    Raises:
        ValueError: wrong rank, mismatched batch / key length / head dim, heads not divisible,
            or mixed dtypes.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, seqlen, heads, headdim); got {q.dim()}-d, {k.dim()}-d, {v.dim()}-d"
        )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v batch sizes differ: {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    check_heads(q, k, v)


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shared checks of packed or batched ``(..., N, H, D)`` q, k, v.

    Raises:
        ValueError: k and v disagree, q and k head dims differ, or H_q is not a multiple of H_k.
    """
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree except in headdim; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"number of query heads ({q.shape[-2]}) must be a multiple of key/value heads ({k.shape[-2]})"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")


def alibi_table(alibi_slopes: torch.Tensor | None, batch: int, h_q: int) -> torch.Tensor | None:
    """ALiBi slopes ``(H_q,)`` or ``(B, H_q)`` as ``(B, H_q)`` fp32.

    Raises:
        ValueError: any other shape.
    """
    if alibi_slopes is None:
        return None
    if alibi_slopes.shape == (h_q,):
        return alibi_slopes.float().expand(batch, h_q)
    if alibi_slopes.shape == (batch, h_q):
        return alibi_slopes.float()
    raise ValueError(
        f"alibi_slopes must be (nheads,) or (batch, nheads) = ({h_q},) or ({batch}, {h_q}); "
        f"got {tuple(alibi_slopes.shape)}"
    )


def check_options(dropout_p: float, window_size: tuple[int, int], softcap: float) -> None:
    """Reject options this plain-PyTorch family does not implement or that make no sense.

    Raises:
        ValueError: dropout, a malformed window, or a negative softcap.
    """
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p={dropout_p} is not supported by this kernel; pass dropout_p=0.0")
    if len(window_size) != 2 or any(int(w) < -1 for w in window_size):
        raise ValueError(f"window_size must be (left, right) with -1 for unbounded; got {window_size}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it); got {softcap}")
