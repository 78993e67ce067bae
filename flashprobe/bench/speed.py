"""``flashprobe bench speed``: time and peak memory of attention kernels vs ``math``.

Time: per sequence length, every kernel (``math`` always included) warms up once, then ``--repeats``
interleaved rounds run under :func:`torch.inference_mode`; a row has the median and min/max ms and
``ratio_vs_math``. Peak memory: each (kernel, N, dtype) runs once more in a fresh process (freed
memory in the allocator would hide the growth), reporting ``VmHWM − VmRSS`` after resetting the peak
through ``/proc/self/clear_refs`` (else ``ru_maxrss``). A kernel that materialises the scores is
skipped where ``3·B·H·N²·itemsize`` exceeds ``--max-memory-gb``; skips go under ``"skipped"``.

Writes ``DIR/speed.json``, ``DIR/speed.csv`` (both rewritten after every N with ``"complete":
false``, so an interrupted sweep keeps what it measured) and ``DIR/speed.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from flashprobe.bench.args import (
    add_input_args,
    add_kernel_args,
    add_output_args,
    add_shape_args,
    parse_device,
    parse_dtypes,
    parse_input_config,
    parse_kernels,
    parse_seeds,
    run_cli,
)
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.inputs import InputConfig, Shape, cast_inputs, make_inputs
from flashprobe.bench.results import format_table, load_results, write_results, wrote_line
from flashprobe.bench.sweep import check_kernel
from flashprobe.kernels import Kernel, dtype_name, get_kernel
from flashprobe.kernels.reference import meminfo_available_bytes as available_memory_bytes

__all__ = [
    "MATERIALISING",
    "TABLE_COLUMNS",
    "available_memory_bytes",
    "build_parser",
    "main",
    "materialised_bytes",
    "peak_memory_mb",
    "speed_rows",
    "time_kernels",
]

#: Kernels that hold the ``(B, H, N, N)`` score matrix and may not fit in memory.
MATERIALISING = ("math", "sdpa_math")

#: Peak memory of ``math`` in score matrices (scores, scaled scores / probabilities, masks).
_MATRICES_AT_PEAK = 3

#: Columns of the printed table: (row key, header).
TABLE_COLUMNS = [
    ("kernel", "kernel"),
    ("dtype", "dtype"),
    ("seq_len", "N"),
    ("ms", "ms"),
    ("ms_lo", "ms lo"),
    ("ms_hi", "ms hi"),
    ("ratio_vs_math", "time/math"),
    ("peak_mb", "peak MB"),
    ("mem_ratio_vs_math", "mem/math"),
]


def materialised_bytes(shape: Shape, dtype: torch.dtype) -> int:
    """Estimated peak bytes of a kernel that materialises the scores: ``3·B·H·N²·itemsize``."""
    n = shape.seq_len
    return _MATRICES_AT_PEAK * shape.batch * shape.heads * n * n * dtype.itemsize


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_kernels(
    kernels: Sequence[Kernel],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    repeats: int,
    is_causal: bool = False,
) -> list[list[float]]:
    """Time kernels on ``(B, H, N, D)`` inputs: one warm-up call each, then ``repeats`` interleaved
    rounds; returns per kernel the ``repeats`` wall-clock times in milliseconds."""
    device = q.device
    times: list[list[float]] = [[] for _ in kernels]
    with torch.inference_mode():
        for kernel in kernels:
            kernel(q, k, v, is_causal=is_causal)
        _sync(device)
        for _ in range(repeats):
            for i, kernel in enumerate(kernels):
                start = time.perf_counter()
                kernel(q, k, v, is_causal=is_causal)
                _sync(device)
                times[i].append((time.perf_counter() - start) * 1e3)
    return times


def _status_kb() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields


def _memory_child(argv: Sequence[str]) -> int:
    """Child process of :func:`peak_memory_mb`: prints ``{"peak_mb": ..., "method": ...}``."""
    spec, batch, heads, n, d, dtype, causal = argv
    shape = Shape(batch=int(batch), heads=int(heads), seq_len=int(n), head_dim=int(d))
    kernel = get_kernel(spec)
    q, k, v = (torch.randn(shape.dims, dtype=getattr(torch, dtype)) for _ in range(3))
    with torch.inference_mode():  # load libraries and start thread pools before measuring
        kernel(q[:, :, :8], k[:, :, :8], v[:, :, :8], is_causal=causal == "1")
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
        method = "VmHWM-VmRSS"
        before_kb = _status_kb()["VmRSS"]
    except OSError:
        method = "ru_maxrss-VmRSS"
        before_kb = _status_kb()["VmRSS"] if os.path.exists("/proc/self/status") else 0
    with torch.inference_mode():
        kernel(q, k, v, is_causal=causal == "1")
    if method == "VmHWM-VmRSS":
        peak_kb = _status_kb()["VmHWM"]
    else:
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"peak_mb": max(peak_kb - before_kb, 0) / 1024, "method": method}))
    return 0


def peak_memory_mb(
    kernel: Kernel, shape: Shape, dtype: torch.dtype, *, is_causal: bool = False, timeout: float = 3600
) -> tuple[float, str]:
    """Peak extra resident memory of one CPU call of ``kernel``, measured in a fresh process.

    Returns:
        ``(megabytes, method)``; ``method`` names how it was measured (module docstring).

    Raises:
        RuntimeError: the child process failed (its stderr is included).
    """
    code = (
        "import sys; from flashprobe.bench.speed import _memory_child; sys.exit(_memory_child(sys.argv[1:]))"
    )
    args = [kernel.spec, *map(str, shape.dims), str(dtype).removeprefix("torch."), "1" if is_causal else "0"]
    # The child imports this very flashprobe (not whatever another install puts on its path).
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"peak-memory child for {kernel.spec} at N={shape.seq_len} {dtype_name(dtype)} failed: "
            f"{proc.stderr.strip()[-2000:]}"
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(result["peak_mb"]), str(result["method"])


def speed_rows(
    shape: Shape,
    seq_lens: Sequence[int],
    *,
    kernels: Sequence[Kernel],
    dtypes: Sequence[torch.dtype],
    repeats: int,
    seed: int = 0,
    inputs: InputConfig | None = None,
    device: torch.device | str = "cpu",
    is_causal: bool = False,
    memory: bool = True,
    max_memory_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
    checkpoint: Callable[[list[dict[str, Any]], list[dict[str, Any]]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Time (and measure the peak memory of) each kernel and ``math`` at each N and dtype.

    Args:
        shape: ``(B, H, ·, D)``; its ``seq_len`` is replaced by each of ``seq_lens``.
        seq_lens: the sequence lengths N.
        kernels: kernels to compare with ``math`` (``math`` is added first when missing).
        dtypes: the inputs' dtypes.
        repeats: timed calls per kernel.
        seed: seed of the inputs.
        inputs: the input distribution.
        device: where the kernels run; peak memory is measured on CPU only.
        is_causal: apply the causal mask.
        memory: measure peak memory (one fresh process per kernel, N and dtype).
        max_memory_bytes: skip :data:`MATERIALISING` kernels whose estimated peak exceeds this
            (default 80 % of available memory).
        progress: called with a short message.
        checkpoint: given ``(rows, skipped)`` so far after each (N, dtype).

    Returns:
        ``(rows, skipped)``: rows with ``ms`` (median, ``ms_lo``, ``ms_hi``), ``ratio_vs_math``,
        ``peak_mb`` and ``mem_ratio_vs_math`` (None where ``math`` was skipped); skipped entries
        with ``kernel``, ``dtype``, ``seq_len``, ``reason``.
    """
    device = torch.device(device)
    say = progress or (lambda _: None)
    math_kernel = get_kernel("math")
    run = [math_kernel, *[kn for kn in kernels if kn.spec != "math"]]
    if max_memory_bytes is None:
        available = available_memory_bytes()
        max_memory_bytes = int(0.8 * available) if available else None
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for n in sorted(dict.fromkeys(seq_lens)):
        at_n = Shape(batch=shape.batch, heads=shape.heads, seq_len=n, head_dim=shape.head_dim)
        for dtype in dtypes:
            ok: list[Kernel] = []
            for kernel in run:
                reason = _skip_reason(kernel, at_n, dtype, device, max_memory_bytes)
                if reason:
                    skipped.append(
                        {"kernel": kernel.spec, "dtype": dtype_name(dtype), "seq_len": n, "reason": reason}
                    )
                else:
                    ok.append(kernel)
            if not ok:
                continue
            say(f"N={n} {dtype_name(dtype)}: timing {', '.join(kn.spec for kn in ok)}")
            q, k, v = cast_inputs(make_inputs(at_n, seed, inputs), dtype, device)
            times = time_kernels(ok, q, k, v, repeats=repeats, is_causal=is_causal)
            del q, k, v
            block = []
            for kernel, ms in zip(ok, times, strict=True):
                peak, method = (None, None)
                if memory and device.type == "cpu":
                    say(f"N={n} {dtype_name(dtype)}: peak memory of {kernel.spec}")
                    peak, method = peak_memory_mb(kernel, at_n, dtype, is_causal=is_causal)
                block.append({
                    "kernel": kernel.spec, "seq_len": n, "dtype": dtype_name(dtype),
                    "ms": statistics.median(ms), "ms_lo": min(ms), "ms_hi": max(ms),
                    "peak_mb": peak, "memory_method": method, **at_n.as_dict(),
                    "device": str(device), "repeats": repeats,
                })  # fmt: skip
            ref = block[0] if ok[0] is math_kernel else None  # math's row, the ratios' reference
            for row in block:
                row["ratio_vs_math"] = row["ms"] / ref["ms"] if ref else None
                both = ref and row["peak_mb"] is not None and ref["peak_mb"]
                row["mem_ratio_vs_math"] = row["peak_mb"] / ref["peak_mb"] if both else None
            rows += block
            if checkpoint:
                checkpoint(rows, skipped)
    return rows, skipped


