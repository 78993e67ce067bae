"""Plumbing shared by the ``flashprobe bench`` commands.

* **arguments**: ``add_*_args`` put the common options on an :class:`argparse.ArgumentParser`
  (kernel specs, dtypes, shapes, input distribution, seed, repeats, output directory) and
  ``parse_*`` turn them into validated objects; bad values raise :class:`BenchArgumentError`
  with a message naming the problem and the fix;
* **inputs**: :func:`make_inputs` draws ``q, k, v`` in float64 from a seed, so every precision
  sees the same values once they are cast (:func:`cast_inputs`);
* **deviation**: :func:`compare_to_references` compares primary kernels with the baseline and the
  float64 golden value on one set of inputs; :func:`deviation_sweep` runs that over sweep points,
  dtypes and seeds and :func:`summarize_seeds` turns the seeds into a median and a spread;
* **results**: :func:`write_results` writes ``DIR/<name>.json`` (rows under ``"rows"``) and
  ``DIR/<name>.csv`` atomically, :func:`format_table` renders rows for the terminal and
  :func:`run_cli` runs a command so that bad input gives exit code 2 and one clear message.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import platform
import shlex
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashprobe.deviation import deviation_tensors, error_ratio, finish_deviation
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.kernels import (
    Kernel,
    KernelInputError,
    KernelSpecError,
    KernelUnavailableError,
    check_inputs,
    dtype_name,
    get_kernel,
    golden_attention,
    to_dtype,
)

__all__ = [
    "DISTRIBUTIONS",
    "PAIRS",
    "BenchArgumentError",
    "InputConfig",
    "Primary",
    "Shape",
    "SweepPoint",
    "add_input_args",
    "add_kernel_args",
    "add_output_args",
    "add_shape_args",
    "atomic_write_text",
    "cast_inputs",
    "check_kernel",
    "compare_to_references",
    "deviation_stats",
    "deviation_sweep",
    "environment",
    "format_table",
    "load_results",
    "make_inputs",
    "parse_device",
    "parse_dtypes",
    "parse_input_config",
    "parse_kernels",
    "parse_seeds",
    "run_cli",
    "summarize_seeds",
    "write_results",
]

#: Input distributions accepted by ``--distribution``.
DISTRIBUTIONS = ("normal", "uniform", "outliers")

#: The three comparisons every deviation row reports, as ``<a>_vs_<b>``.
PAIRS = ("primary_vs_baseline", "primary_vs_golden", "baseline_vs_golden")

#: Dtypes the microbenchmark sweeps by default, fewest mantissa bits first.
DEFAULT_DTYPES = ("bf16", "fp16", "fp32", "fp64")


class BenchArgumentError(ValueError):
    """A benchmark was given a bad argument (shape, dtype, kernel, distribution, ...)."""


# --------------------------------------------------------------------------------------------
# Configuration objects
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Shape:
    """Shape of the attention inputs: ``q, k, v`` are ``(batch, heads, seq_len, head_dim)``."""

    batch: int
    """B, the batch size."""
    heads: int
    """H, the number of heads."""
    seq_len: int
    """N, the sequence length (queries and keys)."""
    head_dim: int
    """D, the head dimension."""

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_len", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise BenchArgumentError(f"{name} must be a positive integer ({flag}), got {value!r}")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """``(B, H, N, D)``."""
        return (self.batch, self.heads, self.seq_len, self.head_dim)

    def as_dict(self) -> dict[str, int]:
        return {"batch": self.batch, "heads": self.heads, "seq_len": self.seq_len, "head_dim": self.head_dim}


@dataclass(frozen=True, kw_only=True)
class InputConfig:
    """How ``q, k, v`` are drawn (see :func:`make_inputs`)."""

    distribution: str = "normal"
    """``normal`` (N(0, 1)), ``uniform`` (U(−√3, √3), unit variance) or ``outliers`` (normal with
    a fraction ``outlier_frac`` of entries multiplied by ``outlier_scale``)."""
    scale: float = 1.0
    """Every entry is multiplied by this; larger values give larger logits (peakier softmax)."""
    outlier_frac: float = 0.001
    """Fraction of entries turned into outliers (``outliers`` only)."""
    outlier_scale: float = 30.0
    """Factor applied to outlier entries (``outliers`` only)."""

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise BenchArgumentError(
                f"unknown input distribution {self.distribution!r}; use one of: {', '.join(DISTRIBUTIONS)}"
            )
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise BenchArgumentError(f"input scale must be a finite positive number, got {self.scale}")
        if not 0.0 <= self.outlier_frac <= 1.0:
            raise BenchArgumentError(f"outlier fraction must lie in [0, 1], got {self.outlier_frac}")
        if not math.isfinite(self.outlier_scale):
            raise BenchArgumentError(f"outlier scale must be finite, got {self.outlier_scale}")

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"distribution": self.distribution, "input_scale": self.scale}
        if self.distribution == "outliers":
            out |= {"outlier_frac": self.outlier_frac, "outlier_scale": self.outlier_scale}
        return out


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


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def add_kernel_args(
    parser: argparse.ArgumentParser, *, default: Sequence[str], baseline: bool = True
) -> None:
    """Add ``--kernel SPEC`` (repeatable) and, with ``baseline``, ``--baseline SPEC``."""
    parser.add_argument(
        "--kernel",
        action="append",
        metavar="SPEC",
        help=f"primary kernel spec, repeatable (default: {' '.join(default)}); e.g. "
        "'tiled:block_k=64,stats_dtype=fp32' or 'sdpa_flash'; see `flashprobe kernels`",
    )
    parser.set_defaults(kernel_default=list(default))
    if baseline:
        parser.add_argument(
            "--baseline", default="math", metavar="SPEC", help="baseline kernel (default: math)"
        )


def add_shape_args(
    parser: argparse.ArgumentParser,
    *,
    batch: int,
    heads: int,
    seq_len: int | Sequence[int],
    head_dim: int,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
) -> None:
    """Add ``--dtype``, ``--batch``, ``--heads``, ``--seq-len`` and ``--head-dim``.

    ``--seq-len`` takes several values when ``seq_len`` is a sequence (the command sweeps it).
    """
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=list(dtypes),
        metavar="DTYPE",
        help=f"input dtypes: bf16, fp16, fp32, fp64 (default: {' '.join(dtypes)})",
    )
    parser.add_argument("--batch", type=int, default=batch, metavar="B", help=f"batch size (default {batch})")
    parser.add_argument("--heads", type=int, default=heads, metavar="H", help=f"heads (default {heads})")
    if isinstance(seq_len, int):
        parser.add_argument(
            "--seq-len", type=int, default=seq_len, metavar="N", help=f"sequence length (default {seq_len})"
        )
    else:
        parser.add_argument(
            "--seq-len",
            type=int,
            nargs="+",
            default=list(seq_len),
            metavar="N",
            help=f"sequence lengths to sweep (default: {' '.join(map(str, seq_len))})",
        )
    parser.add_argument(
        "--head-dim", type=int, default=head_dim, metavar="D", help=f"head dimension (default {head_dim})"
    )
    parser.add_argument("--causal", action="store_true", help="apply the causal mask")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")


def add_input_args(parser: argparse.ArgumentParser, *, repeats: int, seed: int = 0) -> None:
    """Add ``--distribution``, ``--input-scale``, ``--outlier-frac``, ``--outlier-scale``,
    ``--seed`` and ``--repeats``."""
    defaults = InputConfig()
    parser.add_argument(
        "--distribution",
        default=defaults.distribution,
        metavar="NAME",
        help="input distribution: normal (N(0,1)), uniform (U(-√3,√3)), outliers "
        "(normal with a few large entries) (default normal)",
    )
    parser.add_argument(
        "--input-scale",
        type=float,
        default=defaults.scale,
        metavar="S",
        help="multiply q, k, v by S; larger S gives larger logits (default 1)",
    )
    parser.add_argument(
        "--outlier-frac",
        type=float,
        default=defaults.outlier_frac,
        metavar="P",
        help=f"outliers: fraction of entries that are outliers (default {defaults.outlier_frac})",
    )
    parser.add_argument(
        "--outlier-scale",
        type=float,
        default=defaults.outlier_scale,
        metavar="X",
        help=f"outliers: factor applied to outlier entries (default {defaults.outlier_scale:g})",
    )
    parser.add_argument("--seed", type=int, default=seed, help=f"first seed (default {seed})")
    parser.add_argument(
        "--repeats",
        type=int,
        default=repeats,
        metavar="R",
        help=f"repeat over R seeds seed, seed+1, ...; rows carry the median and min/max (default {repeats})",
    )


def add_output_args(parser: argparse.ArgumentParser, name: str, *, replot: bool = False) -> None:
    """Add ``--out DIR`` (default ``out/<name>``) and, with ``replot``, ``--replot``."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("out") / name,
        metavar="DIR",
        help=f"output directory for {name}.json, {name}.csv and {name}.png (default out/{name})",
    )
    if replot:
        parser.add_argument(
            "--replot",
            action="store_true",
            help=f"measure nothing: redraw DIR/{name}.png from the rows in DIR/{name}.json",
        )


