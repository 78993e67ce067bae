"""The verdict's rule: is this call's output (or gradient) as right as a correct kernel's?

Every ``pass``, ``fail`` or ``undetermined`` of flashprobe (the probe at every call, ``flashprobe
fuzz``, ``replay`` and ``bench verdicts``) is decided here. A call's primary (the kernel's ``out``,
``dq``, ``dk`` or ``dv``) is compared with the FP64 golden, against the same-dtype baseline's error
and limits in the dtype's resolution: :func:`decide` (tensors, no host read; its docstring gives the
statistics and :data:`CRITERIA`), or :func:`judge` / :func:`judge_errors` (plain numbers, one call).
The LSE is judged by :func:`judge_lse`, the signed bias over many calls by :func:`judge_bias`, an FP8
kernel against the FP8 baseline (:func:`fp8_baseline`). The headline statistic is :data:`SCORE`.
How the limits were calibrated: docs/calibration.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any, NamedTuple

import torch

from flashprobe.deviation import DIRECTIONS, NORM, PAIR, SUM, StatsWorkspace, pair_and_row_sums
from flashprobe.kernels import Kernel, get_kernel
from flashprobe.kernels.fp8 import FP8_DTYPES

__all__ = [
    "ABSOLUTE_EPS",
    "ABSOLUTE_RATIO",
    "CONDITIONING_LIMIT",
    "CRITERIA",
    "DIRECTIONS",
    "ERROR_COLUMNS",
    "FAILURES",
    "FP8_DRAWS",
    "GROSS_RATIO",
    "LIMITS",
    "LSE_ABSOLUTE_EPS",
    "LSE_CRITERIA",
    "LSE_RELATIVE_LIMIT",
    "LSE_STATISTICS",
    "RELATIVE_LIMITS",
    "ROW_EPS",
    "ROW_RATIO",
    "SCORE",
    "STATISTICS",
    "UNDETERMINED",
    "CallStatistics",
    "Judgement",
    "absolute_limit",
    "call_statistics",
    "decide",
    "error_columns",
    "fp8_baseline",
    "fp8_realisations",
    "judge",
    "judge_bias",
    "judge_errors",
    "judge_lse",
    "judge_tensors",
    "limits",
    "lse_statistics",
    "noise_statistics",
    "reason",
    "resolution",
    "row_limit",
    "row_statistics",
]

#: Every criterion by code, as the on-device accumulators store it (0: pass). Positive codes fail,
#: negative codes leave the call ``undetermined``.
CRITERIA: dict[int, str] = {
    1: "nonfinite",
    2: "relative",
    3: "absolute",
    4: "row",
    5: "biased",
    -1: "ill_conditioned",
    -2: "unrepresentable",
}
#: The criteria that fail a call.
FAILURES: tuple[str, ...] = tuple(name for code, name in CRITERIA.items() if code > 0)
#: The criteria that leave a call undetermined.
UNDETERMINED: tuple[str, ...] = tuple(name for code, name in CRITERIA.items() if code < 0)
#: Limits on the ratio of the primary's L2 error to the same-dtype baseline's, per direction (wider
#: for gradients: a flash backward takes ``rowsum(dO∘O)`` from the rounded output, the baseline not).
RELATIVE_LIMITS: dict[str, float] = {"out": 8.0, "dq": 64.0, "dk": 64.0, "dv": 64.0}
#: The absolute limit in units of :func:`resolution`, per direction (twice for gradients, whose
#: ``dS = P∘(dP − rowsum(dO·O))`` cancels).
ABSOLUTE_EPS: dict[str, float] = {"out": 4.0, "dq": 8.0, "dk": 8.0, "dv": 8.0}
#: The absolute criterion also needs this many times the baseline's relative error.
ABSOLUTE_RATIO: float = 4.0
#: The row limit in units of :func:`resolution` (capped at ½: a zeroed row reads 1).
ROW_EPS: float = 64.0
#: The row criterion also needs this many times the baseline's worst row.
ROW_RATIO: float = 4.0
#: The three limit tables as one record, as ``bench verdicts`` and ``lab.rules`` write them.
LIMITS: dict[str, Any] = {"relative": RELATIVE_LIMITS, "absolute_eps": ABSOLUTE_EPS, "row_eps": ROW_EPS}
#: A call is ill-conditioned when the baseline's relative error exceeds this fraction of the golden.
CONDITIONING_LIMIT: float = 0.25
#: In an ill-conditioned call the primary still fails when off by more than the golden's own size
#: and this many times the baseline's error.
GROSS_RATIO: float = 8.0
#: The FP8 baseline's error is the largest over this many realisations of its rounding
#: (:func:`fp8_realisations`).
FP8_DRAWS: int = 5
#: The statistics of a judgement, in the order :func:`decide` returns them.
STATISTICS: tuple[str, ...] = ("limit_ratio", "absolute", "baseline", "relative", "row")
#: The statistic shown first: the largest ``statistic / limit`` over the criteria that compare errors
#: with limits (``relative``, ``absolute``, ``row``); > 1 fails, 0 for an undetermined call.
SCORE: str = "limit_ratio"


def resolution(dtype: torch.dtype) -> float:
    """``max(eps(dtype), 2⁻¹⁶)``: the unit of the absolute and row limits."""
    return max(float(torch.finfo(dtype).eps), 2.0**-16)


def absolute_limit(dtype: torch.dtype, direction: str) -> float:
    """The largest relative L2 error a correct kernel reaches at ``dtype`` in ``direction`` where the
    call is well-conditioned (the ``absolute`` criterion also asks :data:`ABSOLUTE_RATIO` times the
    baseline's error)."""
    return ABSOLUTE_EPS[direction] * resolution(dtype)


def row_limit(dtype: torch.dtype, direction: str) -> float:
    """The largest worst-row error (:func:`row_statistics`) a correct kernel reaches at ``dtype``."""
    del direction  # one limit: rows of every direction are as long as a head
    return min(0.5, ROW_EPS * resolution(dtype))


def limits(dtype: torch.dtype, directions: Sequence[str]) -> torch.Tensor:
    """``(K, 3)`` float64 limits, per direction: relative, absolute, row."""
    return torch.tensor(
        [[RELATIVE_LIMITS[d], absolute_limit(dtype, d), row_limit(dtype, d)] for d in directions],
        dtype=torch.float64,
    )


def row_statistics(primary: torch.Tensor, baseline: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """The worst row's error of the primary and of the baseline, and the golden's largest magnitude,
    on the device (no host read).

    A row is the last dimension (a query's ``out``/``dq`` row, a key's ``dk``/``dv`` row); its error
    is ``‖x_r − g_r‖₂ / max(‖g_r‖₂, rms_r ‖g_r‖₂)``, so a row the golden makes tiny does not turn
    rounding into a large relative error. A row with a non-finite difference counts as 0 here (the
    ``nonfinite`` criterion counts it).

    Args:
        primary: ``(..., D)`` any floating dtype.
        baseline: as many elements.
        golden: as many elements, the reference.

    Returns:
        ``(3,)`` float64: the primary's and the baseline's worst row (0 for an empty tensor or an
        all-zero golden), and ``max|golden|`` over every position. Combine calls with a maximum.
    """
    return call_statistics(primary, baseline, golden)[1]


class CallStatistics(NamedTuple):
    """One call's statistics (:func:`call_statistics`), on the device."""

    sums: torch.Tensor
    """``(7, 3)`` :func:`~flashprobe.deviation.pair_sums`."""
    rows: torch.Tensor
    """``(3,)`` :func:`row_statistics`."""
    noise: torch.Tensor | None
    """``(2,)`` :func:`noise_statistics` of the baseline's second form, where one was given."""
    finite: bool
    """Whether the three tensors were read to be finite everywhere (``False`` where not read)."""


def call_statistics(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor,
    workspace: StatsWorkspace | None = None,
    *,
    form: torch.Tensor | None = None,
) -> CallStatistics:
    """One call's statistics from one pass over its tensors, on the device (no host read).

    Args:
        primary: ``(..., D)`` the kernel's output or gradient.
        baseline: as many elements, the same-dtype baseline's.
        golden: ``(..., D)``, the FP64 golden.
        workspace: scratch buffers to reuse across calls.
        form: as many elements, a second form of the baseline (the flash form of the backward), or
            None.
    """
    sums, norms, golden_max, finite = pair_and_row_sums(primary, baseline, golden, workspace, form)
    errors = _row_errors(norms, norms[NORM.golden])  # (K, rows) by NORM: the golden's own row unused
    worst = errors.amax(dim=1) if errors.shape[1] else errors.new_zeros(errors.shape[0])
    worst[NORM.golden] = golden_max  # in the golden's slot: max|golden|, the rows' third statistic
    noise = None
    if form is not None:
        noise = torch.stack((norms[NORM.form].nan_to_num(0.0, 0.0, 0.0).square().sum(), worst[NORM.form]))
    rows = worst[: NORM.golden + 1]
    return CallStatistics(sums, rows, noise, finite)


def _row_errors(norms: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """Row errors (:func:`row_statistics`) from L2 norms of rows: ``norms (J, R)`` of the differences
    from the golden (a non-finite one counts as 0) and ``golden (R,)`` of the golden's: ``(J, R)``."""
    scale = torch.maximum(golden, golden.square().mean().sqrt()) if golden.numel() else golden
    tiny = torch.finfo(torch.float64).tiny
    err = norms.nan_to_num(0.0, 0.0, 0.0)
    return torch.where(scale > 0, err / scale.clamp(min=tiny), 0.0)


#: The columns :func:`decide` reads, per direction: ``‖primary − g‖²``, ``‖baseline − g‖²``, ``‖g‖²``
#: (over the finite pairs), the primary's non-finite positions beyond the baseline's, and the
#: :func:`row_statistics`.
ERROR_COLUMNS: tuple[str, ...] = (
    "primary_sq",
    "baseline_sq",
    "golden_sq",
    "extra_nonfinite",
    "row",
    "baseline_row",
    "golden_max",
)


def error_columns(sums: torch.Tensor, rows: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """The ``(K, 7)`` :data:`ERROR_COLUMNS` from ``(K, 7, 3)`` pair sums and ``(K, 3)`` row statistics.

    Args:
        sums: :func:`~flashprobe.deviation.pair_sums` of ``K`` directions (with the golden pairs).
        rows: :func:`row_statistics` of the same directions.
        noise: ``(K, 2)`` :func:`noise_statistics` of a second form of the baseline (the flash form
            of the backward), or None: the baseline's error is the larger of the two.
    """
    pg, bg = PAIR.primary_golden, PAIR.baseline_golden
    extra = sums[:, SUM.nonfinite, pg] - sums[:, SUM.nonfinite, bg]
    base_sq, base_row = sums[:, SUM.sum_sq_diff, bg], rows[:, NORM.baseline_golden]
    if noise is not None:
        base_sq, base_row = torch.maximum(base_sq, noise[:, 0]), torch.maximum(base_row, noise[:, 1])
    primary_sq, golden_sq = sums[:, SUM.sum_sq_diff, pg], sums[:, SUM.sum_sq_ref, pg]
    row, golden_max = rows[:, NORM.primary_golden], rows[:, NORM.golden]
    return torch.stack((primary_sq, base_sq, golden_sq, extra, row, base_row, golden_max), dim=1)


def noise_statistics(
    form: torch.Tensor, golden: torch.Tensor, total: torch.Tensor | None = None
) -> torch.Tensor:
    """A second baseline form's error, on the device: ``(2,)`` float64 ``[‖form − g‖² over its finite
    rows, its worst row]`` (rows as :func:`row_statistics`), folded into ``total`` (sums add, rows
    take the maximum) when given.

    Args:
        form: the second form's output or gradient, ``(..., D)``.
        golden: as many elements, the FP64 golden.
        total: the running statistics of earlier blocks, or None.
    """
    width = golden.shape[-1] if golden.dim() else 1
    g = golden.detach().reshape(-1, width)
    d = form.detach().reshape(g.shape).to(torch.float64, copy=True).sub_(g)  # form − g, promoted exactly
    err = torch.linalg.vector_norm(d, dim=-1)  # (rows,)
    row = _row_errors(err, torch.linalg.vector_norm(g, dim=-1, dtype=torch.float64))
    part = torch.stack(
        (err.nan_to_num(0.0, 0.0, 0.0).square().sum(), row.amax() if row.numel() else row.new_zeros(()))
    )
    if total is None:
        return part
    return torch.stack((total[0] + part[0], torch.maximum(total[1], part[1])))


def decide(
    errors: torch.Tensor,
    dtype: torch.dtype,
    limit: torch.Tensor,
    logit_max: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule on ``K`` directions at once, with tensor ops only (no host read, no branch).

    Statistics, against the FP64 golden ``g`` over the finite pairs, each 0 where its denominator is:
    ``absolute`` = ‖p − g‖₂ / ‖g‖₂; ``baseline`` = ‖b − g‖₂ / ‖g‖₂ (the larger over the baseline's
    forms, :func:`error_columns`); ``relative`` = ‖p − g‖₂ / max(‖b − g‖₂, floor·‖g‖₂) with
    ``floor = max(½·eps, eps₃₂·logit_max)`` (the rounding of the golden in the dtype, or of the
    largest logit in float32 scores); ``row`` = the worst row's error (:func:`row_statistics`).

    Criteria, in order; the first that holds decides:

    1. ``unrepresentable`` (undetermined): ``max|g|`` exceeds the dtype's range.
    2. ``nonfinite`` (fail): NaN/±Inf in the primary at more positions than in the baseline.
    3. ``ill_conditioned`` (undetermined): the baseline (or the largest logit's rounding) is more than
       :data:`CONDITIONING_LIMIT` off and the primary is not within the absolute and row limits;
       unless the primary is off by more than ‖g‖ and :data:`GROSS_RATIO` × the baseline's error,
       which fails it as ``absolute``.
    4. ``relative``, ``absolute``, ``row`` (fail), the one exceeded most relative to its limit:
       ``relative`` above :data:`RELATIVE_LIMITS`; ``absolute`` above :func:`absolute_limit` (capped
       at :data:`CONDITIONING_LIMIT`) and :data:`ABSOLUTE_RATIO` × the baseline's (a gradient tens of
       percent off where the 16-bit baseline is a few percent off); ``row`` above :func:`row_limit`
       and :data:`ROW_RATIO` × the baseline's worst row (a zeroed key tile, wrong tail rows, one
       wrong head, which the whole-tensor L2 averages away). The absolute and row limits are at
       least 4 × the floor.

    A further per-call criterion is a code and name in :data:`CRITERIA`, a limit and one comparison
    here. The ``biased`` criterion is judged over many replicates instead (:func:`judge_bias`).

    Args:
        errors: ``(K, 7)`` float64 :data:`ERROR_COLUMNS` (:func:`error_columns`).
        dtype: the dtype the kernels computed in.
        limit: ``(K, 3)`` :func:`limits` on the same device.
        logit_max: the largest valid |logit| of the call, where known (0: not known).

    Returns:
        ``(code, value, limit, stats)``: ``(K,)`` :data:`CRITERIA` codes (0 pass), ``(K,)`` the
        deciding statistic (the extra non-finite positions for ``nonfinite``, the golden's largest
        magnitude for ``unrepresentable``; ``relative`` on a pass), ``(K,)`` its limit (the dtype's
        largest value for ``unrepresentable``, 0 for ``nonfinite``), and ``(K, 5)``
        :data:`STATISTICS`.
    """
    pg, bg, g, extra, row, base_row, golden_max = errors.unbind(1)
    eps = float(torch.finfo(dtype).eps)
    # Scores are computed at float32 or wider (every kernel accumulates q·kᵀ so): a logit s is rounded
    # to about |s|·eps(scores), whatever the inputs' dtype.
    logit_rounding = logit_max * min(eps, float(torch.finfo(torch.float32).eps))
    rel_floor = max(logit_rounding, 0.5 * eps)
    # absolute, baseline, relative (squared until sqrt_), each 0 where its denominator is
    numerator = torch.stack((pg, bg, pg), dim=1)
    denominator = torch.stack((g, g, torch.maximum(bg, rel_floor**2 * g)), dim=1)
    defined = denominator > 0
    errs = torch.where(defined, numerator / torch.where(defined, denominator, 1.0), 0.0).sqrt_()
    absolute, baseline, relative = errs.unbind(1)
    # The absolute and row limits widen by the logits' rounding, as the relative floor does.
    widened = limit[:, 1:].clamp(min=4.0 * rel_floor)
    abs_limit, row_fixed = widened[:, 0].clamp(max=CONDITIONING_LIMIT), widened[:, 1]
    row_lim = torch.maximum(row_fixed, ROW_RATIO * base_row)
    ill = baseline > CONDITIONING_LIMIT
    if logit_rounding > CONDITIONING_LIMIT:  # logits too large for their differences to be resolved
        ill = torch.ones_like(ill)
        baseline = baseline.clamp(min=logit_rounding)
    ill = ill & ((absolute > abs_limit) | (row > row_fixed))  # a primary that close is right regardless
    gross = (absolute > 1.0) & (relative > GROSS_RATIO)
    # The most exceeded of relative, absolute, row names the failure; absolute's margin is the smaller
    # of its two (the dtype's limit, ABSOLUTE_RATIO x the baseline's error).
    values = torch.stack((relative, absolute, row), dim=1)
    bounds = torch.stack((limit[:, 0], abs_limit, row_lim), dim=1)
    compared = values / bounds
    compared[:, 1] = torch.minimum(compared[:, 1], relative / ABSOLUTE_RATIO)
    most = compared.argmax(1, keepdim=True)
    top = compared.amax(1)
    # The checks, lowest priority first; the last that holds decides (0: none, the call passes):
    # a criterion exceeded, ill-conditioned, ill-conditioned but gross, extra non-finite positions,
    # a golden beyond the dtype's range.
    hits = torch.stack(
        (top > 1, ill, ill & gross, extra > 0, golden_max > float(torch.finfo(dtype).max)), dim=1
    )
    priority, codes, cond, zero, finite_max = _decision_constants(errors.device, dtype)
    pick = (hits * priority).amax(1)
    code = torch.where(pick == 1, most[:, 0].to(pg.dtype) + 2.0, codes[pick])  # relative 2, ...
    k = errors.shape[0]
    value = torch.stack(
        (relative, values.gather(1, most)[:, 0], baseline, absolute, extra, golden_max), dim=1
    )
    bound = torch.stack(
        (
            limit[:, 0],
            bounds.gather(1, most)[:, 0],
            cond.expand(k),
            abs_limit,
            zero.expand(k),
            finite_max.expand(k),
        ),
        dim=1,
    )
    at = pick[:, None]
    score = torch.where(code < 0, 0.0, top)  # an undetermined call scores nothing
    stats = torch.stack((score, absolute, baseline, relative, row), dim=1)
    return code, value.gather(1, at)[:, 0], bound.gather(1, at)[:, 0], stats


@cache
def _decision_constants(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """:func:`decide`'s constant tensors on one device, for one dtype (made once): the checks'
    priorities 1 … 5, the code of each check (index 0: none; 1: the exceeded criterion's, set apart),
    and, float64, the conditioning limit, 0 and the dtype's largest value."""
    f64 = torch.float64
    return (
        torch.arange(1, 6, device=device),
        torch.tensor([0.0, 0.0, -1.0, 3.0, 1.0, -2.0], dtype=f64, device=device),
        *torch.tensor([CONDITIONING_LIMIT, 0.0, float(torch.finfo(dtype).max)], dtype=f64, device=device),
    )


@dataclass(frozen=True)
class Judgement:
    """The rule's answer for one call and direction (plain Python values).

    Attributes:
        verdict: ``pass``, ``fail`` or ``undetermined``.
        criterion: the :data:`CRITERIA` name that decided (None on a pass).
        value: the deciding statistic (on a pass, ``relative``).
        limit: its limit (0 for ``nonfinite``; the dtype's largest value for ``unrepresentable``).
        reason: the verdict in words.
        limit_ratio, absolute, baseline, relative, row: :data:`STATISTICS`.
    """

    verdict: str
    criterion: str | None
    value: float
    limit: float
    reason: str
    limit_ratio: float
    absolute: float
    baseline: float
    relative: float
    row: float

    @property
    def passed(self) -> bool:
        """Whether the verdict is ``pass``."""
        return self.verdict == "pass"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def reason(criterion: str | None, value: float, limit: float, dtype: torch.dtype | None = None) -> str:
    """The criterion's verdict in words (the kernel author's words: relative error, ratio, row).

    Args:
        criterion: a :data:`CRITERIA` name, or None (a pass).
        value: the deciding statistic.
        limit: the criterion's limit.
        dtype: the dtype the kernels computed in, where known.
    """
    fp8 = {dt: f"FP8 {fmt.upper()}" for fmt, dt in FP8_DTYPES.items()}
    name = "this" if dtype is None else fp8.get(dtype, str(dtype).removeprefix("torch."))
    baseline = "the FP8 baseline" if dtype in fp8 else "the same-dtype baseline"
    if criterion == "nonfinite":
        return f"NaN/Inf at {int(value)} more position(s) than the baseline, where the FP64 golden is finite"
    if criterion == "unrepresentable":
        return (
            f"the FP64 golden reaches {value:.3g}, beyond the dtype's range (max {limit:.3g}): no "
            "value in the dtype can be right (undetermined)"
        )
    if criterion == "ill_conditioned":
        return (
            f"{baseline} (or the rounding of the largest logit) is itself {value:.3g} off the "
            f"golden (relative L2, above {limit:.3g}): too ill-conditioned to judge (undetermined)"
        )
    if criterion == "absolute":
        return (
            f"relative L2 error {value:.3g} against the FP64 golden; no correct kernel at "
            f"{name} precision exceeds {limit:.3g} where the baseline is {ABSOLUTE_RATIO:g}x closer"
        )
    if criterion == "row":
        return f"worst row {value:.3g} off the golden (relative to the row; limit {limit:.3g})"
    if criterion == "biased":
        return f"the error has one sign: signed bias z = {value:+.3g} (|z| limit {limit:g})"
    if criterion == "relative":
        return f"relative L2 error {value:.3g}x {baseline}'s (limit {limit:g})"
    return f"relative L2 error {value:.3g}x the baseline's (limit {limit:g}), within every limit"


def judge_bias(entry: Mapping[str, Any], direction: str = "out") -> Judgement:
    """The ``biased`` criterion on one direction's signed bias, read into a :class:`Judgement`: the
    probe applies it to a site over its calls and steps, the fuzzer to the (batch, head) replicates
    of one call of its signed-bias cases.

    Args:
        entry: a :func:`flashprobe.bias.bias_dict` entry (``BiasStats.as_dict()[direction]``).
        direction: its name, for the reason.

    Returns:
        ``fail`` (criterion ``biased``, value ``z``, limit the ``|z|`` limit) where ``|z|`` reaches
        the limit; ``undetermined`` while too few replicates could reach it; else ``pass``.
        ``limit_ratio`` is ``|z| / limit``; the magnitude statistics are not this criterion's (0).
    """
    z, limit = float(entry["z"]), float(entry["limit"])
    verdict = {"biased": "fail", "undetermined": "undetermined"}.get(entry["verdict"], "pass")
    component = entry["component"]
    mean = entry[component]["mean"]
    detail = (
        f"{direction}: {component} {mean:+.3g} of the baseline's error RMS over {entry['replicates']} "
        "replicates"
        if mean is not None
        else f"{direction}: no replicate"
    )
    if verdict == "fail":
        text = f"{reason('biased', z, limit)}; {detail}"
    elif verdict == "undetermined":
        text = f"{detail}: fewer than {limit**2:g} replicates cannot reach |z| {limit:g} (undetermined)"
    else:
        text = f"signed bias z = {z:+.3g} (|z| limit {limit:g}); {detail}"
    criterion = "biased" if verdict == "fail" else None
    return Judgement(
        verdict=verdict,
        criterion=criterion,
        value=z,
        limit=limit,
        reason=text,
        limit_ratio=abs(z) / limit,
        **dict.fromkeys(STATISTICS[1:], 0.0),  # absolute, baseline, relative, row
    )


def judge_tensors(
    sums: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype,
    direction: str,
    *,
    logit_max: float = 0.0,
    precision: torch.dtype | None = None,
) -> Judgement:
    """:func:`decide` on one call's ``(7, 3)`` pair sums and ``(3,)`` :func:`row_statistics`, read
    into a :class:`Judgement` (``precision``: as :func:`judge_errors`)."""
    errors = error_columns(sums.detach().to("cpu", torch.float64).reshape(1, 7, 3), rows.reshape(1, 3).cpu())
    return judge_errors(errors[0], dtype, direction, logit_max=logit_max, precision=precision)


def judge_errors(
    errors: torch.Tensor | Sequence[float],
    dtype: torch.dtype,
    direction: str,
    *,
    logit_max: float = 0.0,
    precision: torch.dtype | None = None,
) -> Judgement:
    """:func:`decide` on one call and direction's ``(7,)`` :data:`ERROR_COLUMNS`, read into a
    :class:`Judgement` (what a caller with its own sums, e.g. the fuzzer, calls).

    Args:
        errors: the :data:`ERROR_COLUMNS`.
        dtype: the dtype of the call's inputs and outputs (its range and rounding).
        direction: ``out``, ``dq``, ``dk`` or ``dv``.
        logit_max: the largest valid |logit| of the call where known.
        precision: the FP8 dtype (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) an FP8 kernel
            rounds its operands to, whose limits then apply (:func:`fp8_baseline`); the baseline must
            then be FP8 too (``math:fp8=<format>``). None: ``dtype``'s limits.
    """
    row = torch.as_tensor(errors, dtype=torch.float64).reshape(1, len(ERROR_COLUMNS))
    code, value, bound, stats = decide(row, dtype, limits(precision or dtype, [direction]), logit_max)
    c, v, lim = int(code.item()), float(value.item()), float(bound.item())
    criterion = CRITERIA.get(c)
    verdict = "pass" if c == 0 else ("fail" if c > 0 else "undetermined")
    named = dict(zip(STATISTICS, stats[0].tolist(), strict=True))
    text = reason(criterion, v, lim, precision or dtype)
    return Judgement(verdict=verdict, criterion=criterion, value=v, limit=lim, reason=text, **named)


def judge(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor,
    direction: str = "out",
    *,
    dtype: torch.dtype | None = None,
    logit_max: float = 0.0,
) -> Judgement:
    """The rule on three tensors of one call (one host read).

    Args:
        primary: the kernel's output or gradient, any shape ``(..., D)``.
        baseline: the same-dtype baseline's, same number of elements.
        golden: the FP64 golden, same number of elements.
        direction: ``out``, ``dq``, ``dk`` or ``dv``.
        dtype: the dtype the kernels computed in (default: ``primary``'s).
        logit_max: the largest valid |logit| of the call where known (widens the floors for
            kernels that round logits: :func:`decide`).

    Returns:
        The :class:`Judgement`.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} must be one of {', '.join(DIRECTIONS)}")
    sums, rows, *_ = call_statistics(primary, baseline, golden)
    return judge_tensors(sums, rows, dtype or primary.dtype, direction, logit_max=logit_max)


def fp8_baseline(kernel: str | Kernel, baseline: str | Kernel) -> tuple[str | Kernel, torch.dtype | None]:
    """The baseline and the limits' precision that judge ``kernel`` (the fuzzer's and the probe's).

    A kernel that rounds its operands to FP8 (it declares the format in ``KernelCapabilities.fp8``)
    is as correct as a correct FP8 kernel when it passes against the FP8 baseline
    ``math:fp8=<format>`` (Q, K and V rounded to the format with one amax scale per tensor, the rest
    in float32) with the limits of the format's dtype; the baseline then differs from the kernel in
    the algorithm only, as ``math`` does from a 16-bit kernel.

    Returns:
        For an FP8 kernel, that baseline in place of ``math`` and the format's dtype (``precision``
        of :func:`judge_errors`); otherwise ``baseline`` and None (the call's dtype).
    """
    fmt = get_kernel(kernel).capabilities.fp8
    if fmt is None:
        return baseline, None
    if get_kernel(baseline).spec == "math":
        baseline = f"math:fp8={fmt}"
    return baseline, FP8_DTYPES[fmt]


def fp8_realisations(baseline: str | Kernel) -> list[str]:
    """The FP8 baseline's other realisations of its rounding: ``math:fp8=<format>,fp8_draw=<r>`` for
    ``r = 1 … FP8_DRAWS − 1``, Q's, K's and V's amax scales shifted by factors in ``(½, 1]``
    (:func:`flashprobe.kernels.fp8.realisation_shifts`). Which valid scale quantizes a tensor is the
    kernel's choice and each rounds differently, so the FP8 baseline's error is the largest over
    these and the amax draw (folded in by the caller; the probe judges against the amax draw alone).
    Empty for any other baseline (``math``, a draw already chosen, a user's)."""
    kernel = get_kernel(baseline)
    fmt = kernel.options.get("fp8")
    if kernel.name != "math" or fmt not in FP8_DTYPES or set(kernel.options) != {"fp8"}:
        return []
    return [f"math:fp8={fmt},fp8_draw={r}" for r in range(1, FP8_DRAWS)]


#: The LSE's limit: this many times the same-dtype baseline's worst row error (:func:`judge_lse`).
LSE_RELATIVE_LIMIT: float = 8.0
#: The LSE's floor in units of :func:`resolution` (bf16 0.031, fp16 0.0039, float32 6e-5).
LSE_ABSOLUTE_EPS: float = 4.0
#: The criteria of the ``lse`` direction: infinities where the golden is finite, a row without keys
#: not holding the empty-row value, a value off the golden, a golden beyond float32 (undetermined).
LSE_CRITERIA: tuple[str, ...] = ("nonfinite", "empty_row", "lse", "unrepresentable")
#: :func:`lse_statistics`' entries, in order
LSE_STATISTICS: tuple[str, ...] = (
    "limit_ratio", "absolute", "baseline", "nonfinite", "empty_row", "golden_max"
)  # fmt: skip


def lse_statistics(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor,
    dtype: torch.dtype,
    *,
    empty: float = float("-inf"),
) -> torch.Tensor:
    """One call's LSE statistics, on the device (no host read).

    Args:
        primary: ``(B, H, N_q)`` (any shape) the kernel's LSE, in the golden's base.
        baseline: the same-dtype baseline's, as many elements.
        golden: the FP64 golden's (``−inf`` for a row that sees no key).
        dtype: the dtype of the call's inputs (the floor's resolution).
        empty: the value a row without keys must hold: ``−inf`` (the logical form) or a kernel's
            declared ``empty_lse`` (``+inf`` for flash-attn 2).

    Returns:
        ``(6,)`` float64 :data:`LSE_STATISTICS`: the worst row's ``|primary − golden| / limit``, the
        worst ``|primary − golden|`` and ``|baseline − golden|`` (over the rows the golden sees keys
        in), the rows with keys where the primary is not finite, the rows without keys where it is
        not ``empty``, and the golden's largest finite magnitude.
    """
    p, b, g = (t.detach().reshape(-1).to(torch.float64) for t in (primary, baseline, golden))
    seen = torch.isfinite(g)
    zero = torch.zeros((), dtype=torch.float64, device=g.device)
    err = torch.where(seen & torch.isfinite(p), (p - g).abs(), zero)
    base = torch.where(seen & torch.isfinite(b), (b - g).abs(), zero)
    base_max = base.amax() if base.numel() else zero
    magnitude = torch.where(seen, g.abs(), zero)
    eps32 = float(torch.finfo(torch.float32).eps)
    floor = (4.0 * eps32 * magnitude).clamp(min=LSE_ABSOLUTE_EPS * resolution(dtype))
    limit = torch.maximum(LSE_RELATIVE_LIMIT * base_max, floor)
    ratio = (err / limit).amax() if err.numel() else zero
    nonfinite = (seen & ~torch.isfinite(p)).sum().to(torch.float64)
    empty_rows = (~seen & (p != empty)).sum().to(torch.float64)  # (NaN != anything)
    return torch.stack(
        (ratio, err.amax() if err.numel() else zero, base_max, nonfinite, empty_rows,
         magnitude.amax() if magnitude.numel() else zero)
    )  # fmt: skip


def judge_lse(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor,
    *,
    dtype: torch.dtype,
    empty: float = float("-inf"),
) -> Judgement:
    """The ``lse`` direction's verdict on one call (one host read): :func:`lse_statistics` read by
    the criteria of :data:`LSE_CRITERIA`, in that order.

    The LSE is judged row by row in the base the kernel declares: a row that sees no key must hold
    exactly ``empty``, a row that sees keys a finite value within ``max(``
    :data:`LSE_RELATIVE_LIMIT` ``× the baseline's worst row error, the floor)`` of the golden, the
    floor :data:`LSE_ABSOLUTE_EPS` ``· resolution(dtype)`` and at least ``4·eps₃₂·|golden|`` (an LSE
    is stored in float32 at least). A base-2 LSE read as natural, a missing scale or sink, or an LSE
    converted twice is off by far more than any rounding.

    Args:
        primary, baseline, golden, dtype, empty: as :func:`lse_statistics`.

    Returns:
        The :class:`Judgement`: ``fail`` (``nonfinite``, ``empty_row`` or ``lse``), ``undetermined``
        (``unrepresentable``: a golden LSE beyond float32's range) or ``pass``; ``limit_ratio`` the
        worst row's error over its limit, ``absolute`` and ``baseline`` the worst ``|x − golden|``,
        ``relative`` their ratio, ``row`` 0.
    """
    ratio, err, base, nonfinite, empty_rows, golden_max = lse_statistics(
        primary, baseline, golden, dtype, empty=empty
    ).tolist()
    relative = err / base if base > 0 else (0.0 if err == 0 else float("inf"))
    stats = {"limit_ratio": ratio, "absolute": err, "baseline": base, "relative": relative, "row": 0.0}
    f32_max = float(torch.finfo(torch.float32).max)
    if nonfinite:
        criterion, value, limit = "nonfinite", nonfinite, 0.0
        text = f"LSE non-finite in {int(nonfinite)} row(s) that see keys, where the FP64 golden is finite"
    elif empty_rows:
        criterion, value, limit = "empty_row", empty_rows, 0.0
        text = f"LSE of {int(empty_rows)} row(s) that see no key is not {empty}, the declared empty-row value"
    elif golden_max > f32_max:
        criterion, value, limit = "unrepresentable", golden_max, f32_max
        text = f"the FP64 golden LSE reaches {golden_max:.3g}, beyond float32 (undetermined)"
    elif ratio > 1.0:
        criterion, value, limit = "lse", ratio, 1.0
        text = (
            f"LSE off the golden by up to {err:.3g} (the same-dtype baseline by {base:.3g}): "
            f"{ratio:.3g}x its limit (max({LSE_RELATIVE_LIMIT:g}x the baseline's, the floor))"
        )
    else:
        return Judgement(
            verdict="pass", criterion=None, value=ratio, limit=1.0, **stats,
            reason=f"LSE error / limit {ratio:.3g} (off the golden by {err:.3g}, the baseline by {base:.3g})",
        )  # fmt: skip
    verdict = "undetermined" if criterion == "unrepresentable" else "fail"
    return Judgement(verdict=verdict, criterion=criterion, value=value, limit=limit, reason=text, **stats)
