"""Kernels whose error has one sign, for the fuzzer's ``signed bias`` cases (issue 37): the suite's
``output_truncated`` (:mod:`lab.mutants`) and, here, its backward twin.

Each computes plain attention in float32 (:func:`flashprobe.math_attention`), more accurately than the
16-bit baseline, and then rounds one result to the 16-bit dtype **toward zero** instead of to the
nearest value: a real conversion bug class (a cast that drops the low mantissa bits, as a truncating
``float → bf16`` does). Its error is at most one ulp, well inside every per-call limit, but always
toward zero, so it adds up over steps instead of averaging out. Only the sign test of
:func:`flashprobe.fuzz.rule.signed_bias` sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashprobe import math_attention
from lab.mutants import output_truncated, round_toward_zero

__all__ = ["BIAS_MUTANTS", "BiasMutant", "bias_mutant", "round_toward_zero"]


class _TruncatedGradients(torch.autograd.Function):
    """Float32 attention, its output rounded to the inputs' dtype to nearest, its input gradients
    rounded toward zero (the backward twin of the suite's ``output_truncated``)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, causal, scale):  # type: ignore[override]
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out32 = math_attention(q32, k32, v32, is_causal=causal, scale=scale)
        ctx.graph = (q32, k32, v32, out32)
        return out32.detach().to(q.dtype)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor):  # type: ignore[override]
        q32, k32, v32, out32 = ctx.graph
        grads = torch.autograd.grad(out32, (q32, k32, v32), d_out.float())
        return (*(round_toward_zero(g, d_out.dtype) for g in grads), None, None)


def gradients_truncated(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """dq, dk and dv rounded toward zero; no attn_mask."""
    if attn_mask is not None:
        raise NotImplementedError("the truncating mutants take no attn_mask")
    return _TruncatedGradients.apply(q, k, v, is_causal, scale)


@dataclass(frozen=True)
class BiasMutant:
    """One kernel whose error has one sign.

    Attributes:
        name: the registered kernel's name.
        text: the class of real bug it stands for.
        case: the catalogue case that must catch it.
        dtype: the dtype it is checked at.
        failure: the expected failure kind (``biased`` or ``<gradient>:biased``).
    """

    name: str
    text: str
    case: str
    dtype: str
    failure: str


def bias_mutant(name: str) -> Any:
    """The kernel function of mutant ``name``."""
    return _KERNELS[name]


_KERNELS = {"truncated_out": output_truncated, "truncated_grads": gradients_truncated}

#: Each mutant with the case and dtype that must catch it.
BIAS_MUTANTS: tuple[BiasMutant, ...] = (
    BiasMutant("truncated_out", "output rounded to bf16 toward zero", "bias_dense", "bf16", "biased"),
    BiasMutant("truncated_out", "output rounded to fp16 toward zero", "bias_dense", "fp16", "biased"),
    BiasMutant("truncated_out", "the same on repeated maxima", "bias_repeated_max", "bf16", "biased"),
    BiasMutant("truncated_grads", "dq, dk, dv rounded toward zero", "bias_dense", "bf16", "dq:biased"),
)  # fmt: skip
