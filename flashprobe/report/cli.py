"""``flashprobe compare`` and ``flashprobe report``: results files → figures and ``report.md``.

``compare`` compares runs' weight snapshots into ``study.json``/``study.csv`` and Figs 7 and 8;
``report`` regenerates a study's ``report.md`` (``--figures``: the figures too) or a training run's
``probe.png``. Both print the verdict and exit with its code, as ``flashprobe study`` does (0 PASS,
3 LOOK CLOSER, 4 UNDETERMINED); bad arguments print one line and exit 2, a full disk exits 1.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashprobe.formats.atomic import DiskFullError
from flashprobe.formats.paths import (
    OutputPathError,
    check_output_dir,
    prepare_output_dir,
    printable,
    safe_name,
)
from flashprobe.formats.probe_log import PROBE_LOG_NAME
from flashprobe.formats.study_file import STUDY_NAME, read_study

__all__ = ["compare_main", "report_main"]


#: What ``compare --out DIR`` writes; a non-empty DIR that holds none of these is refused.
COMPARE_OWNS = ("study.json", "study.csv", "report.md", "fig8_wasserstein.png")


def _fail(prog: str, err: BaseException | str) -> int:
    print(printable(f"{prog}: error: {err}"), file=sys.stderr)
    return 1 if isinstance(err, DiskFullError) else 2


# ------------------------------------------------------------------------------------------ compare


def _parse_pair(text: str) -> tuple[str, tuple[str, str]]:
    name, sep, runs = text.partition("=")
    run_a, comma, run_b = runs.partition(",")
    if not sep or not comma or not name or not run_a or not run_b or "," in run_b:
        raise argparse.ArgumentTypeError(f"--pair wants NAME=RUN_A,RUN_B, got {text!r}")
    try:
        safe_name(name, what="--pair name")
    except OutputPathError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name, (run_a, run_b)


def _auto_name(a: str, b: str, taken: Mapping[str, Any]) -> str:
    """``A_vs_B`` from the runs' directory names, made a safe file name (other characters become ``_``)."""

    def part(run: str) -> str:
        name = Path(run).resolve().name or "run"
        return re.sub(r"[^A-Za-z0-9_.+=-]", "_", name).strip(".-") or "run"

    base = f"{part(a)}_vs_{part(b)}"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def _compare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashprobe compare",
        description="Compare the weight snapshots of runs (Wasserstein and max difference over steps). "
        "Two runs give one comparison; more runs give every pair; --pair names pairs explicitly.",
    )
    parser.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (holding snapshots/)")
    parser.add_argument(
        "--pair", action="append", default=[], type=_parse_pair, metavar="NAME=RUN_A,RUN_B",
        help="a named comparison (repeatable), e.g. flash_vs_baseline=runs/flash,runs/baseline",
    )  # fmt: skip
    parser.add_argument("--out", default="compare", help="output directory (default: ./compare)")
    parser.add_argument("--group-depth", type=int, default=2, help="module path depth of groups; 0: none")
    parser.add_argument("--no-model", action="store_true", help="skip the whole-model distribution")
    parser.add_argument("--no-figures", action="store_true", help="write only study.json and study.csv")
    parser.add_argument(
        "--fig7-pair", default=None, help="the pair drawn in Fig 7 (default: flash_vs_baseline)"
    )
    return parser


def _pairs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    pairs: dict[str, tuple[str, str]] = {}
    for name, runs in args.pair:
        if name in pairs:
            parser.error(f"--pair {name} given twice")
        pairs[name] = runs
    if len(args.runs) == 1:
        parser.error("give at least two run directories (or --pair NAME=RUN_A,RUN_B)")
    for a, b in itertools.combinations(args.runs, 2):
        pairs[_auto_name(a, b, pairs)] = (a, b)
    if not pairs:
        parser.error("nothing to compare: give two or more run directories or --pair NAME=RUN_A,RUN_B")
    if args.group_depth < 0:
        parser.error(f"--group-depth must be >= 0, got {args.group_depth}")
    if args.fig7_pair is not None and args.fig7_pair not in pairs:
        parser.error(f"--fig7-pair {args.fig7_pair!r} is not one of the compared pairs {list(pairs)}")
    return pairs


