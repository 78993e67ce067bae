"""``report.md`` of a study: the verdict (:mod:`flashprobe.report.study_verdict`) and its tables.

Everything is recomputed from ``study.json`` (and ``runs/*``), so ``flashprobe report STUDY_DIR``
regenerates the report; the title claims "like for like" only when every pair's runs differ in at
most one thing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashprobe.formats.atomic import atomic_write_text
from flashprobe.formats.probe_log import PROBE_LOG_NAME, load_probe_records, record_summary
from flashprobe.formats.probe_summary import ProbeSummary
from flashprobe.formats.run_record import read_run_record, run_seconds
from flashprobe.formats.study_file import read_study
from flashprobe.report.study_verdict import (
    Verdict,
    comparison_groups,
    format_value,
    kernel_label,
    needs_line,
    no_verdict_line,
    study_comparisons,
    verdict,
    verdict_lines,
    verdict_subject,
)
from flashprobe.weights.differences import describe_differences, not_like_for_like

if TYPE_CHECKING:
    from flashprobe.probing.session import SiteVerdict

__all__ = ["probe_summary", "probe_verdict", "verdict", "verdict_lines", "write_report"]


def _final(pair: Mapping[str, Any], metric: str = "wasserstein") -> tuple[int, float] | None:
    """The last step with a finite whole-model value of ``metric``."""
    for step, value in zip(reversed(pair["steps"]), reversed(pair["model"][metric]), strict=True):
        if value is not None and math.isfinite(value):
            return step, value
    return None


def probe_summary(run_dir: Path) -> list[ProbeSummary]:
    """Per logged step of a run's ``probe.jsonl``: worst error ratio, worst max_abs, non-finite count."""
    path = run_dir / PROBE_LOG_NAME
    if not path.is_file():
        return []
    return [record_summary(r) for r in load_probe_records(path)]


def probe_verdict(run_dir: Path) -> tuple[ProbeSummary, list[SiteVerdict]] | None:
    """The probe's verdict over a run: the last summary of its ``probe.jsonl`` with every record
    tallied, and the per-site rows of the verdict block; None when the run has no probe records."""
    from flashprobe.probing.session import RunTally

    path = run_dir / PROBE_LOG_NAME
    if not path.is_file():
        return None
    tally, summary = RunTally(), None
    for record in load_probe_records(path):
        summary = tally.add(record_summary(record), record.get("sites") or {})
    return None if summary is None else (summary, tally.rows(summary.failures))