def _skip_reason(
    kernel: Kernel, shape: Shape, dtype: torch.dtype, device: torch.device, max_memory_bytes: int | None
) -> str | None:
    """Why ``kernel`` cannot be timed at ``shape`` and ``dtype`` here, or ``None``."""
    reason = check_kernel(kernel, dtype, device, shape.head_dim)
    need = materialised_bytes(shape, dtype)
    too_big = max_memory_bytes is not None and need > max_memory_bytes
    if reason is None and kernel.name in MATERIALISING and too_big:
        reason = (
            f"would need ~{need / 2**30:.1f} GiB for the score matrices "
            f"(3·B·H·N²·{dtype.itemsize} B) but the limit is "
            f"{max_memory_bytes / 2**30:.1f} GiB (--max-memory-gb)"
        )
    return reason


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench speed``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench speed",
        description="Time and peak memory of attention kernels vs math across sequence lengths.",
    )
    add_kernel_args(parser, default=["tiled", "sdpa_flash"], baseline=False)
    add_shape_args(parser, batch=1, heads=8, seq_len=[1024, 2048, 4096, 8192], head_dim=64, dtypes=["fp32"])
    add_input_args(parser, repeats=5)
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        metavar="GB",
        help="skip math/sdpa_math where 3·B·H·N²·itemsize exceeds this (default: 80%% of available memory)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="do not measure peak memory (saves one process per point)"
    )
    add_output_args(parser, "speed", replot=True)
    return parser


