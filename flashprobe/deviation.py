"""Elementwise deviation between two attention outputs, and the error ratio.

Vocabulary (DESIGN.md): for outputs ``a`` and reference ``b`` of the same shape,

* ``max_abs``  = max |a − b| over finite pairs,
* ``mean_abs`` = mean |a − b| over finite pairs,
* ``rel_l2``   = ‖a − b‖₂ / ‖b‖₂ over finite pairs (0 when both are 0),
* ``nonfinite`` = number of positions where ``a`` or ``b`` is NaN/±inf — counted, never
  allowed to turn the maxima into NaN; when *no* pair is finite the other statistics are
  undefined (NaN);
* **error ratio** = ``max_abs(primary, golden) / max(max_abs(baseline, golden), noise floor)``;
  flash-attention's own tests pass a kernel when it is ≤ 2. The **noise floor**
  (:func:`noise_floor`) is half a unit in the last place of the largest golden value in the dtype
  the kernels computed in, ``½·eps(dtype)·max|golden|``: the rounding error of merely storing the
  golden output in that dtype, which any baseline error normally exceeds. It only matters when the
  baseline is (nearly) exact, where a bare ratio would be infinite or noise over noise. A ratio
  that is undefined — no finite value compared (every output NaN), or 0/0 — is ``None``.

**Names** used everywhere (probe statistics, bench rows, fuzz results, reports): the three
:data:`PAIRS` ``primary_baseline``, ``primary_golden``, ``baseline_golden`` (``a_b`` = deviation of
``a`` from reference ``b``) and the statistics of :class:`Deviation`. A flat key joins them with an
underscore (``primary_golden_max_abs``), a nested record nests them (``{"primary_golden": {"max_abs":
...}}``).

Differences are computed in float64. :func:`deviation_tensors` returns 0-d tensors on the inputs'
device (no host synchronisation) so callers can accumulate them; :func:`deviation` returns floats.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "PAIRS",
    "PAIR_LABELS",
    "Deviation",
    "deviation",
    "deviation_tensors",
    "error_ratio",
    "finish_deviation",
    "noise_floor",
]

#: The compared pairs, ``a_b`` meaning deviation of ``a`` from reference ``b``.
PAIRS: tuple[str, ...] = ("primary_baseline", "primary_golden", "baseline_golden")
#: Each pair in words, for tables and figures.
PAIR_LABELS: dict[str, str] = {
    "primary_baseline": "primary vs baseline",
    "primary_golden": "primary vs golden",
    "baseline_golden": "baseline vs golden",
}


@dataclass(frozen=True)
class Deviation:
    """Deviation of ``a`` from a reference ``b`` (see module docstring)."""

    max_abs: float
    mean_abs: float
    rel_l2: float
    nonfinite: int
    numel: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def deviation_tensors(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sufficient statistics of ``a − b`` as 0-d float64 tensors on the inputs' device.

    Args:
        a: any shape.
        b: the reference, same shape as ``a``.

    Returns:
        ``max_abs``, ``sum_abs``, ``sum_sq_diff``, ``sum_sq_ref``, ``nonfinite`` (count of
        positions where either is non-finite) and ``count`` (finite positions). Reductions of
        several calls: max of ``max_abs``, sums of the rest.
    """
    if a.shape != b.shape:
        raise ValueError(f"deviation: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a64, b64 = a.detach().double(), b.detach().double()
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    diff = torch.where(finite, a64 - b64, 0.0).abs()
    ref = torch.where(finite, b64, 0.0)
    count = finite.sum(dtype=torch.float64)
    return {
        "max_abs": diff.amax() if diff.numel() else diff.new_zeros(()),
        "sum_abs": diff.sum(),
        "sum_sq_diff": diff.square().sum(),
        "sum_sq_ref": ref.square().sum(),
        "nonfinite": a64.numel() - count,
        "count": count,
    }


def _finish(t: dict[str, float]) -> Deviation:
    count, nonfinite = t["count"], int(t["nonfinite"])
    if not count and nonfinite:  # no finite pair compared: every statistic is undefined
        return Deviation(math.nan, math.nan, math.nan, nonfinite, nonfinite)
    rel = (
        math.sqrt(t["sum_sq_diff"] / t["sum_sq_ref"])
        if t["sum_sq_ref"] > 0
        else (0.0 if t["sum_sq_diff"] == 0 else math.inf)
    )
    return Deviation(
        max_abs=t["max_abs"],
        mean_abs=t["sum_abs"] / count if count else 0.0,
        rel_l2=rel,
        nonfinite=nonfinite,
        numel=int(count + nonfinite),
    )


def deviation(a: torch.Tensor, b: torch.Tensor) -> Deviation:
    """Deviation of ``a`` from reference ``b`` as Python floats (one host sync)."""
    t = deviation_tensors(a, b)
    values = torch.stack(list(t.values())).tolist()
    return _finish(dict(zip(t.keys(), values, strict=True)))


def finish_deviation(sums: dict[str, float]) -> Deviation:
    """Turn accumulated sufficient statistics (see :func:`deviation_tensors`) into a :class:`Deviation`."""
    return _finish(sums)


def noise_floor(golden_max_abs: float, dtype: torch.dtype) -> float:
    """The error ratio's noise floor: ``½ · eps(dtype) · max|golden|``.

    Args:
        golden_max_abs: the largest magnitude of the golden output.
        dtype: the dtype the kernels computed in.
    """
    return 0.5 * float(torch.finfo(dtype).eps) * golden_max_abs


def error_ratio(primary_golden: float, baseline_golden: float, *, floor: float = 0.0) -> float | None:
    """The error ratio ``primary_golden / max(baseline_golden, floor)`` of two ``max_abs`` deviations.

    Args:
        primary_golden: ``max_abs`` of the primary kernel against the golden value.
        baseline_golden: ``max_abs`` of the baseline against the golden value.
        floor: the noise floor (:func:`noise_floor`); with the default 0 an exact baseline gives
            an infinite ratio.

    Returns:
        The ratio; ``inf`` when the denominator is 0 and the primary is not exact; ``None`` when it
        is undefined: 0/0, or a NaN deviation (nothing finite was compared).

    Raises:
        ValueError: a deviation or the floor is negative (they are absolute differences).
    """
    if primary_golden < 0 or baseline_golden < 0 or floor < 0:
        raise ValueError(
            f"error_ratio: deviations and the floor are absolute differences and cannot be negative, got "
            f"{primary_golden}, {baseline_golden} and floor {floor}"
        )
    if math.isnan(primary_golden) or math.isnan(baseline_golden):
        return None
    denominator = max(baseline_golden, floor)
    if denominator == 0:
        return None if primary_golden == 0 else math.inf
    return primary_golden / denominator
