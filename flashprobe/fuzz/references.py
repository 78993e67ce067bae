"""What a kernel's output is judged against: the golden, the baseline's noise and the floor.

``golden`` is float64 from the *cast* inputs; the baseline (``math`` at the same dtype,
``--baseline``) has as error the larger over its scale placements ``(q·kᵀ)·s`` and ``(q√s)·(k√s)ᵀ``
and, for an FP8 baseline, its FP8 realisations (:func:`~flashprobe.judge.fp8_realisations`). Where the
baseline is non-finite and the golden is not, the floor comes from the baseline on logits rounded to
the dtype (``noise_from`` says which). Gradient references (:func:`gradient_references`) hold the
golden ``dq``, ``dk``, ``dv`` for a fixed output gradient (:func:`grad_output`) and the baseline's
noise over both placements and the flash form of the backward.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import attend, kernel_label
from flashprobe.fuzz.rule import GRADIENTS, GradientReference, References, noise, value_floor
from flashprobe.judge import fp8_realisations
from flashprobe.kernels import Kernel, default_scale, dtype_name, get_kernel, golden_attention, math_attention
from flashprobe.kernels.flash_form import flash_form_attention
from flashprobe.kernels.reference import reference_input_gradients

__all__ = ["grad_output", "gradient_references", "references"]


def _rounded_logits_baseline(inputs: CaseInputs, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``softmax(round_dtype(q·kᵀ·scale + mask)) · v`` ``(B, H, N_q, D_v)``, every step in the dtype,
    from the float64 ``logits`` and bool ``valid`` ``(B, H, N_q, N_k)``."""
    _, v = inputs.reference_kv()
    z = logits.to(inputs.dtype).masked_fill(~valid, float("-inf"))
    p = torch.softmax(z, dim=-1).masked_fill(~valid.any(-1, keepdim=True), 0.0)
    return p @ v


def _other_forms_max(
    kernel: Kernel, inputs: CaseInputs, k: torch.Tensor, v: torch.Tensor, golden: torch.Tensor
) -> tuple[float, float, float]:
    """``max|baseline − golden|``, the L2 error and the worst row, each the largest over the
    baseline's other forms (``(q√s)·(k√s)ᵀ``, an FP8 baseline's other realisations); a form that is
    non-finite or raises counts 0."""
    root = math.sqrt(default_scale(inputs.q.shape[-1], inputs.scale))
    forms = [(kernel, replace(inputs, q=inputs.q * root, scale=1.0), k * root)]
    forms += [(get_kernel(spec), inputs, k) for spec in fp8_realisations(kernel)]
    largest = (0.0, 0.0, 0.0)
    for form, posed, keys in forms:
        try:
            out = attend(form, posed, keys, v)
        except Exception:  # another form is only a second opinion on the noise
            continue
        err, l2, row, bad = noise(out.double(), golden)
        if not bad:
            largest = (max(largest[0], err), max(largest[1], l2), max(largest[2], row))
    return largest


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> float:
    """``max|x|`` over the valid positions (0 when there are none)."""
    return x.abs().masked_fill(~valid, 0.0).max().item() if valid.any() else 0.0


def _baseline_error(
    kernel: Kernel, inputs: CaseInputs, golden: torch.Tensor
) -> tuple[float, float, float, int, str, torch.Tensor | None]:
    """``(max|baseline − golden|, its L2 error, its worst row, its NaN/Inf count, the problem or "",
    the baseline's output as float64 or None when it raised)``."""
    k, v = inputs.reference_kv()
    try:
        base = attend(kernel, inputs, k, v).double()
    except Exception as err:  # the baseline cannot serve the case: fall back, and say so
        return math.inf, math.inf, math.inf, 0, f"raised {type(err).__name__}: {err}", None
    base_max, base_l2, base_row, base_bad = noise(base, golden)
    problem = f"is non-finite at {base_bad} positions" if base_bad else ""
    return base_max, base_l2, base_row, base_bad, problem, base


