"""``flashprobe report DIR``: regenerate ``report.md`` (and figures) of a study or comparison."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Rebuild ``DIR/report.md`` from ``DIR/study.json``; with ``--figures``, redraw the figures."""
    parser = argparse.ArgumentParser(prog="flashprobe report", description=__doc__)
    parser.add_argument(
        "dir", type=Path, help="a directory written by `flashprobe study` or `flashprobe compare`"
    )
    parser.add_argument("--figures", action="store_true", help="also redraw fig7/fig8 from study.json")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from flashprobe.report.study_report import write_report

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
