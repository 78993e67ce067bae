"""Dense kernels with flash-attn 2.8's ``flash_attn_func`` signature: two controls and the bugs of the
features around the scores (softcap, window, ALiBi, GQA, the tail block, the output tile).

The signature and conventions are flash-attn 2.8.4's ``flash_attn/flash_attn_interface.py``:
``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)`` with q ``(B, N_q, H_q, D)``,
k, v ``(B, N_k, H_k, D)``, GQA by passing fewer K/V heads (query head ``h`` reads K/V head
``h // (H_q / H_k)``), causal aligned bottom-right, keys ``[i + N_k − N_q − left, i + N_k − N_q + right]``
visible under ``window_size=(left, right)``, ALiBi bias ``−slope·|i + N_k − N_q − j|`` added after the
softcap ``softcap·tanh(s / softcap)``. It returns ``out (B, N_q, H_q, D)`` in q's dtype, or with
``return_attn_probs=True`` the tuple ``(out, softmax_lse (B, H_q, N_q) fp32 natural log, S_dmask)``,
``S_dmask`` None without dropout. A row that sees no key gives 0 and, as flash-attn 2's kernel writes,
an LSE of +inf. Dropout is not implemented (a one-line error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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

FlashAttnFunc = Callable[..., Any]


def fa2_lse(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn 2's LSE convention: +inf (not -inf) for a row that sees no key; not differentiable."""
    lse = lse.detach()
    return torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)


