"""What a kernel's output is judged against: the golden, the baseline's noise and the floor.

With ``golden`` computed in float64 from the *cast* inputs and ``baseline`` the ``math`` kernel at
the same dtype (``--baseline``), the baseline's error is the larger of its two standard scale
placements, ``(q·kᵀ)·s`` and ``(q√s)·(k√s)ᵀ`` (torch SDPA's math backend), which round
differently. When the baseline itself is non-finite where the golden is finite (``q·kᵀ``
overflows fp16 before the scale, ...), it cannot provide a noise floor; the baseline is then
recomputed from the logits rounded to the dtype (``softmax(round(q·kᵀ·scale)) · v``, every step in
the dtype): what the dtype can represent. A kernel is judged against that, and its row reports
both (``baseline_golden_max_abs`` is null, ``noise_from`` says which baseline set the floor).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import attend, kernel_label
from flashprobe.fuzz.rule import References, finite_max_abs, value_floor
from flashprobe.kernels import Kernel, default_scale, dtype_name, get_kernel, golden_attention

__all__ = ["references"]


def _rounded_logits_baseline(inputs: CaseInputs, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``softmax(round_dtype(q·kᵀ·scale + mask)) · v`` with softmax and ``p·v`` in the dtype.

    Args:
        inputs: the case.
        logits: ``(B, H, N_q, N_k)`` float64 scaled logits (mask added).
        valid: ``(B, H, N_q, N_k)`` bool.

    Returns:
        ``(B, H, N_q, D_v)`` in the dtype.
    """
    _, v = inputs.reference_kv()
    z = logits.to(inputs.dtype).masked_fill(~valid, float("-inf"))
    p = torch.softmax(z, dim=-1).masked_fill(~valid.any(-1, keepdim=True), 0.0)
    return p @ v


def _prescaled_baseline_max(
    kernel: Kernel, inputs: CaseInputs, k: torch.Tensor, v: torch.Tensor, golden: torch.Tensor
) -> float:
    """``max|baseline − golden|`` with the scale's other standard placement: ``(q√s)·(k√s)ᵀ``.

    Where the scale is applied is an implementation detail of plain attention (torch SDPA's math
    backend scales q and k by √scale); both placements round differently, so both belong to the
    noise floor. Returns 0 when this placement is non-finite or raises (the plain one decides).
    """
    root = math.sqrt(default_scale(inputs.q.shape[-1], inputs.scale))
    try:
        out = attend(kernel, replace(inputs, q=inputs.q * root, scale=1.0), k * root, v)
    except Exception:  # this placement is only a second opinion on the noise
        return 0.0
    err, bad = finite_max_abs(out.double(), golden)
    return 0.0 if bad else err


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> float:
    """``max|x|`` over the valid positions (0 when there are none)."""
    return x.abs().masked_fill(~valid, 0.0).max().item() if valid.any() else 0.0


def _baseline_error(kernel: Kernel, inputs: CaseInputs, golden: torch.Tensor) -> tuple[float, int, str]:
    """``(max|baseline − golden|, its NaN/Inf count, the problem in words or "")``."""
    k, v = inputs.reference_kv()
    try:
        base = attend(kernel, inputs, k, v).double()
    except Exception as err:  # the baseline cannot serve the case: fall back, and say so
        return math.inf, 0, f"raised {type(err).__name__}: {err}"
    base_max, base_bad = finite_max_abs(base, golden)
    return base_max, base_bad, (f"is non-finite at {base_bad} positions" if base_bad else "")


def references(inputs: CaseInputs, baseline: str | Kernel = "math") -> References:
    """Golden, baseline error and noise floor for one case (see the module docstring).

    Args:
        inputs: the case in the dtype under test; GQA inputs are expanded for golden and baseline.
        baseline: spec of the same-dtype baseline kernel.

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
    common = {"golden": golden, "floor": value_floor(v64, inputs.dtype), "fully_masked": ~valid.any(-1)}
    fmax, name = float(torch.finfo(inputs.dtype).max), dtype_name(inputs.dtype)
    if (largest := _masked_max(logits, valid)) > fmax:
        skip = f"valid logits up to {largest:.3g} exceed the {name} range (max {fmax:.6g})"
        refs = References(
            baseline_golden_max_abs=None, baseline_nonfinite=0, noise_max=0.0, noise_from="", **common
        )
        return replace(refs, skip=skip)
    kernel = get_kernel(baseline)
    base_max, base_bad, problem = _baseline_error(kernel, inputs, golden)
    if not problem:
        noise = max(base_max, _prescaled_baseline_max(kernel, inputs, k, v, golden))
        return References(
            baseline_golden_max_abs=base_max,
            baseline_nonfinite=0,
            noise_max=noise,
            noise_from="baseline",
            **common,
        )
    raw_max = _masked_max(raw, valid)
    why = f"q·kᵀ (max {raw_max:.3g}) overflows {name} before the scale is applied; " if raw_max > fmax else ""
    fb_max, fb_bad = finite_max_abs(_rounded_logits_baseline(inputs, logits, valid).double(), golden)
    return References(
        baseline_golden_max_abs=None,
        baseline_nonfinite=base_bad,
        noise_max=fb_max,
        noise_from="rounded-logits baseline",
        note=f"baseline {kernel_label(baseline)} at {name} {problem} ({why}noise floor taken from the "
        f"baseline on {name}-rounded logits)",
        skip=f"not representable in {name}: even the baseline on rounded logits is non-finite"
        if fb_bad
        else "",
        **common,
    )
