"""Running kernels on cases: one :class:`FuzzResult` per (kernel, case, dtype).

Every (kernel, case, dtype) gets a verdict:

``pass``
    the output matches the FP64 golden within the noise floor (:mod:`flashprobe.fuzz.rule`);
``fail``
    with the reason: the kernel raised; NaN/Inf where the golden is finite; a row of zeros where
    the golden is clearly non-zero (the sentinel/underflow signature of FlashInfer PR 4401);
    non-zero output for a fully masked row (expected 0, torch SDPA's convention); or wrong values
    beyond the rule;
``skip``
    the case cannot be posed in this dtype (its logits do not fit the dtype's range);
``unsupported``
    the kernel raised :class:`~flashprobe.KernelUnavailableError` or
    :class:`~flashprobe.KernelInputError` (wrong device, mask kind or GQA not supported): not a
    failure, reported with the kernel's message;
``no_backward``
    the output passes, but the kernel has no backward (its output has no autograd graph), so its
    gradients could not be checked: not a pass, not a failure.

With ``backward=True`` (the default of ``flashprobe fuzz``; ``--no-backward`` turns it off) each
case also checks ``dq``, ``dk``, ``dv`` for a fixed random output gradient against the FP64 golden
gradients (:func:`~flashprobe.fuzz.rule.judge_gradients`); a failed gradient check fails the case
with a ``failure`` kind such as ``dq:nonfinite``, ``dk:zeros``, ``dv:masked`` or ``dq:values``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from flashprobe.fuzz.cases import FuzzCase, case_generator, select_cases
from flashprobe.fuzz.inputs import CaseInputs, UnrepresentableCaseError
from flashprobe.fuzz.kernel_call import KernelCall, call_kernel, kernel_label
from flashprobe.fuzz.references import references
from flashprobe.fuzz.rule import References, Verdict, judge, judge_gradients
from flashprobe.kernels import (
    Kernel,
    KernelInputError,
    KernelUnavailableError,
    dtype_name,
    get_kernel,
    to_dtype,
)

__all__ = ["FuzzResult", "check_case", "kernel_availability", "run_catalogue"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FuzzResult:
    """The verdict for one (kernel, case, dtype); a row of ``fuzz.json``.

    Attributes:
        kernel: the kernel's spec string.
        case: catalogue name or ``random_<i>``.
        dtype: ``bf16``/``fp16``/``fp32``/``fp64``.
        verdict: one of :data:`~flashprobe.fuzz.rule.VERDICTS`.
        reason: why, in words (also on pass: the error and the tolerance).
        failure: kind of the first failed check: ``raised``, ``inplace``, ``shape``, ``nonfinite``,
            ``zeros``, ``masked_nonzero`` or ``values``; ``None`` unless the verdict is ``fail``.
        primary_golden_max_abs: ``max|primary − golden|``; ``None`` when the primary has NaN/Inf
            where the golden is finite, or produced no output.
        baseline_golden_max_abs: ``max|baseline − golden|``; ``None`` when the baseline is
            non-finite.
        tolerance: ``2 · noise + floor`` the error was held to.
        noise_from: which baseline set the noise floor.
        primary_nonfinite: NaN/Inf count of the output where the golden is finite.
        baseline_nonfinite: NaN/Inf count of the same-dtype baseline.
        shape: the inputs, e.g. ``B=2 H=2 Nq=16 Nk=203 D=64 mask=bool(2,1,1,203) scale=1``.
        params: the random sample's parameters (random cases only).
        repro: path of the saved reproducer (shrunk random failures only).
        backward: the gradients' verdict: ``pass``, ``fail``, ``no_backward``, or ``None`` when
            they were not checked (``--no-backward``, the forward failed, a skip).
        gradients: per gradient (``dq``, ``dk``, ``dv``) its ``max_abs``, ``tolerance``,
            ``l2`` and ``l2_tolerance``; empty when not checked.
        layout: the inputs' memory layout (:data:`~flashprobe.fuzz.layouts.LAYOUTS`).
        axes: where the inputs lie on each covered axis (:meth:`CaseInputs.axes`).
        seed: the seed of a catalogue case's inputs (``None`` for random samples and custom cases).
    """

    kernel: str
    case: str
    dtype: str
    verdict: str
    reason: str
    failure: str | None = None
    primary_golden_max_abs: float | None = None
    baseline_golden_max_abs: float | None = None
    tolerance: float | None = None
    noise_from: str | None = None
    primary_nonfinite: int = 0
    baseline_nonfinite: int = 0
    shape: str = ""
    params: dict[str, Any] | None = None
    repro: str | None = None
    backward: str | None = None
    gradients: dict[str, dict[str, float | None]] = field(default_factory=dict)
    layout: str = "contiguous"
    axes: dict[str, int | str] = field(default_factory=dict)
    seed: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The row as a dict (written with :func:`flashprobe.formats.write_json`)."""
        return asdict(self)


