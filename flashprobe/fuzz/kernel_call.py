"""Calling a kernel on a case: its spec as the user wrote it, and one typed outcome per call
(:class:`KernelCall`; a kernel whose output has no autograd graph is reported ``no_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.rule import Verdict
from flashprobe.kernels import Kernel, KernelInputError, KernelUnavailableError, get_kernel

__all__ = ["REFUSALS", "KernelCall", "attend", "call_kernel", "kernel_label"]

#: The exceptions with which a kernel refuses a call: a row they end is ``unsupported``, not failed.
REFUSALS: tuple[type[Exception], ...] = (KernelUnavailableError, KernelInputError)


def kernel_label(kernel: str | Kernel) -> str:
    """The kernel as the user wrote its spec (``tiled:mask_value=-5e4``), validated.

    Raises:
        KernelSpecError: the spec is malformed or names an unknown kernel or option.
    """
    get_kernel(kernel)
    return kernel.strip() if isinstance(kernel, str) else kernel.spec


def attend(kernel: Kernel, inputs: CaseInputs, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``kernel(inputs.q, k, v, ...)`` without autograd, with the case's mask, causality and scale;
    ``k`` ``(B, H_kv, N_k, D)`` and ``v`` ``(B, H_kv, N_k, D_v)`` (the case's, or expanded to ``H``).
    Returns whatever the kernel returns, normally ``(B, H, N_q, D_v)``."""
    with torch.no_grad():
        return kernel(
            inputs.q, k, v, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal, scale=inputs.scale
        )


@dataclass(frozen=True)
class KernelCall:
    """What one call of a kernel under test gave: an output to judge, or the verdict already reached.

    Attributes:
        output: ``(B, H, N_q, D_v)`` the kernel's output; None when ``problem`` is set.
        grads: ``dq`` ``(B, H, N_q, D)``, ``dk`` ``(B, H_kv, N_k, D)``, ``dv`` ``(B, H_kv, N_k, D_v)``
            when the backward ran (None for an input the output does not depend on).
        no_backward: the output has no autograd graph, or the kernel refuses inputs that require
            grad here (``no_backward_reason`` says why).
        backward_problem: the backward raised (``fail``, kind ``backward:raised``).
        problem: ``unsupported`` (KernelUnavailableError/KernelInputError) or ``fail`` (``raised``,
            ``inplace``); None when there is an output to judge.
    """

    output: torch.Tensor | None = None
    problem: Verdict | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    no_backward: bool = False
    backward_problem: Verdict | None = None
    no_backward_reason: str = ""


def _forward_backward(
    kernel: Kernel, inputs: CaseInputs, grad_out: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None] | None, Verdict | None]:
    """The output with autograd, and the gradients (None: no backward) or the backward's problem."""
    q, k, v = (t.requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    with torch.enable_grad():
        out = kernel(q, k, v, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal, scale=inputs.scale)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return out, None, None
    try:
        grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype), allow_unused=True)
    except Exception as err:  # a backward that raises is a bug the fuzzer reports
        why = f"backward raised {type(err).__name__}: {err}"
        return out.detach(), {}, Verdict(verdict="fail", failure="backward:raised", reason=why)
    for t in (q, k, v):
        t.requires_grad_(False)
    return out.detach(), dict(zip(("dq", "dk", "dv"), grads, strict=True)), None


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same values, NaN where the other has NaN (inputs may hold NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def call_kernel(kernel: Kernel, inputs: CaseInputs, grad_out: torch.Tensor | None = None) -> KernelCall:
    """Call ``kernel`` on copies of ``inputs`` and check that it left them untouched.

    Args:
        grad_out: ``(B, H, N_q, D_v)`` output gradient: also run the backward; None runs the
            forward under ``no_grad``.
    """
    copies = inputs.clone()
    grads: dict[str, torch.Tensor | None] | None = {}
    backward_problem = None
    try:
        if grad_out is None:
            out = attend(kernel, copies, copies.k, copies.v)
        else:
            out, grads, backward_problem = _forward_backward(kernel, copies, grad_out)
    except REFUSALS as err:
        reason = f"{type(err).__name__}: {err}"
        if grad_out is None or not isinstance(err, KernelUnavailableError):
            return KernelCall(problem=Verdict(verdict="unsupported", reason=reason))
        # No backward here (e.g. FlexAttention on the CPU): judge the forward, report the gradients.
        forward_only = call_kernel(kernel, inputs)
        if forward_only.problem is None:
            return replace(forward_only, no_backward=True, no_backward_reason=reason)
        return forward_only
    except Exception as err:  # any other exception is a bug the fuzzer reports
        reason = f"raised {type(err).__name__}: {err}"
        return KernelCall(problem=Verdict(verdict="fail", failure="raised", reason=reason))
    if not isinstance(out, torch.Tensor):
        reason = f"returned {type(out).__name__}, not a tensor"
        return KernelCall(problem=Verdict(verdict="fail", failure="raised", reason=reason))
    changed = [
        name
        for name in ("q", "k", "v", "attn_mask")
        if getattr(inputs, name) is not None
        and not same_values(getattr(inputs, name), getattr(copies, name).detach())
    ]
    if changed:
        reason = f"modified its inputs in place: {', '.join(changed)}"
        return KernelCall(problem=Verdict(verdict="fail", failure="inplace", reason=reason))
    return KernelCall(
        output=out,
        grads=grads or {},
        no_backward=grad_out is not None and grads is None,
        backward_problem=backward_problem,
    )