def run_dense(
    impl: OnlineSoftmax,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a ``flash_attn_func`` call and run ``impl`` on it.

    Returns:
        ``out (B, N_q, H_q, D_v)`` in q's dtype and ``lse (B, H_q, N_q)`` fp32 (natural, -inf if empty).
    """
    check_dense(q, k, v)
    check_options(dropout_p, window_size, softcap)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    window = (int(window_size[0]), int(window_size[1]))
    spec = ScoreSpec(
        scale, bool(causal), window, float(softcap), alibi_table(alibi_slopes, q.shape[0], q.shape[2])
    )
    out, lse = impl.forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), spec)
    return out.transpose(1, 2).to(q.dtype), lse


def as_flash_attn_func(impl: OnlineSoftmax, name: str, doc: str) -> FlashAttnFunc:
    """A function with flash-attn 2.8's ``flash_attn_func`` signature running ``impl``."""

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
        out, lse = run_dense(
            impl, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes
        )
        return (out, fa2_lse(lse), None) if return_attn_probs else out

    flash_attn_func.__name__ = flash_attn_func.__qualname__ = name
    flash_attn_func.__doc__ = doc
    return flash_attn_func


# ---- controls


class Exp2Block64(OnlineSoftmax):
    """flash-attn 2's arithmetic: exp2, scale folded in, 64-key blocks, P rounded to the input dtype."""

    block_n = 64
    base2 = True
    p_in_input_dtype = True


fa2_online128 = as_flash_attn_func(
    OnlineSoftmax(),
    "fa2_online128",
    """Correct ``flash_attn_func``: online softmax over 128-key blocks, natural exp, P kept in fp32.

    Supports causal, (left, right) windows, softcap, ALiBi and GQA; differentiable by autograd.""",
)

fa2_exp2_block64 = as_flash_attn_func(
    Exp2Block64(),
    "fa2_exp2_block64",
    """Correct ``flash_attn_func`` computed as flash-attn 2 does: ``exp2(s·log2 e − m·log2 e)`` over
    64-key blocks, P rounded to the input dtype before P·V, fp32 accumulators.""",
)


# ---- bugs of the features around the scores


class SoftcapThroughExp(OnlineSoftmax):
    """tanh written as ``(e^x − e^−x) / (e^x + e^−x)``: inf/inf = NaN once ``|x| > 88.7`` in fp32."""

    def soft_cap(self, s: torch.Tensor, cap: float) -> torch.Tensor:
        x = s / cap
        ex, enx = torch.exp(x), torch.exp(-x)
        return cap * (ex - enx) / (ex + enx)


class SymmetricWindow(OnlineSoftmax):
    """Reads ``window_size[0]`` as the half-width of a symmetric window, ignoring ``window_size[1]``."""

    def window_sides(self, window: tuple[int, int]) -> tuple[int, int]:
        return window[0], window[0]


class AlibiTopLeft(OnlineSoftmax):
    """ALiBi distance ``|i − j|`` (aligned top-left) where flash-attn aligns it bottom-right."""

    def alibi_bias(
        self, rows: torch.Tensor, cols: torch.Tensor, n_q: int, n_k: int, slopes: torch.Tensor
    ) -> torch.Tensor:
        dist = (rows[:, None] - cols[None, :]).abs().float()
        return -slopes[:, :, None, None] * dist


class KvHeadModulo(OnlineSoftmax):
    """Query head ``h`` reads K/V head ``h mod H_k`` (interleaved) instead of ``h // (H_q / H_k)``."""

    def kv_heads(self, h_q: int, h_k: int) -> torch.Tensor:
        return torch.arange(h_q) % h_k


class UnmaskedTail(OnlineSoftmax):
    """The last block is zero-padded to 128 keys and the padding is never masked: each padded key scores
    0 and adds ``exp(0 − m)`` to the row sum (with a zero value)."""

    def in_range(self, cols: torch.Tensor, n_k: int) -> torch.Tensor:
        return torch.ones_like(cols, dtype=torch.bool)


class TransposedTile(OnlineSoftmax):
    """The epilogue stores a full 64×64 output tile (64 query rows × head_dim 64) transposed; other
    tiles (head_dim ≠ 64, or the partial last tile) take the masked store path, which is right."""

    def store(self, out: torch.Tensor) -> torch.Tensor:
        bm = self.block_m
        if out.shape[-1] != bm:
            return out
        tiles = [out[..., i0 : i0 + bm, :] for i0 in range(0, out.shape[-2], bm)]
        return torch.cat([t.transpose(-1, -2) if t.shape[-2] == bm else t for t in tiles], dim=-2)


class PermutedRows(OnlineSoftmax):
    """The vectorised store of a full 64-row tile swaps row ``r`` with row ``r xor 8`` (a wrong swizzle);
    the partial last tile takes the masked store path, which is right."""

    def store(self, out: torch.Tensor) -> torch.Tensor:
        bm = self.block_m
        swizzle = torch.arange(bm) ^ 8
        tiles = [out[..., i0 : i0 + bm, :] for i0 in range(0, out.shape[-2], bm)]
        return torch.cat([t[..., swizzle, :] if t.shape[-2] == bm else t for t in tiles], dim=-2)


fa2_softcap_exp = as_flash_attn_func(
    SoftcapThroughExp(),
    "fa2_softcap_exp",
    """``flash_attn_func`` whose softcap computes tanh through exp (vllm issue 56578).

    Trigger: ``softcap > 0`` and a visible score with ``|scale·q·k / softcap| > 88.7``: that row is NaN.
    Right for every smaller ratio.""",
)

fa2_window_symmetric = as_flash_attn_func(
    SymmetricWindow(),
    "fa2_window_symmetric",
    """``flash_attn_func`` applying ``window_size[0]`` on both sides (vllm PR 49202).

    Trigger: a window with ``left != right`` and not causal (causal clips the right side to 0, which
    hides the bug).""",
)

fa2_alibi_topleft = as_flash_attn_func(
    AlibiTopLeft(),
    "fa2_alibi_topleft",
    """``flash_attn_func`` with ALiBi distances aligned top-left, ``|i − j|``, where flash-attn documents
    ``|i + N_k − N_q − j|`` (a class flashprobe's issue 52 lists; no public report is modelled).

    Trigger: ``alibi_slopes`` given and ``N_q != N_k``. The output moves whenever a query sees keys on
    both sides of ``j = i`` (not causal, or causal with ``N_k > N_q``); causal with ``N_q > N_k`` shifts
    every visible bias of a row by the same amount, so only the LSE moves.""",
)

fa2_gqa_head_modulo = as_flash_attn_func(
    KvHeadModulo(),
    "fa2_gqa_head_modulo",
    """``flash_attn_func`` indexing K/V with the query head modulo ``H_k`` (LMCache PR 3092's class:
    K/V addressed by the query head under GQA).

    Trigger: GQA with ``1 < H_k < H_q``. Right for MHA (``H_k = H_q``) and MQA (``H_k = 1``).""",
)

fa2_tail_unmasked = as_flash_attn_func(
    UnmaskedTail(),
    "fa2_tail_unmasked",
    """``flash_attn_func`` whose last key block counts its zero padding (pytorch issue 159247's class:
    the tail block wrong when ``kv_len`` is not a multiple of 128).

    Trigger: ``N_k % 128 != 0`` and the padded positions not already hidden by the mask (not causal and
    no finite right window). Right when ``N_k`` is a multiple of 128.""",
)

fa2_tile_transposed = as_flash_attn_func(
    TransposedTile(),
    "fa2_tile_transposed",
    """``flash_attn_func`` storing full 64×64 output tiles transposed: each tile keeps its norm while its
    elements are wrong (flash-attention PR 2553).

    Trigger: ``head_dim == 64`` and ``N_q >= 64`` (a full query tile). The LSE is right.""",
)

fa2_tile_rows_permuted = as_flash_attn_func(
    PermutedRows(),
    "fa2_tile_rows_permuted",
    """``flash_attn_func`` storing the rows of each full 64-row output tile permuted (row r at r xor 8):
    correct values at the wrong queries, every norm kept (issue 54's permuted tile).

    Trigger: ``N_q >= 64`` (a full query tile), any head dim. The LSE is right.""",
)


HELDOUT: dict[str, HeldOut] = {
    "fa2_online128": HeldOut(
        fa2_online128, "flash_attn_func", "control", "online softmax, 128-key blocks, P fp32"
    ),
    "fa2_exp2_block64": HeldOut(
        fa2_exp2_block64, "flash_attn_func", "control", "exp2, 64-key blocks, P rounded to the input dtype"
    ),
    "fa2_softcap_exp": HeldOut(
        fa2_softcap_exp, "flash_attn_func", "bug", "softcap > 0 and |s/softcap| > 88.7"
    ),
    "fa2_window_symmetric": HeldOut(
        fa2_window_symmetric, "flash_attn_func", "bug", "window left != right, not causal"
    ),
    "fa2_alibi_topleft": HeldOut(fa2_alibi_topleft, "flash_attn_func", "bug", "alibi_slopes and N_q != N_k"),
    "fa2_gqa_head_modulo": HeldOut(fa2_gqa_head_modulo, "flash_attn_func", "bug", "GQA with 1 < H_k < H_q"),
    "fa2_tail_unmasked": HeldOut(
        fa2_tail_unmasked, "flash_attn_func", "bug", "N_k % 128 != 0, not causal, no finite right window"
    ),
    "fa2_tile_transposed": HeldOut(
        fa2_tile_transposed, "flash_attn_func", "bug", "head_dim == 64 and N_q >= 64"
    ),
    "fa2_tile_rows_permuted": HeldOut(fa2_tile_rows_permuted, "flash_attn_func", "bug", "N_q >= 64"),
}

CONTRACTS: dict[str, Contract] = {name: Contract("flash-attn 2.8") for name in HELDOUT}
