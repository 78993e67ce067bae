"""The 2x rule: is a kernel's output as close to the FP64 golden as the baseline's, up to a floor?

flash-attention's test rule plus a floor, with ``golden`` computed in float64 from the *cast*
inputs and ``baseline`` plain attention at the same dtype:

    max|primary − golden| ≤ 2 · max|baseline − golden| + eps(dtype) · max|v|,

beside an L2 rule: a value is wrong only when **both** fail,

    ‖primary − golden‖₂ > 4 · ‖baseline − golden‖₂ + eps(dtype) · ‖golden‖₂

(in relative terms: ``rel_l2(primary) > 4 · rel_l2(baseline) + eps``).

A max-over-max ratio of two small tensors is noisy (torch's own fp32 CPU flash backward exceeds
2× the math baseline's max error in about 15 % of random 16-token calls); the L2 ratio averages
over every element and is stable, while a real bug (a wrong row, a missing scale, an ignored tile)
moves both statistics by orders of magnitude. The gradients ``dq``, ``dk``, ``dv`` for a fixed
random output gradient are judged by the same two rules (:class:`GradientReference`), their floor
``eps(dtype) · max|golden gradient|``.

The floor (:func:`value_floor`) is one unit in the last place of the largest value, the resolution
of the output; it keeps the rule meaningful when the baseline is exact. flash-attention's own tests
use a tighter floor, the rounding error of the golden output itself in the dtype
(:func:`rounding_floor`); flashprobe's kernel tests use that one, the fuzzer the resolution of ``v``
(its adversarial cases have outputs at every magnitude ``v`` allows). :func:`judge` applies the
rule with everything ``flashprobe fuzz`` knows about a case (:class:`References`: fully masked rows,
the noise of both scale placements, the fallback baseline) and names the first failed check;
:func:`check_output` applies the same rule to three tensors, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashprobe.deviation import error_ratio

__all__ = [
    "GRADIENTS",
    "L2_FACTOR",
    "RULE",
    "VERDICTS",
    "ZEROS_REASON",
    "GradientReference",
    "References",
    "Verdict",
    "check_output",
    "finite_max_abs",
    "judge",
    "judge_gradients",
    "l2_error",
    "rounding_floor",
    "value_floor",
]

#: The verdicts a (kernel, case, dtype) can get; ``no_backward``: the forward passes, but the
#: kernel's output has no autograd graph, so its gradients could not be checked.
VERDICTS = ("pass", "fail", "skip", "unsupported", "no_backward")
#: The input gradients checked, in order.
GRADIENTS = ("dq", "dk", "dv")
#: Multiple of the baseline's relative L2 error the L2 rule allows.
L2_FACTOR = 4.0
ZEROS_REASON = "row returned zeros where golden is non-zero: sentinel/underflow bug"
#: The rule in words, as recorded in ``fuzz.json``.
RULE = (
    "wrong values when both max|primary - golden| > 2 * max|baseline - golden| + eps(dtype) * max|v| "
    "and ||primary - golden||_2 > 4 * ||baseline - golden||_2 + eps(dtype) * ||golden||_2; golden = "
    "fp64 from the cast inputs; baseline error = max over scale placements (q k^T) s and "
    "(q sqrt(s)) (k sqrt(s))^T (and, for gradients, the flash form of the backward); a non-finite "
    "baseline is replaced by the baseline on dtype-rounded logits; dq, dk, dv for a fixed random "
    "output gradient by the same rules with floor eps(dtype) * max|golden gradient|, plus "
    "NaN/Inf, zero rows and gradient into fully masked positions"
)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The verdict on one kernel output.

    Attributes:
        verdict: one of :data:`VERDICTS`.
        reason: why, in words (also on pass: the error and the tolerance).
        failure: kind of the first failed check: ``raised``, ``inplace``, ``shape``, ``nonfinite``,
            ``zeros``, ``masked_nonzero`` or ``values``; ``None`` unless the verdict is ``fail``.
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
        baseline_golden_max_abs: ``max|baseline − golden|``, ``None`` when the baseline is
            non-finite where the golden is finite (or raised).
        baseline_nonfinite: positions where the same-dtype baseline is NaN/Inf.
        noise_max: the baseline error that sets the noise floor: the larger of the baseline's
            errors with the scale applied to the scores and to q and k (``√scale`` each); or,
            when the baseline is non-finite, the error of the baseline on rounded logits.
        noise_from: ``"baseline"`` or ``"rounded-logits baseline"``.
        floor: ``eps(dtype) · max|v|`` (:func:`value_floor`).
        fully_masked: ``(B, H, N_q)`` bool, rows that see no key.
        note: why the fallback was used (empty otherwise).
        skip: why the case cannot be posed in this dtype (empty otherwise).
        noise_l2: the baseline's L2 error ``‖baseline − golden‖₂`` (the larger over the forms
            that set ``noise_max``).
        eps: ``eps(dtype)``; the L2 rule's floor is ``eps · ‖golden‖₂``.
        grad_out: ``(B, H, N_q, D_v)`` the fixed random output gradient (in the dtype), or None
            when gradients are not checked.
        gradients: ``dq``/``dk``/``dv`` → :class:`GradientReference` (empty when not checked).
        grad_note: why the gradients are not checked although asked for (empty otherwise).
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
    grad_out: torch.Tensor | None = None
    gradients: dict[str, GradientReference] = field(default_factory=dict)
    grad_note: str = ""

    @property
    def tolerance(self) -> float:
        """``2 · noise_max + floor``."""
        return 2.0 * self.noise_max + self.floor

    @property
    def l2_tolerance(self) -> float:
        """``L2_FACTOR · noise_l2 + eps · ‖golden‖₂``."""
        return L2_FACTOR * self.noise_l2 + self.eps * self.golden.norm().item()


@dataclass(frozen=True, kw_only=True)
class GradientReference:
    """What one input gradient of a kernel is judged against.

    Attributes:
        name: ``dq``, ``dk`` or ``dv``.
        golden: the FP64 golden gradient: ``(B, H, N_q, D)`` for dq, ``(B, H_kv, N_k, ·)`` for dk, dv.
        noise_max: ``max|baseline gradient − golden|`` (the larger over both scale placements).
        noise_l2: the baseline gradient's L2 error ``‖baseline − golden‖₂``.
        floor: ``eps(dtype) · max|golden|``.
        eps: ``eps(dtype)``.
        zero_rows: bool, shape of ``golden`` without its last dim: rows that must be 0 (queries that
            see no key for dq, keys no query sees for dk and dv): gradient into masked positions.
    """

    name: str
    golden: torch.Tensor
    noise_max: float
    noise_l2: float
    floor: float
    eps: float
    zero_rows: torch.Tensor

    @property
    def tolerance(self) -> float:
        """``2 · noise_max + floor``."""
        return 2.0 * self.noise_max + self.floor

    @property
    def l2_tolerance(self) -> float:
        """``L2_FACTOR · noise_l2 + eps · ‖golden‖₂``."""
        return L2_FACTOR * self.noise_l2 + self.eps * self.golden.norm().item()


def l2_error(a: torch.Tensor, golden: torch.Tensor) -> float:
    """``‖a − golden‖₂`` over the positions where ``a`` is finite.

    Args:
        a: any shape.
        golden: the same shape, finite.
    """
    return torch.where(torch.isfinite(a), a - golden, 0.0).norm().item()


def value_floor(v: torch.Tensor, dtype: torch.dtype) -> float:
    """The rule's floor: ``eps(dtype) · max|v|``, one unit in the last place of the largest value.

    Args:
        v: ``(B, H_kv, N_k, D_v)`` the values of the attention call (any dtype).
        dtype: the dtype under test.
    """
    largest = v.detach().abs().max().item() if v.numel() else 0.0
    return float(torch.finfo(dtype).eps) * largest


def rounding_floor(golden: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attention's floor: the rounding error of the golden output in ``dtype``,
    ``max|(g + 0.3 − 0.3) − g|`` computed in ``dtype`` (its tests' ``fwd_atol`` without the 2×).

    Args:
        golden: ``(B, H, N_q, D_v)`` the FP64 golden output.
        dtype: the dtype under test.
    """
    g = golden.detach().to(dtype)
    return (g + 0.3 - 0.3 - g).abs().max().item() if g.numel() else 0.0


