"""``flashprobe bench tiles``: deviation vs tile size, block order and tile shape (paper Fig 6).

For an on-chip memory of ``M`` elements, ``Bc = ⌈M/4d⌉`` and ``Br = min(⌈M/4d⌉, d)``. One kernel
(default ``tiled:preset=paper``) runs over several ``M`` in the variants of :data:`VARIANTS`
(``default``: ``sram=M``; ``swapped``: Br ↔ Bc; ``square``: Br = Bc; ``loop_q``: outer loop over
query tiles; ``reverse`` and ``shuffle``: key-tile order). Each row is one (variant, M, dtype) with
``block_q``, ``block_k``, ``block_area`` and the deviation keys. Writes ``DIR/tiles.json``,
``DIR/tiles.csv`` and ``DIR/tiles.png``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from flashprobe.bench.args import add_input_args, add_kernel_args, add_output_args, add_shape_args
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.sweep import Primary, SweepPoint
from flashprobe.bench.sweep_command import SweepCommand, SweepPlan, SweepSetup, run_sweep_cli
from flashprobe.kernels import Kernel, KernelSpecError, dtype_name, get_kernel, tile_sizes

__all__ = [
    "COMMAND",
    "DEFAULT_BLOCK_K",
    "TABLE_COLUMNS",
    "VARIANTS",
    "build_parser",
    "main",
    "tile_kernels",
]

#: Variant name → options added to the base spec (besides ``sram``).
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "swapped": {"swap_blocks": True},
    "square": {"square": True},
    "loop_q": {"loop": "q"},
    "reverse": {"order": "reverse"},
    "shuffle": {"order": "shuffle"},
}

#: Default Bc values of the sweep; the SRAM sizes are ``M = 4·d·Bc``.
DEFAULT_BLOCK_K = (16, 32, 64, 128, 256, 512)

#: Options the sweep sets itself, which the base spec must leave alone.
_SWEEP_OPTIONS = ("block_q", "block_k", "sram", "swap_blocks", "square", "loop", "order")

#: Columns of the printed table: (row key, header).
TABLE_COLUMNS = [
    ("dtype", "dtype"),
    ("variant", "variant"),
    ("sram", "M"),
    ("block_q", "Br"),
    ("block_k", "Bc"),
    ("block_area", "Br*Bc"),
    ("primary_baseline_max_abs", "max|p-b|"),
    ("primary_golden_max_abs", "max|p-g|"),
    ("baseline_golden_max_abs", "max|b-g|"),
    ("error_ratio", "ratio"),
]


def _tile_kernel(base: Kernel, head_dim: int, variant: str, sram: int) -> Primary:
    """``base`` with ``sram`` and the variant's options, labelled with its tile sizes."""
    options = {**base.options, "sram": sram, **VARIANTS[variant]}
    spec = Kernel(base.name, options).spec
    try:
        kernel = get_kernel(spec)
    except KernelSpecError as err:
        raise BenchArgumentError(
            f"the tiles sweep needs a kernel with tiled's tile options (sram, swap_blocks, "
            f"square, loop, order): {err}"
        ) from None
    shape = {key: options.get(key, False) for key in ("swap_blocks", "square")}
    try:
        br, bc = tile_sizes(head_dim, sram=sram, **shape)
    except ValueError as err:
        raise BenchArgumentError(f"--sram {sram}: {err}") from None
    labels = {"variant": variant, "sram": sram, "block_q": br, "block_k": bc, "block_area": br * bc}
    return Primary(kernel, {**labels, "kernel": spec})


def tile_kernels(base: Kernel, head_dim: int, srams: Sequence[int], variants: Sequence[str]) -> list[Primary]:
    """The kernels of the sweep: ``base`` (``tiled``, or a kernel with its tile options) with ``sram=M``
    for each SRAM size and the options of each of ``variants``, one labelled
    :class:`~flashprobe.bench.sweep.Primary` per (variant, M).

    Raises:
        BenchArgumentError: unknown variant, a base kernel without tile options, a base spec
            that already sets a tile option, or ``M < 4·d``.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise BenchArgumentError(f"unknown variant {unknown[0]!r}; use any of: {', '.join(VARIANTS)}")
    fixed = [o for o in _SWEEP_OPTIONS if o in base.options]
    if fixed:
        raise BenchArgumentError(
            f"kernel spec {base.spec!r} sets {fixed[0]!r}, which the tiles sweep varies itself; "
            "drop it from the spec (use --sram to choose the tile sizes)"
        )
    return [_tile_kernel(base, head_dim, variant, m) for variant in variants for m in srams]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench tiles``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench tiles",
        description="Deviation of the tiled FlashAttention vs tile size, block order and tile shape "
        "(paper Fig 6).",
    )
    add_kernel_args(parser, default=["tiled:preset=paper"])
    add_shape_args(parser, batch=1, heads=2, seq_len=1024, head_dim=64)
    parser.add_argument(
        "--sram", type=int, nargs="+", metavar="M",
        help="SRAM sizes M in elements; Bc = ⌈M/4d⌉, Br = min(Bc, d) "
        f"(default: 4·d·Bc for Bc in {' '.join(map(str, DEFAULT_BLOCK_K))})",
    )  # fmt: skip
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), metavar="NAME",
        help=f"variants to run (default: {' '.join(VARIANTS)})",
    )  # fmt: skip
    add_input_args(parser, repeats=3)
    add_output_args(parser, "tiles", replot=True)
    return parser


def _plan(args: argparse.Namespace, setup: SweepSetup) -> SweepPlan:
    if len(setup.kernels) != 1:
        raise BenchArgumentError(
            f"the tiles sweep varies one kernel, got {len(setup.kernels)} (--kernel given more than once)"
        )
    base = setup.kernels[0]
    srams = args.sram or [4 * setup.shape.head_dim * bc for bc in DEFAULT_BLOCK_K]
    point = SweepPoint(setup.shape, tile_kernels(base, setup.shape.head_dim, srams, args.variants))
    config = {"base_kernel": base.spec, "baseline": setup.baseline.spec, "sram": srams}
    config |= {"variants": args.variants, **setup.shape.as_dict()}
    dtype_order = [dtype_name(d) for d in setup.dtypes]
    variant_order = list(VARIANTS)
    return SweepPlan(
        points=[point],
        config=config,
        sort_key=lambda r: (dtype_order.index(r["dtype"]), variant_order.index(r["variant"]), r["sram"]),
    )


#: The command's part of the shared deviation-sweep pipeline.
COMMAND = SweepCommand(name="tiles", columns=TABLE_COLUMNS, plan=_plan, figure="plot_tiles", progress=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench tiles``; returns the exit code."""
    return run_sweep_cli(COMMAND, build_parser(), argv)
