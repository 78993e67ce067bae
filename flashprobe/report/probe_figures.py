"""The per-site deviation plot of a probed training run, drawn from its ``probe.jsonl``.

One figure, three panels, each site (attention call site, e.g. ``model.blocks.0.attn``) its own
colour:

* **error ratio over steps**: ``max|primary − golden| / max|baseline − golden|`` of the forward
  output per logging interval (1 = as accurate as the baseline; the paper's flash kernel sat near
  1–2 at FP32/BF16). Backward ratios (``dq``, ``dk``, ``dv``, worst of the three) are dashed when
  the run probed the backward pass. With more than :data:`MAX_LINES` sites this panel is a
  sites × steps heat map instead.
* **max |primary − baseline| over steps** (log axis), what a user swapping kernels would see.
* **per site over the whole run**: the largest ``|primary − golden|`` and ``|baseline − golden|``
  (log axis), so a site where the kernel is worse than the baseline stands out.

Non-finite outputs (counted by the probe) are written into the title. The figure is rendered with
matplotlib's Agg canvas (no pyplot, no display) and written atomically.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from flashprobe.formats.probe_log import load_probe_records
from flashprobe.report.bench_figures import save_figure

__all__ = ["MAX_LINES", "plot_probe", "site_series"]

#: Above this many sites the error-ratio panel becomes a heat map (one colour per site up to here).
MAX_LINES = 10

_GRADS = ("dq", "dk", "dv")


def _num(x: Any) -> float:
    """A number of a decoded probe record as a float; ``None`` (not recorded) is NaN."""
    return math.nan if x is None or isinstance(x, bool) else float(x)


def site_series(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
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


def _short(name: str, width: int = 34) -> str:
    name = name.removeprefix("model.")
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def plot_probe(
    jsonl: str | os.PathLike[str], path: str | os.PathLike[str], *, title: str | None = None
) -> Path:
    """Draw the per-site deviation plot of ``jsonl`` (a ``probe.jsonl``) into ``path`` (PNG).

    Args:
        jsonl: the run's ``probe.jsonl``.
        path: the PNG to write.
        title: figure title (default: the run directory's name).

    Returns:
        ``path``.

    Raises:
        FileNotFoundError: no ``jsonl``.
        ValueError: ``jsonl`` has no record with per-site statistics.
    """
    jsonl = Path(jsonl)
    records = load_probe_records(jsonl)
    series = site_series(records)
    if not series:
        raise ValueError(f"{jsonl}: no per-site statistics to plot (did the probe see any attention call?)")
    steps = [int(r["step"]) for r in records]
    names = list(series)
    nonfinite = sum(int((r.get("summary") or {}).get("nonfinite") or 0) for r in records)
    # An infinite error ratio (the baseline matched golden exactly, the primary did not) is drawn at
    # the top of the axis with a triangle, so the worst points are not lost as gaps.
    ratios = [v for s in series.values() for k in ("error_ratio", "backward_error_ratio") for v in s[k]]
    cap = 1.5 * max((v for v in ratios if math.isfinite(v)), default=1.0)
    infinite = sum(v == math.inf for v in ratios)

    def capped(values: list[float]) -> list[float]:
        return [cap if v == math.inf else v for v in values]

    fig = Figure(figsize=(15, 4.8 if len(names) <= MAX_LINES else 4.8 + 0.12 * len(names)))
    ax_ratio, ax_pb, ax_site = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.2, 1.0, 1.0]})
    colours = [f"C{i % 10}" for i in range(len(names))]

    if len(names) <= MAX_LINES:
        for i, name in enumerate(names):
            forward, backward = series[name]["error_ratio"], series[name]["backward_error_ratio"]
            ax_ratio.plot(steps, capped(forward), "-", color=colours[i], label=_short(name))
            if not all(math.isnan(v) for v in backward):
                ax_ratio.plot(steps, capped(backward), "--", color=colours[i], alpha=0.6)
            for values in (forward, backward):
                top = [s for s, v in zip(steps, values, strict=True) if v == math.inf]
                ax_ratio.plot(top, [cap] * len(top), "^", color=colours[i], markersize=7)
        ax_ratio.axhline(1.0, color="0.4", linewidth=0.8)
        ax_ratio.set_xlabel("training step")
        ax_ratio.set_ylabel("error ratio  |primary − golden| / |baseline − golden|")
        has_backward = any(not all(math.isnan(v) for v in s["backward_error_ratio"]) for s in series.values())
        ax_ratio.set_title("forward error ratio per site" + (" (dashed: backward)" if has_backward else ""))
    else:
        grid = np.array([capped(series[n]["error_ratio"]) for n in names], dtype=float)
        x = np.asarray(steps, dtype=float)
        half = np.diff(x) / 2 if len(x) > 1 else np.array([])
        edges = np.concatenate(
            (
                [x[0] - (half[0] if len(half) else 0.5)],
                x[:-1] + half,
                [x[-1] + (half[-1] if len(half) else 0.5)],
            )
        )
        image = ax_ratio.pcolormesh(
            edges, np.arange(len(names) + 1) - 0.5, np.ma.masked_invalid(grid), cmap="viridis"
        )
        ax_ratio.set_yticks(range(len(names)), [_short(n) for n in names], fontsize=6)
        ax_ratio.invert_yaxis()
        ax_ratio.set_xlabel("training step")
        ax_ratio.set_title("forward error ratio per site")
        fig.colorbar(image, ax=ax_ratio, label="error ratio")

    for i, name in enumerate(names):
        values = [v if v > 0 else math.nan for v in series[name]["primary_baseline"]]
        ax_pb.plot(steps, values, color=colours[i], linewidth=1.0)
    ax_pb.set_yscale("log")
    ax_pb.set_xlabel("training step")
    ax_pb.set_ylabel("max |primary − baseline|")
    ax_pb.set_title("primary vs baseline, per site")

    def worst(name: str, pair: str) -> float:
        values = [v for v in series[name][pair] if math.isfinite(v)]
        return max(values) if values else math.nan

    y = np.arange(len(names))
    primary = [worst(n, "primary_golden") for n in names]
    baseline = [worst(n, "baseline_golden") for n in names]
    ax_site.barh(y - 0.2, primary, height=0.4, color="tab:red", label="primary vs golden")
    ax_site.barh(y + 0.2, baseline, height=0.4, color="tab:blue", label="baseline vs golden")
    ax_site.set_yticks(y, [_short(n) for n in names], fontsize=7 if len(names) <= MAX_LINES else 6)
    ax_site.invert_yaxis()
    if any(v > 0 for v in primary + baseline if not math.isnan(v)):
        ax_site.set_xscale("log")
    ax_site.set_xlabel("largest max |· − golden| over the run")
    ax_site.set_title("per site, whole run")
    ax_site.legend(fontsize=7, loc="lower right")
    if len(names) <= MAX_LINES:
        ax_ratio.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)

    head = title or jsonl.parent.name
    fig.suptitle(
        f"{head}: {len(names)} sites, {len(records)} logged intervals, steps {steps[0]}–{steps[-1]}, "
        f"{nonfinite} non-finite values"
        + (f", {infinite} infinite error ratios (▲ at the top)" if infinite else "")
    )
    fig.tight_layout()
    return save_figure(fig, path)
