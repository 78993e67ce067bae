"""Figures of weight deviation over training (paper §V, Figs 7 and 8), from ``study.json``.

Fig 7 (:func:`plot_pair_over_steps`): one pair's whole-model max difference and Wasserstein distance
over steps. Fig 8 (:func:`plot_wasserstein_curves`): every pair's Wasserstein curve on one log plot,
a comparison with several replicates as its median in a min–max band. Zero distances cannot sit on a
log axis: they are left out, with a note under the plot (or in the legend when a pair is all zero).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from flashprobe.formats.paths import safe_name
from flashprobe.report.bench_figures import save_figure

__all__ = [
    "fig7_pair",
    "pair_over_steps_figure",
    "plot_pair_over_steps",
    "plot_study_figures",
    "plot_wasserstein_curves",
    "wasserstein_curves_figure",
]

_ZERO_NOTE = "zero distances (identical weights) are not drawn on the log axis"


def _positive(steps: Sequence[int], values: Sequence[float | None]) -> tuple[list[int], list[float]]:
    pts = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None and v > 0]
    return [s for s, _ in pts], [v for _, v in pts]


def _all_zero(values: Sequence[float | None]) -> bool:
    return bool(values) and all(v == 0 for v in values)


def _describe(pair: Mapping[str, Any]) -> str:
    runs = pair.get("runs") or {}
    a, b = runs.get("a") or {}, runs.get("b") or {}
    keys = ("attention", "precision", "seed")
    diff = [f"{k} {a.get(k)} vs {b.get(k)}" for k in keys if a.get(k) != b.get(k)]
    return ", ".join(diff) if diff else "same attention, precision and seed"


def _curve(
    ax: Axes, steps: Sequence[int], values: Sequence[float | None], label: str, *, log: bool, **style: Any
) -> None:
    if log:
        xs, ys = _positive(steps, values)
        if _all_zero(values):
            label += " (0 at every step)"
    else:
        xs, ys = zip(*[(s, v) for s, v in zip(steps, values, strict=True) if v is not None], strict=True)
    ax.plot(xs, ys, marker="o", markersize=3, label=label, **style)


def _wide_range(values: Sequence[float | None]) -> bool:
    """Whether the positive values span more than two decades (then a log axis reads better)."""
    positive = [v for v in values if v is not None and v > 0]
    return bool(positive) and max(positive) > 100 * min(positive)


def pair_over_steps_figure(name: str, pair: Mapping[str, Any]) -> Figure:
    """Fig 7: max difference and Wasserstein distance over training steps of the pair ``name`` (its
    ``study.json`` record); a figure not attached to pyplot."""
    steps, model = pair["steps"], pair["model"]
    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, 2)
    panels = (("max_abs", "max |W_a − W_b|", "C3"), ("wasserstein", "Wasserstein-1 distance", "C0"))
    for ax, (key, label, color) in zip(axes, panels, strict=True):
        log = _wide_range(model[key])
        _curve(ax, steps, model[key], label, log=log, color=color)
        if log:
            ax.set_yscale("log")
            ax.text(0.5, -0.2, _ZERO_NOTE, transform=ax.transAxes, ha="center", fontsize=7, color="0.4")
        else:
            ax.set_ylim(bottom=0)
        ax.set(xlabel="training step", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"Fig 7: weight deviation over training, {name} ({_describe(pair)})", fontsize=10)
    return fig


def _band(
    pairs: Mapping[str, Mapping[str, Any]], names: Sequence[str]
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps where every one of ``names`` has a positive finite distance, with the median, min and max."""
    curves = [dict(zip(pairs[n]["steps"], pairs[n]["model"]["wasserstein"], strict=True)) for n in names]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    xs, mid, low, high = [], [], [], []
    for step in steps:
        values = [c[step] for c in curves]
        if all(v is not None and math.isfinite(v) and v > 0 for v in values):
            xs.append(step)
            mid.append(statistics.median(values))
            low.append(min(values))
            high.append(max(values))
    return xs, mid, low, high