def _run(args: argparse.Namespace) -> int:
    from flashprobe.report.bench_figures import plot_speed

    if args.replot:
        doc = load_results(args.out, "speed")
        print(f"redrew {plot_speed(doc['rows'], args.out / 'speed.png', doc.get('skipped', []))}")
        return 0

    shape = Shape(batch=args.batch, heads=args.heads, seq_len=min(args.seq_len), head_dim=args.head_dim)
    kernels = parse_kernels(args.kernel)
    dtypes = parse_dtypes(args.dtype)
    parse_seeds(args.seed, args.repeats)  # refuses --repeats < 1
    if args.max_memory_gb is not None and not args.max_memory_gb > 0:
        raise BenchArgumentError(f"--max-memory-gb must be positive, got {args.max_memory_gb}")
    limit = None if args.max_memory_gb is None else int(args.max_memory_gb * 2**30)
    inputs = parse_input_config(args)
    meta: dict[str, Any] = {
        "command": args.command_line,
        "config": {
            "kernels": ["math", *[k.spec for k in kernels if k.spec != "math"]],
            **shape.as_dict(),
            "seq_len": sorted(set(args.seq_len)),
            **inputs.as_dict(),
            "seed": args.seed,
            "repeats": args.repeats,
        },
        "complete": False,
    }
    start = time.perf_counter()
    rows, skipped = speed_rows(
        shape,
        args.seq_len,
        kernels=kernels,
        dtypes=dtypes,
        repeats=args.repeats,
        seed=args.seed,
        inputs=inputs,
        device=parse_device(args.device),
        is_causal=args.causal,
        memory=not args.no_memory,
        max_memory_bytes=limit,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
        checkpoint=lambda done, skip: write_results(args.out, "speed", done, meta=meta, skipped=skip),
    )
    seconds = time.perf_counter() - start
    print(format_table(rows, TABLE_COLUMNS))
    for s in skipped:
        print(f"skipped {s['kernel']} at {s['dtype']}, N={s['seq_len']}: {s['reason']}")
    meta |= {"complete": True, "seconds": round(seconds, 2)}
    paths = write_results(args.out, "speed", rows, meta=meta, skipped=skipped)
    if rows:
        paths["png"] = plot_speed(rows, args.out / "speed.png", skipped)
    print(wrote_line(rows, seconds, paths))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench speed``; returns the exit code."""
    return run_cli("speed", build_parser(), _run, argv)