def parse_kernels(specs: Iterable[str]) -> list[Kernel]:
    """Resolve kernel spec strings.

    Raises:
        BenchArgumentError: a spec is malformed or names an unknown kernel or option.
    """
    kernels = []
    for spec in specs:
        try:
            kernels.append(get_kernel(spec))
        except KernelSpecError as err:
            raise BenchArgumentError(str(err)) from None
    return kernels


def parse_dtypes(names: Iterable[str]) -> list[torch.dtype]:
    """Turn dtype names into dtypes, keeping order and dropping repeats.

    Raises:
        BenchArgumentError: a name is not bf16, fp16, fp32 or fp64 (or a spelling of one).
    """
    dtypes: list[torch.dtype] = []
    for name in names:
        try:
            dtype = to_dtype(name)
        except ValueError:
            raise BenchArgumentError(f"unsupported dtype {name!r}; use bf16, fp16, fp32 or fp64") from None
        if dtype not in dtypes:
            dtypes.append(dtype)
    if not dtypes:
        raise BenchArgumentError("give at least one dtype (--dtype bf16 fp32 ...)")
    return dtypes


def parse_seeds(seed: int, repeats: int) -> list[int]:
    """``[seed, seed + 1, ..., seed + repeats - 1]``.

    Raises:
        BenchArgumentError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise BenchArgumentError(f"--repeats must be at least 1, got {repeats}")
    return [seed + i for i in range(repeats)]


def parse_device(name: str) -> torch.device:
    """Turn ``--device`` into a :class:`torch.device`.

    Raises:
        BenchArgumentError: the name is not a device, or CUDA was asked for but is not available.
    """
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise BenchArgumentError(f"bad --device {name!r}: {err}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchArgumentError(f"--device {name} given but CUDA is not available here; use --device cpu")
    return device


def parse_input_config(args: argparse.Namespace) -> InputConfig:
    """The :class:`InputConfig` from the options of :func:`add_input_args`."""
    return InputConfig(
        distribution=args.distribution,
        scale=args.input_scale,
        outlier_frac=args.outlier_frac,
        outlier_scale=args.outlier_scale,
    )


# --------------------------------------------------------------------------------------------
# Inputs and kernels
# --------------------------------------------------------------------------------------------


def _draw(shape: tuple[int, ...], config: InputConfig, gen: torch.Generator) -> torch.Tensor:
    if config.distribution == "uniform":
        x = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * math.sqrt(3.0)
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        if config.distribution == "outliers":
            outlier = torch.rand(shape, generator=gen, dtype=torch.float64) < config.outlier_frac
            x = torch.where(outlier, x * config.outlier_scale, x)
    return x * config.scale


def make_inputs(
    shape: Shape, seed: int, config: InputConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``q, k, v`` in float64 on the CPU from ``seed``.

    One ``torch.Generator`` seeded with ``seed`` draws ``q``, then ``k``, then ``v``: ``normal``
    is ``torch.randn``; ``uniform`` is ``(2·torch.rand − 1)·√3``; ``outliers`` is ``torch.randn``
    followed by a ``torch.rand`` draw that picks the outlier entries. Everything is then
    multiplied by ``config.scale``.

    Args:
        shape: the ``(B, H, N, D)`` shape.
        seed: the generator seed.
        config: the distribution (default: standard normal).

    Returns:
        ``q, k, v``, each ``(B, H, N, D)`` float64 on the CPU.
    """
    config = config or InputConfig()
    gen = torch.Generator().manual_seed(seed)
    q = _draw(shape.dims, config, gen)
    k = _draw(shape.dims, config, gen)
    v = _draw(shape.dims, config, gen)
    return q, k, v