def check_case(
    kernel: str | Kernel,
    inputs: CaseInputs,
    *,
    case: str = "custom",
    baseline: str | Kernel = "math",
    refs: References | None = None,
    backward: bool = True,
) -> FuzzResult:
    """Run one kernel on one case and judge its output and (``backward``) its gradients.

    Args:
        kernel: spec or :class:`~flashprobe.Kernel`.
        inputs: the case in the dtype under test: q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_k, ·)``.
        case: the case's name, for the result.
        baseline: same-dtype baseline spec (ignored when ``refs`` is given).
        refs: precomputed :func:`~flashprobe.fuzz.references.references` (reused across kernels);
            gradients are checked only when they hold gradient references.
        backward: check ``dq``, ``dk``, ``dv`` too (when ``refs`` is not given).

    Returns:
        The :class:`FuzzResult`.
    """
    label = kernel_label(kernel)
    refs = references(inputs, baseline, backward=backward) if refs is None else refs
    common = {
        "kernel": label,
        "case": case,
        "dtype": dtype_name(inputs.dtype),
        "shape": inputs.describe(),
        "baseline_golden_max_abs": refs.baseline_golden_max_abs,
        "baseline_nonfinite": refs.baseline_nonfinite,
        "layout": inputs.layout,
        "axes": inputs.axes(),
    }
    if refs.skip:
        return FuzzResult(verdict="skip", reason=refs.skip, **common)
    call = call_kernel(get_kernel(kernel), inputs, refs.grad_out)
    verdict = call.problem if call.output is None else judge(call.output, refs)
    backward, stats, reason = (
        _backward_verdict(call, refs, verdict.reason) if verdict.passed else (None, {}, "")
    )
    result = FuzzResult(
        verdict=verdict.verdict,
        reason=verdict.reason,
        failure=verdict.failure,
        primary_golden_max_abs=verdict.primary_golden_max_abs,
        primary_nonfinite=verdict.primary_nonfinite,
        tolerance=refs.tolerance,
        noise_from=refs.noise_from,
        gradients=stats,
        **common,
    )
    if backward is None:
        return result
    if backward.verdict == "fail":
        return replace(result, verdict="fail", failure=backward.failure, reason=reason, backward="fail")
    if backward.verdict == "no_backward":
        return replace(result, verdict="no_backward", reason=reason, backward="no_backward")
    return replace(result, reason=reason, backward="pass")


def _backward_verdict(
    call: KernelCall, refs: References, forward: str
) -> tuple[Verdict | None, dict[str, Any], str]:
    """The gradients' verdict (None: not checked), their statistics and the combined reason."""
    if refs.grad_out is None:
        return None, {}, ""
    if call.no_backward:
        why = "no backward: " + (
            call.no_backward_reason
            or "the kernel's output has no autograd graph, its gradients are not checked"
        )
        return Verdict(verdict="no_backward", reason=why), {}, why
    if call.backward_problem is not None:
        return call.backward_problem, {}, call.backward_problem.reason
    grads, stats = judge_gradients(call.grads, refs)
    note = f" [{refs.grad_note}]" if refs.grad_note else ""
    if grads.passed:
        return grads, stats, f"{forward}; {grads.reason}{note}"
    return grads, stats, grads.reason + note


