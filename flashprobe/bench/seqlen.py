"""``flashprobe bench seqlen``: deviation vs sequence length at a fixed tile size (paper Fig 5).

The tile size stays whatever the kernel spec says (``tiled`` defaults to Br=64, Bc=128), so a
longer sequence means more key tiles per row and more online-softmax rescalings. Each row is one
(kernel, dtype, N) with the same deviation keys as ``flashprobe bench precision``.

Writes ``DIR/seqlen.json`` (rows under ``"rows"``), ``DIR/seqlen.csv`` and ``DIR/seqlen.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
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

__all__ = ["TABLE_COLUMNS", "build_parser", "main", "seqlen_rows"]

_PROG = "flashprobe bench seqlen"

#: Columns of the printed table: (row key, header).
TABLE_COLUMNS = [
    ("kernel", "kernel"),
    ("dtype", "dtype"),
    ("seq_len", "N"),
    ("primary_vs_baseline_max", "max|p-b|"),
    ("primary_vs_baseline_mean", "mean|p-b|"),
    ("primary_vs_golden_max", "max|p-g|"),
    ("baseline_vs_golden_max", "max|b-g|"),
    ("error_ratio", "ratio"),
]


def seqlen_rows(
    shape: Shape,
    seq_lens: Sequence[int],
    *,
    kernels: Sequence[Kernel],
    baseline: Kernel,
    dtypes: Sequence[torch.dtype],
    seeds: Sequence[int],
    inputs: InputConfig | None = None,
    device: torch.device | str = "cpu",
    is_causal: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deviation of each kernel at each sequence length and dtype.

    Args:
        shape: ``(B, H, ·, D)``; its ``seq_len`` is replaced by each of ``seq_lens``.
        seq_lens: the sequence lengths N to sweep.
        kernels, baseline, dtypes, seeds, inputs, device, is_causal: as in
            :func:`~flashprobe.bench.precision.precision_rows`.
        progress: optional callable taking a short message before each (N, dtype).

    Returns:
        ``(rows, skipped)`` with one row per (N, kernel, dtype).
    """
    points = [
        SweepPoint(replace(shape, seq_len=n), [Primary(k, {"kernel": k.spec}) for k in kernels])
        for n in sorted(dict.fromkeys(seq_lens))
    ]
    return deviation_sweep(
        points,
        baseline=baseline,
        dtypes=dtypes,
        seeds=seeds,
        inputs=inputs or InputConfig(),
        device=device,
        is_causal=is_causal,
        progress=progress,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench seqlen``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench seqlen",
        description="Deviation of attention kernels vs sequence length at a fixed tile size (paper Fig 5).",
    )
    add_kernel_args(parser, default=["tiled"])
    add_shape_args(parser, batch=1, heads=2, seq_len=[128, 256, 512, 1024, 2048, 4096], head_dim=64)
    add_input_args(parser, repeats=3)
    add_output_args(parser, "seqlen", replot=True)
    return parser


def _run(args: argparse.Namespace) -> int:
    from flashprobe.report.bench_figures import plot_seqlen

    if args.replot:
        doc = load_results(args.out, "seqlen")
        print(f"redrew {plot_seqlen(doc['rows'], args.out / 'seqlen.png')}")
        return 0

    shape = Shape(batch=args.batch, heads=args.heads, seq_len=min(args.seq_len), head_dim=args.head_dim)
    kernels = parse_kernels(args.kernel)
    (baseline,) = parse_kernels([args.baseline])
    dtypes = parse_dtypes(args.dtype)
    seeds = parse_seeds(args.seed, args.repeats)
    inputs = parse_input_config(args)
    start = time.perf_counter()
    rows, skipped = seqlen_rows(
        shape,
        args.seq_len,
        kernels=kernels,
        baseline=baseline,
        dtypes=dtypes,
        seeds=seeds,
        inputs=inputs,
        device=parse_device(args.device),
        is_causal=args.causal,
        progress=lambda msg: print(f"{_PROG}: {msg}", file=sys.stderr, flush=True),
    )
    seconds = time.perf_counter() - start
    rows.sort(key=lambda r: (r["kernel"], r["dtype"], r["seq_len"]))
    print(format_table(rows, TABLE_COLUMNS))
    for s in skipped:
        print(f"skipped {s['kernel']} at {s['dtype']}, N={s['seq_len']}: {s['reason']}")
    meta = {
        "command": args.command_line,
        "config": {
            "kernels": [k.spec for k in kernels],
            "baseline": baseline.spec,
            **shape.as_dict(),
            "seq_len": sorted(set(args.seq_len)),
            **inputs.as_dict(),
            "seeds": seeds,
        },
        "seconds": round(seconds, 2),
    }
    paths = write_results(args.out, "seqlen", rows, meta=meta, skipped=skipped)
    if rows:
        paths["png"] = plot_seqlen(rows, args.out / "seqlen.png")
    print(f"{len(rows)} rows in {seconds:.1f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench seqlen``; returns the exit code."""
    return run_cli("seqlen", build_parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
