"""``flashprobe bench precision``: deviation vs numeric precision (paper §IV, Figs 3 and 4).

Per dtype and primary kernel (default ``tiled:preset=paper`` and ``tiled``), the same float64 inputs
are cast and compared: primary vs baseline (Fig 3), primary vs golden and baseline vs golden (Fig 4);
the error ratio is the primary's max error over the baseline's. Writes ``DIR/precision.json``,
``DIR/precision.csv`` and ``DIR/precision.png``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from flashprobe.bench.args import add_input_args, add_kernel_args, add_output_args, add_shape_args
from flashprobe.bench.sweep import Primary, SweepPoint
from flashprobe.bench.sweep_command import SweepCommand, SweepPlan, SweepSetup, run_sweep_cli

__all__ = ["COMMAND", "DEFAULT_KERNELS", "TABLE_COLUMNS", "build_parser", "main"]

#: The primaries by default: the paper's re-implementation and the real kernels' numerics.
DEFAULT_KERNELS = ("tiled:preset=paper", "tiled")

#: Columns of the printed table: (row key, header).
TABLE_COLUMNS = [
    ("kernel", "kernel"),
    ("dtype", "dtype"),
    ("primary_baseline_max_abs", "max|p-b|"),
    ("primary_baseline_mean_abs", "mean|p-b|"),
    ("primary_golden_max_abs", "max|p-g|"),
    ("baseline_golden_max_abs", "max|b-g|"),
    ("error_ratio", "ratio"),
    ("error_ratio_lo", "ratio lo"),
    ("error_ratio_hi", "ratio hi"),
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench precision``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench precision",
        description="Deviation of attention kernels vs baseline and FP64 golden at each precision "
        "(paper Figs 3 and 4).",
    )
    add_kernel_args(parser, default=list(DEFAULT_KERNELS))
    add_shape_args(parser, batch=1, heads=4, seq_len=1024, head_dim=64)
    add_input_args(parser, repeats=3)
    add_output_args(parser, "precision", replot=True)
    return parser


def _plan(args: argparse.Namespace, setup: SweepSetup) -> SweepPlan:
    config = {"kernels": [k.spec for k in setup.kernels], "baseline": setup.baseline.spec}
    point = SweepPoint(setup.shape, [Primary(k, {"kernel": k.spec}) for k in setup.kernels])
    return SweepPlan(points=[point], config={**config, **setup.shape.as_dict()})


#: The command's part of the shared deviation-sweep pipeline.
COMMAND = SweepCommand(name="precision", columns=TABLE_COLUMNS, plan=_plan, figure="plot_precision")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench precision``; returns the exit code."""
    return run_sweep_cli(COMMAND, build_parser(), argv)