def _comparisons_table(study: Mapping[str, Any]) -> list[str]:
    """One row per pair: what it isolates, what its runs differ in, its distances at its last step."""
    meta = study.get("study") or {}
    comparisons, runs = study_comparisons(study), meta.get("runs") or {}

    def side(name: str, recorded: Mapping[str, Any] | None) -> str:
        """A run by name, with the attention, precision and seed planned for it, else those recorded."""
        r = runs.get(name) or recorded or {}
        facts = [str(r[k]) for k in ("attention", "precision") if r.get(k) is not None]
        facts += [f"seed {r['seed']}"] if r.get("seed") is not None else []
        return f"{name} ({', '.join(facts)})" if facts else name

    lines = [
        "| comparison | isolates | run A | run B | differs in (recorded) | last step | Wasserstein | "
        "max abs |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for name, pair in study["pairs"].items():
        c = comparisons.get(name, {})
        final, final_max = _final(pair), _final(pair, "max_abs")
        run_a = c.get("run_a") or Path(pair["run_a"]).name
        run_b = c.get("run_b") or Path(pair["run_b"]).name
        recorded = pair.get("runs") or {}
        lines.append(
            f"| {name} | {c.get('isolates', '–')} | {side(run_a, recorded.get('a'))} | "
            f"{side(run_b, recorded.get('b'))} | "
            f"{describe_differences(pair)} | "
            f"{final[0] if final else '–'} | {format_value(final[1] if final else None)} | "
            f"{format_value(final_max[1] if final_max else None)} |"
        )
    return lines


def _ratios_table(v: Verdict) -> list[str]:
    """The verdict's ratios: median, min–max and each replicate's value at the last step, and the range
    over training."""
    steps, seeds = v.steps, ", ".join(map(str, v.seeds))
    over = f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    lines = [
        f"| ratio | isolates | step {v.step}: median | min–max | per replicate (seeds {seeds}) | "
        f"min–max over {over} | at step {v.step} |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, c in v.context.items():
        ratio = c.ratio
        if ratio is None:
            continue
        by_seed = dict(zip(ratio.seeds, ratio.values, strict=True))
        values = ", ".join(format_value(by_seed.get(seed)) for seed in v.seeds)  # "–": undefined there
        low, high = c.over_training or (None, None)
        where = {"below": "below 1", "above": "above 1", "straddles": "straddles 1"}[ratio.position()]
        lines.append(
            f"| {kernel_label(v)} / {label} | {c.isolates} | {format_value(ratio.median)}× | "
            f"{format_value(ratio.low)}–{format_value(ratio.high)} | {values} | "
            f"{format_value(low)}–{format_value(high)} | {where} |"
        )
    return lines


def _distances_table(study: Mapping[str, Any], v: Verdict) -> list[str]:
    """Per comparison (all its replicates): whole-model distances at the verdict's step, median (min–max)."""
    comparisons = study_comparisons(study)
    step = v.step
    lines = [
        f"| comparison | isolates | replicates | Wasserstein at step {step} | max abs at step {step} |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for group, names in comparison_groups(study).items():
        cells = [
            _spread([_value_at(study["pairs"][n], m, step) for n in names])
            for m in ("wasserstein", "max_abs")
        ]
        isolates = comparisons.get(names[0], {}).get("isolates", "–")
        lines.append(f"| {group} | {isolates} | {len(names)} | {cells[0]} | {cells[1]} |")
    return lines


def _value_at(pair: Mapping[str, Any], metric: str, step: int | None) -> float | None:
    if step not in pair["steps"]:
        return None
    value = pair["model"][metric][pair["steps"].index(step)]
    return value if value is not None and math.isfinite(value) else None


def _spread(values: Sequence[float | None]) -> str:
    """``6.47e-05 (5.9e-05–7.1e-05)``: median (min–max) of the values that are not None."""
    defined = [v for v in values if v is not None]
    if not defined:
        return "–"
    if len(set(defined)) == 1:  # one replicate, or every replicate the same (0 at step 0)
        return format_value(defined[0])
    low, high = format_value(min(defined)), format_value(max(defined))
    return f"{format_value(statistics.median(defined))} ({low}–{high})"


def _steps_table(study: Mapping[str, Any], metric: str, max_rows: int = 8) -> list[str]:
    """Each comparison's whole-model ``metric`` over training: median (min–max) over its replicates."""
    pairs, groups = study["pairs"], comparison_groups(study)
    every = sorted({s for p in pairs.values() for s in p["steps"]})
    steps = every
    if len(every) > max_rows:  # keep the table short: evenly spaced steps, always the last
        idx = sorted({round(i * (len(every) - 1) / (max_rows - 1)) for i in range(max_rows)})
        steps = [every[i] for i in idx]
    left_out = [s for s in every if s not in steps]
    lines = ["| step | " + " | ".join(groups) + " |", "| ---: |" + " ---: |" * len(groups)]
    for step in steps:
        cells = [_spread([_value_at(pairs[n], metric, step) for n in names]) for names in groups.values()]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    if left_out:
        lines += [
            "",
            f"{len(steps)} of the {len(every)} snapshot steps, evenly spaced, to keep the table short; "
            f"left out: steps {', '.join(map(str, left_out))} (every step is in study.json and study.csv).",
        ]
    return lines


def _latest(run: Path, pattern: str) -> str | None:
    found = sorted(run.glob(pattern), key=lambda p: p.name)
    return None if not found else str(found[-1].relative_to(run.parent.parent))


def _runs_table(study_dir: Path, runs: Mapping[str, Any]) -> list[str]:
    lines = [
        "| run | attention | precision | seed | steps | time | probe | last samples |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for name, r in runs.items():
        run = study_dir / "runs" / name
        record = read_run_record(run) or {}
        seconds = run_seconds(record) if record else None
        probe = f"[probe.png](runs/{name}/probe.png)" if (run / "probe.png").is_file() else "–"
        samples = _latest(run, "**/samples/step_*.png")
        time = "–" if seconds is None else f"{seconds:.0f} s"
        grid = "–" if samples is None else f"[{Path(samples).name}]({samples})"
        steps = record.get("global_step", "–")
        cells = [name, r["attention"], r["precision"], r["seed"], steps, time, probe, grid]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def _probe_lines(study_dir: Path, runs: Mapping[str, Any]) -> list[str]:
    rows = []
    for name in runs:
        summary = probe_summary(study_dir / "runs" / name)
        if summary:
            ratios = [r.max_error_ratio for r in summary if r.max_error_ratio is not None]
            nonfinite = sum(r.nonfinite for r in summary)
            first, last, worst = (ratios[0], ratios[-1], max(ratios)) if ratios else (None, None, None)
            verdict, failure = _verdict_cell(summary[-1])
            rows.append(
                f"| {name} | {verdict} | {len(summary)} | {format_value(first)} | {format_value(last)} | "
                f"{format_value(worst)} | {nonfinite} | {failure} |"
            )
    if not rows:
        return []
    return [
        "## Attention probe (primary vs baseline vs FP64 golden, every logged step)",
        "",
        "Verdict: the probe's rule at every compared call (relative L2 error ratio to the baseline's "
        "within 8 for the output and 64 for the gradients, no NaN/Inf where the golden is finite; "
        'docs/probe.md "Reading the verdict"), over the whole run. Error ratio = max|primary − golden| / '
        "max|baseline − golden| over all sites (against the noise floor when the baseline is exact), "
        "for reference: flash-attention's tests pass a kernel at ≤ 2.",
        "",
        "| run | verdict | logged steps | first error ratio | last | worst | non-finite | first failure |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        *rows,
        "",
    ]


def _verdict_cell(summary: ProbeSummary) -> tuple[str, str]:
    """The run's verdict (its last record covers the whole run) and its first failure, in words."""
    firsts = summary.first_failures
    if not firsts:
        return summary.verdict, "–"
    f = firsts[0]
    return summary.verdict, f"{f.site} {f.direction}, step {f.step}: {f.reason}"


def _machine_lines(meta: Mapping[str, Any]) -> list[str]:
    machine = meta.get("machine") or {}
    if not machine:
        return []
    keys = ("torch", "cpu", "cpu_capability", "torch_threads", "cuda")
    if "differ" in machine:
        body = [
            "**The runs trained on different machines or settings**, so each pair's deviation includes "
            "that difference as well as the one thing it isolates:",
            "",
            *(
                f"- {run}: " + ", ".join(f"{k} {f.get(k)}" for k in keys)
                for run, f in machine["differ"].items()
            ),
        ]
    else:
        facts = ", ".join(f"{k} {machine.get(k)}" for k in keys)
        body = [
            f"{facts} (as the runs recorded them in run.json); deterministic algorithms. "
            "On a CPU the runs are bit-identical from one seed "
            "for a given torch build, CPU instruction set and thread count; another of these changes the "
            "last bits of every step, so the distances change a little (their ratios much less).",
        ]
    return ["## What these numbers depend on", "", *body, ""]


def write_report(study_dir: str | Path) -> Path:
    """Write ``report.md`` of a directory written by ``flashprobe study`` or ``compare`` from its
    ``study.json`` (and ``runs/*`` when present); returns its path.

    Raises:
        FileNotFoundError: no ``study.json`` in ``study_dir``.
        ValueError: a malformed ``study.json``.
    """
    study_dir = Path(study_dir)
    study = read_study(study_dir)
    meta = study.get("study") or {}
    v = verdict(study)
    precision, kernel = verdict_subject(study, v)
    mixed = not_like_for_like(study["pairs"])
    subject = kernel_label(v) if v else kernel  # as the runs recorded it, never a fixed kernel word
    title = f"weight deviation of {subject} attention" + ("" if mixed else ", like for like")
    lines = [f"# flashprobe study: {title} (paper §V)", ""]
    if mixed:
        lines += [
            "**Not shown to be like for like**: "
            + "; ".join(f"`{n}` differs in {what}" for n, what in mixed.items())
            + ". A pair that differs in more than one thing mixes their effects (or, unrecorded, may); "
            "the verdict uses only pairs that differ in one thing.",
            "",
        ]
    lines += ["## Verdict", ""]
    if v:
        k = kernel_label(v)
        lines += [f"- {line}" for line in verdict_lines(v, precision, kernel)]
        lines += ["", needs_line(study)]
        n = len(v.seeds)
        lines += [
            "",
            "The rule (docs/study.md): **PASS** when, at every snapshot step after the learning-rate "
            f"warm-up ({_warmup(v)}), {k} / seed is below 1 in every replicate and {k} / the "
            f"low-precision pair at the precision {k} trains at is not above 1 in every replicate "
            f"({k}: the distance of the kernel pair {v.kernel_pair}); "
            f"**LOOK CLOSER** when either fails at some step or {k}'s weights turn non-finite; "
            "**UNDETERMINED** when a comparison the rule needs was not trained, is undefined in some "
            "replicate, or its runs differ in more than the one thing it isolates.",
            "",
            "## Ratios, with intervals over replicates",
            "",
            *_ratios_table(v),
            "",
            f"Each ratio divides distances of one replicate (pairs that share its seed); median and min–max "
            f"over the {n} replicate{'s' * (n != 1)}. "
            + (
                f"With {n} independent replicates, the min–max range covers the median ratio with "
                f"probability 1 − 2^(1−{n}) = {1 - 2 ** (1 - n):.0%} (order statistics; no assumption on the "
                "distribution); a bootstrap interval is not meaningful with so few replicates."
                if n > 1
                else "One replicate: no interval (study.replicates=N trains N seeds)."
            ),
            "",
            "## Distances, median (min–max) over replicates",
            "",
            *_distances_table(study, v),
        ]
    else:
        lines += [
            f"- {no_verdict_line(study)}",
            "",
            "No pair here differs in the attention alone: the distances below carry no verdict.",
            "",
            needs_line(study),
        ]
    lines += ["", "## What each comparison isolates", "", *_comparisons_table(study), ""]
    if meta.get("runs"):
        lines += ["## Runs", "", *_runs_table(study_dir, meta["runs"]), ""]
    figures = sorted(p.name for p in study_dir.glob("fig*.png"))
    if figures:
        lines += ["## Figures", "", *[f"![{f}]({f})" for f in figures], ""]
    spread = (
        " median (min–max) over replicates;"
        if any(len(g) > 1 for g in comparison_groups(study).values())
        else ""
    )
    lines += [
        f"## Wasserstein distance over training (whole model;{spread} zero: identical weights)",
        "",
        *_steps_table(study, "wasserstein"),
        "",
        f"## Max |W_a − W_b| over training (whole model;{spread} zero: identical weights)",
        "",
        *_steps_table(study, "max_abs"),
        "",
    ]
    lines += _probe_lines(study_dir, meta.get("runs") or {})
    lines += _machine_lines(meta)
    lines += [f"Regenerate with `flashprobe report {study_dir}`.", ""]
    out = study_dir / "report.md"
    atomic_write_text(out, "\n".join(lines))
    return out


def _warmup(v: Verdict) -> str:
    steps = v.steps
    which = f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    if v.warmup_steps is None:
        return f"warm-up not recorded: every step after 0, here {which}"
    return f"module.warmup_steps = {v.warmup_steps}; here {which}"
