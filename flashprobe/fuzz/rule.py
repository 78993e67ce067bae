"""The fuzzer's verdict on one kernel output: the rule of :mod:`flashprobe.judge` plus the checks
only a case can make.

``golden`` is float64 from the *cast* inputs; ``baseline`` is plain attention at the same dtype, its
error the larger over the scale placements ``(q kᵀ) s`` and ``(q √s)(k √s)ᵀ`` (see :data:`RULE`).
Values are judged by :func:`flashprobe.judge.judge_errors` with the case's largest valid logit as
``logit_max``; around it, NaN/Inf where the golden is finite, rows of zeros where it is not, and
non-zero output or gradient in fully masked positions fail. An undetermined output is a ``skip``.
``signed bias`` cases at :data:`BIAS_DTYPES` also judge the sign of the errors (failure ``biased``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashprobe.bias import BiasStats
from flashprobe.deviation import GRADIENTS, PAIR, error_ratio
from flashprobe.judge import (
    ABSOLUTE_RATIO,
    CONDITIONING_LIMIT,
    FP8_DRAWS,
    RELATIVE_LIMITS,
    ROW_RATIO,
    Judgement,
    call_statistics,
    judge_bias,
    judge_errors,
)

__all__ = [
    "BIAS_DTYPES",
    "GRADIENTS",
    "RULE",
    "VERDICTS",
    "ZEROS_REASON",
    "GradientReference",
    "References",
    "Verdict",
    "check_output",
    "judge",
    "judge_gradients",
    "noise",
    "output_errors",
    "rounding_floor",
    "signed_bias",
    "value_floor",
]

#: The verdicts a (kernel, case, dtype) can get; ``no_backward``: the forward passes but the output
#: has no autograd graph; ``not_declared``: more accurate than its declared precision can be
#: (:mod:`flashprobe.fuzz.invariants`), which fails a gate as ``fail`` does.
VERDICTS = ("pass", "fail", "skip", "unsupported", "no_backward", "not_declared")
#: The dtypes at which a ``signed bias`` case judges the sign of the error; in float32 a kernel's
#: deterministic last-bit differences from the baseline keep one sign at a harmless size.
BIAS_DTYPES = (torch.bfloat16, torch.float16)
ZEROS_REASON = "row returned zeros where golden is non-zero: sentinel/underflow bug"
#: The rule in words, as recorded in ``fuzz.json``.
RULE = (
    "flashprobe.judge (the probe's rule): fail on NaN/Inf where the golden is finite, or when the "
    f"relative L2 error against the golden exceeds the dtype's absolute limit and {ABSOLUTE_RATIO:g}x the "
    f"baseline's (absolute), the worst row exceeds its limit and {ROW_RATIO:g}x the baseline's (row), or the "
    f"L2 error exceeds {RELATIVE_LIMITS['out']:g}x (out) / {RELATIVE_LIMITS['dq']:g}x (gradients) the "
    "baseline's (relative), floors widened by eps * max|logit|; undetermined when the golden is beyond "
    f"the dtype's range or the baseline is over {CONDITIONING_LIMIT:.0%} off; golden "
    "= fp64 from the cast inputs; baseline error = max over scale placements (q k^T) s and "
    "(q sqrt(s)) (k sqrt(s))^T (and, for gradients, the flash form of the backward; for an FP8 "
    f"kernel's FP8 baseline, also over {FP8_DRAWS} realisations of its FP8 rounding: amax scales shifted by "
    "factors in (1/2, 1]); a non-finite "
    "baseline is replaced by the baseline on dtype-rounded logits; dq, dk, dv for a fixed random "
    "output gradient by the same rule; plus zero rows and output or gradient in fully masked positions; "
    "in the signed-bias cases at bf16/fp16, biased when |z| >= 5 for the (batch, head) slices' signed "
    "mean errors (flashprobe.bias.BiasStats)"
)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The verdict on one kernel output.

    Attributes:
        verdict: one of :data:`VERDICTS`.
        reason: why, in words (also on pass: the error and the tolerance).
        failure: kind of the first failed check: ``raised``, ``inplace``, ``shape``, ``nonfinite``,
            ``zeros``, ``masked_nonzero``, ``values`` or ``biased``; ``None`` unless the verdict is
            ``fail``.
        primary_golden_max_abs: ``max|primary − golden|``; ``None`` when the output has NaN/Inf
            where the golden is finite, or there is no output.
        primary_nonfinite: NaN/Inf count of the output where the golden is finite.
    """

    verdict: str
    reason: str
    failure: str | None = None
    primary_golden_max_abs: float | None = None
    primary_nonfinite: int = 0

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict={self.verdict!r} must be one of {', '.join(VERDICTS)}")

    @property
    def passed(self) -> bool:
        """``True`` when the verdict is ``pass``."""
        return self.verdict == "pass"


