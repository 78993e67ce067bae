"""The ``flashprobe`` command: train, study, bench, fuzz, replay, compare, report, kernels.

Each subcommand lives in its own module with a ``main(argv) -> int``; this file only dispatches,
importing the module on demand so ``flashprobe --help`` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from flashprobe.errors import FlashprobeError
from flashprobe.formats.atomic import DiskFullError

__all__ = ["main"]

#: command → ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("flashprobe.app.train:cli_main", "train the text-to-image model (Hydra overrides)"),
    "study": ("flashprobe.app.study:main", "run the weight-deviation study of paper §V (Hydra multirun)"),
    "compare": ("flashprobe.report.cli:compare_main", "compare the weight snapshots of run directories"),
    "report": ("flashprobe.report.cli:report_main", "redraw report.md and figures of a run or study dir"),
    "fuzz": ("flashprobe.fuzz.cli:main", "fuzz kernels with adversarial edge cases"),
    "replay": ("flashprobe.probing.replay_cli:main", "rerun a failing attention call the probe saved"),
    "kernels": ("flashprobe.cli:list_kernels", "list the kernels, their options and whether they run here"),
}

#: ``flashprobe bench NAME`` → ("module:function", one-line help)
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "precision": ("flashprobe.bench.precision:main", "deviation vs precision (paper Figs 3, 4)"),
    "seqlen": ("flashprobe.bench.seqlen:main", "deviation vs sequence length (paper Fig 5)"),
    "tiles": ("flashprobe.bench.tiles:main", "deviation vs tile sizes and order (paper Fig 6)"),
    "paper": ("flashprobe.bench.paper:main", "measure and judge every microbenchmark claim (Figs 3–6)"),
    "speed": ("flashprobe.bench.speed:main", "time and peak memory of kernels vs math"),
    "overhead": ("flashprobe.bench.overhead:main", "training-step overhead of the shadow probe"),
    "bias": ("flashprobe.bench.bias:main", "signed (biased) error on repeated row maxima (Qiu & Yao)"),
    "fp8": (
        "flashprobe.bench.fp8:main",
        "FP8 attention error vs FP64 and the P-cast collapse (forward only)",
    ),
    "verdicts": (
        "flashprobe.bench.verdicts:main",
        "the probe's verdict on torch's kernels in training (calibration)",
    ),
}

#: ``flashprobe bench NAME`` no longer here → what replaced it (printed as a one-line error, exit 2)
BENCH_REPLACED: dict[str, str] = {
    "rules": "the rules comparison is the project's evidence, not part of the installed tool: run "
    "`python -m lab.rules` (the same options and outputs) from the root of a clone of the repository",
    "wasserstein": "removed: flashprobe's Wasserstein distance is scipy.stats.wasserstein_distance (computed "
    "by scipy, except mean |sort(u) - sort(v)| for two unweighted samples of one size), checked against "
    "scipy in the test suite (tests/weights/test_distances.py); time scipy's directly",
}


#: what ``flashprobe --help`` says first: what the tool is, and its Python entry point
ABOUT = """\
flashprobe: is this attention kernel numerically safe to train with? It compares a kernel with plain
attention in the same dtype and with its float64 value, and gives a verdict (pass/fail per layer and
direction, forward and backward).

In your own training, in Python:
    from flashprobe import probe
    with probe(model) as p:          # your model, unchanged: every attention call is compared
        ...                          # train as usual
    print(p.summary().verdict)