def cast_inputs(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """Cast float64 inputs to ``dtype`` on ``device`` (shapes unchanged)."""
    return tuple(t.to(device=device, dtype=dtype) for t in tensors)


def check_kernel(kernel: Kernel, dtype: torch.dtype, device: torch.device | str, head_dim: int) -> str | None:
    """Check that ``kernel`` runs at ``dtype`` on ``device`` before a long sweep starts.

    Runs the kernel's own availability check and one tiny call, so bad option values (e.g.
    ``tiled:loop=x``) fail at once.

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


# --------------------------------------------------------------------------------------------
# Deviation
# --------------------------------------------------------------------------------------------


def deviation_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Elementwise ``|a − b|`` statistics (in float64, over positions where both are finite).

    Args:
        a, b: tensors of the same shape.

    Returns:
        ``max``, ``mean`` and ``std`` (population standard deviation) of ``|a − b|``, ``rel_l2``
        (``‖a − b‖ / ‖b‖``) and ``nonfinite`` (positions where either is NaN/inf).
    """
    t = deviation_tensors(a, b)
    sums = dict(zip(t.keys(), torch.stack(list(t.values())).tolist(), strict=True))
    dev = finish_deviation(sums)
    count = sums["count"]
    var = sums["sum_sq_diff"] / count - dev.mean_abs**2 if count else 0.0
    return {
        "max": dev.max_abs,
        "mean": dev.mean_abs,
        "std": math.sqrt(max(var, 0.0)),
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
    """Deviation of each primary from the baseline and from the golden value, on one input.

    The golden value is :func:`~flashprobe.kernels.golden_attention` of these very inputs (the
    baseline in float64), so it measures each kernel's arithmetic, not the rounding of the inputs.

    Args:
        q: ``(B, H, N, D)`` queries, in the dtype under test; k, v: keys and values, same shape.
        primaries: the kernels under test.
        baseline: the baseline kernel (usually ``math``).
        is_causal: apply the causal mask.

    Returns:
        One dict per primary with ``<pair>_{max,mean,std,rel_l2}`` for each of :data:`PAIRS`,
        ``error_ratio`` (primary-vs-golden max over baseline-vs-golden max; ``inf`` when the
        baseline is exact), ``primary_nonfinite`` and ``baseline_nonfinite``.

    Raises:
        KernelInputError: malformed inputs (rank, heads, head dims, dtypes), naming the problem.
    """
    check_inputs(q, k, v, None, is_causal, kernel="bench")
    with torch.inference_mode():
        golden = golden_attention(q, k, v, is_causal=is_causal)
        base = baseline(q, k, v, is_causal=is_causal)
        base_vs_golden = deviation_stats(base, golden)
        rows = []
        for kernel in primaries:
            out = kernel(q, k, v, is_causal=is_causal)
            stats = {
                "primary_vs_baseline": deviation_stats(out, base),
                "primary_vs_golden": deviation_stats(out, golden),
                "baseline_vs_golden": base_vs_golden,
            }
            row = {f"{pair}_{m}": stats[pair][m] for pair in PAIRS for m in ("max", "mean", "std", "rel_l2")}
            row["error_ratio"] = error_ratio(row["primary_vs_golden_max"], row["baseline_vs_golden_max"])
            row["primary_nonfinite"] = int(torch.count_nonzero(~torch.isfinite(out)))
            row["baseline_nonfinite"] = int(torch.count_nonzero(~torch.isfinite(base)))
            rows.append(row)
    return rows


def summarize_seeds(per_seed: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Median over seeds of every metric, plus its spread.

    Args:
        per_seed: one metrics dict per seed, all with the same keys.

    Returns:
        For each key ``m``: ``m`` (median over seeds), ``m_lo`` and ``m_hi`` (min and max over
        seeds); counts (keys ending in ``nonfinite``) are summed instead.
    """
    out: dict[str, float] = {}
    for key in per_seed[0]:
        values = [row[key] for row in per_seed]
        if key.endswith("nonfinite"):
            out[key] = int(sum(values))
            continue
        out[key] = statistics.median(values)
        out[f"{key}_lo"] = min(values)
        out[f"{key}_hi"] = max(values)
    return out


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

    For each point and seed the inputs are drawn once in float64 and cast to every dtype, so all
    precisions see the same values. Kernels that cannot run at a dtype here are skipped.

    Args:
        points: the sweep points, each with its shape and primary kernels.
        baseline: the baseline kernel.
        dtypes: the dtypes under test.
        seeds: one repeat per seed.
        inputs: the input distribution.
        device: where the kernels run.
        is_causal: apply the causal mask.
        progress: called with a short message before each (point, dtype).

    Returns:
        ``(rows, skipped)``: one row per (point, primary, dtype) with the point's and primary's
        labels, the shape, ``dtype``, ``baseline``, the input distribution, ``repeats`` and the
        :func:`summarize_seeds` metrics; and one ``{..., "reason"}`` entry per skipped run.

    Raises:
        BenchArgumentError: a kernel spec has invalid option values.
    """
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for point in points:
        drawn: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for dtype in dtypes:
            head_dim = point.shape.head_dim
            reason = check_kernel(baseline, dtype, device, head_dim)
            runnable = []
            for primary in point.primaries:
                why = reason and f"baseline {baseline.spec}: {reason}"
                why = why or check_kernel(primary.kernel, dtype, device, head_dim)
                if why:
                    skipped.append(
                        {
                            **point.labels,
                            **primary.labels,
                            "dtype": dtype_name(dtype),
                            **point.shape.as_dict(),
                            "reason": why,
                        }
                    )
                else:
                    runnable.append(primary)
            if not runnable:
                continue
            if progress:
                progress(
                    f"N={point.shape.seq_len} {dtype_name(dtype)}: "
                    f"{len(runnable)} kernel(s) × {len(seeds)} seed(s)"
                )
            per_seed: list[list[dict[str, float]]] = []
            for seed in seeds:
                if seed not in drawn:
                    drawn[seed] = make_inputs(point.shape, seed, inputs)
                q, k, v = cast_inputs(drawn[seed], dtype, device)
                per_seed.append(
                    compare_to_references(
                        q, k, v, [p.kernel for p in runnable], baseline, is_causal=is_causal
                    )
                )
            for i, primary in enumerate(runnable):
                rows.append(
                    {
                        **point.labels,
                        **primary.labels,
                        "dtype": dtype_name(dtype),
                        "baseline": baseline.spec,
                        **point.shape.as_dict(),
                        "causal": is_causal,
                        **inputs.as_dict(),
                        "repeats": len(seeds),
                        **summarize_seeds([seed_rows[i] for seed_rows in per_seed]),
                    }
                )
    return rows, skipped


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


def _json_safe(value: Any) -> Any:
    """Non-finite floats become ``None`` (JSON has no inf/NaN); containers are walked."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path | torch.dtype):
        return str(value)
    return value


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_results(
    out_dir: Path,
    name: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    meta: Mapping[str, Any] | None = None,
    skipped: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Path]:
    """Write ``out_dir/<name>.json`` and ``out_dir/<name>.csv`` atomically.

    The JSON object holds ``name``, ``environment``, the ``meta`` entries, ``rows`` and
    ``skipped``; non-finite numbers are written as ``null``. The CSV has one column per key seen
    in the rows (first-seen order); missing values are empty and ``inf`` is written as ``inf``.

    Returns:
        ``{"json": path, "csv": path}``.
    """
    out_dir = Path(out_dir)
    doc = {"name": name, "environment": environment(), **(meta or {}), "rows": rows, "skipped": skipped}
    paths = {"json": out_dir / f"{name}.json", "csv": out_dir / f"{name}.csv"}
    atomic_write_text(paths["json"], json.dumps(_json_safe(doc), indent=1, allow_nan=False) + "\n")
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(paths["csv"], buf.getvalue())
    return paths


def load_results(out_dir: Path, name: str) -> dict[str, Any]:
    """Read ``out_dir/<name>.json`` as written by :func:`write_results`.

    Raises:
        BenchArgumentError: the file is missing or has no ``"rows"`` (or none).
    """
    path = Path(out_dir) / f"{name}.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchArgumentError(
            f"no {path} to replot; run `flashprobe bench {name} --out {out_dir}` without --replot first"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not doc["rows"]:
        raise BenchArgumentError(f"{path} has no rows under 'rows' to plot; was it written by flashprobe?")
    return doc


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.3g}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Render rows as an aligned text table.

    Args:
        rows: the rows; missing keys show as ``-``.
        columns: ``(key, header)`` pairs in display order.

    Returns:
        The table, header first, without a trailing newline.
    """
    cells = [[header for _, header in columns]]
    cells += [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_cli(
    name: str,
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """Parse ``argv`` and call ``run(args)``; bad input prints one clear error and returns 2.

    Args:
        name: the command name used in messages (``precision``).
        parser: the command's parser.
        run: the command body.
        argv: arguments (default ``sys.argv[1:]``).

    ``args.command_line`` is set to the equivalent shell command, for the results' metadata.

    Returns:
        The exit code: ``run``'s, 0 for ``--help``, 2 for bad input.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    args.command_line = shlex.join(["flashprobe", "bench", name, *argv])
    if getattr(args, "kernel", "absent") is None:
        args.kernel = list(args.kernel_default)
    try:
        return run(args)
    except (BenchArgumentError, KernelSpecError, KernelInputError) as err:
        print(f"flashprobe bench {name}: error: {err}", file=sys.stderr)
        return 2
