"""The pipeline shared by the deviation-sweep commands ``precision``, ``seqlen`` and ``tiles``.

A command is a :class:`SweepCommand` whose ``plan`` turns the parsed arguments into a
:class:`SweepPlan`; :func:`run_sweep_command` does the rest the same way for each: ``--replot``, the
shared options, the timed sweep, the table, the skipped runs, and the JSON, CSV and figure.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashprobe.bench.args import (
    parse_device,
    parse_dtypes,
    parse_input_config,
    parse_kernels,
    parse_seeds,
    progress_printer,
    run_cli,
)
from flashprobe.bench.inputs import InputConfig, Shape
from flashprobe.bench.results import (
    format_table,
    load_results,
    peak_memory,
    peak_memory_line,
    write_results,
    wrote_line,
)
from flashprobe.bench.sweep import SweepPoint, deviation_sweep
from flashprobe.kernels import Kernel

__all__ = ["SweepCommand", "SweepPlan", "SweepSetup", "parse_setup", "run_sweep_cli", "run_sweep_command"]

Row = Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class SweepSetup:
    """The options every deviation sweep shares (``--kernel``, ``--baseline``, ``--dtype`` in the order
    given, ``--causal``, ...), parsed and validated (:func:`parse_setup`)."""

    shape: Shape
    """``(B, H, N, D)``; with several ``--seq-len`` values, N is the smallest."""
    kernels: list[Kernel]
    baseline: Kernel
    dtypes: list[torch.dtype]
    seeds: list[int]
    """``--seed`` … ``--seed + --repeats − 1``."""
    inputs: InputConfig
    device: torch.device
    is_causal: bool


@dataclass(frozen=True, kw_only=True)
class SweepPlan:
    """What one command sweeps: the points, how its rows are sorted, and its configuration."""

    points: Sequence[SweepPoint]
    """The sweep points, each with its shape and primary kernels."""
    config: Mapping[str, Any]
    """The command's entries of the results' ``"config"``; the inputs and seeds follow them."""
    sort_key: Callable[[Row], Any] | None = None
    """Sort key of the rows (``None``: the sweep's order, point × dtype × primary)."""


@dataclass(frozen=True, kw_only=True)
class SweepCommand:
    """What differs between the deviation-sweep commands; :func:`run_sweep_command` does the rest."""

    name: str
    """The command (``precision``): ``flashprobe bench NAME``, ``DIR/NAME.json``, ..."""
    columns: Sequence[tuple[str, str]]
    """Columns of the printed table: ``(row key, header)``."""
    plan: Callable[[argparse.Namespace, SweepSetup], SweepPlan]
    """Builds the sweep from the parsed arguments; raises ``BenchArgumentError`` on bad input."""
    figure: str
    """Name of the :mod:`flashprobe.report.bench_figures` function that draws the rows."""
    skipped_line: str = "skipped {kernel} at {dtype}: {reason}"
    """Line printed per skipped run, formatted with the skipped entry's keys."""
    progress: bool = False
    """Report each (point, dtype) on stderr as the sweep goes."""


def parse_setup(args: argparse.Namespace) -> SweepSetup:
    """The :class:`SweepSetup` from the options of the ``add_*_args`` of :mod:`flashprobe.bench.args`.

    Raises:
        BenchArgumentError: a bad shape, kernel spec, dtype, repeat count, distribution or device.
    """
    seq_len = min(args.seq_len) if isinstance(args.seq_len, list) else args.seq_len
    shape = Shape(batch=args.batch, heads=args.heads, seq_len=seq_len, head_dim=args.head_dim)
    kernels = parse_kernels(args.kernel)
    (baseline,) = parse_kernels([args.baseline])
    return SweepSetup(
        shape=shape,
        kernels=kernels,
        baseline=baseline,
        dtypes=parse_dtypes(args.dtype),
        seeds=parse_seeds(args.seed, args.repeats),
        inputs=parse_input_config(args),
        device=parse_device(args.device),
        is_causal=args.causal,
    )


def _draw(command: SweepCommand, rows: Sequence[Row], path: Path) -> Path:
    from flashprobe.report import bench_figures  # matplotlib is slow to import: only when drawing

    return getattr(bench_figures, command.figure)(rows, path)


def run_sweep_command(command: SweepCommand, args: argparse.Namespace) -> int:
    """Run a deviation-sweep command on its parsed arguments (``--replot``: only redraw the figure from
    the JSON); returns the exit code."""
    png = args.out / f"{command.name}.png"
    if args.replot:
        doc = load_results(args.out, command.name)
        print(f"redrew {_draw(command, doc['rows'], png)}")
        return 0
    setup = parse_setup(args)
    plan = command.plan(args, setup)
    start = time.perf_counter()
    rows, skipped = deviation_sweep(
        plan.points,
        baseline=setup.baseline,
        dtypes=setup.dtypes,
        seeds=setup.seeds,
        inputs=setup.inputs,
        device=setup.device,
        is_causal=setup.is_causal,
        progress=progress_printer(command.name) if command.progress else None,
    )
    seconds = time.perf_counter() - start
    if plan.sort_key is not None:
        rows.sort(key=plan.sort_key)
    print(format_table(rows, command.columns))
    for entry in skipped:
        print(command.skipped_line.format(**entry))
    config = {**plan.config, **setup.inputs.as_dict(), "seeds": setup.seeds}
    peak = peak_memory()
    print(peak_memory_line(peak))
    meta = {"command": args.command_line, "config": config, "seconds": round(seconds, 2), "peak_memory": peak}
    paths = write_results(args.out, command.name, rows, meta=meta, skipped=skipped)
    if rows:
        paths["png"] = _draw(command, rows, png)
    print(wrote_line(rows, seconds, paths))
    return 0


def run_sweep_cli(command: SweepCommand, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """The ``main`` of a deviation-sweep command: :func:`~flashprobe.bench.args.run_cli` around
    :func:`run_sweep_command`."""
    return run_cli(command.name, parser, lambda args: run_sweep_command(command, args), argv)
