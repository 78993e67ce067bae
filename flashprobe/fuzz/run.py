"""Running kernels on cases: one :class:`FuzzResult` per (kernel, case, dtype).

Verdicts (:data:`~flashprobe.fuzz.rule.VERDICTS`): ``pass``; ``fail`` with the reason (the kernel
raised, NaN/Inf, rows of zeros, non-zero fully masked rows, wrong values, ``biased``); ``skip`` (the
case cannot be posed in this dtype); ``unsupported`` (the kernel raised
:class:`~flashprobe.KernelUnavailableError` or :class:`~flashprobe.KernelInputError`); ``no_backward``
(the output passes but has no autograd graph). With ``backward`` each case also judges ``dq``, ``dk``,
``dv`` (:func:`~flashprobe.fuzz.rule.judge_gradients`), failure kinds such as ``dq:values``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from flashprobe.fuzz.cases import FuzzCase, case_generator, select_cases
from flashprobe.fuzz.fit import FittedInputs, NotApplicableError, fit_inputs
from flashprobe.fuzz.inputs import CaseInputs, UnrepresentableCaseError
from flashprobe.fuzz.kernel_call import REFUSALS, KernelCall, call_kernel, kernel_label
from flashprobe.fuzz.references import grad_output, gradient_references, references
from flashprobe.fuzz.rule import References, Verdict, judge, judge_gradients
from flashprobe.judge import fp8_baseline
from flashprobe.kernels import (
    Kernel,
    dtype_name,
    get_kernel,
    to_dtype,
)

if TYPE_CHECKING:
    from flashprobe.fuzz.ledger import Ledger
    from flashprobe.fuzz.reproducer import ReproducerStore

__all__ = ["FuzzResult", "case_references", "check_case", "kernel_availability", "run_catalogue"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FuzzResult:
    """The verdict for one (kernel, case, dtype); a row of ``fuzz.json``.

    Attributes:
        kernel: the kernel's spec string.
        case: catalogue name or ``random_<i>``.
        dtype: ``bf16``/``fp16``/``fp32``/``fp64``.
        verdict, reason, failure, primary_golden_max_abs, primary_nonfinite: as
            :class:`~flashprobe.fuzz.rule.Verdict` (``failure`` the output's first failed check or,
            when it passed, the gradients').
        baseline_golden_max_abs: ``max|baseline − golden|``; None when the baseline is non-finite.
        tolerance: ``2 · noise + floor`` the error was held to.
        noise_from: which baseline set the noise floor.
        baseline_nonfinite: NaN/Inf count of the same-dtype baseline.
        shape: the inputs, e.g. ``B=2 H=2 Nq=16 Nk=203 D=64 mask=bool(2,1,1,203) scale=1``.
        params: the random sample's parameters (random cases only).
        repro: path of the saved reproducer.
        backward: the gradients' verdict; None when not checked.
        gradients: per gradient (``dq``, ``dk``, ``dv``) its statistics; empty when not checked.
        layout: the inputs' memory layout (:data:`~flashprobe.fuzz.layouts.LAYOUTS`).
        axes: where the inputs lie on each covered axis (:meth:`CaseInputs.axes`).
        seed: the seed of a catalogue case's inputs (None for random samples and custom cases).
        property: the property the case tests (``""`` for random samples and custom cases).
        fitted: how the call was moved inside the kernel's limits (``""``: posed as built).
        seconds: wall time of the call, its judgement and the references it computed.
        backward_failure: kind of the first failed gradient check, also when the output failed.
        lost: the case's other properties its fitted call no longer exhibits, each with why.
        known: the ledger entry that accepts this failure or quarantines the call
            (``"<file>:<line>: <reason> (<link>)"``).
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
    property: str = ""
    fitted: str = ""
    seconds: float = 0.0
    backward_failure: str | None = None
    lost: dict[str, str] = field(default_factory=dict)
    known: str = ""

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
    bias: bool = False,
) -> FuzzResult:
    """Run one kernel on one case and judge its output and (``backward``) its gradients.

    The gradients are judged whenever the kernel gave an output, also when the output fails
    (``backward_failure``). Rows that depend on a NaN input must be NaN (``nan_hidden`` otherwise).

    Args:
        kernel: spec or :class:`~flashprobe.Kernel`.
        inputs: the case in the dtype under test: q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_k, ·)``.
        baseline, backward, bias: used when ``refs`` is not given (:func:`case_references`).
        refs: precomputed references, reused across kernels.
    """
    label = kernel_label(kernel)
    refs = case_references(inputs, baseline, backward=backward, bias=bias) if refs is None else refs
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
    verdict = call.problem if call.output is None else _judge_output(call.output, refs, inputs.nan_rows())
    grads, stats, grad_reason = (
        _backward_verdict(call, refs, verdict.reason) if call.output is not None else (None, {}, "")
    )
    judged = {"tolerance": refs.tolerance, "noise_from": refs.noise_from, "gradients": stats}
    result = FuzzResult(**asdict(verdict), **judged, **common)  # the Verdict's fields, a row's too
    if grads is None:
        return result
    kind = grads.failure if grads.verdict == "fail" else None
    if not verdict.passed:  # the output failed: the gradients are reported beside it
        both = f"{verdict.reason}; {grads.reason}" if grads.verdict != "no_backward" else result.reason
        return replace(result, reason=both, backward=grads.verdict, backward_failure=kind)
    row = grads.verdict  # the output passed: the gradients' verdict (pass, fail or no_backward) is the row's
    return replace(result, verdict=row, failure=kind, reason=grad_reason, backward=row, backward_failure=kind)


