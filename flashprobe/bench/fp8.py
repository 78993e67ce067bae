"""``flashprobe bench fp8``: is FP8 attention accurate enough? Error of FP8 forward variants vs FP64.

Two experiments, one command:

1. **Error** (``part = "error"``): each variant's output against the FP64 golden value of its own
   inputs, beside 16-bit flash (``tiled``, the ``fa2`` preset, at bf16 and fp16) and the baseline
   (``math`` at bf16), over the paper's axes (sequence length, head dim; Fig 5's and Figs 3-4's
   views) and over input distributions that matter for FP8 (:data:`DISTRIBUTIONS`). The FP8
   variants take bf16 inputs, as FA3's FP8 path takes the model's bf16 activations. Each row has
   ``rel_l2`` (``‖out − golden‖ / ‖golden‖``), ``max_abs``, ``rmse`` and ``error_ratio``: its
   ``rel_l2`` over that of the baseline at its input dtype (``math`` in bf16, or fp16 for
   ``flash fp16``).
2. **P-cast collapse** (``part = "pcast"``), after *P-Cast Precision in FP8 Attention: Sink-Induced
   Collapse and the Optimality of S = 2^8* (arXiv 2606.06521): an attention sink (key 0 with a large
   logit) and P cast to E4M3 after a static scale S; with forward key order the sink's tile comes
   first, the running max is the sink's logit, and the other keys' ``exp(s − m)`` underflow to zero
   in E4M3. Rows give the fraction of non-sink P that underflows (``p_underflow``: its fp32 value is
   positive, its E4M3 cast zero) and the output MSE against the golden value, for forward and
   reverse order × S in {1, 16, 256, 448} × sink strength. Only P is cast (Q, K, V stay bf16), so
   the MSE is the P cast's. The summary reports MSE(forward, S=1) / MSE(reverse, S=256) at the
   moderate sink strength, with a 95% interval over the seeds, beside the paper's 3-10×.

Every row names its FP8 format (``fp8_qkv``, ``fp8_p``), scaling (``fp8_scaling``), P scale
(``p_scale``), key order (``order``) and rotation (``rotation``); ``-`` where a knob does not apply.

Writes ``DIR/fp8.json`` (rows under ``"rows"``, the summaries under ``"summary"``), ``DIR/fp8.csv``,
``DIR/fp8.md``, ``DIR/fp8_errors.png`` and ``DIR/fp8_pcast.png``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
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
from flashprobe.kernels.tiled import spec_numerics

__all__ = [
    "DISTRIBUTIONS",
    "P_SCALES",
    "VARIANTS",
    "Variant",
    "build_parser",
    "error_rows",
    "fp8_inputs",
    "main",
    "p_underflow",
    "pcast_rows",
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


def _labels(spec: str, dtype: torch.dtype) -> dict[str, Any]:
    """The row entries that name a kernel's numerics: FP8 formats, scaling, P scale, order, rotation."""
    kernel = get_kernel(spec)
    if kernel.name != "tiled":
        return {**fp8_numerics.Fp8Numerics().labels(), "order": "-"}  # FP8 off, no key tiles
    numerics = spec_numerics(kernel.options, dtype)
    return {**numerics.fp8.labels(), "order": numerics.order}


