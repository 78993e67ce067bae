"""Command-line plumbing shared by the ``flashprobe bench`` commands.

``add_*_args`` put the common options on a parser, ``parse_*`` turn them into validated objects, and
:func:`run_cli` runs a command so that bad input gives exit code 2 and one line, before any work.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.inputs import InputConfig
from flashprobe.formats.paths import OutputPathError, check_output_dir, output_dir_arg
from flashprobe.kernels import Kernel, KernelInputError, KernelSpecError, get_kernel, to_dtype
from flashprobe.kernels.threads import torch_threads

__all__ = [
    "DEFAULT_DTYPES",
    "add_input_args",
    "add_kernel_args",
    "add_output_args",
    "add_shape_args",
    "check_size",
    "parse_device",
    "parse_dtypes",
    "parse_input_config",
    "parse_kernels",
    "parse_seeds",
    "progress_printer",
    "run_cli",
    "torch_threads",
]

#: Dtypes the microbenchmark sweeps by default, fewest mantissa bits first.
DEFAULT_DTYPES = ("bf16", "fp16", "fp32", "fp64")

#: Errors that mean bad input: exit code 2 and one line, no traceback.
_INPUT_ERRORS = (BenchArgumentError, OutputPathError, KernelSpecError, KernelInputError)


def add_kernel_args(
    parser: argparse.ArgumentParser, *, default: Sequence[str], baseline: bool = True
) -> None:
    """Add ``--kernel SPEC`` (repeatable) and, with ``baseline``, ``--baseline SPEC``."""
    parser.add_argument(
        "--kernel", action="append", metavar="SPEC",
        help=f"primary kernel spec, repeatable (default: {' '.join(default)}); e.g. "
        "'tiled:block_k=64,stats_dtype=fp32' or 'sdpa_flash'; see `flashprobe kernels`",
    )  # fmt: skip
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
    """Add ``--dtype``, ``--batch``, ``--heads``, ``--seq-len`` (several values when ``seq_len`` is a
    sequence), ``--head-dim``, ``--causal`` and ``--device``."""
    parser.add_argument(
        "--dtype", nargs="+", default=list(dtypes), metavar="DTYPE",
        help=f"input dtypes: bf16, fp16, fp32, fp64 (default: {' '.join(dtypes)})",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=batch, metavar="B", help=f"batch size (default {batch})")
    parser.add_argument("--heads", type=int, default=heads, metavar="H", help=f"heads (default {heads})")
    if isinstance(seq_len, int):
        lengths: dict[str, Any] = {"default": seq_len, "help": f"sequence length (default {seq_len})"}
    else:
        sweep = f"sequence lengths to sweep (default: {' '.join(map(str, seq_len))})"
        lengths = {"nargs": "+", "default": list(seq_len), "help": sweep}
    parser.add_argument("--seq-len", type=int, metavar="N", **lengths)
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
        "--distribution", default=defaults.distribution, metavar="NAME",
        help="input distribution: normal (N(0,1)), uniform (U(-√3,√3)), outliers "
        "(normal with a few large entries) (default normal)",
    )  # fmt: skip
    parser.add_argument(
        "--input-scale", type=float, default=defaults.scale, metavar="S",
        help="multiply q, k, v by S; larger S gives larger logits (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--outlier-frac", type=float, default=defaults.outlier_frac, metavar="P",
        help=f"outliers: fraction of entries that are outliers (default {defaults.outlier_frac})",
    )  # fmt: skip
    parser.add_argument(
        "--outlier-scale", type=float, default=defaults.outlier_scale, metavar="X",
        help=f"outliers: factor applied to outlier entries (default {defaults.outlier_scale:g})",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=seed, help=f"first seed (default {seed})")
    parser.add_argument(
        "--repeats", type=int, default=repeats, metavar="R",
        help=f"repeat over R seeds seed, seed+1, ...; rows carry the median and min/max (default {repeats})",
    )  # fmt: skip


def add_output_args(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    replot: bool = False,
    figure: bool = True,
    files: str | None = None,
) -> None:
    """Add ``--out DIR`` (default ``out/<name>``) and, with ``replot``, ``--replot``.

    ``figure`` (draws ``DIR/<name>.png``) and ``files`` (default: the JSON, CSV and figure) name the
    files written, for the help text.
    """
    files = files or (f"{name}.json, {name}.csv and {name}.png" if figure else f"{name}.json and {name}.csv")
    parser.add_argument(
        "--out", type=output_dir_arg, default=Path("out") / name, metavar="DIR",
        help=f"output directory for {files} (default out/{name})",
    )  # fmt: skip
    if replot:
        parser.add_argument(
            "--replot", action="store_true",
            help=f"measure nothing: redraw DIR/{name}.png from the rows in DIR/{name}.json",
        )  # fmt: skip


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
    except (RuntimeError, TypeError) as err:
        raise BenchArgumentError(f"bad --device {name!r}: {err}; use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchArgumentError(f"--device {name} given but CUDA is not available here; use --device cpu")
    return device


def progress_printer(name: str) -> Callable[[str], None]:
    """A ``progress`` callable that prints ``flashprobe bench <name>: MESSAGE`` on stderr."""
    return lambda msg: print(f"flashprobe bench {name}: {msg}", file=sys.stderr, flush=True)


def parse_input_config(args: argparse.Namespace) -> InputConfig:
    """The :class:`~flashprobe.bench.inputs.InputConfig` from the options of :func:`add_input_args`."""
    return InputConfig(
        distribution=args.distribution,
        scale=args.input_scale,
        outlier_frac=args.outlier_frac,
        outlier_scale=args.outlier_scale,
    )


#: float64 tensors of the shape (B, H, N, D) one measured call keeps at once: q, k, v, the golden
#: output, the output gradient and the golden dq, dk, dv.
FP64_TENSORS = 8


def check_size(args: argparse.Namespace) -> None:
    """Refuse a shape whose tensors alone cannot fit in the device's memory, before anything is allocated.

    The floor: :data:`FP64_TENSORS` float64 tensors of ``(B, H, N, D)`` at the largest ``--seq-len``
    plus one block of the chunked reference attention.

    Raises:
        BenchArgumentError: naming the options, the estimate and the memory available.
    """
    from flashprobe.kernels.reference import _available_bytes, reference_budget

    sizes = [getattr(args, a, None) for a in ("batch", "heads", "seq_len", "head_dim")]
    if any(v is None for v in sizes):
        return
    batch, heads, seq_len, head_dim = sizes
    n = max(seq_len) if isinstance(seq_len, list | tuple) and seq_len else seq_len
    if not all(isinstance(v, int) and v > 0 for v in (batch, heads, n, head_dim)):
        return  # the command names what is wrong with these
    try:
        device = torch.device(getattr(args, "device", "cpu") or "cpu")
        available, block = _available_bytes(device), reference_budget(device)
    except (RuntimeError, ValueError, AssertionError):
        return  # an unknown or absent device: the command says so
    needed = FP64_TENSORS * batch * heads * n * head_dim * 8 + block
    if needed > available:
        gib = 2**30
        raise BenchArgumentError(
            f"--seq-len {n} with --batch {batch} --heads {heads} --head-dim {head_dim} needs at least "
            f"{needed / gib:.3g} GiB ({FP64_TENSORS} float64 tensors of {batch}x{heads}x{n}x{head_dim} and a "
            f"{block / gib:.3g} GiB reference block), but {device} has {available / gib:.3g} GiB available; "
            "lower --seq-len (or --batch, --heads)"
        )


def run_cli(
    name: str,
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
    *,
    command: str | None = None,
) -> int:
    """Parse ``argv``, check the size and ``--out``, and call ``run(args)``; bad input prints one error.

    ``args.command_line`` is set to the equivalent shell command (for the results' metadata); an
    unusable ``--out`` fails before ``run`` starts, and the directory is created by the first write.

    Args:
        name: the command name used in messages (``precision``).
        parser: the command's parser.
        run: the command body.
        argv: arguments (default ``sys.argv[1:]``).
        command: how the command is typed (default ``flashprobe bench NAME``).

    Returns:
        The exit code: ``run``'s, 0 for ``--help``, 2 for bad input.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    command = command or f"flashprobe bench {name}"
    args.command_line = shlex.join([*command.split(), *argv])
    if getattr(args, "kernel", "absent") is None:
        args.kernel = list(args.kernel_default)
    try:
        check_size(args)
        if getattr(args, "out", None) is not None:  # checked now, created by the first write
            args.out = check_output_dir(args.out, flag="--out")
        return run(args)
    except _INPUT_ERRORS as err:
        print(f"{command}: error: {err}", file=sys.stderr)
        return 2