def grad_output(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """The fixed random output gradient of a case: standard normal ``shape`` ``(B, H, N_q, D_v)``
    (seed 0), in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _prescaled(kernel: Kernel, root: float):
    """``kernel`` with the scale applied to q and k (``√scale`` each): differentiable in q and k."""

    def call(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        return kernel(q * root, k * root, v, attn_mask=attn_mask, is_causal=is_causal, scale=1.0)

    return call


def gradient_references(
    inputs: CaseInputs,
    baseline: str | Kernel,
    grad_out: torch.Tensor,
    valid: torch.Tensor,
    *,
    bias: bool = False,
) -> tuple[dict[str, GradientReference], str]:
    """Golden ``dq``, ``dk``, ``dv`` and the baseline's gradient noise for ``grad_out``.

    Args:
        grad_out: ``(B, H, N_q, D_v)`` the output gradient, in the dtype.
        valid: ``(B, H, N_q, N_k)`` bool, where a query may attend to a key.
        bias: keep the plain baseline's gradients (``GradientReference.baseline``) where finite.

    Returns:
        ``dq``/``dk``/``dv`` → :class:`~flashprobe.fuzz.rule.GradientReference` (empty when the
        golden gradient is not finite), and a note saying why, or why the noise came from the
        golden's rounding.
    """
    mask = inputs.attn_mask
    call = {"attn_mask": mask, "is_causal": inputs.is_causal, "scale": inputs.scale}
    q, k, v = inputs.q.contiguous(), inputs.k.contiguous(), inputs.v.contiguous()
    gold_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    in64 = (t.double() for t in (q, k, v, grad_out))
    _, *golden = reference_input_gradients(
        math_attention, *in64, **{**call, "attn_mask": gold_mask}, dtype=torch.float64
    )
    if not all(torch.isfinite(g).all() for g in golden):
        why = "the golden gradient is not finite (logits beyond float64's exp range): gradients not checked"
        return {}, why
    kernel = get_kernel(baseline)
    root = math.sqrt(default_scale(q.shape[-1], inputs.scale))
    placements, plain = [], None
    for fn in (kernel, _prescaled(kernel, root), flash_form_attention):
        try:
            _, *grads = reference_input_gradients(fn, q, k, v, grad_out, **call, dtype=inputs.dtype)
        except Exception:  # a placement that cannot run gives no opinion on the noise
            continue
        placements.append([g.double() for g in grads])
        if fn is kernel:
            plain = placements[-1]
    eps = float(torch.finfo(inputs.dtype).eps)
    b, h, _, n_k = valid.shape
    h_kv = k.shape[1]
    unseen = ~valid.any(2).view(b, h_kv, h // h_kv, n_k).any(2)  # (B, H_kv, N_k): keys no query sees
    zero_rows = {"dq": ~valid.any(-1), "dk": unseen, "dv": unseen}
    refs, fallback = {}, []
    for i, name in enumerate(GRADIENTS):
        g = golden[i]
        finite = [p[i] for p in placements if bool(torch.isfinite(p[i]).all())]
        if not finite:  # what the dtype can represent of the golden gradient
            fallback.append(name)
            finite = [g.to(inputs.dtype).double()]
        noises = [noise(p, g) for p in finite]
        refs[name] = GradientReference(
            name=name,
            golden=g,
            noise_max=max(n[0] for n in noises),
            noise_l2=max(n[1] for n in noises),
            noise_row=max(n[2] for n in noises),
            floor=eps * (g.abs().max().item() if g.numel() else 0.0),
            eps=eps,
            zero_rows=zero_rows[name],
            baseline=plain[i] if bias and plain is not None and bool(plain[i].isfinite().all()) else None,
        )
    note = (
        f"the baseline's {', '.join(fallback)} is non-finite in {dtype_name(inputs.dtype)}: its noise is the "
        "golden gradient's rounding to the dtype"
        if fallback
        else ""
    )
    return refs, note


def references(
    inputs: CaseInputs, baseline: str | Kernel = "math", *, backward: bool = False, bias: bool = False
) -> References:
    """Golden, baseline error and noise floor for one case (see the module docstring).

    Args:
        backward: also the gradient references for :func:`grad_output`.
        bias: keep the baseline's output and gradients for the signed bias.

    Returns:
        The :class:`~flashprobe.fuzz.rule.References`; ``skip`` is set when the valid logits do not
        fit the dtype.

    Raises:
        ValueError: the golden is not finite (a broken case generator).
    """
    k, v = inputs.reference_kv()
    q64, k64, v64 = inputs.q.double(), k.double(), v.double()
    mask = inputs.attn_mask
    golden = golden_attention(q64, k64, v64, attn_mask=mask, is_causal=inputs.is_causal, scale=inputs.scale)
    if not torch.isfinite(golden).all():
        raise ValueError("the golden output is not finite: the case generator is broken")
    valid = inputs.valid_keys()
    raw = q64 @ k64.transpose(-2, -1)  # (B, H, N_q, N_k)
    logits = raw * default_scale(q64.shape[-1], inputs.scale)
    if mask is not None and mask.is_floating_point():
        logits = logits + torch.where(valid, mask.double(), 0.0)
    common = {
        "golden": golden,
        "floor": value_floor(v64, inputs.dtype),
        "fully_masked": ~valid.any(-1),
        "eps": float(torch.finfo(inputs.dtype).eps),
        "dtype": inputs.dtype,
        "logit_max": (largest := _masked_max(logits, valid)),
    }
    fmax, name = float(torch.finfo(inputs.dtype).max), dtype_name(inputs.dtype)
    if largest > fmax:
        common["skip"] = f"valid logits up to {largest:.3g} exceed the {name} range (max {fmax:.6g})"
        return References(
            baseline_golden_max_abs=None, baseline_nonfinite=0, noise_max=0.0, noise_from="", **common
        )
    if backward:
        grad_out = grad_output(golden.shape, inputs.dtype, golden.device)
        grads, grad_note = gradient_references(inputs, baseline, grad_out, valid, bias=bias)
        common.update(grad_out=grad_out if grads else None, gradients=grads, grad_note=grad_note)
    kernel = get_kernel(baseline)
    base_max, base_l2, base_row, base_bad, problem, base = _baseline_error(kernel, inputs, golden)
    if not problem:
        pre_max, pre_l2, pre_row = _other_forms_max(kernel, inputs, k, v, golden)
        return References(
            baseline_golden_max_abs=base_max,
            baseline_nonfinite=0,
            noise_max=max(base_max, pre_max),
            noise_l2=max(base_l2, pre_l2),
            noise_row=max(base_row, pre_row),
            noise_from="baseline",
            baseline_out=base if bias else None,
            **common,
        )
    raw_max = _masked_max(raw, valid)
    why = f"q·kᵀ (max {raw_max:.3g}) overflows {name} before the scale is applied; " if raw_max > fmax else ""
    fallback = _rounded_logits_baseline(inputs, logits, valid).double()
    fb_max, fb_l2, fb_row, fb_bad = noise(fallback, golden)
    return References(
        baseline_golden_max_abs=None,
        baseline_nonfinite=base_bad,
        noise_max=fb_max,
        noise_l2=fb_l2,
        noise_row=fb_row,
        noise_from="rounded-logits baseline",
        note=f"baseline {kernel_label(baseline)} at {name} {problem} ({why}noise floor taken from the "
        f"baseline on {name}-rounded logits)",
        skip=f"not representable in {name}: even the baseline on rounded logits is non-finite"
        if fb_bad
        else "",
        **common,
    )
