"""``python -m lab.recall``: recall on the mutation suite and false alarms on correct kernels, per input
strategy of ``flashprobe fuzz``.

The form checkers of attention kernels are measured in (arXiv 2606.27396 reports 78 % recall and 0 %
false alarms for boundary shapes): for each way the fuzzer builds inputs,

* ``catalogue``: the default profile's cases (:func:`flashprobe.fuzz.run_catalogue`), ``--seeds``
  seeds;
* ``random search``: ``--budget`` samples inside the kernels' declared limits
  (:func:`flashprobe.fuzz.search.random_search`), one draw per group of kernels that declare the
  same limits (so a mutant and its control get the same samples);
* ``sequences`` and ``invariants``: several calls of a kernel in one process, and oracles that need
  no tolerance (``flashprobe.fuzz.invariants``: checks named ``seq_*`` and ``inv_*``); their rows read
  ``not available`` where that module is not installed;

the table gives

* **recall**: the mutants of :data:`lab.mutants.MUTANTS` the strategy catches, of all of them. A
  mutant is caught when one of its rows fails (a ``fail`` verdict) where its **control** — the same
  code without the bug, declaring the same limits (:func:`~lab.mutants.correct_flash` as
  ``bug_none``; :func:`~lab.mutants.blockwise_attention` with :data:`~lab.mutants.TRITON_LIKE`;
  :func:`~lab.mutants.blockwise_64` with :data:`~lab.mutants.TRITON_LIKE_64`) — ran the same case,
  dtype and seed and did not fail: a failure the control shares is the numerics', not the bug's.
* **false alarms**: the correct kernels (the controls, the suite's :data:`~lab.mutants.CORRECT`
  kernels, ``sdpa_math``, ``tiled``; ``--kernels``) with a failure that the shipped ledger of
  documented findings (``flashprobe.fuzz.ledger``, ``builtin``) does not accept, of all of them; and
  their failing rows, of the rows that ran.

Writes ``DIR/recall.json``, ``DIR/recall.csv`` (one row per strategy) and ``DIR/recall.md`` (the
table with the command and the mutants each strategy missed). Run it from the repository's root
(``lab`` is not installed with flashprobe).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashprobe.bench.args import add_output_args, run_cli, torch_threads
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.results import format_table, write_results, wrote_line
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.fuzz import FuzzResult, run_catalogue, select_cases
from flashprobe.fuzz.ledger import load_ledger
from flashprobe.fuzz.search import random_search
from flashprobe.kernels import KernelCapabilities, get_kernel, register_kernel, to_dtype, unregister_kernel
from lab.mutants import (
    CORRECT,
    MUTANTS,
    TRITON_LIKE,
    TRITON_LIKE_64,
    blockwise_64,
    blockwise_attention,
    correct_flash,
)

__all__ = ["CONTROLS", "STRATEGIES", "control_of", "main", "recall_rows"]

#: the input strategies, in the table's order
STRATEGIES: tuple[str, ...] = ("catalogue", "random search", "sequences", "invariants")
#: the controls: the mutants' code without a bug, registered with the limits their mutants declare
CONTROLS: dict[str, tuple[Callable[..., torch.Tensor], KernelCapabilities | None]] = {
    "bug_none": (correct_flash, None),
    "ctl_blockwise": (blockwise_attention, TRITON_LIKE),
    "ctl_blockwise_64": (blockwise_64, TRITON_LIKE_64),
}
#: the correct kernels besides the controls (specs)
CORRECT_KERNELS: tuple[str, ...] = (*(f"ok_{name}" for name in CORRECT), "sdpa_math", "tiled")
_DTYPES = ("fp32", "bf16", "fp16")
_Options = dict[str, Any]  # budget: random samples; cases: the catalogue's patterns (None: all)
_Runner = Callable[[list[str], list[str], range, _Options], list[FuzzResult] | None]


def control_of(mutant: str) -> str:
    """The control of ``bug_<mutant>``: the registered kernel without the bug and with its limits."""
    caps = MUTANTS[mutant].capabilities
    return next(name for name, (_, c) in CONTROLS.items() if c == caps)


def _register() -> list[str]:
    """Register the mutants (``bug_<name>``), the suite's correct kernels and the controls."""
    kernels = [(f"bug_{m.name}", m.fn, m.capabilities) for m in MUTANTS.values()]
    kernels += [(f"ok_{n}", fn, None) for n, fn in CORRECT.items()]
    kernels += [(name, fn, caps) for name, (fn, caps) in CONTROLS.items()]
    for name, fn, caps in kernels:
        register_kernel(name, fn, capabilities=caps, overwrite=True)
    return [name for name, _, _ in kernels]


def _checks_module() -> Any | None:
    """``flashprobe.fuzz.invariants`` (sequences and invariants) where this flashprobe has it."""
    try:
        module = importlib.import_module("flashprobe.fuzz.invariants")
    except ImportError:
        return None
    return module if hasattr(module, "CHECKS") and hasattr(module, "run_checks") else None


