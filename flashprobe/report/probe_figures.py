"""The per-site deviation plot of a probed training run, drawn from its ``probe.jsonl``.

Three panels, one colour per site (named as in ``probe.jsonl``): the forward error ratio over steps
(backward ratios dashed; a sites × steps heat map beyond :data:`MAX_LINES` sites), ``max |primary −
baseline|`` over steps, and per site the largest ``|primary − golden|`` and ``|baseline − golden|``
over the run as two joined dots. Non-finite outputs and the run's signed bias go in the title.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter

from flashprobe.formats.paths import printable
from flashprobe.formats.probe_log import load_probe_records, record_summary
from flashprobe.probing.summary import bias_words
from flashprobe.report.bench_figures import save_figure

__all__ = ["MAX_LINES", "plot_probe", "site_series"]

#: Above this many sites the error-ratio panel becomes a heat map (one colour per site up to here).
MAX_LINES = 10

_GRADS = ("dq", "dk", "dv")

#: site → quantity → one value per record (:func:`site_series`).
Series = dict[str, dict[str, list[float]]]


def _num(x: Any) -> float:
    """A number of a decoded probe record as a float; ``None`` (not recorded) is NaN."""
    return math.nan if x is None or isinstance(x, bool) else float(x)


def site_series(records: Sequence[Mapping[str, Any]]) -> Series:
    """Per site, per quantity, one value per record (NaN where the site was not probed).

    Quantities: ``error_ratio`` (forward), ``backward_error_ratio`` (worst of dq, dk, dv),
    ``primary_baseline``, ``primary_golden`` and ``baseline_golden`` (forward ``max_abs``).
    """
    names = sorted({name for r in records for name in (r.get("sites") or {})})
    keys = ("error_ratio", "backward_error_ratio", "primary_baseline", "primary_golden", "baseline_golden")
    out = {name: {k: [] for k in keys} for name in names}
    for record in records:
        sites = record.get("sites") or {}
        for name in names:
            site = sites.get(name) or {}
            fwd = site.get("forward") or {}
            pairs = fwd.get("out") or {}
            bwd = site.get("backward") or {}
            back = [_num((bwd.get(g) or {}).get("error_ratio")) for g in _GRADS]
            back = [b for b in back if not math.isnan(b)]
            series = out[name]
            series["error_ratio"].append(_num(pairs.get("error_ratio")))
            series["backward_error_ratio"].append(max(back) if back else math.nan)
            for pair in ("primary_baseline", "primary_golden", "baseline_golden"):
                series[pair].append(_num((pairs.get(pair) or {}).get("max_abs")))
    return out


def _short(name: str, width: int = 56) -> str:
    """The site name as in probe.jsonl, its middle elided when longer than ``width``."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "…" + name[-(width - 1 - head) :]


def _label_size(sites: int) -> float:
    """Tick-label font size for ``sites`` labels on one axis of the figure's height."""
    return 7.0 if sites <= MAX_LINES else 6.0


def _capped(values: Sequence[float], cap: float) -> list[float]:
    """Infinite ratios drawn at ``cap`` (the top of the axis)."""
    return [cap if v == math.inf else v for v in values]


def _ratio_lines(ax: Axes, steps: list[int], series: Series, cap: float) -> None:
    """The error ratio of each site over steps, one colour per site; backward ratios dashed."""
    for i, (name, s) in enumerate(series.items()):
        colour = f"C{i % 10}"
        forward, backward = s["error_ratio"], s["backward_error_ratio"]
        ax.plot(steps, _capped(forward, cap), "-", color=colour, label=_short(name))
        if not all(math.isnan(v) for v in backward):
            ax.plot(steps, _capped(backward, cap), "--", color=colour, alpha=0.6)
        for values in (forward, backward):
            top = [step for step, v in zip(steps, values, strict=True) if v == math.inf]
            ax.plot(top, [cap] * len(top), "^", color=colour, markersize=7)
    ax.axhline(1.0, color="0.4", linewidth=0.8)
    ax.set(xlabel="training step", ylabel="error ratio  |primary − golden| / |baseline − golden|")
    has_backward = any(not all(math.isnan(v) for v in s["backward_error_ratio"]) for s in series.values())
    ax.set_title("forward error ratio per site" + (" (dashed: backward)" if has_backward else ""))
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)


def _ratio_heatmap(fig: Figure, ax: Axes, steps: list[int], series: Series, cap: float) -> None:
    """The forward error ratio as a sites × steps heat map (many sites)."""
    names = list(series)
    grid = np.array([_capped(series[n]["error_ratio"], cap) for n in names], dtype=float)
    x = np.asarray(steps, dtype=float)
    half = np.diff(x) / 2 if len(x) > 1 else np.array([])
    edges = np.concatenate(
        (
            [x[0] - (half[0] if len(half) else 0.5)],
            x[:-1] + half,
            [x[-1] + (half[-1] if len(half) else 0.5)],
        )
    )
    image = ax.pcolormesh(edges, np.arange(len(names) + 1) - 0.5, np.ma.masked_invalid(grid), cmap="viridis")
    ax.set_yticks(range(len(names)), [_short(n) for n in names], fontsize=_label_size(len(names)))
    ax.invert_yaxis()
    ax.set(xlabel="training step", title="forward error ratio per site")
    fig.colorbar(image, ax=ax, label="error ratio")


