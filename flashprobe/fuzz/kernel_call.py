"""Calling a kernel on a case: its spec as the user wrote it, and one typed outcome per call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.rule import Verdict
from flashprobe.kernels import Kernel, KernelInputError, KernelUnavailableError, get_kernel

__all__ = ["KernelCall", "attend", "call_kernel", "kernel_label"]


def kernel_label(kernel: str | Kernel) -> str:
    """The kernel as the user wrote its spec (``tiled:mask_value=-5e4``), validated.

    Raises:
        KernelSpecError: the spec is malformed or names an unknown kernel or option.
    """
    get_kernel(kernel)
    return kernel.strip() if isinstance(kernel, str) else kernel.spec


def attend(kernel: Kernel, inputs: CaseInputs, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``kernel(inputs.q, k, v, ...)`` without autograd, with the case's mask, causality and scale.

    Args:
        kernel: the kernel.
        inputs: the case (its ``q``, ``attn_mask``, ``is_causal``, ``scale`` are used).
        k: ``(B, H_kv, N_k, D)`` keys (the case's, or expanded to ``H`` for a reference).
        v: ``(B, H_kv, N_k, D_v)`` values.

    Returns:
        Whatever the kernel returns, normally ``(B, H, N_q, D_v)``.
    """
    with torch.no_grad():
        return kernel(
            inputs.q, k, v, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal, scale=inputs.scale
        )


@dataclass(frozen=True)
class KernelCall:
    """What one call of a kernel under test gave: an output to judge, or the verdict already reached.

    Attributes:
        output: ``(B, H, N_q, D_v)`` the kernel's output; ``None`` when ``problem`` is set.
        problem: ``unsupported`` (the kernel raised KernelUnavailableError/KernelInputError) or
            ``fail`` (``raised``: it raised anything else or returned no tensor; ``inplace``: it
            modified its inputs); ``None`` when there is an output to judge.
    """

    output: torch.Tensor | None = None
    problem: Verdict | None = None


def call_kernel(kernel: Kernel, inputs: CaseInputs) -> KernelCall:
    """Call ``kernel`` on copies of ``inputs`` and check that it left them untouched."""
    copies = inputs.clone()
    try:
        out = attend(kernel, copies, copies.k, copies.v)
    except (KernelUnavailableError, KernelInputError) as err:
        return KernelCall(problem=Verdict(verdict="unsupported", reason=f"{type(err).__name__}: {err}"))
    except Exception as err:  # any other exception is a bug the fuzzer reports
        reason = f"raised {type(err).__name__}: {err}"
        return KernelCall(problem=Verdict(verdict="fail", failure="raised", reason=reason))
    if not isinstance(out, torch.Tensor):
        reason = f"returned {type(out).__name__}, not a tensor"
        return KernelCall(problem=Verdict(verdict="fail", failure="raised", reason=reason))
    changed = [
        name
        for name in ("q", "k", "v", "attn_mask")
        if getattr(inputs, name) is not None and not torch.equal(getattr(inputs, name), getattr(copies, name))
    ]
    if changed:
        reason = f"modified its inputs in place: {', '.join(changed)}"
        return KernelCall(problem=Verdict(verdict="fail", failure="inplace", reason=reason))
    return KernelCall(output=out)