def _catalogue(kernels: list[str], dtypes: list[str], seeds: range, options: _Options) -> list[FuzzResult]:
    cases = None if options["cases"] is None else select_cases(options["cases"])
    return [r for s in seeds for r in run_catalogue(kernels, dtypes, cases=cases, seed=s)]


def _random(kernels: list[str], dtypes: list[str], seeds: range, options: _Options) -> list[FuzzResult]:
    groups: dict[Any, list[str]] = {}
    for k in kernels:  # kernels that declare the same limits draw the same samples
        groups.setdefault(repr(get_kernel(k).capabilities), []).append(k)
    return [
        r
        for s in seeds
        for group in groups.values()
        for r in random_search(group, dtypes, budget=options["budget"], seed=s)
    ]


def _checks(prefix: str) -> _Runner:
    def run(
        kernels: list[str], dtypes: list[str], seeds: range, options: _Options
    ) -> list[FuzzResult] | None:
        module = _checks_module()
        if module is None:
            return None
        checks = [c for name, c in module.CHECKS.items() if name.startswith(prefix)]
        resolved = [to_dtype(d) for d in dtypes]
        return [r for s in seeds for r in module.run_checks(kernels, resolved, checks, seed=s)]

    return run


_RUNNERS: dict[str, _Runner] = {
    "catalogue": _catalogue,
    "random search": _random,
    "sequences": _checks("seq_"),
    "invariants": _checks("inv_"),
}


def _score(
    strategy: str, results: list[FuzzResult], mutants: list[str], correct: list[str]
) -> dict[str, Any]:
    """One row of the table from one strategy's rows."""
    failed = {(r.kernel, r.case, r.dtype, r.seed) for r in results if r.verdict == "fail"}
    ran = {
        (r.kernel, r.case, r.dtype, r.seed) for r in results if r.verdict in ("pass", "fail", "no_backward")
    }
    caught, missed = [], []
    for m in mutants:
        control = control_of(m)
        hits = [
            key for key in failed
            if key[0] == f"bug_{m}" and (control, *key[1:]) in ran and (control, *key[1:]) not in failed
        ]  # fmt: skip
        (caught if hits else missed).append(m)
    report = load_ledger("builtin").apply([r for r in results if r.kernel in correct])
    alarms = sorted({r.kernel for r in report.failures})
    correct_rows = [r for r in report.results if r.verdict in ("pass", "fail", "no_backward")]
    return {
        "strategy": strategy,
        "available": True,
        "caught": len(caught),
        "mutants": len(mutants),
        "recall": round(len(caught) / len(mutants), 3) if mutants else None,
        "false_alarm_kernels": len(alarms),
        "correct_kernels": len(correct),
        "false_alarm_rate": round(len(alarms) / len(correct), 3) if correct else None,
        "false_alarm_rows": len(report.failures),
        "correct_rows": len(correct_rows),
        "missed": ",".join(missed),
        "alarmed": ",".join(alarms),
    }