def kernel_availability(
    kernels: Sequence[str], device: torch.device, dtypes: Sequence[torch.dtype]
) -> dict[tuple[str, torch.dtype], str | None]:
    """Why each (kernel spec, dtype) cannot run on ``device`` (``None`` when it can)."""
    why: dict[tuple[str, torch.dtype], str | None] = {}
    for label in kernels:
        for dtype in dtypes:
            try:
                get_kernel(label).check(device, dtype)
                why[label, dtype] = None
            except (KernelUnavailableError, KernelInputError) as err:
                why[label, dtype] = f"{type(err).__name__}: {err}"
    return why


def _run_case(
    case: FuzzCase,
    dtype: torch.dtype,
    labels: Sequence[str],
    unavailable: dict[tuple[str, torch.dtype], str | None],
    *,
    seed: int,
    device: torch.device,
    baseline: str | Kernel,
    backward: bool,
    layouts: Sequence[str] = ("contiguous",),
) -> list[FuzzResult]:
    """Every kernel on one case at one dtype (in each of ``layouts``), sharing golden and baseline.

    A case built in its own layout (``layout_*``) runs in that one only; ``expanded_kv`` changes
    the values (every k/v head is the first), so it gets references of its own.
    """
    common = {"case": case.name, "dtype": dtype_name(dtype)}
    try:
        base = case.make(dtype, case_generator(seed, case.name)).to(device)
        refs = references(base, baseline, backward=backward and case.backward)
    except UnrepresentableCaseError as err:
        return [FuzzResult(kernel=k, verdict="skip", reason=str(err), seed=seed, **common) for k in labels]
    results = []
    for layout in layouts if base.layout == "contiguous" else (base.layout,):
        inputs = base if layout == base.layout else base.with_layout(layout)
        layout_refs = refs
        if layout == "expanded_kv" and inputs is not base:
            try:
                layout_refs = references(inputs, baseline, backward=backward and case.backward)
            except ValueError:  # a golden the expanded values do not allow: this layout is not posable
                continue
        results += _run_kernels(case, inputs, layout_refs, labels, unavailable, dtype, seed)
    return results


def _run_kernels(
    case: FuzzCase,
    inputs: CaseInputs,
    refs: References,
    labels: Sequence[str],
    unavailable: dict[tuple[str, torch.dtype], str | None],
    dtype: torch.dtype,
    seed: int,
) -> list[FuzzResult]:
    """Every kernel on one case's inputs."""
    common = {"case": case.name, "dtype": dtype_name(dtype)}
    results = []
    for kernel in labels:
        if (why := unavailable[kernel, dtype]) is not None:
            result = FuzzResult(
                kernel=kernel,
                verdict="unsupported",
                reason=why,
                shape=inputs.describe(),
                layout=inputs.layout,
                axes=inputs.axes(),
                **common,
            )
        else:
            result = check_case(kernel, inputs, case=case.name, refs=refs)
        log.debug("%s %s %s: %s", kernel, case.name, common["dtype"], result.verdict)
        results.append(replace(result, seed=seed))
    return results


def run_catalogue(
    kernels: Sequence[str | Kernel],
    dtypes: Sequence[str | torch.dtype],
    *,
    cases: Iterable[FuzzCase] | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    baseline: str | Kernel = "math",
    backward: bool = True,
    layouts: Sequence[str] = ("contiguous",),
) -> list[FuzzResult]:
    """Run every case against every kernel at every dtype, in every layout of ``layouts``.

    Golden and baseline are computed once per (case, dtype) and shared by the kernels. The inputs
    of a case depend only on ``seed`` and the case's name. ``backward`` checks the gradients too;
    ``layouts`` (:data:`~flashprobe.fuzz.layouts.LAYOUTS`) lays each case's inputs out so.

    Returns:
        One :class:`FuzzResult` per (case, dtype, kernel), in that order.
    """
    labels = [kernel_label(k) for k in kernels]
    device = torch.device(device)
    resolved = [to_dtype(d) for d in dtypes]
    unavailable = kernel_availability(labels, device, resolved)
    return [
        result
        for case in (cases if cases is not None else select_cases())
        for dtype in resolved
        for result in _run_case(
            case,
            dtype,
            labels,
            unavailable,
            seed=seed,
            device=device,
            baseline=baseline,
            backward=backward,
            layouts=layouts,
        )
    ]