def _judge_output(out: torch.Tensor, refs: References, nan_rows: torch.Tensor | None) -> Verdict:
    """:func:`~flashprobe.fuzz.rule.judge`; with NaN inputs, the rows in ``nan_rows`` ``(B, H, N_q)``
    must hold a NaN and the others are judged against the golden of the call without NaN."""
    if nan_rows is None or tuple(out.shape) != tuple(refs.golden.shape):
        return judge(out, refs)
    o = out.detach().double()
    hidden = nan_rows & ~torch.isnan(o).any(-1)
    if hidden.any():
        return Verdict(
            verdict="fail",
            failure="nan_hidden",
            reason=f"{int(hidden.sum())} of the {int(nan_rows.sum())} rows that depend on a NaN input came "
            "out without NaN: the kernel turned a NaN into a number",
        )
    verdict = judge(torch.where(nan_rows.unsqueeze(-1), refs.golden, o), refs)
    return replace(
        verdict,
        reason=f"{verdict.reason}; NaN in exactly the {int(nan_rows.sum())} rows that depend on a NaN input",
    )


def case_references(
    inputs: CaseInputs,
    baseline: str | Kernel = "math",
    *,
    backward: bool = True,
    grad: str = "",
    bias: bool = False,
) -> References:
    """:func:`~flashprobe.fuzz.references.references` of one call (without its NaN inputs; no
    gradients then) for the output gradient form ``grad`` (:data:`~flashprobe.fuzz.cases.GRAD_FORMS`);
    ``bias`` keeps the baseline's output and gradients for the signed bias."""
    nan_rows = inputs.nan_rows()
    clean = inputs if nan_rows is None else inputs.without_nan()
    backward = backward and nan_rows is None
    # other values of dO than the standard one: their gradient references only (computed below)
    refs = references(clean, baseline, backward=backward and grad in ("", "transposed"), bias=bias)
    if not grad or not backward or refs.skip:
        return refs
    if grad == "transposed":  # the same values, laid out as (B, N_q, H, D_v)
        standard = refs.grad_out
        if standard is None:
            return refs
        return replace(refs, grad_out=standard.transpose(1, 2).contiguous().transpose(1, 2))
    standard = grad_output(refs.golden.shape, clean.dtype, refs.golden.device)  # (B, H, N_q, D_v)
    factor = {"tiny": 2.0**-20, "huge": 2.0**12}.get(grad)
    given = (
        standard[:, :1].expand_as(standard)
        if grad == "expanded"
        else (standard.double() * factor).to(standard.dtype)
    )
    grads, note = gradient_references(clean, baseline, given.contiguous(), clean.valid_keys())
    return replace(refs, grad_out=given if grads else None, gradients=grads, grad_note=note)


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
            except REFUSALS as err:
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
    reproducers: ReproducerStore | None = None,
    ledger: Ledger | None = None,
) -> list[FuzzResult]:
    """Every kernel on one case at one dtype (in each of ``layouts``), each at the call fitted to
    its limits; kernels given the same call share its references. A ``layout_*`` case runs in its
    own layout only."""
    common = {"case": case.name, "dtype": dtype_name(dtype), "seed": seed, "property": case.property}
    start = time.perf_counter()
    try:
        base = case.make(dtype, case_generator(seed, case.name)).to(device)
    except UnrepresentableCaseError as err:
        seconds = round(time.perf_counter() - start, 3)
        return [
            FuzzResult(kernel=k, verdict="skip", reason=str(err), seconds=seconds, **common) for k in labels
        ]
    results = []
    refs: dict[tuple[str, str], References | None] = {}
    for layout in layouts if base.layout == "contiguous" else (base.layout,):
        inputs = base if layout == base.layout else base.with_layout(layout)
        for kernel in labels:
            t0 = time.perf_counter()
            held = ledger and ledger.quarantined(kernel, case.name, dtype_name(dtype), device.type)
            if held:  # it raises or crashes there: not called
                why, label = f"quarantined by the ledger: {held.label}", held.label
                results.append(FuzzResult(kernel=kernel, verdict="skip", reason=why, known=label, **common))
                continue
            result = _run_kernel(case, inputs, kernel, unavailable[kernel, dtype], refs, baseline, backward)
            if result is None:  # a golden the expanded values do not allow: this layout is not posable
                continue
            result = replace(result, seconds=round(time.perf_counter() - t0, 3), **common)
            if reproducers is not None:
                build = lambda r=result, x=inputs: _fitted(case, x, r.kernel).inputs  # noqa: E731
                result = reproducers.offer(result, build)
            log.debug("%s %s %s: %s", kernel, case.name, common["dtype"], result.verdict)
            results.append(result)
    return results


