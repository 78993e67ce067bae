"""``flashprobe report DIR``: regenerate ``report.md`` (and figures) of a study or comparison, or the
per-site deviation plot ``probe.png`` of a training run (a directory holding ``probe.jsonl``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Rebuild ``DIR/report.md`` from ``DIR/study.json``; with ``--figures``, redraw the figures.

    A training run directory (``probe.jsonl``, no ``study.json``) gets its ``probe.png`` redrawn and
    the worst error ratio per logged step printed.
    """
    parser = argparse.ArgumentParser(prog="flashprobe report", description=__doc__)
    parser.add_argument(
        "dir",
        type=Path,
        help="a directory written by `flashprobe study`, `flashprobe compare` or `flashprobe train`",
    )
    parser.add_argument("--figures", action="store_true", help="also redraw fig7/fig8 from study.json")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from flashprobe.report.study_report import write_report

    if not (args.dir / "study.json").is_file() and (args.dir / "probe.jsonl").is_file():
        return _run_report(args.dir)
    if args.figures:
        import json

        from flashprobe.report.weights_figures import plot_pair_over_steps, plot_wasserstein_curves

        pairs = json.loads((args.dir / "study.json").read_text())["pairs"]
        chosen = "flash_vs_baseline" if "flash_vs_baseline" in pairs else next(iter(pairs))
        plot_pair_over_steps(chosen, pairs[chosen], args.dir / f"fig7_{chosen}.png")
        plot_wasserstein_curves(pairs, args.dir / "fig8_wasserstein.png")
    try:
        report = write_report(args.dir)
    except FileNotFoundError as err:
        print(f"flashprobe report: {err}", file=sys.stderr)
        return 2
    print(report.read_text())
    return 0


def _run_report(run_dir: Path) -> int:
    """Redraw ``run_dir/probe.png`` and print the per-step summary of ``probe.jsonl``."""
    from flashprobe.report.probe_figures import plot_probe
    from flashprobe.report.study_report import probe_summary

    try:
        figure = plot_probe(run_dir / "probe.jsonl", run_dir / "probe.png")
    except ValueError as err:
        print(f"flashprobe report: {err}", file=sys.stderr)
        return 2
    print("| step | max error ratio | worst site | max abs primary-baseline | non-finite |")
    print("| ---: | ---: | --- | ---: | ---: |")
    for row in probe_summary(run_dir):
        ratio = _g(row.get("max_error_ratio"))
        diff = _g((row.get("max_abs") or {}).get("primary_baseline"))
        site = row.get("max_error_ratio_site") or "-"
        print(f"| {row['step']} | {ratio} | {site} | {diff} | {row.get('nonfinite', 0)} |")
    print(f"wrote {figure}")
    return 0


def _g(value: float | str | None) -> str:
    """A number of probe.jsonl (non-finite ones are stored as "inf"/"nan" strings) as 3 digits."""
    return "-" if value is None else f"{float(value):.3g}"