@dataclass(frozen=True, kw_only=True)
class References:
    """Everything a kernel's output is judged against, computed once per (case, dtype).

    Attributes:
        golden: ``(B, H, N_q, D_v)`` float64 golden from the cast inputs.
        baseline_golden_max_abs: ``max|baseline − golden|``; None when the baseline is non-finite
            where the golden is finite (or raised).
        baseline_nonfinite: positions where the same-dtype baseline is NaN/Inf.
        noise_max: the baseline error that sets the noise floor (the larger over the baseline's
            forms; the rounded-logits baseline's when the baseline is non-finite).
        noise_from: ``"baseline"`` or ``"rounded-logits baseline"``.
        floor: ``eps(dtype) · max|v|`` (:func:`value_floor`).
        fully_masked: ``(B, H, N_q)`` bool, rows that see no key.
        note: why the fallback was used; skip: why the case cannot be posed in this dtype.
        noise_l2, noise_row: the baseline's ``‖baseline − golden‖₂`` and worst row
            (:func:`flashprobe.judge.row_statistics`), the larger over the same forms.
        dtype: the dtype under test (the rule's limits).
        precision: the FP8 dtype an FP8 kernel rounds to, whose limits apply instead; None otherwise.
        logit_max: the largest valid |logit| of the case (widens the rule's floors).
        baseline_out: ``(B, H, N_q, D_v)`` the baseline's output (``signed bias`` cases only).
        grad_out: ``(B, H, N_q, D_v)`` the fixed random output gradient, or None when gradients are
            not checked.
        gradients: ``dq``/``dk``/``dv`` → :class:`GradientReference` (empty when not checked).
        grad_note: why the gradients are not checked although asked for.
    """

    golden: torch.Tensor
    baseline_golden_max_abs: float | None
    baseline_nonfinite: int
    noise_max: float
    noise_from: str
    floor: float
    fully_masked: torch.Tensor
    note: str = ""
    skip: str = ""
    noise_l2: float = 0.0
    eps: float = 0.0
    noise_row: float = 0.0
    dtype: torch.dtype = torch.float32
    precision: torch.dtype | None = None
    logit_max: float = 0.0
    baseline_out: torch.Tensor | None = None
    grad_out: torch.Tensor | None = None
    gradients: dict[str, GradientReference] = field(default_factory=dict)
    grad_note: str = ""

    @property
    def tolerance(self) -> float:
        """``2 · noise_max + floor``."""
        return 2.0 * self.noise_max + self.floor


@dataclass(frozen=True, kw_only=True)
class GradientReference:
    """What one input gradient of a kernel is judged against.

    Attributes:
        name: ``dq``, ``dk`` or ``dv``.
        golden: the FP64 golden gradient: ``(B, H, N_q, D)`` for dq, ``(B, H_kv, N_k, ·)`` for dk, dv.
        noise_max, noise_l2, noise_row: the baseline gradient's ``max|baseline − golden|``,
            ``‖baseline − golden‖₂`` and worst row (the larger over the forms).
        floor: ``eps(dtype) · max|golden|``.
        zero_rows: bool, ``golden``'s shape without its last dim: rows that must be 0 (queries
            that see no key for dq, keys no query sees for dk and dv).
        baseline: the baseline's gradient (``signed bias`` cases only).
    """

    name: str
    golden: torch.Tensor
    noise_max: float
    noise_l2: float
    floor: float
    eps: float
    zero_rows: torch.Tensor
    noise_row: float = 0.0
    baseline: torch.Tensor | None = None

    @property
    def tolerance(self) -> float:
        """``2 · noise_max + floor``."""
        return 2.0 * self.noise_max + self.floor


def value_floor(v: torch.Tensor, dtype: torch.dtype) -> float:
    """The rule's floor ``eps(dtype) · max|v|`` for the values ``v`` ``(B, H_kv, N_k, D_v)``."""
    largest = v.detach().abs().max().item() if v.numel() else 0.0
    return float(torch.finfo(dtype).eps) * largest


