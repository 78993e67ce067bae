"""``flashprobe bench fp8``: is FP8 attention accurate enough? Error of FP8 forward variants vs FP64.

Three experiments (``--part``):

* ``error``: each of :data:`VARIANTS` against the FP64 golden value of its own inputs, over N, D and
  :data:`DISTRIBUTIONS`; ``error_ratio`` is ``rel_l2`` over that of ``math`` at the same input dtype.
* ``pcast``: the P-cast collapse of arXiv 2606.06521: an attention sink, only P cast to E4M3 after a
  static scale S, forward vs reverse key order; rows give ``p_underflow`` and the output ``mse``.
* ``saturation`` (flash-attention issue 2716): lazy rescale (``tiled:rescale_threshold``) with the 2^8
  offset on P lets ``P·S`` pass the format's largest value; rows give ``p_saturated``, the error on
  V = 1 (``v1_max_abs``, ``v1_mean``) and ``rel_l2`` on gaussian V.

Every row names its FP8 numerics (``fp8_qkv``, ``fp8_p``, ``fp8_scaling``, ``p_scale``, ``order``,
``rotation``, ``rescale_threshold``; ``-`` where a knob does not apply). Writes ``DIR/fp8.json`` (rows,
and the headline numbers under ``"summary"``), ``fp8.csv``, ``fp8.md``, ``fp8_errors.png`` and
``fp8_pcast.png``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashprobe.bench.args import add_output_args, check_size, parse_seeds, progress_printer, run_cli
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.inputs import Shape
from flashprobe.bench.results import (
    format_cell,
    format_table,
    load_results,
    peak_memory,
    write_results,
    wrote_line,
)
from flashprobe.bench.sweep import deviation_stats, summarize_seeds
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.kernels import fp8 as fp8_numerics
from flashprobe.kernels import get_kernel, golden_attention, tile_order
from flashprobe.kernels.tiled import lazy_tile_max, spec_numerics

__all__ = [
    "DISTRIBUTIONS",
    "LOGIT_STDS",
    "PARTS",
    "P_SCALES",
    "RESCALE_THRESHOLDS",
    "VARIANTS",
    "Variant",
    "build_parser",
    "error_rows",
    "fp8_inputs",
    "main",
    "p_saturation",
    "p_underflow",
    "pcast_rows",
    "saturation_rows",
    "saturation_variants",
    "summarize",
]

#: Input distributions of the error experiment.
DISTRIBUTIONS = ("gaussian", "outlier_channels", "sink", "dynamic_range")
#: The static scales S on P of the P-cast experiment.
P_SCALES = (1.0, 16.0, 256.0, 448.0)
#: Factor on the outlier channels of Q and K (``outlier_channels``); one channel in 32 is one.
OUTLIER_SCALE = 20.0
#: Per-token magnitudes of ``dynamic_range``: 2^U(lo, hi) on every row of Q, K and V.
DYNAMIC_RANGE_LOG2 = (-10.0, 2.0)
#: Sink logit of the ``sink`` distribution in the error experiment (the moderate strength).
MODERATE_SINK = 8.0
#: The paper's reported range of the MSE ratio at moderate sink strengths.
PAPER_RATIO = (3.0, 10.0)
#: The experiments of the command, in order.
PARTS = ("error", "pcast", "saturation")
#: Standard deviations of the gaussian logits of the saturation experiment.
LOGIT_STDS = (0.5, 1.0, 2.0)
#: Lazy-rescale thresholds (log2 units) of the saturation experiment: off (FA3; FA4 since PR 2731),
#: under the bound ``log2(448) − 8 ≈ 0.807`` (PRs 2713, 2731), and FA4's FP8 value before.
RESCALE_THRESHOLDS = (0.0, 0.75, 4.0)


@dataclass(frozen=True)
class Variant:
    """One kernel of the error experiment: its label, spec and input dtype."""

    label: str
    spec: str
    dtype: torch.dtype


#: The kernels compared: the baseline, 16-bit flash, and FP8 variants from naive to FA3.
VARIANTS = (
    Variant("baseline bf16", "math", torch.bfloat16),
    Variant("flash bf16", "tiled", torch.bfloat16),
    Variant("flash fp16", "tiled", torch.float16),
    Variant("fp8 per-tensor", "tiled:qkv_fp8=e4m3,p_fp8=e4m3", torch.bfloat16),
    Variant("fa3 fp8 library", "tiled:preset=fa3_fp8,fp8_scaling=head,rotation=off", torch.bfloat16),
    Variant("fa3 fp8 no rotation", "tiled:preset=fa3_fp8,rotation=off", torch.bfloat16),
    Variant("fa3 fp8", "tiled:preset=fa3_fp8", torch.bfloat16),
    Variant("fa3 fp8 e5m2", "tiled:preset=fa3_fp8,qkv_fp8=e5m2,p_fp8=e5m2", torch.bfloat16),
)

#: Columns of the printed error table: (row key, header).
ERROR_COLUMNS = [
    ("variant", "variant"),
    ("distribution", "inputs"),
    ("seq_len", "N"),
    ("head_dim", "D"),
    ("rel_l2", "rel L2 vs golden"),
    ("max_abs", "max|o-g|"),
    ("error_ratio", "ratio to baseline"),
]
#: Columns of the printed P-cast table.
PCAST_COLUMNS = [
    ("sink_strength", "sink"),
    ("order", "order"),
    ("p_scale", "S"),
    ("p_underflow", "P underflow"),
    ("mse", "MSE"),
]
#: Columns of the printed saturation table.
SATURATION_COLUMNS = [
    ("logit_std", "logit std"),
    ("fp8_p", "P"),
    ("p_scale", "S"),
    ("rescale_threshold", "threshold"),
    ("p_saturated", "P saturated"),
    ("v1_max_abs", "V=1: max|o-1|"),
    ("v1_mean", "V=1: mean(o-1)"),
    ("rel_l2", "rel L2 (random V)"),
]


def _row_head(part: str, label: str, spec: str, dtype: torch.dtype) -> dict[str, Any]:
    """The first entries of a row: the experiment, the kernel, and what names its numerics (FP8
    formats, scaling, P scale, order, rotation, lazy-rescale threshold)."""
    row = {"part": part, "variant": label, "kernel": spec, "input_dtype": str(dtype).removeprefix("torch.")}
    kernel = get_kernel(spec)
    if kernel.name != "tiled":  # FP8 off, no key tiles
        return row | fp8_numerics.Fp8Numerics().labels() | {"order": "-", "rescale_threshold": None}
    numerics = spec_numerics(kernel.options, dtype)
    lazy = {"order": numerics.order, "rescale_threshold": numerics.rescale_threshold}
    return row | numerics.fp8.labels() | lazy


def fp8_inputs(
    shape: Shape, distribution: str, seed: int, *, sink_strength: float = MODERATE_SINK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``q, k, v`` in float64 from ``seed`` for one of :data:`DISTRIBUTIONS`.

    * ``gaussian``: every entry N(0, 1);
    * ``outlier_channels``: one channel in 32 of Q and K (at least one) times :data:`OUTLIER_SCALE`;
    * ``sink``: ``√D·u`` added to every query and key 0 set to ``sink_strength · u`` (``u`` a random
      unit vector), so key 0's logit is about ``sink_strength`` for every query;
    * ``dynamic_range``: every row of Q, K and V times ``2^U(DYNAMIC_RANGE_LOG2)``.

    Returns:
        ``q, k, v``, each ``(B, H, N, D)`` float64 on the CPU.

    Raises:
        BenchArgumentError: an unknown distribution.
    """
    if distribution not in DISTRIBUTIONS:
        raise BenchArgumentError(
            f"unknown distribution {distribution!r}; use one of {', '.join(DISTRIBUTIONS)}"
        )
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape.dims, generator=gen, dtype=torch.float64) for _ in range(3))
    d = shape.head_dim
    if distribution == "outlier_channels":
        channels = torch.randperm(d, generator=gen)[: max(1, d // 32)]
        q[..., channels] *= OUTLIER_SCALE
        k[..., channels] *= OUTLIER_SCALE
    elif distribution == "sink":
        u = torch.randn(d, generator=gen, dtype=torch.float64)
        u /= u.norm()
        q += math.sqrt(d) * u
        k[..., 0, :] = sink_strength * u
    elif distribution == "dynamic_range":
        lo, hi = DYNAMIC_RANGE_LOG2
        for x in (q, k, v):
            x *= 2.0 ** (lo + (hi - lo) * torch.rand(*x.shape[:-1], 1, generator=gen, dtype=torch.float64))
    return q, k, v


def _error_metrics(out: torch.Tensor, golden: torch.Tensor) -> dict[str, float]:
    """``rel_l2``, ``max_abs``, ``rmse`` and ``nonfinite`` of ``out`` against ``golden``."""
    stats = deviation_stats(out, golden)
    rmse = math.sqrt(stats["std_abs"] ** 2 + stats["mean_abs"] ** 2)
    metrics = {"rel_l2": stats["rel_l2"], "max_abs": stats["max_abs"], "rmse": rmse}
    return metrics | {"nonfinite": stats["nonfinite"]}


def _run_variants(
    variants: Sequence[Variant], shape: Shape, distribution: str, seeds: Sequence[int]
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """One row per variant at one point (median, min/max over seeds), and each variant's rel L2 per seed."""
    per_variant: dict[str, list[dict[str, float]]] = {v.label: [] for v in variants}
    for seed in seeds:
        drawn = fp8_inputs(shape, distribution, seed)
        goldens: dict[torch.dtype, torch.Tensor] = {}
        baselines: dict[torch.dtype, float] = {}
        for variant in variants:
            q, k, v = (t.to(variant.dtype) for t in drawn)
            with torch.no_grad():
                if variant.dtype not in goldens:
                    goldens[variant.dtype] = golden_attention(q, k, v)
                    base = get_kernel("math")(q, k, v)
                    baselines[variant.dtype] = _error_metrics(base, goldens[variant.dtype])["rel_l2"]
                out = get_kernel(variant.spec)(q, k, v)
            metrics = _error_metrics(out, goldens[variant.dtype])
            base = baselines[variant.dtype]
            metrics["error_ratio"] = metrics["rel_l2"] / base if base > 0 else math.nan
            per_variant[variant.label].append(metrics)
    rows = []
    for variant in variants:
        row = _row_head("error", variant.label, variant.spec, variant.dtype)
        row |= {"distribution": distribution, **shape.as_dict(), "repeats": len(seeds)}
        rows.append(row | summarize_seeds(per_variant[variant.label]))
    return rows, {label: [m["rel_l2"] for m in seeds_] for label, seeds_ in per_variant.items()}


def error_rows(
    *,
    seq_lens: Sequence[int],
    head_dims: Sequence[int],
    base_seq_len: int,
    base_head_dim: int,
    heads: int,
    distributions: Sequence[str],
    seeds: Sequence[int],
    variants: Sequence[Variant] = VARIANTS,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[tuple[str, str, int, int], list[float]]]:
    """The error experiment: gaussian inputs over ``seq_lens`` and over ``head_dims``, and every
    distribution at ``(base_seq_len, base_head_dim)``.

    Returns:
        ``(rows, rel_l2)``: one row per (variant, distribution, N, D) and sweep ``axis`` (``seq_len``,
        ``head_dim`` or ``distribution``; a point on several sweeps is run once, listed under each),
        and the rel L2 errors per seed keyed by (variant, distribution, N, D).
    """
    points: dict[tuple[str, int, int], list[str]] = {}
    for n in seq_lens:
        points.setdefault(("gaussian", n, base_head_dim), []).append("seq_len")
    for d in head_dims:
        points.setdefault(("gaussian", base_seq_len, d), []).append("head_dim")
    for dist in distributions:
        points.setdefault((dist, base_seq_len, base_head_dim), []).append("distribution")
    rows = []
    rel_l2: dict[tuple[str, str, int, int], list[float]] = {}
    for (dist, n, d), axes in points.items():
        if progress:
            progress(f"errors: {dist}, N={n}, D={d}: {len(variants)} kernels × {len(seeds)} seeds")
        shape = Shape(batch=1, heads=heads, seq_len=n, head_dim=d)
        point_rows, per_seed = _run_variants(variants, shape, dist, seeds)
        for row in point_rows:
            rows += [{**row, "axis": axis} for axis in axes]
        rel_l2 |= {(label, dist, n, d): values for label, values in per_seed.items()}
    return rows, rel_l2


def p_underflow(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    order: str,
    p_scales: Sequence[float],
    block_k: int = 128,
    p_fp8: str = "e4m3",
    skip_key: int = 0,
    scale: float | None = None,
) -> dict[float, float]:
    """Fraction of the P entries (all keys but ``skip_key``, the sink) that the FP8 cast turns to zero.

    An entry underflows when ``P > 0`` in fp32 but ``cast_fp8(P · S) = 0``, with P replayed as the
    ``fa2`` update computes it (:func:`_replayed_p`).

    Args:
        q: ``(B, H, N_q, D)``.
        k: ``(B, H, N_k, D)`` (no mask).
        order: ``"forward"`` or ``"reverse"``.
        p_scales: the static scales S.
        block_k: keys per tile.
        p_fp8: the format P is cast to.
        skip_key: the key left out of the count.
        scale: softmax scale, default ``1/√D``.

    Returns:
        ``{S: fraction}``.
    """
    zeros = dict.fromkeys(p_scales, 0)
    positive = 0
    for j0, j1, p in _replayed_p(q, k, order=order, block_k=block_k, scale=scale):
        if j0 <= skip_key < j1:
            p = torch.cat([p[..., : skip_key - j0], p[..., skip_key - j0 + 1 :]], dim=-1)
        counted = p > 0
        positive += int(counted.sum())
        for factor in p_scales:
            zeros[factor] += int((counted & (fp8_numerics.cast_fp8(p * factor, p_fp8) == 0)).sum())
    return {factor: zeros[factor] / max(positive, 1) for factor in p_scales}


def _replayed_p(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    order: str,
    block_k: int,
    scale: float | None,
    threshold: float = 0.0,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(j0, j1, P)`` per key tile, ``P = exp(s − m)`` ``(B, H, N_q, j1 − j0)`` as the ``fa2``
    update computes it in ``order``: fp32 scores, ``m`` the running max over the tiles visited so far,
    left stale while a tile raises it by at most ``threshold`` powers of two (``lazy_tile_max``)."""
    s = (q.float() @ k.float().transpose(-2, -1)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    n_k = k.shape[-2]
    starts = list(range(0, n_k, block_k))
    m = torch.full((*s.shape[:-1], 1), float("-inf"))
    for t in tile_order(len(starts), order):
        j0, j1 = starts[t], min(starts[t] + block_k, n_k)
        m_tile = s[..., j0:j1].amax(dim=-1, keepdim=True)
        m = torch.maximum(m, lazy_tile_max(m, m_tile, threshold) if threshold else m_tile)
        yield j0, j1, torch.exp(s[..., j0:j1] - m)


def p_saturation(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    threshold: float,
    p_scales: Sequence[float],
    order: str = "reverse",
    block_k: int = 128,
    p_fp8: str = "e4m3",
    scale: float | None = None,
) -> dict[float, float]:
    """Fraction of the P entries whose FP8 cast saturates: ``P · S`` above the format's largest value.

    P is replayed by :func:`_replayed_p` with lazy rescaling at ``threshold`` (0: ``P ≤ 1``).

    Args:
        q: ``(B, H, N_q, D)``.
        k: ``(B, H, N_k, D)`` (no mask).
        threshold: the lazy-rescale threshold, log2 units (``tiled:rescale_threshold``).
        p_scales: the static scales S.
        order: ``"forward"``, ``"reverse"`` or ``"shuffle"``.
        block_k: keys per tile.
        p_fp8: the format P is cast to.
        scale: softmax scale, default ``1/√D``.

    Returns:
        ``{S: fraction of all N_q · N_k entries}``.
    """
    top = fp8_numerics.fp8_max(p_fp8)
    over = dict.fromkeys(p_scales, 0)
    for _, _, p in _replayed_p(q, k, order=order, block_k=block_k, scale=scale, threshold=threshold):
        for factor in p_scales:
            over[factor] += int((p * factor > top).sum())
    total = max(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[-2], 1)
    return {factor: over[factor] / total for factor in p_scales}


def pcast_rows(
    *,
    sink_strengths: Sequence[float],
    seeds: Sequence[int],
    seq_len: int,
    head_dim: int,
    heads: int,
    p_scales: Sequence[float] = P_SCALES,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[tuple[float, str, float], list[float]]]:
    """The P-cast experiment: ``sink`` inputs (bf16), only P cast to E4M3, fa2 numerics.

    Returns:
        ``(rows, mse)``: one row per (sink strength, order, S) with ``p_underflow`` and ``mse`` over
        the seeds, and the per-seed MSEs keyed by (strength, order, S).
    """
    shape = Shape(batch=1, heads=heads, seq_len=seq_len, head_dim=head_dim)
    per_seed: dict[tuple[float, str, float], list[dict[str, float]]] = {}
    for strength in sink_strengths:
        if progress:
            progress(f"P cast: sink strength {strength:g}: 2 orders × {len(p_scales)} S × {len(seeds)} seeds")
        for seed in seeds:
            q, k, v = (t.to(torch.bfloat16) for t in fp8_inputs(shape, "sink", seed, sink_strength=strength))
            golden = golden_attention(q, k, v)
            for order in ("forward", "reverse"):
                under = p_underflow(q, k, order=order, p_scales=p_scales)
                for s in p_scales:
                    spec = f"tiled:p_fp8=e4m3,p_scale={s:g},order={order}"
                    with torch.no_grad():
                        out = get_kernel(spec)(q, k, v)
                    mse = float(((out.double() - golden) ** 2).mean())
                    per_seed.setdefault((strength, order, s), []).append(
                        {"p_underflow": under[s], "mse": mse}
                    )
    rows = []
    for (strength, order, s), values in per_seed.items():
        spec = f"tiled:p_fp8=e4m3,p_scale={s:g},order={order}"
        row = _row_head("pcast", f"P e4m3, S={s:g}, {order}", spec, torch.bfloat16)
        row |= {"distribution": "sink", "sink_strength": strength, **shape.as_dict(), "repeats": len(seeds)}
        rows.append(row | summarize_seeds(values))
    mse = {key: [v["mse"] for v in values] for key, values in per_seed.items()}
    return rows, mse


def saturation_variants(thresholds: Sequence[float] = RESCALE_THRESHOLDS) -> list[Variant]:
    """The kernels of the saturation experiment: per lazy-rescale threshold, only P cast, to E4M3
    without and with the 2^8 prescale and to E5M2 with it (fa2 numerics, reverse order, bf16)."""
    return [
        Variant(
            f"P {fmt} ×{s:g}, threshold {t:g}",
            f"tiled:p_fp8={fmt},p_scale={s:g},rescale_threshold={t:g}",
            torch.bfloat16,
        )
        for t in thresholds
        for fmt, s in (("e4m3", 1.0), ("e4m3", 256.0), ("e5m2", 256.0))
    ]


def saturation_rows(
    *,
    logit_stds: Sequence[float],
    thresholds: Sequence[float],
    seeds: Sequence[int],
    seq_len: int,
    head_dim: int,
    heads: int,
    block_k: int = 128,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[tuple[str, float], list[float]]]:
    """The saturation experiment: gaussian Q, K scaled to logits of each standard deviation, bf16,
    for every kernel of :func:`saturation_variants`, on V = 1 and on the gaussian V.

    Returns:
        ``(rows, rel_l2)``: one row per (variant, logit std) with ``p_saturated``, ``v1_max_abs``,
        ``v1_mean`` and ``rel_l2`` over the seeds, and the per-seed ``rel_l2`` keyed by (label, std).
    """
    variants = saturation_variants(thresholds)
    shape = Shape(batch=1, heads=heads, seq_len=seq_len, head_dim=head_dim)
    per_seed: dict[tuple[str, float], list[dict[str, float]]] = {}
    for std in logit_stds:
        if progress:
            progress(f"saturation: logit std {std:g}: {len(variants)} kernels × {len(seeds)} seeds")
        for seed in seeds:
            q, k, v = fp8_inputs(shape, "gaussian", seed)
            q, k, v = (std * q).bfloat16(), k.bfloat16(), v.bfloat16()
            golden = golden_attention(q, k, v)
            ones = torch.ones_like(v)
            saturated = {
                (t, fmt): p_saturation(q, k, threshold=t, p_scales=(1.0, 256.0), p_fp8=fmt, block_k=block_k)
                for t in thresholds
                for fmt in ("e4m3", "e5m2")
            }
            for variant in variants:
                kernel = get_kernel(variant.spec + f",block_k={block_k}")
                with torch.no_grad():
                    out, out_one = kernel(q, k, v), kernel(q, k, ones).double()
                numerics = spec_numerics(kernel.options, torch.bfloat16)
                fmt, factor = numerics.fp8.p, numerics.fp8.p_scale
                per_seed.setdefault((variant.label, std), []).append({
                    "p_saturated": saturated[numerics.rescale_threshold, fmt][factor],
                    "v1_max_abs": (out_one - 1).abs().max().item(),
                    "v1_mean": (out_one - 1).mean().item(),
                    "rel_l2": _error_metrics(out, golden)["rel_l2"],
                })  # fmt: skip
    rows = []
    for (label, std), values in per_seed.items():
        variant = next(v for v in variants if v.label == label)
        row = _row_head("saturation", label, variant.spec, torch.bfloat16)
        row |= {"distribution": "gaussian", "logit_std": std, **shape.as_dict(), "block_k": block_k}
        rows.append(row | {"repeats": len(seeds)} | summarize_seeds(values))
    return rows, {key: [v["rel_l2"] for v in values] for key, values in per_seed.items()}


def saturation_summary(
    rows: Sequence[Mapping[str, Any]], rel_l2: Mapping[tuple[str, float], Sequence[float]]
) -> list[dict[str, Any]]:
    """Per logit std, E4M3 with the 2^8 prescale at the largest threshold against 0: its saturated
    fraction and V = 1 error, the rel L2 factor seed by seed, and the E4M3 / E5M2 rel L2 ratio at both
    thresholds (E4M3 rounds finer, so a correct kernel has the smaller error in E4M3)."""
    sat = [r for r in rows if r["part"] == "saturation"]
    thresholds = sorted({r["rescale_threshold"] for r in sat})
    if len(thresholds) < 2 or thresholds[0] != 0:
        return []
    lazy = thresholds[-1]
    pick = {(r["fp8_p"], r["p_scale"], r["rescale_threshold"], r["logit_std"]): r for r in sat}
    summary = []
    for std in sorted({r["logit_std"] for r in sat}):
        on, off = pick.get(("e4m3", 256.0, lazy, std)), pick.get(("e4m3", 256.0, 0.0, std))
        e5_on, e5_off = pick.get(("e5m2", 256.0, lazy, std)), pick.get(("e5m2", 256.0, 0.0, std))
        if not (on and off and e5_on and e5_off):
            continue
        pairs = zip(rel_l2[on["variant"], std], rel_l2[off["variant"], std], strict=True)
        ratios = [a / b for a, b in pairs if b > 0]
        entry = {
            "logit_std": std,
            "threshold": lazy,
            "p_saturated": on["p_saturated"],
            "v1_max_abs": on["v1_max_abs"],
            "v1_mean": on["v1_mean"],
            "rel_l2_lazy": on["rel_l2"],
            "rel_l2_eager": off["rel_l2"],
            "e4m3_over_e5m2_lazy": on["rel_l2"] / e5_on["rel_l2"],
            "e4m3_over_e5m2_eager": off["rel_l2"] / e5_off["rel_l2"],
        }
        summary.append(entry | ({"factor": _log_interval(ratios)} if ratios else {}))
    return summary


def _log_interval(ratios: Sequence[float]) -> dict[str, float]:
    """Geometric mean of ``ratios`` with a 95% Student-t interval on their logs, and min/max."""
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = 0.0
    if len(logs) > 1:
        half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {
        "geomean": math.exp(mean),
        "ci95_lo": math.exp(mean - half),
        "ci95_hi": math.exp(mean + half),
        "min": min(ratios),
        "max": max(ratios),
        "seeds": len(ratios),
    }


def _rotation_gain(
    rows: Sequence[Mapping[str, Any]], rel_l2: Mapping[tuple[str, str, int, int], Sequence[float]], dist: str
) -> dict[str, Any] | None:
    """rel L2 of ``fa3 fp8 no rotation`` and ``fa3 fp8`` on ``dist`` inputs, and their ratio seed by seed."""
    pick = {
        r["variant"]: r
        for r in rows
        if r["part"] == "error" and r.get("axis") == "distribution" and r["distribution"] == dist
    }
    off, on = pick.get("fa3 fp8 no rotation"), pick.get("fa3 fp8")
    if not off or not on or not on["rel_l2"]:
        return None
    point = (dist, on["seq_len"], on["head_dim"])
    pairs = zip(
        rel_l2.get(("fa3 fp8 no rotation", *point), []), rel_l2.get(("fa3 fp8", *point), []), strict=True
    )
    ratios = [a / b for a, b in pairs if b > 0]
    gain = {"distribution": dist, "rel_l2_without": off["rel_l2"], "rel_l2_with": on["rel_l2"]}
    return gain | ({"factor": _log_interval(ratios)} if ratios else {})


def summarize(
    rows: Sequence[Mapping[str, Any]],
    mse: Mapping[tuple[float, str, float], Sequence[float]],
    moderate: float,
    rel_l2: Mapping[tuple[str, str, int, int], Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The headline numbers: the P-cast MSE ratio at ``moderate`` sink strength (``mse`` of
    :func:`pcast_rows`) and the Hadamard rotation's error factor (``rel_l2`` of :func:`error_rows`)."""
    summary: dict[str, Any] = {}
    fwd, rev = mse.get((moderate, "forward", 1.0)), mse.get((moderate, "reverse", 256.0))
    if fwd and rev:
        ratios = [a / b for a, b in zip(fwd, rev, strict=True) if b > 0]
        if ratios:
            summary["pcast_ratio"] = {
                "sink_strength": moderate,
                "numerator": "forward, S=1",
                "denominator": "reverse, S=256",
                **_log_interval(ratios),
                "paper": list(PAPER_RATIO),
            }
    for dist in ("outlier_channels", "gaussian"):
        gain = _rotation_gain(rows, rel_l2 or {}, dist)
        if gain:
            summary[f"rotation_{dist}"] = gain
    return summary


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The summary in sentences, for the terminal and the Markdown report."""
    lines = []
    ratio = summary.get("pcast_ratio")
    if ratio:
        lines.append(
            f"P-cast collapse at sink strength {ratio['sink_strength']:g}: MSE(forward, S=1) / "
            f"MSE(reverse, S=256) = {ratio['geomean']:.3g} (95% interval {ratio['ci95_lo']:.3g}-"
            f"{ratio['ci95_hi']:.3g}, range {ratio['min']:.3g}-{ratio['max']:.3g} over {ratio['seeds']} "
            f"seeds); the paper reports {PAPER_RATIO[0]:g}-{PAPER_RATIO[1]:g}x at moderate sink strengths"
        )
    for entry in summary.get("saturation", []):
        f = entry.get("factor")
        factor = ""
        if f:
            interval = f"95% interval {f['ci95_lo']:.3g}-{f['ci95_hi']:.3g} over {f['seeds']} seeds"
            factor = f" (x{f['geomean']:.3g}, {interval})"
        lines.append(
            f"Lazy rescale at threshold {entry['threshold']:g}, P e4m3 x256 (FA4's FP8 before PR 2731), "
            f"logits of std {entry['logit_std']:g}: {entry['p_saturated']:.3g} of P saturated; V = 1 off by "
            f"up to {entry['v1_max_abs']:.3g} (mean {entry['v1_mean']:+.3g}); "
            f"rel L2 {entry['rel_l2_lazy']:.3g} against {entry['rel_l2_eager']:.3g} with the max always "
            f"updated{factor}; e4m3 / e5m2 rel L2 "
            f"{entry['e4m3_over_e5m2_lazy']:.3g} (threshold {entry['threshold']:g}), "
            f"{entry['e4m3_over_e5m2_eager']:.3g} (threshold 0)"
        )
    for dist in ("outlier_channels", "gaussian"):
        gain = summary.get(f"rotation_{dist}")
        if gain and "factor" in gain:
            f = gain["factor"]
            lines.append(
                f"Hadamard rotation on {dist} inputs (fa3 fp8 no rotation -> fa3 fp8): rel L2 "
                f"{gain['rel_l2_without']:.3g} -> {gain['rel_l2_with']:.3g} (medians); error divided by "
                f"{f['geomean']:.3g} (95% interval {f['ci95_lo']:.3g}-{f['ci95_hi']:.3g}, range "
                f"{f['min']:.3g}-{f['max']:.3g} over {f['seeds']} seeds, same inputs)"
            )
    return lines


def _markdown(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any], command: str) -> str:
    """``DIR/fp8.md``: the summary and the tables."""
    out = ["# flashprobe bench fp8", "", f"Command: `{command}`", ""]
    out += [f"- {line}" for line in summary_lines(summary)]
    names = ["variant", "fp8_qkv", "fp8_scaling", "fp8_p", "p_scale", "order", "rotation"]
    err = [
        "distribution",
        "seq_len",
        "head_dim",
        "rel_l2",
        "rel_l2_lo",
        "rel_l2_hi",
        "max_abs",
        "error_ratio",
    ]
    pcast = ["sink_strength", "p_underflow", "p_underflow_lo", "p_underflow_hi", "mse", "mse_lo", "mse_hi"]
    saturation = ["rescale_threshold", "logit_std", "p_saturated", "v1_max_abs", "v1_mean"]
    saturation += ["rel_l2", "rel_l2_lo", "rel_l2_hi"]
    for title, part, keys in (
        ("Error vs the FP64 golden value", "error", err),
        ("P-cast collapse", "pcast", pcast),
        ("P saturation under lazy rescale (flash-attention issue 2716)", "saturation", saturation),
    ):
        part_rows = _listed(rows, part)
        if not part_rows:
            continue
        out += ["", f"## {title}", "", "| " + " | ".join(names + keys) + " |"]
        out.append("|" + "---|" * len(names + keys))
        out += ["| " + " | ".join(format_cell(r.get(key)) for key in names + keys) + " |" for r in part_rows]
    return "\n".join(out) + "\n"


def _listed(rows: Sequence[Mapping[str, Any]], part: str) -> list[Mapping[str, Any]]:
    """The rows of ``part`` for a table: an error point listed under several axes appears once."""
    first: dict[Any, Mapping[str, Any]] = {}
    for i, r in enumerate(rows):
        if r["part"] == part:
            key = (r["variant"], r["distribution"], r["seq_len"], r["head_dim"]) if part == "error" else i
            first.setdefault(key, r)
    return list(first.values())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench fp8``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench fp8",
        description="Error of FP8 attention variants vs the FP64 golden value (beside bf16/fp16 flash and "
        "the baseline) over N, D and input distributions, the P-cast collapse of arXiv 2606.06521, and P "
        "saturation under FlashAttention-4's lazy rescale (flash-attention issue 2716).",
    )
    parser.add_argument(
        "--seq-len", type=int, nargs="+", default=[256, 512, 1024], metavar="N",
        help="sequence lengths of the N sweep (default 256 512 1024)",
    )  # fmt: skip
    parser.add_argument(
        "--head-dim", type=int, nargs="+", default=[32, 64, 128], metavar="D",
        help="head dims of the D sweep (powers of two; default 32 64 128)",
    )  # fmt: skip
    parser.add_argument(
        "--base-seq-len", type=int, default=1024, metavar="N",
        help="N of the D and distribution sweeps and of the P-cast experiment (default 1024)",
    )  # fmt: skip
    parser.add_argument(
        "--base-head-dim", type=int, default=64, metavar="D",
        help="D of the N and distribution sweeps and of the P-cast experiment (default 64)",
    )  # fmt: skip
    parser.add_argument("--heads", type=int, default=1, metavar="H", help="heads (default 1; batch is 1)")
    parser.add_argument(
        "--distribution", nargs="+", default=list(DISTRIBUTIONS), metavar="NAME",
        help=f"input distributions (default: {' '.join(DISTRIBUTIONS)})",
    )  # fmt: skip
    parser.add_argument(
        "--sink-strength", type=float, nargs="+", default=[0.0, 4.0, 8.0, 12.0, 16.0], metavar="L",
        help="sink logits of the P-cast experiment (default 0 4 8 12 16)",
    )  # fmt: skip
    parser.add_argument(
        "--moderate-sink", type=float, default=MODERATE_SINK, metavar="L",
        help=f"the sink strength of the headline ratio (default {MODERATE_SINK:g})",
    )  # fmt: skip
    parser.add_argument(
        "--logit-std", type=float, nargs="+", default=list(LOGIT_STDS), metavar="SIGMA",
        help="standard deviations of the gaussian logits of the saturation experiment (default 0.5 1 2)",
    )  # fmt: skip
    parser.add_argument(
        "--rescale-threshold", type=float, nargs="+", default=list(RESCALE_THRESHOLDS), metavar="T",
        help="lazy-rescale thresholds of the saturation experiment, log2 units (default 0 0.75 4)",
    )  # fmt: skip
    parser.add_argument(
        "--part", nargs="+", default=list(PARTS), choices=PARTS,
        help="the experiments to run (default: all: error pcast saturation)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument(
        "--repeats", type=int, default=3, metavar="R",
        help="seeds of the error and saturation experiments (default 3)",
    )  # fmt: skip
    parser.add_argument(
        "--pcast-repeats", type=int, default=5, metavar="R",
        help="seeds of the P-cast experiment (at least 5 for the interval; default 5)",
    )  # fmt: skip
    parser.add_argument(
        "--tiny", action="store_true",
        help="a seconds-long smoke run: N 64 128, D 16 32, 1 head, 1 seed (2 for P cast), logit std 1",
    )  # fmt: skip
    add_output_args(parser, "fp8", replot=True)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.tiny:
        args.seq_len, args.head_dim, args.base_seq_len, args.base_head_dim = [64, 128], [16, 32], 256, 16
        args.heads, args.repeats, args.pcast_repeats = 1, 1, 2
        args.sink_strength, args.logit_std = [0.0, args.moderate_sink], [1.0]
    for name in ("seq_len", "head_dim"):
        for value in getattr(args, name):
            if value < 1:
                raise BenchArgumentError(f"--{name.replace('_', '-')} values must be positive, got {value}")
    for d in [*args.head_dim, args.base_head_dim] if "error" in args.part else []:
        if not fp8_numerics.is_power_of_two(d):
            raise BenchArgumentError(
                f"head dim {d} is not a power of two; the Hadamard rotation of the fa3 fp8 variant needs one"
            )
    if args.base_seq_len < 2 or args.heads < 1 or args.repeats < 1 or args.pcast_repeats < 1:
        raise BenchArgumentError("--base-seq-len must be ≥ 2 and --heads, --repeats, --pcast-repeats ≥ 1")
    for dist in args.distribution:
        if dist not in DISTRIBUTIONS:
            raise BenchArgumentError(f"unknown --distribution {dist!r}; use: {', '.join(DISTRIBUTIONS)}")
    for std in args.logit_std:
        if not (math.isfinite(std) and std > 0):
            raise BenchArgumentError(f"--logit-std values must be finite and positive, got {std:g}")
    for t in args.rescale_threshold:
        if not (math.isfinite(t) and t >= 0):
            raise BenchArgumentError(
                f"--rescale-threshold values must be finite and ≥ 0 (log2 units), got {t:g}"
            )
    args.part = [part for part in PARTS if part in args.part]
    args.rescale_threshold = sorted(set(args.rescale_threshold))
    if args.moderate_sink not in args.sink_strength:
        args.sink_strength = sorted({*args.sink_strength, args.moderate_sink})
    # the largest calls, before any is made: every --seq-len at --base-head-dim, every --head-dim at
    # --base-seq-len (a batch of 1); the P cast and saturation experiments run at the base size
    sizes = [(args.base_seq_len, args.base_head_dim)]
    if "error" in args.part:
        sizes += [(max(args.seq_len), args.base_head_dim), (args.base_seq_len, max(args.head_dim))]
    for n, d in sizes:
        check_size(argparse.Namespace(batch=1, heads=args.heads, seq_len=n, head_dim=d))


def _draw(rows: Sequence[Mapping[str, Any]], out: Path) -> dict[str, Path]:
    from flashprobe.report.fp8_figures import plot_fp8_errors, plot_fp8_pcast

    paths = {}
    if any(r["part"] == "error" for r in rows):
        paths["errors_png"] = plot_fp8_errors(rows, out / "fp8_errors.png")
    if any(r["part"] == "pcast" for r in rows):
        paths["pcast_png"] = plot_fp8_pcast(rows, out / "fp8_pcast.png")
    return paths


def _run(args: argparse.Namespace) -> int:
    if args.replot:
        doc = load_results(args.out, "fp8")
        for path in _draw(doc["rows"], args.out).values():
            print(f"redrew {path}")
        return 0
    _check_args(args)
    progress = progress_printer("fp8")
    start = time.perf_counter()
    seeds = parse_seeds(args.seed, args.repeats)
    rows: list[dict[str, Any]] = []
    rel_l2: dict[tuple[str, str, int, int], list[float]] = {}
    mse: dict[tuple[float, str, float], list[float]] = {}
    at_base = {"seq_len": args.base_seq_len, "head_dim": args.base_head_dim, "heads": args.heads}
    at_base |= {"progress": progress}
    if "error" in args.part:
        rows, rel_l2 = error_rows(
            seq_lens=sorted(set(args.seq_len)), head_dims=sorted(set(args.head_dim)),
            base_seq_len=args.base_seq_len, base_head_dim=args.base_head_dim, heads=args.heads,
            distributions=args.distribution, seeds=seeds, progress=progress,
        )  # fmt: skip
    if "pcast" in args.part:
        pcast_seeds = [args.seed + i for i in range(args.pcast_repeats)]
        pcast, mse = pcast_rows(sink_strengths=args.sink_strength, seeds=pcast_seeds, **at_base)
        rows += pcast
    saturation_rel_l2: dict[tuple[str, float], list[float]] = {}
    if "saturation" in args.part:
        saturated, saturation_rel_l2 = saturation_rows(
            logit_stds=args.logit_std, thresholds=args.rescale_threshold, seeds=seeds, **at_base
        )
        rows += saturated
    seconds = time.perf_counter() - start
    summary = summarize(rows, mse, args.moderate_sink, rel_l2)
    if saturation_rel_l2:
        summary["saturation"] = saturation_summary(rows, saturation_rel_l2)
    tables = (("error", ERROR_COLUMNS), ("pcast", PCAST_COLUMNS), ("saturation", SATURATION_COLUMNS))
    for part, columns in tables:
        part_rows = _listed(rows, part)
        if part_rows:
            print(format_table(part_rows, columns))
    for line in summary_lines(summary):
        print(line)
    config = {
        "seq_len": sorted(set(args.seq_len)),
        "head_dim": sorted(set(args.head_dim)),
        "base_seq_len": args.base_seq_len,
        "base_head_dim": args.base_head_dim,
        "heads": args.heads,
        "distributions": list(args.distribution),
        "sink_strengths": list(args.sink_strength),
        "moderate_sink": args.moderate_sink,
        "seeds": seeds,
        "pcast_seeds": args.pcast_repeats,
        "parts": list(args.part),
        "logit_stds": list(args.logit_std),
        "rescale_thresholds": list(args.rescale_threshold),
        "variants": {v.label: v.spec for v in VARIANTS},
        "saturation_variants": {v.label: v.spec for v in saturation_variants(args.rescale_threshold)},
    }
    meta = {"command": args.command_line, "config": config, "summary": summary}
    meta |= {"seconds": round(seconds, 2), "peak_memory": peak_memory()}
    paths = write_results(args.out, "fp8", rows, meta=meta)
    paths["md"] = args.out / "fp8.md"
    atomic_write_text(paths["md"], _markdown(rows, summary, args.command_line))
    paths |= _draw(rows, args.out)
    print(wrote_line(rows, seconds, paths))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench fp8``; returns the exit code."""
    return run_cli("fp8", build_parser(), _run, argv)