def wasserstein_curves_figure(
    pairs: Mapping[str, Mapping[str, Any]], groups: Mapping[str, Sequence[str]] | None = None
) -> Figure:
    """Fig 8: the whole-model Wasserstein distance of every comparison over training steps, log scale.

    Args:
        pairs: pair name → its record from ``study.json``.
        groups: comparison name → its pairs at every replicate (default: each pair alone), drawn as
            their median in a min–max band.

    Returns:
        A matplotlib figure (not attached to pyplot).
    """
    groups = groups if groups is not None else {n: [n] for n in pairs}
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    zero: list[tuple[str, str]] = []  # comparisons at 0 at every step: drawn as a floor line below
    drawn: dict[tuple[Any, ...], str] = {}  # a curve's points → the first comparison drawn with them
    banded = 0
    for i, (name, members) in enumerate(groups.items()):
        color = f"C{i % 10}"
        if all(_all_zero(pairs[n]["model"]["wasserstein"]) for n in members):
            zero.append((name, color))
            continue
        style = {"linewidth": 2.5} if "flash" in name.lower() else {"linewidth": 1.3}
        if len(members) == 1:
            pair = pairs[members[0]]
            points: tuple[Any, ...] = (tuple(pair["steps"]), tuple(pair["model"]["wasserstein"]))
        else:
            band = _band(pairs, members)
            points = tuple(map(tuple, band))
        first = drawn.setdefault(points, name)
        label = name if len(members) == 1 else f"{name} ({len(members)} replicates)"
        if first != name:  # the same points as a curve already drawn: said, and drawn dashed on top
            label += f" — the same curve as {first} (they overlap)"
            style |= {"linestyle": "--"}
        if len(members) == 1:
            _curve(ax, pair["steps"], pair["model"]["wasserstein"], label, log=True, color=color, **style)
            continue
        xs, mid, low, high = band
        ax.fill_between(xs, low, high, color=color, alpha=0.18, linewidth=0)
        ax.plot(xs, mid, marker="o", markersize=3, color=color, label=label, **style)
        banded = max(banded, len(members))
    ax.set_yscale("log")
    if zero:
        if len(ax.get_lines()) == 0:
            ax.set_ylim(1e-12, 1.0)
        floor = ax.get_ylim()[0] / 2  # below every drawn value
        for name, color in zero:  # 0 has no place on a log axis: a dashed line below the data
            others = [n for n, _ in zero if n != name]
            label = f"{name}: 0 at every step (drawn low" + (
                f"; overlaps {', '.join(others)})" if others else ")"
            )
            ax.axhline(floor, color=color, linestyle="--", linewidth=2, label=label)
        ax.set_ylim(bottom=floor / 2)
    ax.set(xlabel="training step", ylabel="Wasserstein-1 distance of all weights")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    title = "Fig 8: weight deviation of each comparison over training"
    if banded:
        title += "\n(line: median over replicates; band: lowest to highest replicate)"
    ax.set_title(title, fontsize=10)
    fig.text(0.5, -0.02, _ZERO_NOTE, ha="center", fontsize=7, color="0.4")
    return fig


def plot_pair_over_steps(name: str, pair: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw Fig 7 (:func:`pair_over_steps_figure`) and save it atomically to ``path``; returns ``path``."""
    return save_figure(pair_over_steps_figure(name, pair), path, dpi=120)


def plot_wasserstein_curves(
    pairs: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike[str],
    groups: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Draw Fig 8 (:func:`wasserstein_curves_figure`) and save it atomically to ``path``; returns ``path``."""
    return save_figure(wasserstein_curves_figure(pairs, groups), path, dpi=120)


def fig7_pair(names: Sequence[str], wanted: str | None = None) -> str:
    """The pair drawn in Fig 7: ``wanted`` if given, else ``flash_vs_baseline``, else the first pair
    whose name contains ``flash``, else the first pair.

    Raises:
        ValueError: ``wanted`` is not one of ``names``.
    """
    if wanted is not None:
        if wanted not in names:
            raise ValueError(f"fig7 pair {wanted!r} is not one of the compared pairs {list(names)}")
        return wanted
    if "flash_vs_baseline" in names:
        return "flash_vs_baseline"
    return next((n for n in names if "flash" in n.lower()), names[0])


def plot_study_figures(
    pairs: Mapping[str, Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    *,
    fig7: str | None = None,
    groups: Mapping[str, Sequence[str]] | None = None,
) -> list[Path]:
    """Draw Fig 7 (of :func:`fig7_pair`) and Fig 8 of a study's pairs into ``out_dir``.

    Args:
        pairs: ``study.json``'s ``"pairs"``.
        out_dir: where ``fig7_<pair>.png`` and ``fig8_wasserstein.png`` go.
        fig7: the pair of Fig 7 (default: see :func:`fig7_pair`).
        groups: Fig 8's comparisons (:func:`flashprobe.report.study_verdict.comparison_groups`).

    Returns:
        The two paths; none when no pair has whole-model distances (``compare --no-model``).
    """
    if not any(pair["model"]["wasserstein"] for pair in pairs.values()):
        return []
    out = Path(out_dir)
    chosen = safe_name(fig7_pair(list(pairs), fig7), what="pair name")
    return [
        plot_pair_over_steps(chosen, pairs[chosen], out / f"fig7_{chosen}.png"),
        plot_wasserstein_curves(pairs, out / "fig8_wasserstein.png", groups),
    ]
