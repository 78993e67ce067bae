"""``flashprobe study``: the paper's §V weight-deviation study in one command.

It trains the runs of ``conf/study_run/`` with Hydra multirun (flash and baseline attention from one
seed, an identical repeat of the baseline, the baseline from other seeds, and the baseline in FP16
and BF16 mixed precision), then compares their weight snapshots pairwise
(:func:`flashprobe.weights.compare_runs`) and writes ``study.json``, ``study.csv``, the Fig 7/8
figures and ``report.md`` with the verdict: flash-vs-baseline deviation as multiples of the
seed-to-seed and the low-precision deviation. Any Hydra override is passed to every run, e.g.
``flashprobe study trainer.max_steps=400 hydra/launcher=submitit_slurm``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["COMPARISONS", "DEFAULT_RUNS", "main", "run_study"]

log = logging.getLogger(__name__)

#: Runs of the study (``conf/study_run/<name>.yaml``).
DEFAULT_RUNS: tuple[str, ...] = ("flash", "baseline", "identical", "seed1", "seed2", "fp16", "bf16")

#: Comparison name → (run A, run B). Comparisons whose runs were not trained are left out.
COMPARISONS: dict[str, tuple[str, str]] = {
    "flash_vs_baseline": ("flash", "baseline"),
    "identical": ("identical", "baseline"),
    "seed1_vs_seed0": ("seed1", "baseline"),
    "seed2_vs_seed0": ("seed2", "baseline"),
    "fp16_vs_fp32": ("fp16", "baseline"),
    "bf16_vs_fp32": ("bf16", "baseline"),
}

#: Overrides of the embedded default study: 120-step runs of the ~0.5 M-parameter dit_small on 2 CPU
#: cores (about 8 minutes for all seven runs, most of it the fp16 and bf16 runs).
STUDY_DEFAULTS: tuple[str, ...] = (
    "data.batch_size=32",
    "trainer.max_steps=120",
    "trainer.val_check_interval=120",
    "trainer.log_every_n_steps=20",
    "callbacks.weight_snapshot.every_n_steps=20",
    "callbacks.checkpoint=null",
    "module.num_samples=8",
    "module.num_sample_steps=20",
)


def run_study(
    out: str | Path,
    runs: Sequence[str] = DEFAULT_RUNS,
    overrides: Sequence[str] = (),
    *,
    train: bool = True,
) -> Path:
    """Train the study's runs and compare them; returns the path of ``report.md``.

    Args:
        out: the study directory; runs go to ``out/runs/<name>``.
        runs: names from ``conf/study_run/`` to train (``baseline`` is needed by every pair).
        overrides: Hydra overrides applied to every run (after the study defaults).
        train: train the runs (``False``: only compare runs already in ``out/runs``).

    Raises:
        ValueError: an unknown run name, or no comparable pair.
    """
    from flashprobe.report.study_report import write_report
    from flashprobe.report.weights_figures import plot_study_figures
    from flashprobe.t2i.train import CONF_DIR, cli_main
    from flashprobe.weights import compare_runs

    known = sorted(p.stem for p in (CONF_DIR / "study_run").glob("*.yaml"))
    unknown = [r for r in runs if r not in known]
    if unknown:
        raise ValueError(f"unknown study run {unknown[0]!r}; choose from: {', '.join(known)}")
    out = Path(out).resolve()
    runs_dir = out / "runs"
    if train:
        start = time.perf_counter()
        cli_main(
            [
                "-m",
                f"study_run={','.join(runs)}",
                f"hydra.sweep.dir={runs_dir}",
                "hydra.sweep.subdir=${run_name}",
                *STUDY_DEFAULTS,
                *overrides,
            ]
        )
        log.info("trained %d runs in %.0f s", len(runs), time.perf_counter() - start)
    present = (
        {p.name for p in runs_dir.iterdir() if (p / "snapshots").is_dir()} if runs_dir.is_dir() else set()
    )
    pairs = {
        name: (runs_dir / a, runs_dir / b)
        for name, (a, b) in COMPARISONS.items()
        if a in present and b in present
    }
    if not pairs:
        raise ValueError(
            f"no comparable pair of runs in {runs_dir} (found {sorted(present) or 'none'}); "
            "every pair needs the 'baseline' run and one of: "
            + ", ".join(sorted({a for a, _ in COMPARISONS.values()}))
        )
    comparison = compare_runs(pairs, out)
    plot_study_figures(comparison.as_dict()["pairs"], out)
    return write_report(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe study [--out DIR] [--runs a,b,...] [--compare-only] [HYDRA_OVERRIDES...]``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe study",
        description="Train flash, baseline, identical, other-seed and low-precision runs of the "
        "text-to-image model and bound flash attention's weight deviation (paper §V).",
    )
    parser.add_argument("--out", default="out/study", help="study directory (default: out/study)")
    parser.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=f"comma-separated runs from conf/study_run (default: {','.join(DEFAULT_RUNS)})",
    )
    parser.add_argument(
        "--compare-only", action="store_true", help="compare runs already trained in OUT/runs"
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides for every run, e.g. trainer.max_steps=400"
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = run_study(
        args.out, [r for r in args.runs.split(",") if r], args.overrides, train=not args.compare_only
    )
    print(report.read_text())
    print(f"wrote {report.parent}/study.json, study.csv, figures and {report}")
    return 0
