"""Deviation sweeps: primary kernels against the baseline and the FP64 golden value.

Row keys are ``{pair}_{stat}``, ``pair`` in :data:`~flashprobe.deviation.PAIRS` and ``stat`` in
:data:`STATS` (e.g. ``primary_golden_max_abs``); :func:`summarize_seeds` gives their median and spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.inputs import InputConfig, Shape, cast_inputs, make_inputs
from flashprobe.deviation import PAIRS, deviation_tensors, error_ratio, finish_deviation, noise_floor
from flashprobe.kernels import (
    Kernel,
    KernelUnavailableError,
    check_inputs,
    dtype_name,
    golden_attention,
)
from flashprobe.kernels.reference import reference_attention

__all__ = [
    "STATS",
    "Primary",
    "SweepPoint",
    "check_kernel",
    "compare_to_references",
    "deviation_stats",
    "deviation_sweep",
    "summarize_seeds",
]

#: The statistics of each pair in a row: those of :class:`~flashprobe.deviation.Deviation` plus
#: ``std_abs``, the population standard deviation of ``|a − b|``.
STATS = ("max_abs", "mean_abs", "std_abs", "rel_l2")

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Primary:
    """A primary kernel in a sweep, with the labels its rows carry (e.g. ``{"kernel": "tiled"}``)."""

    kernel: Kernel
    labels: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SweepPoint:
    """One point of a deviation sweep: an input shape, its row labels, and the primaries to run."""

    shape: Shape
    primaries: Sequence[Primary]
    labels: Mapping[str, Any] = field(default_factory=dict)


def check_kernel(kernel: Kernel, dtype: torch.dtype, device: torch.device | str, head_dim: int) -> str | None:
    """Check that ``kernel`` runs at ``dtype`` on ``device`` (its own check and one tiny call on zeros)
    before a long sweep starts.

    Returns:
        ``None`` when it runs, else the reason it cannot run here (the sweep skips it).

    Raises:
        BenchArgumentError: the spec's option values are invalid.
    """
    try:
        kernel.check(device, dtype)
        x = torch.zeros(1, 1, 4, head_dim, dtype=dtype, device=device)
        kernel(x, x, x)
    except KernelUnavailableError as err:
        return str(err)
    except (ValueError, TypeError) as err:
        raise BenchArgumentError(f"kernel spec {kernel.spec!r}: {err}") from None
    return None


def deviation_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Elementwise ``|a − b|`` statistics (in float64, over positions where both are finite).

    Args:
        a: any shape.
        b: the reference, same shape as ``a``.

    Returns:
        ``max_abs``, ``mean_abs`` and ``std_abs`` (population standard deviation) of ``|a − b|``,
        ``rel_l2`` (``‖a − b‖ / ‖b‖``) and ``nonfinite`` (positions where either is NaN/inf).
    """
    t = deviation_tensors(a, b)
    sums = dict(zip(t.keys(), torch.stack(list(t.values())).tolist(), strict=True))
    dev = finish_deviation(sums)
    count = sums["count"]
    var = sums["sum_sq_diff"] / count - dev.mean_abs**2 if count else 0.0
    return {
        "max_abs": dev.max_abs,
        "mean_abs": dev.mean_abs,
        "std_abs": math.sqrt(max(var, 0.0)),
        "rel_l2": dev.rel_l2,
        "nonfinite": dev.nonfinite,
    }


def compare_to_references(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    primaries: Sequence[Kernel],
    baseline: Kernel,
    *,
    is_causal: bool = False,
) -> list[dict[str, float]]:
    """Deviation of each primary from the baseline and from the golden value of these very inputs.

    Args:
        q: ``(B, H, N, D)`` queries, in the dtype under test.
        k: ``(B, H, N, D)`` keys.
        v: ``(B, H, N, D)`` values.
        primaries: the kernels under test.
        baseline: the baseline kernel (usually ``math``).
        is_causal: apply the causal mask.

    Returns:
        One dict per primary with ``{pair}_{stat}``, ``error_ratio``
        (:func:`~flashprobe.deviation.error_ratio`; ``None`` when undefined), ``primary_nonfinite``
        and ``baseline_nonfinite``.

    Raises:
        KernelInputError: malformed inputs (rank, heads, head dims, dtypes), naming the problem.
    """
    check_inputs(q, k, v, None, is_causal, kernel="bench")
    with torch.inference_mode():
        # both references in blocks of bounded memory: a 16k-token call's scores would be gigabytes
        golden = golden_attention(q, k, v, is_causal=is_causal)
        base = reference_attention(baseline, q, k, v, is_causal=is_causal)
        base_golden = deviation_stats(base, golden)
        floor = noise_floor(golden.abs().max().item() if golden.numel() else 0.0, q.dtype)
        base_nonfinite = int(torch.count_nonzero(~torch.isfinite(base)))
        rows = []
        for kernel in primaries:
            out = kernel(q, k, v, is_causal=is_causal)
            stats = {
                "primary_baseline": deviation_stats(out, base),
                "primary_golden": deviation_stats(out, golden),
                "baseline_golden": base_golden,
            }
            row = {f"{pair}_{stat}": stats[pair][stat] for pair in PAIRS for stat in STATS}
            row["error_ratio"] = error_ratio(
                row["primary_golden_max_abs"], row["baseline_golden_max_abs"], floor=floor
            )
            row["primary_nonfinite"] = int(torch.count_nonzero(~torch.isfinite(out)))
            row["baseline_nonfinite"] = base_nonfinite
            rows.append(row)
    return rows