def _primary_baseline_panel(ax: Axes, steps: list[int], series: Series) -> None:
    """max |primary − baseline| of each site over steps, log axis."""
    for i, s in enumerate(series.values()):
        values = [v if v > 0 else math.nan for v in s["primary_baseline"]]
        ax.plot(steps, values, color=f"C{i % 10}", linewidth=1.0)
    ax.set(yscale="log", xlabel="training step", ylabel="max |primary − baseline|")
    ax.set_title("primary vs baseline, per site")


def _per_site_panel(ax: Axes, series: Series) -> None:
    """Per site, the largest |primary − golden| and |baseline − golden| over the run."""

    def worst(values: list[float]) -> float:
        finite = [v for v in values if math.isfinite(v)]
        return max(finite) if finite else math.nan

    names = list(series)
    y = np.arange(len(names))
    primary = [worst(series[n]["primary_golden"]) for n in names]
    baseline = [worst(series[n]["baseline_golden"]) for n in names]
    log = any(v > 0 for v in primary + baseline if not math.isnan(v))
    # Dots, not bars: on a log axis a bar's length depends on where the axis starts.
    shown_p = [v if v > 0 or not log else math.nan for v in primary]
    shown_b = [v if v > 0 or not log else math.nan for v in baseline]
    ax.hlines(y, shown_p, shown_b, color="0.75", linewidth=1.0, zorder=1)
    ax.plot(shown_p, y, "o", color="tab:red", markersize=5, label="primary vs golden", zorder=2)
    ax.plot(shown_b, y, "s", color="tab:blue", markersize=4, label="baseline vs golden", zorder=2)
    ax.set_yticks(y, [_short(n) for n in names], fontsize=_label_size(len(names)))
    ax.set_ylim(len(names) - 0.5, -0.5)
    if log:
        ax.set_xscale("log")
        ax.margins(x=0.15)
        # Labelled ticks at 1, 2, 5 per decade, no labelled minor ticks: never overlapping.
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=8))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelsize=7)
    ax.grid(axis="x", which="major", color="0.9", linewidth=0.6)
    ax.set(xlabel="largest max |· − golden| over the run", title="per site, whole run")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)


def plot_probe(
    jsonl: str | os.PathLike[str], path: str | os.PathLike[str], *, title: str | None = None
) -> Path:
    """Draw the per-site deviation plot of a run's ``probe.jsonl`` into ``path`` (PNG); returns ``path``.

    ``title`` defaults to the run directory's name.

    Raises:
        FileNotFoundError: no ``jsonl``.
        ValueError: ``jsonl`` has no record with per-site statistics, or a record's summary is not a
            probe summary.
    """
    jsonl = Path(jsonl)
    records = load_probe_records(jsonl)
    series = site_series(records)
    if not series:
        raise ValueError(f"{jsonl}: no per-site statistics to plot (did the probe see any attention call?)")
    summaries = [record_summary(r) for r in records]
    steps = [s.step for s in summaries]
    nonfinite = sum(s.nonfinite for s in summaries)
    # An infinite error ratio (the baseline matched golden exactly, the primary did not) is drawn at
    # the top of the axis with a triangle, so the worst points are not lost as gaps.
    ratios = [v for s in series.values() for k in ("error_ratio", "backward_error_ratio") for v in s[k]]
    cap = 1.5 * max((v for v in ratios if math.isfinite(v)), default=1.0)
    infinite = sum(v == math.inf for v in ratios)

    many = len(series) > MAX_LINES
    # Tall enough for one readable label per site (the per-site panel lists every site).
    fig = Figure(figsize=(17, max(4.8, 1.8 + 0.24 * len(series))))
    ax_ratio, ax_pb, ax_site = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.2, 1.0, 1.0]})
    if many:
        _ratio_heatmap(fig, ax_ratio, steps, series, cap)
    else:
        _ratio_lines(ax_ratio, steps, series, cap)
    _primary_baseline_panel(ax_pb, steps, series)
    _per_site_panel(ax_site, series)
    head = title or printable(jsonl.parent.name)  # (a name whose bytes are not UTF-8: shown escaped)
    last = summaries[-1]
    firsts = last.first_failures
    for f in firsts:  # each first failure: a red line at its step
        ax_ratio.axvline(f.step, color="red", linewidth=1.0, linestyle="--", alpha=0.7)
    verdict_text = f"verdict {last.verdict.upper()}"
    if firsts:
        f = firsts[0]
        verdict_text += f" (first: {f.site} {f.direction} at step {f.step}; red lines: first failures)"
    bias = bias_words(last)
    if bias:
        verdict_text += f"; {bias}"
    fig.suptitle(
        f"{head}: {len(series)} sites, {len(records)} logged intervals, steps {steps[0]}–{steps[-1]}, "
        f"{nonfinite} non-finite values"
        + (f", {infinite} infinite error ratios (▲ at the top)" if infinite else "")
        + (f"\n{verdict_text}" if verdict_text else "")
    )
    fig.tight_layout()
    return save_figure(fig, path)
