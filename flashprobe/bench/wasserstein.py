"""``flashprobe bench wasserstein``: our torch Wasserstein-1 distance against scipy's, side by side.

For each size ``n`` and case, draws float64 samples from a seed and times, interleaved in one run,
:func:`scipy.stats.wasserstein_distance` and :func:`flashprobe.weights.wasserstein_distance`
(median of ``--repeats``), and reports their relative difference. Cases:

* ``equal``: ``n`` vs ``n`` unweighted values (the case of two runs' weight tensors);
* ``unequal``: ``n`` vs ``3n/4`` values (the merged-CDF path);
* ``weighted``: ``n`` vs ``n`` values with random weights.

An exact 1-D Wasserstein distance cannot cost less than sorting both inputs, so each row also
times that **sort floor**, interleaved with the distances: ``np.sort`` of both samples
(``sort_floor_ms``), and for weighted samples the sort that carries the weights along
(``np.argsort`` and two gathers per sample, ``weighted_sort_floor_ms``); ``vs_floor`` is
flashprobe's time over the floor of its case and ``vs_sort`` its time over ``np.sort`` of both
samples. It also times one ``torch.sort`` of ``n`` values: CPU sort speed differs several-fold
between the libraries (flashprobe sorts with numpy on CPU).

Writes ``DIR/wasserstein.json`` and ``DIR/wasserstein.csv`` and prints a table. On a CPU shared with
other busy processes, torch's multi-threaded elementwise kernels can stall waiting for a descheduled
thread; ``--threads 1`` shows the single-threaded figure (scipy and numpy are single-threaded).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.stats
import torch

from flashprobe.bench.args import add_output_args, parse_device, run_cli
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.results import format_table, write_results
from flashprobe.weights.distances import wasserstein_distance

__all__ = ["CASES", "bench_case", "main"]

CASES = ("equal", "unequal", "weighted")

_COLUMNS = (
    ("case", "case"),
    ("n", "n"),
    ("m", "m"),
    ("device", "device"),
    ("scipy_ms", "scipy_ms"),
    ("torch_ms", "torch_ms"),
    ("speedup", "speedup"),
    ("rel_diff", "rel_diff"),
    ("floor_ms", "floor_ms"),
    ("vs_floor", "vs_floor"),
    ("sort_floor_ms", "np.sort×2_ms"),
    ("vs_sort", "vs_np.sort×2"),
    ("sort_torch_ms", "torch.sort_ms"),
)


def _weighted_sort_floor(u: np.ndarray, v: np.ndarray, uw: np.ndarray, vw: np.ndarray) -> None:
    for x, w in ((u, uw), (v, vw)):
        order = np.argsort(x)
        x.take(order)
        w.take(order)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3, out


def bench_case(case: str, n: int, *, repeats: int, seed: int, device: torch.device) -> dict[str, Any]:
    """Time scipy and torch on one case; returns one result row (times in ms, medians)."""
    if case not in CASES:
        raise BenchArgumentError(f"unknown case {case!r}; use one of: {', '.join(CASES)}")
    rng = np.random.default_rng(seed)
    m = n if case != "unequal" else max(1, 3 * n // 4)
    u = rng.standard_normal(n)
    v = rng.standard_normal(m) * 1.02 + 0.01
    uw = rng.random(n) if case == "weighted" else None
    vw = rng.random(m) if case == "weighted" else None
    tu, tv = torch.from_numpy(u).to(device), torch.from_numpy(v).to(device)
    tuw = None if uw is None else torch.from_numpy(uw).to(device)
    tvw = None if vw is None else torch.from_numpy(vw).to(device)

    times: dict[str, list[float]] = {"scipy": [], "torch": [], "floor": [], "weighted_floor": []}
    expected = got = 0.0
    wasserstein_distance(tu[:1000], tv[:1000])  # warm-up (lazy imports, allocator)
    cpu = torch.device("cpu")
    for _ in range(repeats):  # interleaved so all see the same machine load
        t, expected = _timed(lambda: scipy.stats.wasserstein_distance(u, v, uw, vw), cpu)
        times["scipy"].append(t)
        t, got = _timed(lambda: wasserstein_distance(tu, tv, tuw, tvw), device)
        times["torch"].append(t)
        times["floor"].append(_timed(lambda: (np.sort(u), np.sort(v)), cpu)[0])
        if uw is not None and vw is not None:
            times["weighted_floor"].append(_timed(lambda: _weighted_sort_floor(u, v, uw, vw), cpu)[0])
    sort_torch, _ = _timed(lambda: torch.sort(tu), device)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    floor = med["weighted_floor"] if case == "weighted" else med["floor"]
    scipy_med, torch_med = med["scipy"], med["torch"]
    return {
        "case": case,
        "n": n,
        "m": m,
        "weighted": case == "weighted",
        "device": str(device),
        "scipy_ms": scipy_med,
        "torch_ms": torch_med,
        "speedup": scipy_med / torch_med,
        "rel_diff": abs(got - expected) / abs(expected) if expected else abs(got - expected),
        "scipy_value": expected,
        "torch_value": got,
        "scipy_ms_all": times["scipy"],
        "torch_ms_all": times["torch"],
        "floor_ms": floor,
        "vs_floor": torch_med / floor,
        "sort_floor_ms": med["floor"],
        "vs_sort": torch_med / med["floor"],
        "weighted_sort_floor_ms": med["weighted_floor"],
        "sort_torch_ms": sort_torch,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashprobe bench wasserstein",
        description="Time flashprobe's torch Wasserstein-1 distance against scipy.stats.wasserstein_distance "
        "on float64 samples and check they agree.",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[4_000_000],
        metavar="N",
        help="sample sizes (default 4000000)",
    )
    parser.add_argument(
        "--cases", nargs="+", default=list(CASES), metavar="CASE", help=f"cases (default: {' '.join(CASES)})"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per method (median; default 3)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the samples (default 0)")
    parser.add_argument("--device", default="cpu", help="device of the torch tensors (default cpu)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op CPU threads (torch.set_num_threads); default: torch's own choice",
    )
    add_output_args(parser, "wasserstein", figure=False)
    return parser


#: float64 arrays of the sample size one case holds at once, a floor: the two samples and their
#: weights, and the sorts, cumulative sums and merged values scipy and torch make of them
ARRAYS_PER_CASE = 12


def _check_memory(n: int) -> None:
    """Refuse a sample size whose arrays cannot fit in the host's memory, before any is drawn."""
    from flashprobe.kernels.reference import _available_bytes

    needed, available = ARRAYS_PER_CASE * 8 * n, _available_bytes(torch.device("cpu"))
    if needed > available:
        gib = 2**30
        raise BenchArgumentError(
            f"--sizes {n} needs at least {needed / gib:.3g} GiB ({ARRAYS_PER_CASE} float64 arrays of {n} "
            f"values: the samples, their weights and their sorts), but the host has {available / gib:.3g} "
            "GiB available; lower --sizes"
        )


def _run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise BenchArgumentError(f"--repeats must be >= 1, got {args.repeats}")
    bad = [n for n in args.sizes if n < 1]
    if bad:
        raise BenchArgumentError(f"--sizes must be positive, got {bad}")
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        raise BenchArgumentError(f"unknown case(s) {unknown}; use: {', '.join(CASES)}")
    device = parse_device(args.device)
    _check_memory(max(args.sizes))
    if args.threads is not None:
        if args.threads < 1:
            raise BenchArgumentError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows = [
        bench_case(case, n, repeats=args.repeats, seed=args.seed, device=device)
        for n in args.sizes
        for case in args.cases
    ]
    meta = {
        "repeats": args.repeats,
        "seed": args.seed,
        "dtype": "float64",
        "torch_threads": torch.get_num_threads(),
    }
    paths = write_results(args.out, "wasserstein", rows, meta=meta)
    print(format_table(rows, _COLUMNS))
    print(f"wrote {paths['json']} and {paths['csv']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench wasserstein``."""
    return run_cli("wasserstein", _parser(), _run, argv)