(docs/probe.md). The commands: the embedded model trained with the probe and the paper's study of the
weights (train, study, compare, report), adversarial cases for any kernel (fuzz), a saved failing call
(replay), the kernels that run here (kernels) and the microbenchmarks (bench)."""


def _usage(table: dict[str, tuple[str, str]], prog: str, about: str = "") -> str:
    width = max(len(n) for n in table)
    lines = [f"usage: {prog} COMMAND [ARGS...]", "", *([about, ""] if about else []), "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in table.items()]
    return "\n".join(lines)


def _dispatch(
    table: dict[str, tuple[str, str]],
    argv: list[str],
    prog: str,
    replaced: dict[str, str] | None = None,
    about: str = "",
) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(table, prog, about))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if replaced and name in replaced:
        print(f"{prog} {name}: error: {replaced[name]}", file=sys.stderr)
        return 2
    if name not in table:
        print(f"{prog}: unknown command {name!r}\n\n{_usage(table, prog)}", file=sys.stderr)
        return 2
    module, _, func = table[name][0].partition(":")
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except FlashprobeError as err:  # flashprobe's own refusal, wherever raised: one line, no traceback
        from flashprobe.formats.paths import printable

        message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(printable(f"{prog} {name}: error: {message}"), file=sys.stderr)
        return 1 if isinstance(err, DiskFullError) else 2  # a full disk: nothing torn, run it again


def _compiles_on_first_call(kernel: Any) -> bool:
    """True for a kernel with a ``compile`` option that is on (``flex``): its first call compiles."""
    import inspect

    parameter = inspect.signature(kernel.fn).parameters.get("compile")
    return parameter is not None and kernel.options.get("compile", parameter.default) is True


def _availability(name: str, device: str, *, call: bool) -> Any:
    """:func:`~flashprobe.kernels.kernel_availability` with the tiny call posed in the kernel's own api
    (:func:`flashprobe.fuzz.contract_cases.tiny_call`: a packed call to a varlen kernel, a KV cache,
    a merge), at the lengths and head dim it declares, and with FP8 inputs where it declares
    ``float8_e4m3fn``."""
    import torch

    from flashprobe.fuzz.contract_cases import short_dtype, tiny_call
    from flashprobe.kernels import KernelUnavailableError, get_kernel
    from flashprobe.kernels.registry import KernelAvailability

    kernel = get_kernel(name)
    dtypes = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    dtypes += [torch.float8_e4m3fn] if torch.float8_e4m3fn in (kernel.capabilities.dtypes or ()) else []
    ran: list[str] = []
    reasons: dict[str, str] = {}
    for dtype in dtypes:
        try:
            kernel.check(torch.device(device), dtype)
            if call:
                kernel.run(tiny_call(kernel.api, kernel.capabilities, dtype, device))
        except Exception as err:  # any failure means "not here"; its message says why
            unavailable = isinstance(err, KernelUnavailableError)
            reasons[short_dtype(dtype)] = str(err) if unavailable else f"{type(err).__name__}: {err}"
        else:
            ran.append(short_dtype(dtype))
    return KernelAvailability(kernel.spec, device, tuple(ran), reasons, called=call)


def list_kernels(argv: Sequence[str]) -> int:
    """``flashprobe kernels``: every registered kernel, its options and whether it runs here (on the
    CPU, and CUDA where torch sees a GPU), each dtype tried with :func:`_availability`; a kernel whose
    first call compiles gets only its check unless ``--try`` is given. A kernel that cannot run says why.
    """
    import argparse

    import torch

    from flashprobe.kernels import (
        KernelSpecError,
        add_import_option,
        get_kernel,
        import_kernel_modules,
        list_kernels,
    )

    parser = argparse.ArgumentParser(
        prog="flashprobe kernels",
        description="List the registered kernels, their spec options and whether each runs on this "
        "machine (its declared check and one tiny call per dtype), with the reason when it does not. "
        "A kernel compiled on its first call is only checked unless --try is given.",
    )
    add_import_option(parser)
    parser.add_argument(
        "--try",
        dest="try_all",
        action="store_true",
        help="make the tiny call for every kernel, also those compiled on their first call "
        "(about 30 s per dtype each on a 2-core CPU)",
    )
    args = parser.parse_args(list(argv))
    try:
        import_kernel_modules(args.imports or [])
    except KernelSpecError as err:
        print(f"flashprobe kernels: {err}", file=sys.stderr)
        return 2
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    runnable: dict[str, list[str]] = {d: [] for d in devices}
    unchecked: dict[str, list[str]] = {d: [] for d in devices}
    for info in list_kernels():
        kernel = get_kernel(info.name)
        api = f"\n{'':<15} api: {kernel.api}" if kernel.api != "sdpa" else ""
        print(f"{info.name:<15} {info.description}\n{'':<15} options: {', '.join(info.options) or '-'}{api}")
        call = args.try_all or not _compiles_on_first_call(kernel)
        for device in devices:
            found = _availability(info.name, device, call=call)
            if found.available:
                runnable[device].append(info.name)
                if not found.called:
                    unchecked[device].append(info.name)
                verb = "runs" if found.called else "declared to run"
                note = f"{verb} on {device}: {', '.join(found.dtypes)}"
                print(f"{'':<15} {note}" + (f" (not {found.reason})" if found.reasons else ""))
                if not found.called:
                    print(f"{'':<15} not called: compiled on its first call; --try makes one tiny call")
            else:
                print(f"{'':<15} NOT on {device}: {found.reason}")
    names = [info.name for info in list_kernels()]
    for device in devices:
        missing = [n for n in names if n not in runnable[device]]
        print(
            f"\non {device}: {len(runnable[device])} of {len(names)} kernels run"
            + (f" ({', '.join(unchecked[device])} by the declared check only)" if unchecked[device] else "")
            + (f"; not: {', '.join(missing)}" if missing else "")
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flashprobe`` console script."""
    for stream in (sys.stdout, sys.stderr):  # a path whose bytes are not UTF-8 prints as \xNN, not a crash
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--version"]:
        from importlib.metadata import version

        from flashprobe import __version__

        print(f"flashprobe {__version__} (torch {version('torch')})")
        return 0
    if args and args[0] == "bench":
        return _dispatch(BENCH_COMMANDS, args[1:], "flashprobe bench", BENCH_REPLACED)
    table = {**COMMANDS, "bench": ("", "microbenchmarks: " + ", ".join(BENCH_COMMANDS))}
    return _dispatch(table, args, "flashprobe", about=ABOUT)


if __name__ == "__main__":
    sys.exit(main())
