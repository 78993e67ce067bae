"""FP8 kernels with FlashAttention-3's ``flash_attn_func`` signature: two controls and the P-cast bugs of
2025–26, plus a kernel that declares FP8 and computes in bf16.

Signature and conventions (flash-attention ``hopper/flash_attn_interface.py`` and ``hopper/flash_api.cpp``):
``flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
deterministic=False, sm_margin=0, return_attn_probs=False)``; q ``(B, N_q, H_q, D)``, k, v ``(B, N_k, H_k,
D)``, float8_e4m3fn or 16-bit. For e4m3 inputs the descales are fp32 ``(B, H_k)`` (``q_descale`` too is per
KV head: "(b, h_k), not (b, h)"), the scores are ``q·k · softmax_scale · q_descale · k_descale``, the output
is multiplied by ``v_descale`` and returned in **bf16**; descales are ignored for 16-bit inputs. Returns
``out`` or ``(out, softmax_lse (B, H_q, N_q) fp32)``, natural log, **-inf** for a row that sees no key (the
FA3 convention; the output row is 0). No ALiBi; ``qv`` and ``attention_chunk`` are refused here.

FA3's FP8 softmax (``hopper/softmax.h``) computes ``P = exp2(s·log2 e − (m·log2 e − 8))`` — P scaled by
2^8 into [0, 256] so that small probabilities stay above e4m3's underflow — rounds P to e4m3 for the P·V
product, but accumulates the row sum from the fp32 P; the 2^8 cancels in ``O = acc / l`` and is removed
from the LSE. FA4 (``flash_attn/cute``) adds a lazy rescale: the running max is only updated when a block's
max exceeds it by more than a threshold (in log2 units).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from lab.heldout._online import (
    LOG2E,
    OnlineSoftmax,
    ScoreSpec,
    cast_e4m3,
    check_dense,
    check_options,
)
from lab.heldout._table import Contract, HeldOut

Kernel = Callable[..., Any]
E4M3 = torch.float8_e4m3fn


class Fa3Sixteen(OnlineSoftmax):
    """FA3's 16-bit path: exp2, 128-key blocks, P rounded to the input dtype."""

    base2 = True
    p_in_input_dtype = True


