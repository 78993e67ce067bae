"""``flashprobe bench seqlen``: deviation vs sequence length at a fixed tile size (paper Fig 5).

A longer sequence means more key tiles per row, so more online-softmax rescalings. Each row is one
(kernel, dtype, N) with the deviation keys of ``flashprobe bench precision``. Writes
``DIR/seqlen.json``, ``DIR/seqlen.csv`` and ``DIR/seqlen.png``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

from flashprobe.bench.args import add_input_args, add_kernel_args, add_output_args, add_shape_args
from flashprobe.bench.sweep import Primary, SweepPoint
from flashprobe.bench.sweep_command import SweepCommand, SweepPlan, SweepSetup, run_sweep_cli

__all__ = ["COMMAND", "TABLE_COLUMNS", "build_parser", "main"]

#: Columns of the printed table: (row key, header).
TABLE_COLUMNS = [
    ("kernel", "kernel"),
    ("dtype", "dtype"),
    ("seq_len", "N"),
    ("primary_baseline_max_abs", "max|p-b|"),
    ("primary_baseline_mean_abs", "mean|p-b|"),
    ("primary_golden_max_abs", "max|p-g|"),
    ("baseline_golden_max_abs", "max|b-g|"),
    ("error_ratio", "ratio"),
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench seqlen``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench seqlen",
        description="Deviation of attention kernels vs sequence length at a fixed tile size (paper Fig 5).",
    )
    add_kernel_args(parser, default=["tiled:preset=paper", "tiled"])
    add_shape_args(parser, batch=1, heads=2, seq_len=[128, 256, 512, 1024, 2048, 4096], head_dim=64)
    add_input_args(parser, repeats=3)
    add_output_args(parser, "seqlen", replot=True)
    return parser


def _plan(args: argparse.Namespace, setup: SweepSetup) -> SweepPlan:
    config = {"kernels": [k.spec for k in setup.kernels], "baseline": setup.baseline.spec}
    config |= {**setup.shape.as_dict(), "seq_len": sorted(set(args.seq_len))}
    primaries = [Primary(k, {"kernel": k.spec}) for k in setup.kernels]
    return SweepPlan(  # one point per distinct N, shortest first
        points=[SweepPoint(replace(setup.shape, seq_len=n), primaries) for n in config["seq_len"]],
        config=config,
        sort_key=lambda r: (r["kernel"], r["dtype"], r["seq_len"]),
    )


#: The command's part of the shared deviation-sweep pipeline.
COMMAND = SweepCommand(
    name="seqlen",
    columns=TABLE_COLUMNS,
    plan=_plan,
    figure="plot_seqlen",
    skipped_line="skipped {kernel} at {dtype}, N={seq_len}: {reason}",
    progress=True,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench seqlen``; returns the exit code."""
    return run_sweep_cli(COMMAND, build_parser(), argv)