def finite_max_abs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """``max|a − b|`` over positions where ``a`` is finite, and the count where it is not.

    Args:
        a: an output, any shape.
        b: the reference, same shape, finite.
    """
    finite = torch.isfinite(a)
    diff = torch.where(finite, a - b, 0.0).abs()
    return (diff.max().item() if diff.numel() else 0.0), int((~finite).sum().item())


def _nonfinite(o: torch.Tensor, bad: int, refs: References) -> list[tuple[str, str]]:
    """The ``nonfinite`` check on ``o`` ``(B, H, N_q, D_v)`` float64 with ``bad`` NaN/Inf."""
    if not bad:
        return []
    n_nan = int(torch.isnan(o).sum().item())
    where = ""
    bad_rows = (~torch.isfinite(o)).any(-1)
    if bool(refs.fully_masked.any()) and bool((bad_rows <= refs.fully_masked).all()):
        where = " (all in fully masked rows: expected 0, torch SDPA's convention)"
    text = f"{n_nan} NaN and {bad - n_nan} ±Inf where golden is finite{where}"
    if refs.baseline_nonfinite:
        text += "; the same-dtype baseline is non-finite here too"
    return [("nonfinite", text)]


def _zero_rows(o: torch.Tensor, refs: References) -> list[tuple[str, str]]:
    """The ``zeros`` check: rows of exact zeros where the golden row clearly is not zero."""
    golden_rows = refs.golden.abs().amax(-1)  # (B, H, N_q)
    zero_rows = (o == 0).all(-1) & (golden_rows > 2 * refs.tolerance)
    if not zero_rows.any():
        return []
    text = (
        f"{ZEROS_REASON} ({int(zero_rows.sum())} of {zero_rows.numel()} rows; golden row max "
        f"up to {golden_rows[zero_rows].max().item():.3g})"
    )
    return [("zeros", text)]


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
        out: ``(B, H, N_q, D_v)`` the primary kernel's output (any floating dtype).
        refs: the case's :class:`References`.

    Returns:
        ``pass``, or ``fail`` with every failed check in the reason and the kind of the first
        (``shape``, ``nonfinite``, ``zeros``, ``masked_nonzero``, ``values``) as ``failure``.
    """
    golden = refs.golden
    if tuple(out.shape) != tuple(golden.shape):
        reason = f"returned shape {tuple(out.shape)}, expected {tuple(golden.shape)}"
        return Verdict(verdict="fail", failure="shape", reason=reason)
    o = out.detach().double()
    err, bad = finite_max_abs(o, golden)
    reasons = [*_nonfinite(o, bad, refs), *_zero_rows(o, refs), *_masked_nonzero(o, refs)]
    rule = f"2 × {refs.noise_from} {refs.noise_max:.3g} + floor {refs.floor:.3g}"
    l2 = l2_error(o, golden)
    l2_rule = f"‖·‖₂ {l2:.3g} > {L2_FACTOR:g} × {refs.noise_l2:.3g} + eps·‖golden‖₂"
    if err > refs.tolerance and l2 > refs.l2_tolerance:
        reasons.append(("values", f"wrong values: max|primary − golden| = {err:.3g} > {rule} and {l2_rule}"))
    note = f" [{refs.note}]" if refs.note else ""
    primary_max = None if bad else err
    if reasons:
        reason = "; ".join(text for _, text in reasons) + note
        failure = reasons[0][0]
        return Verdict(
            verdict="fail",
            failure=failure,
            reason=reason,
            primary_golden_max_abs=primary_max,
            primary_nonfinite=bad,
        )
    ratio = error_ratio(err, refs.noise_max)
    ratio_text = "both exact" if ratio is None else f"ratio {ratio:.2f}"
    if err <= refs.tolerance:
        reason = f"max|primary − golden| = {err:.3g} ≤ {rule} ({ratio_text})" + note
    else:
        reason = (
            f"max|primary − golden| = {err:.3g} > {rule} ({ratio_text}), but ‖primary − golden‖₂ "
            f"{l2:.3g} ≤ {refs.l2_tolerance:.3g} (the L2 rule)" + note
        )
    return Verdict(verdict="pass", reason=reason, primary_golden_max_abs=primary_max)


def check_output(
    out: torch.Tensor, baseline: torch.Tensor, golden: torch.Tensor, *, floor: float = 0.0
) -> Verdict:
    """The rule on three tensors: ``max|out − golden| ≤ 2 · max|baseline − golden| + floor``.

    The same checks as :func:`judge` (NaN/Inf in ``out`` fails), without the knowledge of a
    case's mask; pass ``floor=value_floor(v, dtype)`` for the rule ``flashprobe fuzz`` applies,
    ``floor=rounding_floor(golden, dtype)`` for flash-attention's tests' rule.

    Args:
        out: ``(B, H, N_q, D_v)`` the output under test.
        baseline: ``(B, H, N_q, D_v)`` the baseline at the same dtype.
        golden: ``(B, H, N_q, D_v)`` the FP64 golden, finite.
        floor: the absolute floor added to the tolerance.

    Returns:
        The :class:`Verdict` (``pass`` or ``fail``).

    Raises:
        ValueError: the baseline is NaN/Inf where the golden is finite: it sets no noise floor.
    """
    golden = golden.detach().double()
    noise, base_bad = finite_max_abs(baseline.detach().double(), golden)
    if base_bad:
        raise ValueError(
            f"the baseline is NaN/Inf at {base_bad} positions: it sets no noise floor; compare against "
            "a baseline that is finite on these inputs (e.g. math at a wider dtype)"
        )
    refs = References(
        golden=golden,
        baseline_golden_max_abs=noise,
        baseline_nonfinite=0,
        noise_max=noise,
        noise_l2=l2_error(baseline.detach().double(), golden),
        eps=float(torch.finfo(out.dtype).eps) if out.is_floating_point() else 0.0,
        noise_from="baseline",
        floor=floor,
        fully_masked=torch.zeros(golden.shape[:-1], dtype=torch.bool, device=golden.device),
    )
    return judge(out, refs)


def _gradient_reasons(grad: torch.Tensor | None, ref: GradientReference) -> list[tuple[str, str]]:
    """Every failed check of one gradient, as ``(failure kind, text)``; kinds ``<name>:<check>``."""
    name, golden = ref.name, ref.golden
    if grad is None or tuple(grad.shape) != tuple(golden.shape):
        got = "no gradient" if grad is None else f"shape {tuple(grad.shape)}"
        return [(f"{name}:shape", f"{name}: {got}, expected {tuple(golden.shape)}")]
    g = grad.detach().double()
    err, bad = finite_max_abs(g, golden)
    reasons = []
    if bad:
        n_nan = int(torch.isnan(g).sum().item())
        reasons.append(
            (f"{name}:nonfinite", f"{name}: {n_nan} NaN and {bad - n_nan} ±Inf where golden is finite")
        )
    golden_rows = golden.abs().amax(-1)
    zero_rows = (g == 0).all(-1) & (golden_rows > 2 * ref.tolerance)
    if zero_rows.any():
        reasons.append(
            (
                f"{name}:zeros",
                f"{name}: rows of zeros where golden is non-zero ({int(zero_rows.sum())} of "
                f"{zero_rows.numel()} rows; golden row max up to {golden_rows[zero_rows].max().item():.3g})",
            )
        )
    leak = ref.zero_rows & (torch.where(torch.isfinite(g), g, 0.0).abs().amax(-1) > ref.tolerance)
    if leak.any():
        what = "queries that see no key" if name == "dq" else "keys no query sees"
        reasons.append(
            (
                f"{name}:masked",
                f"{name}: gradient into fully masked positions ({int(leak.sum())} rows of {what}; "
                "expected 0)",
            )
        )
    l2 = l2_error(g, golden)
    if err > ref.tolerance and l2 > ref.l2_tolerance:
        reasons.append(
            (
                f"{name}:values",
                f"{name}: wrong values: max|{name} − golden| = {err:.3g} > 2 × baseline "
                f"{ref.noise_max:.3g} + floor {ref.floor:.3g} and ‖·‖₂ {l2:.3g} > {L2_FACTOR:g} × "
                f"{ref.noise_l2:.3g} + eps·‖golden‖₂",
            )
        )
    return reasons


def judge_gradients(
    grads: dict[str, torch.Tensor | None], refs: References
) -> tuple[Verdict, dict[str, dict[str, float | None]]]:
    """Apply the rule to a kernel's input gradients.

    Args:
        grads: ``dq`` ``(B, H, N_q, D)``, ``dk`` ``(B, H_kv, N_k, D)``, ``dv`` ``(B, H_kv, N_k, D_v)``
            (None: the kernel gave no gradient for that input).
        refs: the case's :class:`References` with ``gradients`` set.

    Returns:
        The verdict (``pass``, or ``fail`` with every failed check; ``failure`` is the first's kind,
        ``dq:nonfinite``, ``dk:zeros``, ``dv:masked``, ``dq:values``, ...) and per gradient its
        ``max_abs``, ``tolerance``, ``l2`` (``‖grad − golden‖₂``), ``l2_tolerance``.
    """
    reasons: list[tuple[str, str]] = []
    stats: dict[str, dict[str, float | None]] = {}
    for name, ref in refs.gradients.items():
        grad = grads.get(name)
        reasons += _gradient_reasons(grad, ref)
        ok = grad is not None and tuple(grad.shape) == tuple(ref.golden.shape)
        err, bad = finite_max_abs(grad.detach().double(), ref.golden) if ok else (None, 0)
        stats[name] = {
            "max_abs": None if (err is None or bad) else err,
            "tolerance": ref.tolerance,
            "l2": l2_error(grad.detach().double(), ref.golden) if ok else None,
            "l2_tolerance": ref.l2_tolerance,
        }
    if reasons:
        text = "; ".join(t for _, t in reasons)
        return Verdict(verdict="fail", failure=reasons[0][0], reason=text), stats
    summary = ", ".join(
        f"{n} {s['max_abs']:.3g} ≤ {s['tolerance']:.3g}"
        if s["max_abs"] <= s["tolerance"]
        else f"{n} ‖·‖₂ {s['l2']:.3g} ≤ {s['l2_tolerance']:.3g}"
        for n, s in stats.items()
    )
    return Verdict(verdict="pass", reason=f"gradients: {summary}"), stats
