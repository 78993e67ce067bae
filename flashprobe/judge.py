"""The verdict's one rule: is this call's output (or gradient) as right as a correct kernel's?

Every place that says ``pass``, ``fail`` or ``undetermined`` — the probe (on the device, at every
call), ``flashprobe fuzz``, ``flashprobe replay`` and ``flashprobe bench verdicts`` — decides
here, with :func:`decide` (tensors, no host read) or :func:`judge` (plain numbers, one call).

**Statistics** of one call and one direction (``out``, ``dq``, ``dk``, ``dv``), all against the
FP64 **golden** ``g``, over the finite pairs (:func:`flashprobe.deviation.pair_sums` gives the
sums, :func:`row_statistics` the rows):

* ``absolute`` = ‖primary − g‖₂ / ‖g‖₂, the primary's relative L2 error (0 for an all-zero golden,
  where no relative error is defined);
* ``baseline`` = ‖baseline − g‖₂ / ‖g‖₂, the same-dtype baseline's (the larger over its forms where
  the caller computes several: the probe and the fuzzer add, for gradients, the flash form of the
  backward, which takes ``rowsum(dO∘O)`` from the rounded output as flash kernels do —
  :func:`noise_statistics`);
* ``relative`` = ‖primary − g‖₂ / max(‖baseline − g‖₂, floor · ‖g‖₂), the error ratio to the
  baseline; ``floor = max(½·eps, eps₃₂·logit_max)``: the rounding of the golden value in the dtype,
  or of the largest logit where the caller knows it (a kernel that rounds a logit ``s`` in its
  float32 scores, as every exp2 kernel does with ``s·log2(e)``, is off by about ``|s|·eps₃₂``);
* ``row`` = the worst row's error, ``max_r ‖primary_r − g_r‖₂ / max(‖g_r‖₂, rms_r ‖g_r‖₂)``: a row is
  the last dimension, so a query row for ``out`` and ``dq``, a key row for ``dk`` and ``dv``.

**Criteria**, in the order they are checked; the first that applies decides and names itself (of
4–6, the one exceeded most, relative to its limit):

1. ``unrepresentable`` → ``undetermined``: the golden's largest magnitude exceeds the dtype's
   range (an fp16 golden gradient of 9.2e5): no value in the dtype could be right.
2. ``nonfinite`` → ``fail``: NaN/±Inf in the primary at more positions than in the baseline.
3. ``ill_conditioned`` → ``undetermined``: the baseline is itself more than
   :data:`CONDITIONING_LIMIT` (a quarter of the golden's size) off — a very sharp or flat softmax,
   cancelling gradients, logits the 16-bit baseline rounds coarsely — or the rounding of the
   largest logit is (``eps·logit_max``: logits near the float range, whose differences cannot be
   resolved), *and* the primary is not within the absolute and row limits (a kernel that close to
   the golden is right, however poor the baseline; it passes). No ratio means anything there —
   unless the primary is plainly wrong all the same: off by more than the golden's own size and
   :data:`GROSS_RATIO` times the baseline's error (then ``absolute`` fails it).
4. ``absolute`` → ``fail``: the primary's relative error exceeds :func:`absolute_limit` — what no
   correct kernel at this dtype reaches where the call is well-conditioned — and is
   :data:`ABSOLUTE_RATIO` times the baseline's. This catches a gradient tens of percent wrong
   where the 16-bit baseline is itself a few percent off (a ratio of 20, under the relative
   limit). The guard ratio keeps a correct kernel that rounds every step in the dtype, as the
   baseline does, from failing where the call is hard for both.
5. ``row`` → ``fail``: the worst row exceeds :func:`row_limit` and :data:`ROW_RATIO` times the
   baseline's worst row (where the softmax is sharp some rows are hard for every kernel): a zeroed
   key tile, wrong tail rows, one wrong head or batch entry, which the whole-tensor L2 averages
   away.
6. ``relative`` → ``fail``: the error ratio exceeds :data:`RELATIVE_LIMITS` (where the same-dtype
   baseline is strong, in float32, the sharpest criterion).

Further per-call criteria extend :data:`CRITERIA`: a code, a name, a limit and one comparison in
:func:`decide`. The signed bias is judged over many replicates, not by :func:`decide`: criterion 5,
``biased`` → ``fail``, where the self-normalised sum ``z`` of the replicates' signed mean errors
(:mod:`flashprobe.bias`) reaches :data:`flashprobe.bias.BIAS_Z_LIMIT` (:func:`judge_bias`). The probe
applies it to a site over its calls and steps (``biased: ...``,
:func:`flashprobe.probing.shadow.site_verdict`), the fuzzer to the (batch, head) replicates of one call
of its ``signed bias`` cases; no other call fails for it.

**The statistic shown first** is :data:`SCORE`, ``limit_ratio``: the largest ``statistic / limit``
over the criteria 4–6 (> 1 fails; 0 for an undetermined call). A progress bar, summary or figure
that shows it shows the number the verdict used; the older ratios stay under their own names
(``error_ratio``: of maxima, flash-attention's statistic; ``l2_error_ratio``: ``relative``).

**Limits.** With ``ε = max(eps(dtype), 2⁻¹⁶)`` (the dtype's resolution, at least 1.5e-5: float32
errors are set by the logits and reduction lengths, not by its eps): absolute ``4ε`` (``out``) and
``8ε`` (gradients), i.e. bf16 3.1 % / 6.3 %, fp16 0.39 % / 0.78 %, float32 6e-5 / 1.2e-4; row
``min(½, 64ε)``. Measured (``tests/test_judge.py``, ``flashprobe bench verdicts``; docs/calibration.md
"Why the limits are these"): correct kernels that
accumulate in fp32 (torch's flash and math, ``tiled`` ``fa2``) stay at about ``1ε``; those that
round every step in the dtype (``tiled`` ``paper``, and the baseline itself) reach ``6ε`` at
most at moderate sharpness, and within 1.6× of the baseline on the calibration models (the fuzzer's
``single_query`` and ``grad_out_tiny`` cases take one row of ``paper`` to 2.1–2.3× in some seeds, where it
fails the row criterion: docs/fuzz.md "The `paper` preset's failures, step by step"); a backward that drops
``rowsum(dO·O)`` is tens of percent off at 20–1000× the baseline, and a zeroed key tile's rows read
1. Gradients get twice the output's limits because ``dS = P∘(dP − rowsum(dO·O))`` cancels: their
errors are a few times the output's for every correct kernel.

**The LSE** (``lse``, a direction of its own: :func:`judge_lse`, from :func:`lse_statistics` on the
device) is judged row by row in the base the kernel declares, against the golden's LSE and the
same-dtype baseline's (both from :func:`flashprobe.kernels.math.call_reference`): a row that sees no
key must hold exactly the empty-row value (``−inf`` in the logical form, or the kernel's declared
``KernelCapabilities.empty_lse`` for its own LSE: ``empty_row``), a row that sees keys a finite value
(``nonfinite``), within ``max(`` :data:`LSE_RELATIVE_LIMIT` ``× the baseline's worst row error, the
floor)`` of the golden (``lse``), the floor :data:`LSE_ABSOLUTE_EPS` ``· resolution(dtype)`` and at least
``4·eps₃₂·|golden|`` (an LSE is stored in float32 at least: a base conversion or an exp2 kernel's
``s·log2(e)`` rounds it so). An LSE error is a relative error of the row's softmax denominator: a base-2
LSE read as natural, a missing scale or sink, ALiBi added at another anchor, an LSE converted twice
are off by far more than any rounding.

**FP8.** A kernel that rounds its operands to an FP8 format (Q, K, V or P; it says so in
``KernelCapabilities.fp8``) is as correct as a correct FP8 kernel when it is within these criteria
against the **FP8 baseline** ``math:fp8=<format>`` — Q, K and V rounded to the format with one amax
scale per tensor, everything after in float32 — with the limits of the format's dtype
(``precision`` of :func:`judge_errors`): E4M3's ``ε = 2⁻³`` makes the absolute limit the ¼ cap
(and 4× the FP8 baseline's error), the row limit ½ (and 4× its worst row), and the relative
limit stays 8× the FP8 baseline's error. The baseline differs from the kernel in the algorithm
only (tiling, the FP8 cast of P, finer scales, the rotation), as ``math`` does from a 16-bit kernel.
Its error is **the spread of FP8's own rounding, not one draw of it**: which scale quantizes a
tensor is the kernel's choice (the amax, a static scale, one per block), every valid one rounds each
value differently, and where a few roundings decide the result the error depends on which. So the
FP8 baseline's error is the largest over :data:`FP8_DRAWS` realisations of its rounding
(:func:`fp8_realisations`: ``math:fp8=<format>,fp8_draw=<r>``, Q's, K's and V's amax scales shifted
by factors in ``(½, 1]`` that are not powers of two, :func:`flashprobe.kernels.fp8.realisation_shifts`),
folded in by the caller as the baseline's other forms are (the fuzzer's noise,
:mod:`flashprobe.fuzz.references`). Every criterion reads that one yardstick, the conditioning
included: a call where some valid rounding is more than ¼ off is one FP8 cannot be judged on. The
probe, which computes one baseline per call on the device, judges an FP8 primary against the amax
draw alone.
On the fuzzer's ``outliers`` call of seed 8 (bf16; a channel of q and k 20× the others, logits in the
hundreds) per-tensor E4M3 with static scales 0.08–0.14 is 0.042–0.381 off the golden, the
amax draw 0.094 and ``fa3_fp8`` with ``rotation=off`` 0.378: against the amax draw alone it failed
(4× closer needed), against the five draws (up to 0.246) it passes (``tests/fuzz/test_fp8_rule.py``).
Measured over 20 seeds of the fuzzer's default catalogue, bf16, fp16 and fp32, outputs only
(docs/calibration.md "FA3's FP8 forward (`tiled:preset=fa3_fp8`) over 20 seeds";
``tests/fuzz/test_fp8_rule.py`` repeats a subset): ``fa3_fp8`` with ``rotation=off`` failed one of its
2,484 judged calls against the amax draw alone, that ``outliers`` call, and none of the cases that
failed or came close (``outliers``, ``rising_max``, ``sentinel_*``) against the five; on seeds 0–1, bf16
and fp16, it, per-tensor scales and E5M2 stay within 1.4× the FP8 baseline's error, and four
FP8 bug classes fail (a descale left out, on all of V or on its last block of keys; Q rotated but not
K; K scaled from its first rows). With the Hadamard rotation (the preset's default) three kinds of
call fail, and each is FA3's published algorithm, not the emulation's nor the judge's (the kernel is
within 1 % of an FP64 FA3 forward written out by hand: ``tests/fuzz/test_fp8_rule.py``): ``rising_max``
(worst row; every seed in fp16 and fp32, some in bf16) and logits of 1e4 or more (``sentinel_*``,
``raw_sentinel_*``; a few seeds, 0.7–7× the golden's size off) — rotated, every channel of a key mixes
all its channels (size about ``‖k_j‖/√d``) and rounds by up to 2⁻⁴ of that, so a logit's error scales
with ``‖q_i‖·‖k_j‖``, independently key by key, instead of with ``Σ_c |q_ic·k_jc|``: quiet rows inherit
loud rows' errors and logits of 1e4 are off by hundreds; and ``bias_repeated_max`` in fp16 (signed bias,
z −5.0 to −6.0) — FA3 divides by the row sum of P in fp32 but multiplies V by P in E4M3, which rounds
the rotation's near-ties (P above 31/32) up to 1, so the output leans away from zero. The FP8 baseline
differs from the kernel in the algorithm only at every dtype (both quantize the same bf16, fp16 or fp32
inputs and return that dtype), so these verdicts are the rotation's, and right.
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
    "code_name",
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
#: Limits on the ratio of the primary's L2 error to the same-dtype baseline's, per direction: the
#: output's from ``bench verdicts`` (correct kernels read at most 1.4), the gradients' wider because
#: FlashAttention's backward takes ``rowsum(dO∘O)`` from the rounded output, which the plain
#: baseline does not (correct kernels read up to 10.7 where ``dS`` cancels).
RELATIVE_LIMITS: dict[str, float] = {"out": 8.0, "dq": 64.0, "dk": 64.0, "dv": 64.0}
#: The absolute limit in units of :func:`resolution`, per direction.
ABSOLUTE_EPS: dict[str, float] = {"out": 4.0, "dq": 8.0, "dk": 8.0, "dv": 8.0}
#: The absolute criterion also needs this many times the baseline's relative error.
ABSOLUTE_RATIO: float = 4.0
#: The row limit in units of :func:`resolution` (capped at ½: a zeroed row reads 1).
ROW_EPS: float = 64.0
#: The row criterion also needs this many times the baseline's worst row.
ROW_RATIO: float = 4.0
#: The three limit tables as one record, as ``bench rules`` and ``bench verdicts`` write them.
LIMITS: dict[str, Any] = {"relative": RELATIVE_LIMITS, "absolute_eps": ABSOLUTE_EPS, "row_eps": ROW_EPS}
#: A call is ill-conditioned when the baseline's relative error exceeds this fraction of the golden.
CONDITIONING_LIMIT: float = 0.25
#: In an ill-conditioned call, the primary still fails when it is off by more than the golden's
#: own size and this many times the baseline's error.
GROSS_RATIO: float = 8.0
#: How many realisations of the FP8 baseline's rounding its error is the largest of
#: (:func:`fp8_realisations`): the amax scales and ``FP8_DRAWS − 1`` shifts of them.
FP8_DRAWS: int = 5
#: The statistics of a judgement, in the order :func:`decide` returns them.
STATISTICS: tuple[str, ...] = ("limit_ratio", "absolute", "baseline", "relative", "row")
#: The statistic shown first: the largest ``statistic / limit`` over the criteria that fail.
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

    A row is the last dimension (a query's output or ``dq`` row, a key's ``dk``/``dv`` row); its
    error is ``‖x_r − g_r‖₂ / max(‖g_r‖₂, rms_r ‖g_r‖₂)``: relative to the row's own norm, or to the
    root mean square of the rows' norms where the row is smaller (a row the golden makes tiny does
    not turn rounding into a large relative error). A row with a non-finite difference counts as 0
    here (the ``nonfinite`` criterion counts it). Computed by :func:`call_statistics`, from the
    differences the pair sums take (memory: their bounded scratch and a few per-row vectors).

    Args:
        primary: ``(..., D)`` any floating dtype.
        baseline: as many elements.
        golden: as many elements, the reference.

    Returns:
        ``(3,)`` float64: the primary's and the baseline's worst row (0 for an empty tensor or an
        all-zero golden, where no relative error is defined), and ``max|golden|`` over every
        position (the ``unrepresentable`` criterion's statistic). Combine calls or blocks with a
        maximum.
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
    """Whether the primary, the baseline and the golden were read to be finite everywhere (where a
    host read is free; else ``False``): what lets :meth:`flashprobe.bias.BiasStats.add` skip masking."""


def call_statistics(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor,
    workspace: StatsWorkspace | None = None,
    *,
    form: torch.Tensor | None = None,
) -> CallStatistics:
    """One call's statistics from one pass over its tensors, on the device (no host read):
    :func:`~flashprobe.deviation.pair_and_row_sums` takes each difference once and reduces it
    for the pairs and for the rows.

    Args:
        primary: ``(..., D)`` the kernel's output or gradient.
        baseline: as many elements, the same-dtype baseline's.
        golden: ``(..., D)``, the FP64 golden.
        workspace: scratch buffers to reuse across calls.
        form: as many elements, a second form of the baseline (the flash form of the backward), or
            None.

    Returns:
        The :class:`CallStatistics`.
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
    take the maximum) when given. One difference tensor, no host read (:func:`call_statistics`
    computes it with a call's other statistics, in their pass).

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
    # absolute ‖p − g‖/‖g‖, baseline ‖b − g‖/‖g‖ and relative ‖p − g‖/max(‖b − g‖, floor·‖g‖), each 0
    # where its denominator is: against an all-zero golden a relative error is undefined (the relative
    # criterion, with the baseline's error as yardstick, still applies).
    numerator = torch.stack((pg, bg, pg), dim=1)
    denominator = torch.stack((g, g, torch.maximum(bg, rel_floor**2 * g)), dim=1)
    defined = denominator > 0
    errs = torch.where(defined, numerator / torch.where(defined, denominator, 1.0), 0.0).sqrt_()
    absolute, baseline, relative = errs.unbind(1)
    # The absolute and row limits widen by the logits' rounding, as the relative floor does.
    widened = limit[:, 1:].clamp(min=4.0 * rel_floor)
    abs_limit, row_fixed = widened[:, 0].clamp(max=CONDITIONING_LIMIT), widened[:, 1]
    # A row fails above its limit and ROW_RATIO x the baseline's worst row (sharp rows are hard for all).
    row_lim = torch.maximum(row_fixed, ROW_RATIO * base_row)
    ill = baseline > CONDITIONING_LIMIT
    if logit_rounding > CONDITIONING_LIMIT:  # logits too large for their differences to be resolved
        ill = torch.ones_like(ill)
        baseline = baseline.clamp(min=logit_rounding)
    # Ill-conditioned is undetermined only where the primary is not within the limits a correct kernel
    # keeps in a well-conditioned call: a kernel that is that close to the golden is right regardless.
    ill = ill & ((absolute > abs_limit) | (row > row_fixed))
    # Plainly wrong even where ill-conditioned: off by more than the golden itself, and GROSS x the
    # baseline's error.
    gross = (absolute > 1.0) & (relative > GROSS_RATIO)
    # Of the criteria that compare errors with limits (relative, absolute, row), the most exceeded one
    # names the failure; absolute is beyond the dtype's limit and ABSOLUTE_RATIO x the baseline's
    # error (the smaller of the two margins is the criterion's).
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
    const = _decision_constants(errors.device, dtype)
    pick = (hits * const.priority).amax(1)
    code = torch.where(pick == 1, most[:, 0].to(pg.dtype) + 2.0, const.codes[pick])  # relative 2, ...
    k = errors.shape[0]
    value = torch.stack(
        (relative, values.gather(1, most)[:, 0], baseline, absolute, extra, golden_max), dim=1
    )
    bound = torch.stack(
        (
            limit[:, 0],
            bounds.gather(1, most)[:, 0],
            const.cond.expand(k),
            abs_limit,
            const.zero.expand(k),
            const.finite_max.expand(k),
        ),
        dim=1,
    )
    at = pick[:, None]
    score = torch.where(code < 0, 0.0, top)  # an undetermined call scores nothing
    stats = torch.stack((score, absolute, baseline, relative, row), dim=1)
    return code, value.gather(1, at)[:, 0], bound.gather(1, at)[:, 0], stats


class _DecisionConstants(NamedTuple):
    """:func:`decide`'s constant tensors on one device, for one dtype (made once)."""

    priority: torch.Tensor
    """``(5,)`` int64: 1 … 5, the checks' priorities."""
    codes: torch.Tensor
    """``(6,)`` float64: the code of each check (index 0: none, 1: the exceeded criterion's, set apart)."""
    cond: torch.Tensor
    zero: torch.Tensor
    finite_max: torch.Tensor


@cache
def _decision_constants(device: torch.device, dtype: torch.dtype) -> _DecisionConstants:
    f64 = torch.float64
    return _DecisionConstants(
        torch.arange(1, 6, device=device),
        torch.tensor([0.0, 0.0, -1.0, 3.0, 1.0, -2.0], dtype=f64, device=device),
        torch.tensor(CONDITIONING_LIMIT, dtype=f64, device=device),
        torch.tensor(0.0, dtype=f64, device=device),
        torch.tensor(float(torch.finfo(dtype).max), dtype=f64, device=device),
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
    """The ``biased`` criterion on one direction's signed bias, read into a :class:`Judgement`.

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
            kernels that round logits, see the module docstring).

    Returns:
        The :class:`Judgement`.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r} must be one of {', '.join(DIRECTIONS)}")
    sums, rows, *_ = call_statistics(primary, baseline, golden)
    return judge_tensors(sums, rows, dtype or primary.dtype, direction, logit_max=logit_max)


def fp8_baseline(kernel: str | Kernel, baseline: str | Kernel) -> tuple[str | Kernel, torch.dtype | None]:
    """The baseline and the limits' precision that judge ``kernel`` (the fuzzer's and the probe's):
    for a kernel that declares an FP8 format (``KernelCapabilities.fp8``), the FP8 baseline
    ``math:fp8=<format>`` in place of ``math`` and that format's dtype (``precision`` of
    :func:`judge_errors`; "FP8" above); otherwise ``baseline`` and None (the call's dtype).
    """
    fmt = get_kernel(kernel).capabilities.fp8
    if fmt is None:
        return baseline, None
    if get_kernel(baseline).spec == "math":
        baseline = f"math:fp8={fmt}"
    return baseline, FP8_DTYPES[fmt]


def fp8_realisations(baseline: str | Kernel) -> list[str]:
    """The FP8 baseline's other realisations of its rounding, whose errors its own error is the
    largest of ("FP8" above): ``math:fp8=<format>,fp8_draw=<r>`` for ``r = 1 … FP8_DRAWS − 1``, Q's,
    K's and V's amax scales shifted by factors in ``(½, 1]``
    (:func:`flashprobe.kernels.fp8.realisation_shifts`). Empty for any other baseline (``math``, a
    draw already chosen, a user's)."""
    kernel = get_kernel(baseline)
    fmt = kernel.options.get("fp8")
    if kernel.name != "math" or fmt not in FP8_DTYPES or set(kernel.options) != {"fp8"}:
        return []
    return [f"math:fp8={fmt},fp8_draw={r}" for r in range(1, FP8_DRAWS)]


def code_name(code: float) -> str | None:
    """The :data:`CRITERIA` name of a stored code (None for 0)."""
    return CRITERIA.get(int(code))


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
    the criteria of :data:`LSE_CRITERIA`, in that order (module docstring, "The LSE").

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
