"""``flashprobe bench precision``: deviation vs numeric precision (paper §IV, Figs 3 and 4).

For each dtype (default bf16, fp16, fp32, fp64) and each primary kernel (default ``tiled``, the
FlashAttention re-implementation with every step in the inputs' dtype), the same float64 inputs
are cast to the dtype and three outputs are compared elementwise: primary vs baseline (Fig 3),
primary vs golden and baseline vs golden (Fig 4, golden = baseline in float64). The **error
ratio** is primary-vs-golden max over baseline-vs-golden max.

Run it against the real kernel too: ``--kernel tiled --kernel sdpa_flash``. Knobs such as
``--kernel tiled:stats_dtype=fp32,acc_dtype=fp32`` mimic FlashAttention-2's fp32 statistics.

Writes ``DIR/precision.json`` (rows under ``"rows"``), ``DIR/precision.csv`` and
``DIR/precision.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from flashprobe.bench.common import (
    InputConfig,
    Primary,
    Shape,
    SweepPoint,
    add_input_args,
    add_kernel_args,
    add_output_args,
    add_shape_args,
    deviation_sweep,
    format_table,
    load_results,
    parse_device,
    parse_dtypes,
    parse_input_config,
    parse_kernels,
    parse_seeds,
    run_cli,
    write_results,
)
from flashprobe.kernels import Kernel

__all__ = ["TABLE_COLUMNS", "build_parser", "main", "precision_rows"]

#: Columns of the printed table: (row key, header).
TABLE_COLUMNS = [
    ("kernel", "kernel"),
    ("dtype", "dtype"),
    ("primary_vs_baseline_max", "max|p-b|"),
    ("primary_vs_baseline_mean", "mean|p-b|"),
    ("primary_vs_golden_max", "max|p-g|"),
    ("baseline_vs_golden_max", "max|b-g|"),
    ("error_ratio", "ratio"),
    ("error_ratio_lo", "ratio lo"),
    ("error_ratio_hi", "ratio hi"),
]


def precision_rows(
    shape: Shape,
    *,
    kernels: Sequence[Kernel],
    baseline: Kernel,
    dtypes: Sequence[torch.dtype],
    seeds: Sequence[int],
    inputs: InputConfig | None = None,
    device: torch.device | str = "cpu",
    is_causal: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deviation of each kernel from the baseline and the golden value at each dtype.

    Args:
        shape: the ``(B, H, N, D)`` input shape.
        kernels: the primary kernels; each spec is applied to inputs of every dtype.
        baseline: the baseline kernel.
        dtypes: the precisions to compare.
        seeds: one repeat per seed.
        inputs: the input distribution (default standard normal).
        device: where the kernels run.
        is_causal: apply the causal mask.

    Returns:
        ``(rows, skipped)``, see :func:`~flashprobe.bench.common.deviation_sweep`; every row has
        ``kernel``, ``dtype``, ``primary_vs_baseline_max``, ``primary_vs_golden_max``,
        ``baseline_vs_golden_max``, ``error_ratio``, the ``_mean``/``_std`` variants and the
        ``_lo``/``_hi`` spread over seeds.
    """
    point = SweepPoint(shape, [Primary(k, {"kernel": k.spec}) for k in kernels])
    return deviation_sweep(
        [point],
        baseline=baseline,
        dtypes=dtypes,
        seeds=seeds,
        inputs=inputs or InputConfig(),
        device=device,
        is_causal=is_causal,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench precision``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench precision",
        description="Deviation of attention kernels vs baseline and FP64 golden at each precision "
        "(paper Figs 3 and 4).",
    )
    add_kernel_args(parser, default=["tiled"])
    add_shape_args(parser, batch=1, heads=4, seq_len=1024, head_dim=64)
    add_input_args(parser, repeats=3)
    add_output_args(parser, "precision", replot=True)
    return parser


def _run(args: argparse.Namespace) -> int:
    from flashprobe.report.bench_figures import plot_precision

    if args.replot:
        doc = load_results(args.out, "precision")
        print(f"redrew {plot_precision(doc['rows'], args.out / 'precision.png')}")
        return 0

    shape = Shape(batch=args.batch, heads=args.heads, seq_len=args.seq_len, head_dim=args.head_dim)
    kernels = parse_kernels(args.kernel)
    (baseline,) = parse_kernels([args.baseline])
    dtypes = parse_dtypes(args.dtype)
    seeds = parse_seeds(args.seed, args.repeats)
    inputs = parse_input_config(args)
    start = time.perf_counter()
    rows, skipped = precision_rows(
        shape,
        kernels=kernels,
        baseline=baseline,
        dtypes=dtypes,
        seeds=seeds,
        inputs=inputs,
        device=parse_device(args.device),
        is_causal=args.causal,
    )
    seconds = time.perf_counter() - start
    print(format_table(rows, TABLE_COLUMNS))
    for s in skipped:
        print(f"skipped {s['kernel']} at {s['dtype']}: {s['reason']}")
    meta = {
        "command": args.command_line,
        "config": {
            "kernels": [k.spec for k in kernels],
            "baseline": baseline.spec,
            **shape.as_dict(),
            **inputs.as_dict(),
            "seeds": seeds,
        },
        "seconds": round(seconds, 2),
    }
    paths = write_results(args.out, "precision", rows, meta=meta, skipped=skipped)
    if rows:
        paths["png"] = plot_precision(rows, args.out / "precision.png")
    print(f"{len(rows)} rows in {seconds:.1f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench precision``; returns the exit code."""
    return run_cli("precision", build_parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