def rounding_floor(golden: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attention's floor (its tests' ``fwd_atol`` without the 2×): ``max|(g + 0.3 − 0.3) − g|``
    in ``dtype`` for the golden output ``g`` ``(B, H, N_q, D_v)``."""
    g = golden.detach().to(dtype)
    return (g + 0.3 - 0.3 - g).abs().max().item() if g.numel() else 0.0


def output_errors(
    out: torch.Tensor, golden: torch.Tensor, noise_l2: float, noise_row: float
) -> tuple[list[float], float, int]:
    """The rule's inputs for one output against the golden, and ``max|out − golden|``.

    Args:
        out: ``(..., D)``, any floating dtype.
        golden: the same shape, float64.
        noise_l2, noise_row: the baseline's ``‖baseline − golden‖₂`` and worst row.

    Returns:
        ``(errors, max_abs, nonfinite)``: the :data:`flashprobe.judge.ERROR_COLUMNS` (non-finite
        count 0: the fuzzer's own check reports those), ``max|out − golden|`` over the finite
        positions and the count of the others.
    """
    stats = call_statistics(out, golden, golden)  # one pass; golden as the baseline too
    sums = stats.sums[:, PAIR.primary_baseline].tolist()  # rows of SUM_ROWS
    rows = stats.rows.tolist()
    errors = [sums[2], noise_l2**2, sums[3], 0.0, rows[0], noise_row, rows[2]]
    return errors, sums[0], int(sums[4])


def noise(out: torch.Tensor, golden: torch.Tensor) -> tuple[float, float, float, int]:
    """A baseline's ``(..., D)`` noise against the float64 golden: ``max|out − golden|``,
    ``‖out − golden‖₂`` and its worst row over the finite positions, and the non-finite count."""
    errors, max_abs, bad = output_errors(out, golden, 0.0, 0.0)
    return max_abs, errors[0] ** 0.5, errors[4], bad


#: what a ``biased`` failure adds to its reason: the mechanism known to give it and its mitigation
BIAS_HINT = (
    "errors that keep one sign do not average out over steps; a known mechanism is the biased rounding "
    "of arXiv 2510.04212 (P near 1 rounded up to 1 in bf16 where a row's maximum repeats), removed by "
    "shifting the row maximum (max_shift, e.g. tiled:max_shift=repeated)"
)


def signed_bias(
    name: str, x: torch.Tensor, golden: torch.Tensor, baseline: torch.Tensor | None, dtype: torch.dtype
) -> Judgement | None:
    """The ``biased`` criterion (:func:`flashprobe.judge.judge_bias`) on one direction ``name``
    of one call, its ``(…, N, D)`` slices the replicates (:class:`~flashprobe.bias.BiasStats`).

    Args:
        x: the kernel's output or gradient ``(B, H, N, D)``; golden, baseline: the same shape
            (``baseline`` None: not a ``signed bias`` case).

    Returns:
        The judgement, or None where the sign is not judged (no baseline, or a dtype outside
        :data:`BIAS_DTYPES`).
    """
    if baseline is None or dtype not in BIAS_DTYPES:
        return None
    stats = BiasStats((name,), golden.device)
    stats.add(name, x.detach(), golden, baseline)
    return judge_bias(stats.as_dict()[name], name)


def _nan_inf(x: torch.Tensor, bad: int) -> str:
    """``bad`` non-finite values of ``x`` (any shape) in words."""
    n_nan = int(torch.isnan(x).sum().item())
    return f"{n_nan} NaN and {bad - n_nan} ±Inf where golden is finite"


def _nonfinite(o: torch.Tensor, bad: int, refs: References) -> list[tuple[str, str]]:
    """The ``nonfinite`` check on ``o`` ``(B, H, N_q, D_v)`` with ``bad`` NaN/Inf."""
    if not bad:
        return []
    text = _nan_inf(o, bad)
    bad_rows = (~torch.isfinite(o)).any(-1)
    if bool(refs.fully_masked.any()) and bool((bad_rows <= refs.fully_masked).all()):
        text += " (all in fully masked rows: expected 0, torch SDPA's convention)"
    if refs.baseline_nonfinite:
        text += "; the same-dtype baseline is non-finite here too"
    return [("nonfinite", text)]


def _zero_rows(
    o: torch.Tensor, golden: torch.Tensor, tolerance: float, kind: str, what: str
) -> list[tuple[str, str]]:
    """The ``zeros`` check: rows of exact zeros in ``o`` ``(..., D)`` where the golden's are not."""
    golden_rows = golden.abs().amax(-1)  # (B, H, N_q) for the output
    zero_rows = (o == 0).all(-1) & (golden_rows > 2 * tolerance)
    if not zero_rows.any():
        return []
    text = (
        f"{what} ({int(zero_rows.sum())} of {zero_rows.numel()} rows; golden row max "
        f"up to {golden_rows[zero_rows].max().item():.3g})"
    )
    return [(kind, text)]


def _masked_nonzero(o: torch.Tensor, refs: References) -> list[tuple[str, str]]:
    """The ``masked_nonzero`` check: fully masked rows must be 0 (torch SDPA's convention)."""
    out_rows = o.abs().amax(-1)  # (B, H, N_q)
    masked_nonzero = refs.fully_masked & (out_rows > refs.tolerance)
    if not masked_nonzero.any():
        return []
    text = (
        f"fully masked rows returned non-zero values ({int(masked_nonzero.sum())} rows, max |out| "
        f"{out_rows[masked_nonzero].max().item():.3g}); expected 0, torch SDPA's convention"
    )
    return [("masked_nonzero", text)]


def judge(out: torch.Tensor, refs: References) -> Verdict:
    """Apply the rule to one kernel output.

    Args:
        out: ``(B, H, N_q, D_v)`` the kernel's output (any floating dtype).
        refs: the case's :class:`References`.

    Returns:
        ``pass``, ``skip`` (undetermined), or ``fail`` with every failed check in the reason and
        the first's kind as ``failure``.
    """
    golden = refs.golden
    if tuple(out.shape) != tuple(golden.shape):
        reason = f"returned shape {tuple(out.shape)}, expected {tuple(golden.shape)}"
        return Verdict(verdict="fail", failure="shape", reason=reason)
    o = out.detach().double()
    errors, err, bad = output_errors(o, golden, refs.noise_l2, refs.noise_row)
    judged = judge_errors(errors, refs.dtype, "out", logit_max=refs.logit_max, precision=refs.precision)
    note = f" [{refs.note}]" if refs.note else ""
    primary_max = None if bad else err
    zeros = _zero_rows(o, golden, refs.tolerance, "zeros", ZEROS_REASON)
    reasons = [*_nonfinite(o, bad, refs), *zeros, *_masked_nonzero(o, refs)]
    if not reasons and judged.verdict == "undetermined":  # beyond the dtype's range, or ill-conditioned
        why = f"undetermined: {judged.reason}{note}"
        return Verdict(verdict="skip", reason=why, primary_golden_max_abs=primary_max)
    if judged.verdict == "fail":
        reasons.append(("values", f"wrong values ({judged.criterion}): {judged.reason}"))
    bias = signed_bias("out", o, golden, refs.baseline_out, refs.dtype)
    if bias is not None:
        if bias.verdict == "fail":
            reasons.append(("biased", f"biased: {bias.reason} ({BIAS_HINT})"))
        else:
            note = f"; {bias.reason}{note}"
    if reasons:
        return Verdict(
            verdict="fail",
            failure=reasons[0][0],
            reason="; ".join(text for _, text in reasons) + note,
            primary_golden_max_abs=primary_max,
            primary_nonfinite=bad,
        )
    return Verdict(
        verdict="pass", reason=_passed(judged, err, refs.noise_max) + note, primary_golden_max_abs=primary_max
    )


def _passed(judged: Judgement, err: float, noise_max: float) -> str:
    """A pass in words: the rule's statistic first, then the ratio of maxima beside it."""
    ratio = error_ratio(err, noise_max)
    ratio_text = "both exact" if ratio is None else f"{ratio:.2f}"
    return (
        f"error / limit {judged.limit_ratio:.3g} (relative L2 error {judged.absolute:.3g}, "
        f"{judged.relative:.3g}x the baseline's; worst row {judged.row:.3g}); max/max ratio {ratio_text}"
    )


def check_output(
    out: torch.Tensor, baseline: torch.Tensor, golden: torch.Tensor, *, floor: float = 0.0
) -> Verdict:
    """:func:`judge` on three tensors, without a case's mask (NaN/Inf in ``out`` fails).

    Args:
        out: ``(B, H, N_q, D_v)`` the output under test; its dtype sets the rule's limits.
        baseline: the same shape, the baseline at the same dtype.
        golden: the same shape, the FP64 golden, finite.
        floor: the floor of the reported 2x tolerance (:func:`value_floor` as the fuzzer,
            :func:`rounding_floor` as flash-attention's tests).

    Returns:
        The :class:`Verdict` (``pass``, ``fail``, or ``skip`` when undetermined).

    Raises:
        ValueError: the baseline is NaN/Inf where the golden is finite: it sets no noise floor.
    """
    golden = golden.detach().double()
    base_max, base_l2, base_row, base_bad = noise(baseline.detach().double(), golden)
    if base_bad:
        raise ValueError(
            f"the baseline is NaN/Inf at {base_bad} positions: it sets no noise floor; compare against "
            "a baseline that is finite on these inputs (e.g. math at a wider dtype)"
        )
    dtype = out.dtype if out.is_floating_point() else torch.float32
    refs = References(
        golden=golden,
        baseline_golden_max_abs=base_max,
        baseline_nonfinite=0,
        noise_max=base_max,
        noise_l2=base_l2,
        noise_row=base_row,
        eps=float(torch.finfo(dtype).eps),
        dtype=dtype,
        noise_from="baseline",
        floor=floor,
        fully_masked=torch.zeros(golden.shape[:-1], dtype=torch.bool, device=golden.device),
    )
    return judge(out, refs)


def _gradient_reasons(
    grad: torch.Tensor | None, ref: GradientReference, refs: References
) -> tuple[list[tuple[str, str]], dict[str, float | str | None]]:
    """Every failed check of one gradient, as ``(failure kind, text)`` (kinds ``<name>:<check>``),
    and its statistics."""
    name, golden = ref.name, ref.golden
    stats: dict[str, float | str | None] = {"max_abs": None, "tolerance": ref.tolerance}
    if grad is None or tuple(grad.shape) != tuple(golden.shape):
        got = "no gradient" if grad is None else f"shape {tuple(grad.shape)}"
        return [(f"{name}:shape", f"{name}: {got}, expected {tuple(golden.shape)}")], stats
    g = grad.detach().double()
    errors, err, bad = output_errors(g, golden, ref.noise_l2, ref.noise_row)
    judged = judge_errors(errors, refs.dtype, name, logit_max=refs.logit_max, precision=refs.precision)
    judged_stats = ("verdict", "limit_ratio", "absolute", "relative", "row", "reason")
    stats.update(max_abs=None if bad else err, **{key: getattr(judged, key) for key in judged_stats})
    reasons = [(f"{name}:nonfinite", f"{name}: {_nan_inf(g, bad)}")] if bad else []
    reasons += _zero_rows(
        g, golden, ref.tolerance, f"{name}:zeros", f"{name}: rows of zeros where golden is non-zero"
    )
    leak = ref.zero_rows & (torch.where(torch.isfinite(g), g, 0.0).abs().amax(-1) > ref.tolerance)
    if leak.any():
        what = "queries that see no key" if name == "dq" else "keys no query sees"
        text = f"{name}: gradient into fully masked positions ({int(leak.sum())} rows of {what}; expected 0)"
        reasons.append((f"{name}:masked", text))
    if judged.verdict == "fail":
        reasons.append((f"{name}:values", f"{name}: wrong values ({judged.criterion}): {judged.reason}"))
    if judged.verdict == "undetermined" and judged.criterion == "unrepresentable":
        reasons = []  # no value in the dtype can be right: Inf is no failure either
    bias = signed_bias(name, g, golden, ref.baseline, refs.dtype)
    if bias is not None:
        stats.update(bias_z=bias.value, bias_verdict=bias.verdict)
        if bias.verdict == "fail":
            reasons.append((f"{name}:biased", f"{name} biased: {bias.reason} ({BIAS_HINT})"))
    return reasons, stats


def judge_gradients(
    grads: dict[str, torch.Tensor | None], refs: References
) -> tuple[Verdict, dict[str, dict[str, float | str | None]]]:
    """Apply the rule to a kernel's input gradients.

    Args:
        grads: ``dq`` ``(B, H, N_q, D)``, ``dk`` ``(B, H_kv, N_k, D)``, ``dv`` ``(B, H_kv, N_k, D_v)``
            (None: the kernel gave no gradient for that input).
        refs: the case's :class:`References` with ``gradients`` set.

    Returns:
        The verdict (``fail`` with every failed check, ``failure`` the first's kind such as
        ``dq:values``; an undetermined gradient is not failed) and per gradient its ``max_abs``,
        ``tolerance`` and the rule's ``verdict``, ``limit_ratio``, ``absolute``, ``relative``,
        ``row`` and ``reason``.
    """
    reasons: list[tuple[str, str]] = []
    stats: dict[str, dict[str, float | str | None]] = {}
    for name, ref in refs.gradients.items():
        found, stats[name] = _gradient_reasons(grads.get(name), ref, refs)
        reasons += found
    if reasons:
        text = "; ".join(t for _, t in reasons)
        return Verdict(verdict="fail", failure=reasons[0][0], reason=text), stats
    summary = ", ".join(
        f"{n} undetermined: {s['reason']}"
        if s.get("verdict") == "undetermined"
        else f"{n} {s['limit_ratio']:.3g}"
        for n, s in stats.items()
    )
    return Verdict(verdict="pass", reason=f"gradients error / limit: {summary}"), stats