def _fmt_e(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.3e}"


def compare_main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe compare``: compare the weight snapshots of two or more run directories."""
    from flashprobe.report.study_verdict import EXIT_CODES, UNDETERMINED, answer, needs_line
    from flashprobe.report.weights_figures import plot_study_figures
    from flashprobe.weights import SnapshotStore, compare_runs
    from flashprobe.weights.differences import describe_differences, not_like_for_like

    prog = "flashprobe compare"
    parser = _compare_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    pairs = _pairs(parser, args)
    try:
        check_output_dir(args.out, flag="--out", owned=COMPARE_OWNS)  # fails first, creating nothing
        for run in dict.fromkeys(r for pair in pairs.values() for r in pair):
            SnapshotStore(run)  # a missing or malformed run fails here, before any distance or write
        for name, (a, b) in pairs.items():
            if os.path.realpath(a) == os.path.realpath(b):
                raise ValueError(
                    f"{name}: {a} and {b} are the same run directory, and a run against itself is at "
                    "distance 0; give two different runs"
                )
        created = not os.path.lexists(args.out)
        out = prepare_output_dir(args.out, flag="--out", owned=COMPARE_OWNS)
    except (FileNotFoundError, ValueError) as err:
        return _fail(prog, err)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        result = compare_runs(pairs, out, group_depth=args.group_depth, whole_model=not args.no_model)
        pairs_doc = result.as_dict()["pairs"]
        if not args.no_figures:
            result.files += plot_study_figures(pairs_doc, out, fig7=args.fig7_pair)
    except (FileNotFoundError, ValueError, DiskFullError) as err:
        if created and not any(out.iterdir()):  # refused before writing: leave no empty --out behind
            out.rmdir()
        return _fail(prog, err)
    width = max(len(n) for n in result.pairs)
    header = f"{'pair':<{width}}  {'steps':>5}  {'last step':>9}  {'wasserstein':>11}  {'max_abs':>9}"
    print(f"{header}  differs in")
    for name, pair in result.pairs.items():
        last = pair.model[-1] if pair.model else None
        w = _fmt_e(last.wasserstein) if last else "-"
        m = _fmt_e(last.max_abs) if last else "-"
        differs = describe_differences(pairs_doc[name])
        print(f"{name:<{width}}  {len(pair.steps):>5}  {pair.steps[-1]:>9}  {w:>11}  {m:>9}  {differs}")
    mixed = not_like_for_like(pairs_doc)
    if mixed:
        print(
            "warning: not like for like: "
            + "; ".join(f"{n} differs in {what}" for n, what in mixed.items())
            + " — such a distance mixes the effects of everything its runs differ in"
        )
    lines, code = answer({"pairs": pairs_doc})  # UNDETERMINED: what is missing, in its lines
    if code != EXIT_CODES[UNDETERMINED]:
        print(needs_line({"pairs": pairs_doc}))
    print(printable("\n".join(["", *lines, ""])))
    for path in result.files:
        print(printable(f"wrote {path}"))
    return code


# ------------------------------------------------------------------------------------------- report


def report_main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe report DIR``: rebuild ``DIR/report.md`` from ``DIR/study.json`` (``--figures``:
    redraw the figures too), print the verdict and name the files written, exiting with the verdict's
    code as ``flashprobe study`` does; for a training run directory (``probe.jsonl``, no ``study.json``)
    redraw ``probe.png``, print the worst error ratio per logged step and the probe's verdict, and exit
    with :data:`RUN_EXIT_CODES` of that verdict."""
    from flashprobe.report.study_report import write_report
    from flashprobe.report.study_verdict import answer, comparison_groups
    from flashprobe.report.weights_figures import plot_study_figures

    prog = "flashprobe report"
    parser = argparse.ArgumentParser(prog=prog, description=report_main.__doc__)
    parser.add_argument(
        "dir",
        help="a directory written by `flashprobe study`, `flashprobe compare` or `flashprobe train`",
    )
    parser.add_argument("--figures", action="store_true", help="also redraw fig7/fig8 from study.json")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not args.dir.strip():  # Path("") would be the working directory
        return _fail(prog, "DIR is empty; give the study, comparison or run directory (. for this one)")
    args.dir = Path(args.dir)
    if not args.dir.is_dir():
        return _fail(prog, f"{args.dir} is not a directory; give a study, comparison or run directory")
    if not (args.dir / STUDY_NAME).is_file() and (args.dir / PROBE_LOG_NAME).is_file():
        return _run_report(args.dir)
    try:
        study = read_study(args.dir)
        prepare_output_dir(args.dir, flag="DIR")
        groups = comparison_groups(study)
        figures = plot_study_figures(study["pairs"], args.dir, groups=groups) if args.figures else []
        report = write_report(args.dir)
    except (FileNotFoundError, ValueError, DiskFullError) as err:
        return _fail(prog, err)
    lines, code = answer(study)  # the verdict and its exit code, as `flashprobe study` gives them
    print(printable("\n".join([*lines, ""])))
    for path in (report, *figures):  # the files, not their contents: the report is for reading there
        print(printable(f"wrote {path}"))
    return code