def recall_rows(
    strategies: Sequence[str],
    dtypes: Sequence[str],
    seeds: range,
    *,
    budget: int = 8,
    cases: Sequence[str] | None = None,
    mutants: Sequence[str] | None = None,
    correct: Sequence[str] = CORRECT_KERNELS,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per strategy: recall on the mutants, false alarms on the correct kernels.

    Args:
        strategies: of :data:`STRATEGIES`.
        dtypes: ``fp32``, ``bf16``, ``fp16``.
        seeds: the seeds each strategy runs.
        budget: random samples per seed and group of kernels with the same limits.
        cases: the catalogue's case names or globs (None: the default profile).
        mutants: names in :data:`lab.mutants.MUTANTS` (None: all).
        correct: the correct kernels besides the controls (specs).
        progress: called with a line per strategy as it finishes.

    Returns:
        The rows (``available`` False, counts None, where a strategy's module is not installed).
    """
    mutants = list(MUTANTS if mutants is None else mutants)
    registered = _register()
    try:
        controls = sorted({control_of(m) for m in mutants})
        kernels = [*(f"bug_{m}" for m in mutants), *controls, *correct]
        correct_all = [*controls, *correct]
        rows = []
        for strategy in strategies:
            start = time.perf_counter()
            results = _RUNNERS[strategy](kernels, list(dtypes), seeds, {"budget": budget, "cases": cases})
            if results is None:
                row: dict[str, Any] = {"strategy": strategy, "available": False}
                row |= dict.fromkeys(
                    ("caught", "mutants", "recall", "false_alarm_kernels", "correct_kernels")
                )
                row |= dict.fromkeys(("false_alarm_rate", "false_alarm_rows", "correct_rows"))
                row |= {"missed": "", "alarmed": ""}
            else:
                row = _score(strategy, results, mutants, correct_all)
            row["seconds"] = round(time.perf_counter() - start, 1)
            if progress is not None:
                progress(
                    f"{strategy}: {_cells(row)[0]} recall, {_cells(row)[1]} false alarms ({row['seconds']} s)"
                )
            rows.append(row)
        return rows
    finally:
        for name in registered:
            unregister_kernel(name)


def _cells(row: dict[str, Any]) -> tuple[str, str]:
    """``(recall, false alarms)`` in words: ``30 / 44 (68 %)``, ``0 / 7 kernels (0 %; 0 of 812 rows)``."""
    if not row["available"]:
        return "not available", "not available"
    recall = f"{row['caught']} / {row['mutants']} ({100 * (row['recall'] or 0):.0f} %)"
    alarms = (
        f"{row['false_alarm_kernels']} / {row['correct_kernels']} kernels "
        f"({100 * (row['false_alarm_rate'] or 0):.0f} %; "
        f"{row['false_alarm_rows']} of {row['correct_rows']} rows)"
    )
    return recall, alarms


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table: one line per strategy."""
    lines = [
        "| input strategy | recall (mutants caught) | false alarms (correct kernels failed) "
        "| mutants missed |",
        "|---|---|---|---|",
    ]
    for r in rows:
        recall, alarms = _cells(r)
        missed = ", ".join(f"`{m}`" for m in r["missed"].split(",") if m) or (
            "none" if r["available"] else ""
        )
        if not r["available"]:
            missed = "not in this flashprobe (flashprobe.fuzz.invariants)"
        lines.append(f"| {r['strategy']} | {recall} | {alarms} | {missed} |")
    return "\n".join(lines)


TABLE_COLUMNS = [
    ("strategy", "strategy"),
    ("caught", "caught"),
    ("mutants", "of"),
    ("recall", "recall"),
    ("false_alarm_kernels", "false alarms"),
    ("correct_kernels", "of"),
    ("false_alarm_rows", "rows"),
    ("correct_rows", "of"),
    ("seconds", "s"),
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lab.recall",
        description="Recall on the mutation suite and false alarms on correct kernels, per input strategy.",
    )
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated, of {', '.join(STRATEGIES)} ('random' for short; default all)",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds per strategy (default 1)")
    p.add_argument("--dtype", default="fp32", help="comma-separated: fp32, bf16, fp16 (default fp32)")
    p.add_argument(
        "--budget", type=int, default=8, help="random samples per seed and group of kernels (default 8)"
    )
    p.add_argument(
        "--case",
        action="append",
        default=None,
        metavar="PATTERN",
        help="the catalogue's cases (names or globs, repeatable; default: the default profile)",
    )
    p.add_argument("--mutants", default=None, help="comma-separated mutant names (default: the whole suite)")
    p.add_argument(
        "--kernels",
        default=",".join(CORRECT_KERNELS),
        help="comma-separated correct kernels besides the controls (default: the suite's correct "
        "kernels, sdpa_math, tiled)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    add_output_args(p, "recall", figure=False, files="recall.json, recall.csv and recall.md")
    return p


def _run(args: argparse.Namespace) -> int:
    alias = {"random": "random search"}
    strategies = [alias.get(s.strip(), s.strip()) for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise BenchArgumentError(f"--strategies {args.strategies!r}: choose from {', '.join(STRATEGIES)}")
    dtypes = [d for d in args.dtype.split(",") if d]
    if not dtypes or any(d not in _DTYPES for d in dtypes):
        raise BenchArgumentError(
            f"--dtype {args.dtype!r}: use a comma-separated list of {', '.join(_DTYPES)}"
        )
    if args.seeds < 1 or args.budget < 0:
        raise BenchArgumentError(f"--seeds {args.seeds} must be >= 1 and --budget {args.budget} >= 0")
    mutants = None if args.mutants is None else [m for m in args.mutants.split(",") if m]
    if mutants is not None and (not mutants or any(m not in MUTANTS for m in mutants)):
        raise BenchArgumentError(f"--mutants {args.mutants!r}: choose from {', '.join(MUTANTS)}")
    correct = [k for k in args.kernels.split(",") if k]
    start = time.perf_counter()
    with torch_threads(args.threads):
        rows = recall_rows(
            strategies,
            dtypes,
            range(args.seeds),
            budget=args.budget,
            cases=args.case,
            mutants=mutants,
            correct=correct,
            progress=lambda line: print(line, file=sys.stderr),
        )
    seconds = time.perf_counter() - start
    print(format_table(rows, TABLE_COLUMNS))
    meta = {"command": args.command_line, "torch": torch.__version__, "seconds": round(seconds, 1)}
    paths = write_results(args.out, "recall", rows, meta=meta)
    paths["md"] = atomic_write_text(
        args.out / "recall.md", f"Produced by `{args.command_line}`\n\n{markdown_table(rows)}\n"
    )
    print(markdown_table(rows))
    print(wrote_line(rows, seconds, paths))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m lab.recall``; returns the exit code."""
    return run_cli("recall", _parser(), _run, argv, command="python -m lab.recall")


if __name__ == "__main__":
    sys.exit(main())