def fp8_inputs(
    shape: Shape, distribution: str, seed: int, *, sink_strength: float = MODERATE_SINK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``q, k, v`` in float64 from ``seed`` for one of :data:`DISTRIBUTIONS`.

    * ``gaussian``: every entry N(0, 1);
    * ``outlier_channels``: gaussian, with one channel in 32 (at least one, the same for Q and K,
      drawn by ``torch.randperm``) multiplied by :data:`OUTLIER_SCALE`, as the massive channels of
      LLM activations;
    * ``sink``: gaussian, plus ``√D·u`` on every query and key 0 set to ``sink_strength · u``
      (``u`` a random unit vector), so key 0's logit is ``sink_strength · (1 + z/√D)`` for every
      query while the others stay O(1);
    * ``dynamic_range``: gaussian with every token (row) of Q, K and V multiplied by
      ``2^U(-10, 2)``, twelve binades of magnitude.

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
    """``rel_l2``, ``max_abs`` and ``rmse`` of ``out`` against ``golden`` (one path: deviation_stats)."""
    stats = deviation_stats(out, golden)
    rmse = math.sqrt(stats["std_abs"] ** 2 + stats["mean_abs"] ** 2)
    return {
        "rel_l2": stats["rel_l2"],
        "max_abs": stats["max_abs"],
        "rmse": rmse,
        "nonfinite": stats["nonfinite"],
    }


def _run_variants(
    variants: Sequence[Variant], shape: Shape, distribution: str, seeds: Sequence[int]
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """One row per variant at one shape and distribution (median and min/max over the seeds), and
    each variant's relative L2 error per seed."""
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
        row = {"part": "error", "variant": variant.label, "kernel": variant.spec}
        row |= {"input_dtype": str(variant.dtype).removeprefix("torch.")}
        row |= _labels(variant.spec, variant.dtype)
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
    """The error experiment: gaussian inputs over ``seq_lens`` (at ``base_head_dim``) and over
    ``head_dims`` (at ``base_seq_len``), and every distribution at ``(base_seq_len, base_head_dim)``.

    Returns:
        ``(rows, rel_l2)``: one row per (variant, distribution, N, D), with ``axis`` = ``seq_len``,
        ``head_dim`` or ``distribution`` naming the sweep it belongs to (a point on several sweeps
        is run once and listed under each); and the relative L2 errors per seed, keyed by
        (variant, distribution, N, D).
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
    """Fraction of the P entries (all keys but ``skip_key``) that the FP8 cast turns to zero.

    Replays the running max of the ``fa2`` update in ``order`` over key tiles of ``block_k``:
    when a tile is visited, ``P = exp(s − m)`` with ``m`` the max over the tiles visited so far
    (fp32 scores, as the kernel); an entry underflows when ``P > 0`` in fp32 but
    ``cast_fp8(P · S) = 0``.

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H, N_k, D)`` (no mask).
        order: ``"forward"`` or ``"reverse"``.
        p_scales: the static scales S.
        block_k: keys per tile.
        p_fp8: the format P is cast to.
        skip_key: the key left out of the count (the sink).
        scale: softmax scale, default ``1/√D``.

    Returns:
        ``{S: fraction}``.
    """
    s = (q.float() @ k.float().transpose(-2, -1)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    n_k = k.shape[-2]
    starts = list(range(0, n_k, block_k))
    m = torch.full((*s.shape[:-1], 1), float("-inf"))
    zeros = dict.fromkeys(p_scales, 0)
    positive = 0
    for t in tile_order(len(starts), order):
        j0, j1 = starts[t], min(starts[t] + block_k, n_k)
        m = torch.maximum(m, s[..., j0:j1].amax(dim=-1, keepdim=True))
        p = torch.exp(s[..., j0:j1] - m)
        if j0 <= skip_key < j1:
            p = torch.cat([p[..., : skip_key - j0], p[..., skip_key - j0 + 1 :]], dim=-1)
        counted = p > 0
        positive += int(counted.sum())
        for factor in p_scales:
            zeros[factor] += int((counted & (fp8_numerics.cast_fp8(p * factor, p_fp8) == 0)).sum())
    return {factor: zeros[factor] / max(positive, 1) for factor in p_scales}


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
        ``(rows, mse)``: one row per (sink strength, order, S) with the median and min/max over the
        seeds of ``p_underflow`` and ``mse``; and the per-seed MSEs keyed by (strength, order, S).
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
        row = {
            "part": "pcast",
            "variant": f"P e4m3, S={s:g}, {order}",
            "kernel": spec,
            "input_dtype": "bfloat16",
        }
        row |= _labels(spec, torch.bfloat16)
        row |= {"distribution": "sink", "sink_strength": strength, **shape.as_dict(), "repeats": len(seeds)}
        rows.append(row | summarize_seeds(values))
    mse = {key: [v["mse"] for v in values] for key, values in per_seed.items()}
    return rows, mse


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
    """rel L2 of ``fa3 fp8 no rotation`` over ``fa3 fp8`` on ``dist`` inputs: the medians, and the
    ratio seed by seed (same inputs) with its interval (:func:`_log_interval`)."""
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
    """The headline numbers: the P-cast MSE ratio at ``moderate`` sink strength (from the per-seed
    ``mse`` of :func:`pcast_rows`), the Hadamard rotation's error factor on outlier channels and on
    gaussian inputs (from the per-seed ``rel_l2`` of :func:`error_rows`)."""
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


def _markdown(doc: Mapping[str, Any]) -> str:
    """``DIR/fp8.md``: the summary and both tables."""
    rows = doc["rows"]
    out = ["# flashprobe bench fp8", "", f"Command: `{doc['command']}`", ""]
    out += [f"- {line}" for line in summary_lines(doc["summary"])]
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
    for title, part, keys in (
        ("Error vs the FP64 golden value", "error", err),
        ("P-cast collapse", "pcast", pcast),
    ):
        part_rows = [r for r in rows if r["part"] == part and (part != "error" or _first_axis(r, rows))]
        out += ["", f"## {title}", "", "| " + " | ".join(names + keys) + " |"]
        out.append("|" + "---|" * len(names + keys))
        out += ["| " + " | ".join(format_cell(r.get(key)) for key in names + keys) + " |" for r in part_rows]
    return "\n".join(out) + "\n"


def _first_axis(row: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``row`` is the first listing of its (variant, distribution, N, D) point."""
    key = ("variant", "distribution", "seq_len", "head_dim")
    first = next(r for r in rows if r["part"] == "error" and all(r[k] == row[k] for k in key))
    return first is row


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench fp8``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench fp8",
        description="Error of FP8 attention variants vs the FP64 golden value (beside bf16/fp16 flash and "
        "the baseline) over N, D and input distributions, and the P-cast collapse of arXiv 2606.06521.",
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
        "--distribution",
        nargs="+",
        default=list(DISTRIBUTIONS),
        metavar="NAME",
        help=f"input distributions (default: {' '.join(DISTRIBUTIONS)})",
    )
    parser.add_argument(
        "--sink-strength",
        type=float,
        nargs="+",
        default=[0.0, 4.0, 8.0, 12.0, 16.0],
        metavar="L",
        help="sink logits of the P-cast experiment (default 0 4 8 12 16)",
    )
    parser.add_argument(
        "--moderate-sink",
        type=float,
        default=MODERATE_SINK,
        metavar="L",
        help=f"the sink strength of the headline ratio (default {MODERATE_SINK:g})",
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument(
        "--repeats", type=int, default=3, metavar="R", help="seeds of the error experiment (default 3)"
    )
    parser.add_argument(
        "--pcast-repeats",
        type=int,
        default=5,
        metavar="R",
        help="seeds of the P-cast experiment (at least 5 for the interval; default 5)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long smoke run: N 64 128, D 16 32, 1 head, 1 seed (2 for P cast)",
    )
    add_output_args(parser, "fp8", replot=True)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.tiny:
        args.seq_len, args.head_dim, args.base_seq_len, args.base_head_dim = [64, 128], [16, 32], 128, 16
        args.heads, args.repeats, args.pcast_repeats = 1, 1, 2
        args.sink_strength = [0.0, args.moderate_sink]
    for name in ("seq_len", "head_dim"):
        for value in getattr(args, name):
            if value < 1:
                raise BenchArgumentError(f"--{name.replace('_', '-')} values must be positive, got {value}")
    for d in [*args.head_dim, args.base_head_dim]:
        if not fp8_numerics.is_power_of_two(d):
            raise BenchArgumentError(
                f"head dim {d} is not a power of two; the Hadamard rotation of the fa3 fp8 variant needs one"
            )
    if args.base_seq_len < 2 or args.heads < 1 or args.repeats < 1 or args.pcast_repeats < 1:
        raise BenchArgumentError("--base-seq-len must be ≥ 2 and --heads, --repeats, --pcast-repeats ≥ 1")
    for dist in args.distribution:
        if dist not in DISTRIBUTIONS:
            raise BenchArgumentError(f"unknown --distribution {dist!r}; use: {', '.join(DISTRIBUTIONS)}")
    if args.moderate_sink not in args.sink_strength:
        args.sink_strength = sorted({*args.sink_strength, args.moderate_sink})
    # the largest calls, before any is made: every --seq-len at --base-head-dim, every --head-dim at
    # --base-seq-len (a batch of 1)
    for n, d in ((max(args.seq_len), args.base_head_dim), (args.base_seq_len, max(args.head_dim))):
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
    rows, rel_l2 = error_rows(
        seq_lens=sorted(set(args.seq_len)),
        head_dims=sorted(set(args.head_dim)),
        base_seq_len=args.base_seq_len,
        base_head_dim=args.base_head_dim,
        heads=args.heads,
        distributions=args.distribution,
        seeds=seeds,
        progress=progress,
    )
    pcast, mse = pcast_rows(
        sink_strengths=args.sink_strength,
        seeds=[args.seed + i for i in range(args.pcast_repeats)],
        seq_len=args.base_seq_len,
        head_dim=args.base_head_dim,
        heads=args.heads,
        progress=progress,
    )
    rows += pcast
    seconds = time.perf_counter() - start
    summary = summarize(rows, mse, args.moderate_sink, rel_l2)
    print(format_table([r for r in rows if r["part"] == "error" and _first_axis(r, rows)], ERROR_COLUMNS))
    print(format_table(pcast, PCAST_COLUMNS))
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
        "variants": {v.label: v.spec for v in VARIANTS},
    }
    meta = {
        "command": args.command_line,
        "config": config,
        "summary": summary,
        "seconds": round(seconds, 2),
        "peak_memory": peak_memory(),
    }
    paths = write_results(args.out, "fp8", rows, meta=meta)
    paths["md"] = args.out / "fp8.md"
    atomic_write_text(
        paths["md"], _markdown({"rows": rows, "summary": summary, "command": args.command_line})
    )
    paths |= _draw(rows, args.out)
    print(wrote_line(rows, seconds, paths))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench fp8``; returns the exit code."""
    return run_cli("fp8", build_parser(), _run, argv)
