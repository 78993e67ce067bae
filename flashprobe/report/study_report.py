"""``report.md`` of a study: the verdict of paper §V, computed from ``study.json`` like for like.

The verdict puts the flash-vs-baseline weight deviation in context, as the paper does (Fig 8): as a
multiple of the deviation between runs that differ only in their seed, and of the deviation that
low-precision training causes. Each context is a comparison that isolates one thing (``study.json``'s
``study.comparisons``); flash's pair is divided only by comparisons of the kinds ``seed`` (same
precision as flash) and ``precision`` (the baseline across precisions). An ``identical`` pair is the
noise floor: reported as such, never as a ratio. Everything is recomputed from files, so
``flashprobe report STUDY_DIR`` regenerates the report.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashprobe.formats.atomic import atomic_write_text
from flashprobe.formats.probe_log import PROBE_LOG_NAME, load_probe_records
from flashprobe.formats.run_record import read_run_record, run_seconds
from flashprobe.formats.study_file import read_study

__all__ = ["VERDICT_KINDS", "probe_summary", "verdict", "write_report"]

FLASH = "flash_vs_baseline"
#: Comparison kinds flash's deviation is divided by, in the verdict's order.
VERDICT_KINDS = ("seed", "precision")


def _final(pair: Mapping[str, Any], metric: str = "wasserstein") -> tuple[int, float] | None:
    """The last step with a finite whole-model value of ``metric``."""
    for step, value in zip(reversed(pair["steps"]), reversed(pair["model"][metric]), strict=True):
        if value is not None and math.isfinite(value):
            return step, value
    return None


def verdict(study: Mapping[str, Any]) -> dict[str, Any]:
    """Flash-vs-baseline deviation as multiples of like-for-like context deviations.

    Args:
        study: ``study.json`` as read by :func:`flashprobe.formats.study_file.read_study`.

    Returns:
        ``step`` and ``flash`` (flash's final whole-model Wasserstein distance); ``noise_floor``
        (the ``identical`` pair's final distance, or None); ``context``: per context — ``seed``
        (the mean over the seed pairs) and each ``precision`` pair — its ``wasserstein``, the
        ``pairs`` it covers, what it ``isolates`` and ``ratio`` = flash / context (None when the
        context distance is 0); ``extra``: the ``kernel_fp32`` pair's distance, if trained.
        Empty when there is no flash pair or no study metadata (a plain ``flashprobe compare``).
    """
    pairs = study["pairs"]
    comparisons = (study.get("study") or {}).get("comparisons") or {}
    if FLASH not in pairs or not comparisons or _final(pairs[FLASH]) is None:
        return {}
    step, flash = _final(pairs[FLASH])
    finals = {n: f[1] for n in pairs if n in comparisons and (f := _final(pairs[n])) is not None}
    out: dict[str, Any] = {"step": step, "flash": flash, "context": {}, "extra": {}}
    noise = [finals[n] for n, c in comparisons.items() if c["kind"] == "noise" and n in finals]
    out["noise_floor"] = max(noise) if noise else None
    seeds = [n for n, c in comparisons.items() if c["kind"] == "seed" and n in finals]
    groups = {"seed": seeds} if seeds else {}
    groups |= {n: [n] for n, c in comparisons.items() if c["kind"] == "precision" and n in finals}
    for label, names in groups.items():
        value = statistics.fmean(finals[n] for n in names)
        out["context"][label] = {
            "wasserstein": value,
            "ratio": flash / value if value > 0 else None,
            "pairs": names,
            "isolates": "the random seed" if label == "seed" else comparisons[label]["isolates"],
        }
    out["extra"] = {
        n: finals[n] for n, c in comparisons.items() if c["kind"] == "kernel_fp32" and n in finals
    }
    return out


def _fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.3g}"


def _times(ratio: float) -> str:
    """``ratio`` as "3.2× below" or "1.4× above"."""
    return f"{1 / ratio:.3g}× below" if ratio < 1 else f"{ratio:.3g}× above"


def verdict_lines(v: Mapping[str, Any], precision: str, kernel: str = "sdpa_flash") -> list[str]:
    """The verdict in a few sentences, each computed from ``v`` (:func:`verdict`)."""
    lines = [
        f"At step {v['step']}, the kernel under test ({kernel}) trained at {precision} is at whole-model "
        f"Wasserstein distance **{_fmt(v['flash'])}** from the baseline (math attention, same precision and "
        "seed)."
    ]
    floor = v.get("noise_floor")
    if floor is not None:
        lines.append(
            "Noise floor: 0 — identical runs give bit-identical weights, so every distance here is real."
            if floor == 0
            else f"Noise floor: identical runs differ by {_fmt(floor)}; distances near it are noise."
        )
    seed = v["context"].get("seed")
    if seed is not None and seed["ratio"] is not None:
        within = seed["ratio"] <= 1
        lines.append(
            f"Seed: flash's deviation is {_fmt(seed['ratio'])}× the seed-to-seed deviation at that precision "
            + (
                "— within the bound set by random initialisation, as in the paper."
                if within
                else "— above the bound set by random initialisation, unlike the paper: look closer."
            )
        )
    for name, c in v["context"].items():
        if name == "seed" or c["ratio"] is None:
            continue
        lines.append(
            f"Low precision: flash's deviation is {_times(c['ratio'])} that of {name} "
            f"({c['isolates']}; paper: 2–5× below FP16 vs FP32)."
        )
    for name, value in v["extra"].items():
        lines.append(
            f"Without low precision ({name}, both at fp32) flash deviates by {_fmt(value)}: "
            f"{_fmt(value / v['flash']) if v['flash'] else '–'}× its deviation at {precision}."
        )
    return lines


def probe_summary(run_dir: Path) -> list[dict[str, Any]]:
    """Per logged step of a run's ``probe.jsonl``: worst error ratio, worst max_abs, non-finite count."""
    path = run_dir / PROBE_LOG_NAME
    if not path.is_file():
        return []
    return [{"step": r["step"], **r.get("summary", {})} for r in load_probe_records(path)]


def _comparisons_table(study: Mapping[str, Any], v: Mapping[str, Any]) -> list[str]:
    meta = study.get("study") or {}
    comparisons, runs = meta.get("comparisons") or {}, meta.get("runs") or {}

    def side(name: str) -> str:
        r = runs.get(name)
        return name if r is None else f"{name} ({r['attention']}, {r['precision']}, seed {r['seed']})"

    lines = [
        "| comparison | isolates | run A | run B | last step | Wasserstein | max abs | flash / this |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, pair in study["pairs"].items():
        c = comparisons.get(name, {})
        final = _final(pair)
        final_max = _final(pair, "max_abs")
        if name == FLASH:
            vs = "–"
        elif c.get("kind") == "noise":
            vs = "noise floor: 0" if final is not None and final[1] == 0 else "noise floor"
        elif final is not None and final[1] > 0 and v:
            vs = f"{_fmt(v['flash'] / final[1])}×"
        else:
            vs = "–"
        lines.append(
            f"| {name} | {c.get('isolates', '–')} | {side(c.get('run_a', pair['run_a']))} | "
            f"{side(c.get('run_b', pair['run_b']))} | {final[0] if final else '–'} | "
            f"{_fmt(final[1] if final else None)} | {_fmt(final_max[1] if final_max else None)} | {vs} |"
        )
    return lines


def _steps_table(pairs: Mapping[str, Mapping[str, Any]], metric: str, max_rows: int = 8) -> list[str]:
    names = list(pairs)
    steps = sorted({s for p in pairs.values() for s in p["steps"]})
    if len(steps) > max_rows:  # keep the table short: evenly spaced steps, always the last
        idx = sorted({round(i * (len(steps) - 1) / (max_rows - 1)) for i in range(max_rows)})
        steps = [steps[i] for i in idx]
    lines = ["| step | " + " | ".join(names) + " |", "| ---: |" + " ---: |" * len(names)]
    for step in steps:
        cells = []
        for n in names:
            p = pairs[n]
            cells.append(_fmt(p["model"][metric][p["steps"].index(step)]) if step in p["steps"] else "–")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
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
            ratios = [r.get("max_error_ratio") for r in summary if r.get("max_error_ratio") is not None]
            nonfinite = sum(r.get("nonfinite", 0) for r in summary)
            first, last, worst = (ratios[0], ratios[-1], max(ratios)) if ratios else (None, None, None)
            verdict, failure = _verdict_cell(summary[-1])
            rows.append(
                f"| {name} | {verdict} | {len(summary)} | {_fmt(first)} | {_fmt(last)} | {_fmt(worst)} | "
                f"{nonfinite} | {failure} |"
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


def _verdict_cell(summary: Mapping[str, Any]) -> tuple[str, str]:
    """The run's verdict (its last record covers the whole run) and its first failure, in words."""
    verdict = summary.get("verdict") or "–"
    firsts = [f for f in summary.get("failures") or [] if not f.get("worst")]
    if not firsts:
        return verdict, "–"
    f = firsts[0]
    return verdict, f"{f['site']} {f['direction']}, step {f['step']}: {f['reason']}"


def _machine_lines(meta: Mapping[str, Any]) -> list[str]:
    machine = meta.get("machine") or {}
    if not machine:
        return []
    keys = ("torch", "cpu", "cpu_capability", "torch_threads", "cuda")
    if "differ" in machine:
        per_run = [
            f"{run}: " + ", ".join(f"{k} {f.get(k)}" for k in keys) for run, f in machine["differ"].items()
        ]
        return [
            "## What these numbers depend on",
            "",
            "**The runs trained on different machines or settings**, so each pair's deviation includes "
            "that difference as well as the one thing it isolates:",
            "",
            *(f"- {line}" for line in per_run),
            "",
        ]
    facts = ", ".join(f"{k} {machine.get(k)}" for k in keys)
    return [
        "## What these numbers depend on",
        "",
        f"{facts} (as the runs recorded them in run.json); deterministic algorithms. "
        "On a CPU the runs are bit-identical from one seed "
        "for a given torch build, CPU instruction set and thread count; another of these changes the last "
        "bits of every step, so the distances change a little (their ratios much less).",
        "",
    ]


def write_report(study_dir: str | Path) -> Path:
    """Write ``study_dir/report.md`` from ``study.json`` (and ``runs/*`` when present).

    Args:
        study_dir: a directory written by ``flashprobe study`` or ``flashprobe compare``.

    Returns:
        The path of ``report.md``.

    Raises:
        FileNotFoundError: no ``study.json`` in ``study_dir``.
        ValueError: a malformed ``study.json``.
    """
    study_dir = Path(study_dir)
    study = read_study(study_dir)
    meta = study.get("study") or {}
    v = verdict(study)
    precision = meta.get("precision", "?")
    lines = [
        "# flashprobe study: weight deviation of flash attention, like for like (paper §V)",
        "",
        "## Verdict",
        "",
    ]
    if v:
        lines += [f"- {line}" for line in verdict_lines(v, precision, meta.get("kernel", "sdpa_flash"))]
    else:
        lines.append(
            "No like-for-like `flash_vs_baseline` comparison here: the distances below carry no verdict."
        )
    lines += ["", "## What each comparison isolates", "", *_comparisons_table(study, v), ""]
    if meta.get("runs"):
        lines += ["## Runs", "", *_runs_table(study_dir, meta["runs"]), ""]
    figures = sorted(p.name for p in study_dir.glob("fig*.png"))
    if figures:
        lines += ["## Figures", "", *[f"![{f}]({f})" for f in figures], ""]
    lines += [
        "## Wasserstein distance over training (whole model)",
        "",
        *_steps_table(study["pairs"], "wasserstein"),
    ]
    lines += [
        "",
        "## Max |W_a − W_b| over training (whole model)",
        "",
        *_steps_table(study["pairs"], "max_abs"),
        "",
    ]
    lines += _probe_lines(study_dir, meta.get("runs") or {})
    lines += _machine_lines(meta)
    lines += [f"Regenerate with `flashprobe report {study_dir}`.", ""]
    out = study_dir / "report.md"
    atomic_write_text(out, "\n".join(lines))
    return out