#: ``flashprobe report RUN_DIR``'s exit code for the probe's verdict of a training run: 1 for a
#: failure, as ``fuzz`` and ``replay``; 4 when nothing was judged, as ``study``'s UNDETERMINED.
RUN_EXIT_CODES = {"pass": 0, "fail": 1, "undetermined": 4}


def _run_report(run_dir: Path) -> int:
    """Redraw ``run_dir/probe.png``, print the per-step summary of ``probe.jsonl`` and the run's
    verdict block (:func:`flashprobe.probing.session.verdict_block`, the per-site table the training
    callbacks print); return the verdict's exit code (:data:`RUN_EXIT_CODES`)."""
    from flashprobe.formats.probe_log import load_probe_records, record_summary
    from flashprobe.probing.session import RunTally, verdict_block
    from flashprobe.report.probe_figures import plot_probe

    path = run_dir / PROBE_LOG_NAME
    try:
        check_output_dir(run_dir, flag="DIR")  # a read-only disk: one line, before drawing
        figure = plot_probe(path, run_dir / "probe.png")
    except (FileNotFoundError, ValueError, DiskFullError) as err:
        return _fail("flashprobe report", err)
    # the verdict's statistic first; the ratio of maxima (flash-attention's) under its own name
    print(
        "| step | verdict | error / limit | worst site | max error ratio | max abs primary-baseline "
        "| non-finite |"
    )
    print("| ---: | --- | ---: | --- | ---: | ---: | ---: |")
    tally, summary = RunTally(), None
    try:
        for record in load_probe_records(path):
            summary = tally.add(record_summary(record), record.get("sites") or {})
            ratio, old = _g(summary.limit_ratio), _g(summary.max_error_ratio)
            diff = _g(summary.max_abs.get("primary_baseline"))
            site, verdict, nonfinite = summary.max_limit_ratio_site or "-", summary.verdict, summary.nonfinite
            print(f"| {record['step']} | {verdict} | {ratio} | {site} | {old} | {diff} | {nonfinite} |")
    except ValueError as err:
        return _fail("flashprobe report", f"{path}: {err}")
    if summary is not None:
        rows = tally.rows(summary.failures)
        print(printable(verdict_block(summary, rows, who="flashprobe report", path=path, max_rows=10**6)))
    print(printable(f"wrote {figure}"))
    return RUN_EXIT_CODES.get("undetermined" if summary is None else summary.verdict, 4)


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