class Fa3Fp8(OnlineSoftmax):
    """FA3's FP8 path: P offset by 2^8, rounded to e4m3 (saturating) for P·V, row sum from fp32 P."""

    base2 = True
    p_offset_log2 = 8.0

    def p_operand(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return cast_e4m3(p)


class Fp8NoPrescale(Fa3Fp8):
    """P in (0, 1] cast to e4m3 directly: below 2^-10 it rounds to 0, below 2^-6 to the subnormal steps."""

    p_offset_log2 = 0.0


class Fp8LazyRescale(Fa3Fp8):
    """FA4's lazy rescale: keep the running max until a block's max exceeds it by more than
    ``threshold_log2`` (log2 units), so P can reach ``2^(8 + threshold)``."""

    threshold_log2 = 4.0

    def running_max(self, m: torch.Tensor, block_max: torch.Tensor) -> torch.Tensor:
        grow = (block_max - m) * LOG2E
        keep = (m > -math.inf) & (grow <= self.threshold_log2)
        return torch.where(keep, m, torch.maximum(m, block_max))


class Fp8LazyRescaleBounded(Fp8LazyRescale):
    """Lazy rescale with the threshold bounded by e4m3's range: ``2^(8 + 0.75) < 448`` never saturates."""

    threshold_log2 = 0.75


class Fp8DeclaredComputesBf16(Fa3Fp8):
    """Takes e4m3 inputs and descales like FA3 but rounds P to bf16, not e4m3, for P·V."""

    def p_operand(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return p.to(torch.bfloat16).float()


def _descale(d: torch.Tensor | None, batch: int, h_k: int, name: str) -> torch.Tensor:
    """A ``(B, H_k)`` fp32 descale (ones when None).

    Raises:
        ValueError: any other shape.
    """
    if d is None:
        return torch.ones(batch, h_k)
    if d.shape != (batch, h_k):
        raise ValueError(
            f"{name} must be fp32 (batch_size, nheads_k) = ({batch}, {h_k}); got {tuple(d.shape)}"
        )
    return d.float()


def run_fa3(
    fp8: OnlineSoftmax,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None,
    causal: bool,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    window_size: tuple[int, int],
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate an FA3 ``flash_attn_func`` call and run ``fp8`` on e4m3 inputs (``Fa3Sixteen`` otherwise).

    Returns:
        ``out (B, N_q, H_q, D_v)`` (bf16 for e4m3 inputs, else q's dtype) and ``lse (B, H_q, N_q)`` fp32.
    """
    check_dense(q, k, v)
    check_options(0.0, window_size, softcap)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    spec = ScoreSpec(scale, bool(causal), (int(window_size[0]), int(window_size[1])), float(softcap))
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, N, D)
    if q.dtype != E4M3:
        out, lse = Fa3Sixteen().forward(qh, kh, vh, spec)
        return out.transpose(1, 2).to(q.dtype), lse.detach()
    batch, h_q, h_k = q.shape[0], q.shape[2], k.shape[2]
    group = torch.arange(h_q) // (h_q // h_k)
    qk_descale = _descale(q_descale, batch, h_k, "q_descale") * _descale(k_descale, batch, h_k, "k_descale")
    q_scaled = qh.float() * qk_descale[:, group, None, None]  # (B, H_q, N_q, D) fp32
    out, lse = fp8.forward(q_scaled, kh, vh, spec)
    out = out * _descale(v_descale, batch, h_k, "v_descale")[:, group, None, None]
    return out.transpose(1, 2).to(torch.bfloat16), lse.detach()


def as_fa3_flash_attn_func(fp8: OnlineSoftmax, name: str, doc: str) -> Kernel:
    """A function with FlashAttention-3's ``flash_attn_func`` signature running ``fp8`` on e4m3 inputs."""

    def flash_attn_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        softmax_scale: float | None = None,
        causal: bool = False,
        qv: torch.Tensor | None = None,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
        window_size: tuple[int, int] = (-1, -1),
        attention_chunk: int = 0,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: bool | None = None,
        deterministic: bool = False,
        sm_margin: int = 0,
        return_attn_probs: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if qv is not None or attention_chunk != 0:
            raise ValueError(
                "qv and attention_chunk are not supported by this kernel; pass qv=None, attention_chunk=0"
            )
        out, lse = run_fa3(
            fp8, q, k, v, softmax_scale, causal, q_descale, k_descale, v_descale, window_size, softcap
        )
        return (out, lse) if return_attn_probs else out

    flash_attn_func.__name__ = flash_attn_func.__qualname__ = name
    flash_attn_func.__doc__ = doc
    return flash_attn_func


fa3_fp8_prescale = as_fa3_flash_attn_func(
    Fa3Fp8(),
    "fa3_fp8_prescale",
    """Correct FP8 ``flash_attn_func`` (FA3): P·2^8 rounded to e4m3 for P·V, row sum from fp32 P, the
    running max exact; 16-bit inputs take the 16-bit path.""",
)

fa4_fp8_lazy_bounded = as_fa3_flash_attn_func(
    Fp8LazyRescaleBounded(),
    "fa4_fp8_lazy_bounded",
    """Correct FP8 ``flash_attn_func`` with FA4's lazy rescale at threshold 0.75 (the bound
    ``log2(448) − 8 ≈ 0.807`` of flash-attention PRs 2713/2731): P never exceeds 448.""",
)

fa3_fp8_no_prescale = as_fa3_flash_attn_func(
    Fp8NoPrescale(),
    "fa3_fp8_no_prescale",
    """FP8 ``flash_attn_func`` casting P to e4m3 without the 2^8 prescale, row sum from fp32 P: diffuse
    probability mass vanishes from the numerator only; the LSE stays exact (flashinfer PR 5020; ROCm
    FlyDSL PR 1020, aiter PRs 5535/5642).

    Trigger: e4m3 inputs and rows with much mass in probabilities below ~2^-10 of the row max — the
    fixture V = 1 with one logit 0 and many at -7 gives ``out = 1 / (1 + (N−1)·e^-7)``, not 1. Right on
    16-bit inputs and close on random rows with few keys.""",
)

fa4_fp8_lazy_rescale = as_fa3_flash_attn_func(
    Fp8LazyRescale(),
    "fa4_fp8_lazy_rescale",
    """FP8 ``flash_attn_func`` with FA4's lazy rescale at threshold 4 and the 2^8 offset: a block whose max
    exceeds the running max by 0.81–4 log2 units gives P up to 2^12, which saturates at 448 in e4m3 while
    the fp32 row sum keeps it (flash-attention issues 2716, 2577; PRs 2713, 2731).

    Trigger: e4m3 inputs, ``N_k > 128`` and a later key block whose max exceeds every earlier key's score
    by ``0.56 < Δ ≤ 2.77`` (natural units). Right when the row max sits in the first block.""",
)

fa3_fp8_computes_bf16 = as_fa3_flash_attn_func(
    Fp8DeclaredComputesBf16(),
    "fa3_fp8_computes_bf16",
    """Declares FP8 (takes e4m3 q, k, v and descales) but rounds P to bf16, not e4m3, for P·V: more
    accurate than an FP8 P·V can be, so every tolerance passes it (KernelBench-Hard's audit: the top "FP8"
    GEMMs computed in bf16).

    Trigger: every e4m3 call with non-trivial probabilities — its error against the golden sits far below
    the e4m3 P-cast error of a real FP8 kernel. Not a wrong answer: a wrong declared precision.""",
)


HELDOUT: dict[str, HeldOut] = {
    "fa3_fp8_prescale": HeldOut(fa3_fp8_prescale, "flash_attn_func", "control", "FA3 FP8: P·2^8 to e4m3"),
    "fa4_fp8_lazy_bounded": HeldOut(
        fa4_fp8_lazy_bounded, "flash_attn_func", "control", "FA4 lazy rescale, threshold 0.75"
    ),
    "fa3_fp8_no_prescale": HeldOut(
        fa3_fp8_no_prescale, "flash_attn_func", "bug", "e4m3; diffuse rows (V=1, one logit 0, many at -7)"
    ),
    "fa4_fp8_lazy_rescale": HeldOut(
        fa4_fp8_lazy_rescale,
        "flash_attn_func",
        "bug",
        "e4m3; a later 128-key block raises the max by 0.56-2.77",
    ),
    "fa3_fp8_computes_bf16": HeldOut(
        fa3_fp8_computes_bf16,
        "flash_attn_func",
        "bug",
        "e4m3; more accurate than an e4m3 P·V (declared precision)",
    ),
}

CONTRACTS: dict[str, Contract] = {
    name: Contract(
        "FlashAttention-3", empty_row_lse=-math.inf, dtypes=("e4m3", "bf16", "fp16", "fp32"), backward=None
    )
    for name in HELDOUT
}