def _fitted(case: FuzzCase, inputs: CaseInputs, kernel: str) -> FittedInputs:
    """The case's call as posed to ``kernel`` (:func:`~flashprobe.fuzz.fit.fit_inputs`)."""
    return fit_inputs(inputs, get_kernel(kernel).capabilities, fixed=case.fixed, properties=case.properties)


def _run_kernel(
    case: FuzzCase,
    inputs: CaseInputs,
    kernel: str,
    why: str | None,
    refs: dict[tuple[str, str], References | None],
    baseline: str | Kernel,
    backward: bool,
) -> FuzzResult | None:
    """One kernel on one case's call fitted to its limits, judged against the references cached in
    ``refs``; None when ``expanded_kv`` values allow no golden."""
    unsupported = {"verdict": "unsupported", "shape": inputs.describe(), "layout": inputs.layout}
    if why is not None:
        return FuzzResult(
            kernel=kernel, reason=why, axes=inputs.axes(), case=case.name, dtype="", **unsupported
        )
    try:
        fitted = _fitted(case, inputs, kernel)
    except NotApplicableError as err:
        reason = f"not applicable to this kernel: {err}"
        return FuzzResult(kernel=kernel, reason=reason, case=case.name, dtype="", **unsupported)
    baseline, precision = fp8_baseline(kernel, baseline)
    key = (inputs.layout, fitted.changes, kernel_label(baseline))
    if key not in refs:
        try:
            refs[key] = case_references(
                fitted.inputs, baseline, backward=backward and case.backward, grad=case.grad, bias=case.bias
            )
        except ValueError:
            if inputs.layout != "expanded_kv":
                raise
            refs[key] = None
    if refs[key] is None:
        return None
    result = check_case(kernel, fitted.inputs, case=case.name, refs=replace(refs[key], precision=precision))
    return replace(result, fitted=fitted.changes, lost=fitted.lost)


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
    progress: Callable[[str], None] | None = None,
    reproducers: ReproducerStore | None = None,
    ledger: Ledger | None = None,
) -> list[FuzzResult]:
    """Run every case against every kernel at every dtype, in every layout of ``layouts``.

    Each case is posed to each kernel at the nearest call its limits accept that still tests its
    property (:func:`~flashprobe.fuzz.fit.fit_inputs`), or reported ``unsupported`` ("not
    applicable to this kernel: <why>"). A case's inputs depend only on ``seed`` and its name.

    Args:
        progress: called with one line per (case, dtype) as it finishes.
        reproducers: where failures are saved.
        ledger: its quarantined (kernel, case, dtype) are reported ``skip`` without a call; the
            caller applies its other entries (:meth:`Ledger.apply`).

    Returns:
        One :class:`FuzzResult` per (case, dtype, kernel), in that order.
    """
    labels = [kernel_label(k) for k in kernels]
    device = torch.device(device)
    resolved = [to_dtype(d) for d in dtypes]
    unavailable = kernel_availability(labels, device, resolved)
    todo = [(case, dtype) for case in (cases if cases is not None else select_cases()) for dtype in resolved]
    settings = {
        "seed": seed,
        "device": device,
        "baseline": baseline,
        "backward": backward,
        "layouts": layouts,
        "ledger": ledger,
    }
    results: list[FuzzResult] = []
    for i, (case, dtype) in enumerate(todo, 1):
        rows = _run_case(case, dtype, labels, unavailable, reproducers=reproducers, **settings)
        if progress is not None:
            verdicts = ", ".join(f"{r.kernel} {r.verdict}" for r in rows)
            seconds = sum(r.seconds for r in rows)
            progress(
                f"[{i}/{len(todo)}] {case.name} {dtype_name(dtype)} seed {seed}: {verdicts} ({seconds:.1f} s)"
            )
        results += rows
    return results