def summarize_seeds(per_seed: Sequence[Mapping[str, float | None]]) -> dict[str, float | None]:
    """Per key ``m`` of the per-seed dicts: ``m`` (median), ``m_lo`` and ``m_hi`` (min, max) over the
    seeds where it is defined (not None/NaN; None when none); keys ending in ``nonfinite`` are summed."""
    out: dict[str, float | None] = {}
    for key in per_seed[0]:
        values = [row[key] for row in per_seed]
        if key.endswith("nonfinite"):
            out[key] = int(sum(v or 0 for v in values))
            continue
        defined = [v for v in values if v is not None and not math.isnan(v)]
        out[key] = statistics.median(defined) if defined else None
        out[f"{key}_lo"] = min(defined) if defined else None
        out[f"{key}_hi"] = max(defined) if defined else None
    return out


def _runnable(
    point: SweepPoint, baseline: Kernel, dtype: torch.dtype, device: torch.device | str
) -> tuple[list[Primary], list[dict[str, Any]]]:
    """The primaries of ``point`` that run at ``dtype`` here, and a skipped entry for each other."""
    head_dim = point.shape.head_dim
    reason = check_kernel(baseline, dtype, device, head_dim)
    runnable, skipped = [], []
    for primary in point.primaries:
        why = reason and f"baseline {baseline.spec}: {reason}"
        why = why or check_kernel(primary.kernel, dtype, device, head_dim)
        if not why:
            runnable.append(primary)
            continue
        where = {"dtype": dtype_name(dtype), **point.shape.as_dict()}
        skipped.append({**point.labels, **primary.labels, **where, "reason": why})
    return runnable, skipped


def deviation_sweep(
    points: Sequence[SweepPoint],
    *,
    baseline: Kernel,
    dtypes: Sequence[torch.dtype],
    seeds: Sequence[int],
    inputs: InputConfig,
    device: torch.device | str = "cpu",
    is_causal: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run :func:`compare_to_references` over sweep points × dtypes × seeds.

    Per point and seed the inputs are drawn once in float64 and cast to every dtype; kernels that
    cannot run at a dtype here are skipped. ``progress`` is called before each (point, dtype).

    Returns:
        ``(rows, skipped)``: one row per (point, primary, dtype) with the labels, the setting and the
        :func:`summarize_seeds` metrics; one ``{..., "reason"}`` entry per skipped run.

    Raises:
        BenchArgumentError: a kernel spec has invalid option values.
    """
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for point in points:
        drawn: dict[int, Tensors] = {}
        for dtype in dtypes:
            runnable, skips = _runnable(point, baseline, dtype, device)
            skipped += skips
            if not runnable:
                continue
            if progress:
                n, name = point.shape.seq_len, dtype_name(dtype)
                progress(f"N={n} {name}: {len(runnable)} kernel(s) × {len(seeds)} seed(s)")
            per_seed = []
            for seed in seeds:
                if seed not in drawn:
                    drawn[seed] = make_inputs(point.shape, seed, inputs)
                q, k, v = cast_inputs(drawn[seed], dtype, device)
                kernels = [p.kernel for p in runnable]
                per_seed.append(compare_to_references(q, k, v, kernels, baseline, is_causal=is_causal))
            labels = {"baseline": baseline.spec, **point.shape.as_dict(), "causal": is_causal}
            labels |= {**inputs.as_dict(), "repeats": len(seeds)}
            for i, primary in enumerate(runnable):
                summary = summarize_seeds([seed_rows[i] for seed_rows in per_seed])
                row = {**point.labels, **primary.labels, "dtype": dtype_name(dtype), **labels, **summary}
                rows.append(row)
    return rows, skipped
