"""Figures of the ``flashprobe bench`` commands, one PNG per paper figure.

Each ``plot_*`` takes the rows a bench command wrote and saves one PNG atomically (matplotlib's
object-oriented API on the Agg canvas). Deviation axes are logarithmic; a zero deviation is drawn as
a hollow marker on the bottom edge, labelled "= 0".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from flashprobe.formats.atomic import atomic_write

__all__ = [
    "plot_overhead",
    "plot_paper_tiles",
    "plot_precision",
    "plot_seqlen",
    "plot_speed",
    "plot_tiles",
    "save_figure",
]

Row = Mapping[str, Any]

#: Explicit mantissa bits of each dtype, the x axis of paper Fig 3.
MANTISSA_BITS = {"bf16": 7, "fp16": 10, "fp32": 23, "fp64": 52}
_DTYPE_COLORS = {"bf16": "tab:red", "fp16": "tab:orange", "fp32": "tab:blue", "fp64": "tab:green"}
_MARKERS = "osD^v<>ph*"
_STYLES = ("-", "--", ":", "-.")
_UNITS = "absolute, in units of v"


def save_figure(fig: Figure, path: Path | str, *, dpi: int = 130) -> Path:
    """Save ``fig`` at ``path`` atomically (temporary file + ``os.replace``), in the format its
    suffix names (``.png``, ``.pdf``, ``.svg``, ...; PNG without a suffix)."""
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "png"
    FigureCanvasAgg(fig)
    atomic_write(path, lambda fh: fig.savefig(fh, format=fmt, dpi=dpi, bbox_inches="tight"), binary=True)
    return path


def _unique(values: Sequence[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _dtypes(rows: Sequence[Row]) -> list[str]:
    return sorted(_unique([r["dtype"] for r in rows]), key=lambda d: MANTISSA_BITS.get(d, 99))


def _color(dtype: str, i: int) -> str:
    return _DTYPE_COLORS.get(dtype, f"C{i}")


def _finite_pos(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _yerr(row: Row, key: str) -> tuple[float, float]:
    """The error bar of ``row[key]``: its distances down to ``{key}_lo`` and up to ``{key}_hi`` (0 where
    an end is missing, zero or not finite)."""

    def end(value: Any) -> float:
        return value if isinstance(value, int | float) and math.isfinite(value) and value else y

    y = row[key]
    return max(y - end(row.get(f"{key}_lo")), 0.0), max(end(row.get(f"{key}_hi")) - y, 0.0)


def _plot_series(
    ax: Axes,
    xs: Sequence[float],
    rows: Sequence[Row],
    key: str,
    *,
    spread: bool = True,
    **style: Any,
) -> None:
    """Plot ``rows[i][key]`` against ``xs`` on a log-y axis, with min/max error bars; zeros are
    drawn as hollow markers on the bottom edge."""
    pts = [(x, r) for x, r in zip(xs, rows, strict=True) if _finite_pos(r.get(key))]
    if pts:
        px = [x for x, _ in pts]
        py = [r[key] for _, r in pts]
        if spread and all(f"{key}_lo" in r for _, r in pts):
            yerr = list(zip(*(_yerr(r, key) for _, r in pts), strict=True))  # (2, len(pts))
            ax.errorbar(px, py, yerr=yerr, capsize=3, **style)
        else:
            ax.plot(px, py, **style)
    zeros = [x for x, r in zip(xs, rows, strict=True) if r.get(key) == 0]
    if zeros:
        ax.plot(
            zeros,
            [0.0] * len(zeros),
            linestyle="none",
            marker=style.get("marker", "o"),
            markerfacecolor="none",
            color=style.get("color"),
            clip_on=False,
            transform=ax.get_xaxis_transform(),
            label=f"{style.get('label', key)} = 0" if style.get("label") else None,
        )


def plot_precision(rows: Sequence[Row], path: Path | str) -> Path:
    """Paper Figs 3 and 4 from ``flashprobe bench precision`` rows; returns ``path``.

    Left (Fig 3): max and mean ``|primary − baseline|`` per dtype, ordered by mantissa bits. Right
    (Fig 4): max deviation from the FP64 golden value of the baseline and of each primary, with the
    error ratio above each primary's bar.
    """
    dtypes = _dtypes(rows)
    kernels = _unique([r["kernel"] for r in rows])
    fig = Figure(figsize=(13, 5), layout="constrained")
    ax3, ax4 = fig.subplots(1, 2)
    xs = list(range(len(dtypes)))
    labels = [f"{d}\n({MANTISSA_BITS[d]} bits)" if d in MANTISSA_BITS else d for d in dtypes]
    _fig3(ax3, rows, dtypes, kernels)
    _fig4(ax4, rows, dtypes, kernels)
    for ax in (ax3, ax4):
        ax.set_yscale("log")
        ax.set_xticks(xs, labels)
    ax3.set(xlabel="input dtype (explicit mantissa bits)", ylabel=f"|primary − baseline| ({_UNITS})")
    ax3.set_title("Fig 3: primary vs baseline at the same precision\n(solid: max, dashed: mean)")
    ax3.grid(True, which="major", alpha=0.3)
    ax3.legend(fontsize=8)
    ax4.set_xlabel("input dtype (0: identical to the golden value)")
    ax4.set_ylabel(f"max |output − FP64 golden| ({_UNITS})")
    ax4.set_title("Fig 4: deviation from the FP64 golden value\n(×: error ratio primary/baseline)")
    ax4.grid(True, axis="y", which="major", alpha=0.3)
    ax4.legend(fontsize=8)
    _caption(fig, rows)
    return save_figure(fig, path)


def _fig3(ax: Axes, rows: Sequence[Row], dtypes: Sequence[str], kernels: Sequence[str]) -> None:
    """Max (solid) and mean (dashed) ``|primary − baseline|`` of each kernel at x = dtype index."""
    for i, kernel in enumerate(kernels):
        by_dtype = {r["dtype"]: r for r in rows if r["kernel"] == kernel}
        present = [(x, by_dtype[d]) for x, d in enumerate(dtypes) if d in by_dtype]
        px, prow = [x for x, _ in present], [r for _, r in present]
        color = f"C{i}"
        _plot_series(ax, px, prow, "primary_baseline_max_abs", color=color, marker="o", label=kernel)
        _plot_series(ax, px, prow, "primary_baseline_mean_abs", color=color, marker="s", linestyle="--")


def _fig4(ax: Axes, rows: Sequence[Row], dtypes: Sequence[str], kernels: Sequence[str]) -> None:
    """Bars of the max deviation from golden: the baseline's, then each kernel's with its error ratio."""
    baseline = rows[0].get("baseline", "baseline")
    series = [(f"baseline ({baseline})", "baseline_golden_max_abs", None)]
    series += [(kernel, "primary_golden_max_abs", kernel) for kernel in kernels]
    width = 0.8 / len(series)
    for j, (label, key, kernel) in enumerate(series):
        legend_label: str | None = label
        for x, dtype in enumerate(dtypes):
            match = [r for r in rows if r["dtype"] == dtype and (kernel is None or r["kernel"] == kernel)]
            bx = x - 0.4 + width * (j + 0.5)
            if match and match[0][key] == 0:
                ax.annotate("0", (bx, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom")
            if not match or not _finite_pos(match[0][key]):
                continue
            row = match[0]
            err = [[row[key] - row[f"{key}_lo"]], [row[f"{key}_hi"] - row[key]]]
            color = "0.6" if kernel is None else f"C{kernels.index(kernel)}"
            ax.bar(bx, row[key], width, yerr=err, capsize=2, color=color, label=legend_label)
            legend_label = None
            ratio = row.get("error_ratio")
            if kernel is not None and isinstance(ratio, int | float) and math.isfinite(ratio):
                ax.annotate(
                    f"×{ratio:.2g}",
                    (bx, row[f"{key}_hi"]),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                )


def _caption(fig: Figure, rows: Sequence[Row], extra: str = "") -> None:
    r = rows[0]
    lengths = _unique([row.get("seq_len") for row in rows])
    parts = [
        f"B={r.get('batch')} H={r.get('heads')} D={r.get('head_dim')}"
        + (f" N={lengths[0]}" if len(lengths) == 1 else ""),
        f"inputs: {r.get('distribution', 'normal')} ×{r.get('input_scale', 1)}",
        f"baseline: {r.get('baseline', '?')}",
        f"{r.get('repeats', 1)} seeds (median, bars: min–max)",
    ]
    if extra:
        parts.insert(1, extra)
    fig.text(0.5, -0.02, " · ".join(parts), ha="center", va="top", fontsize=8, color="0.3")


def plot_seqlen(rows: Sequence[Row], path: Path | str) -> Path:
    """Paper Fig 5 from ``flashprobe bench seqlen`` rows: deviation vs sequence length.

    Panels: max ``|primary − baseline|``; the relative L2 error against golden divided by its value
    at the smallest N (outputs shrink as N grows); max deviation from golden; the error ratio. The
    baseline is dashed; colour tells dtypes apart (kernels, with one dtype), markers kernels.
    """
    dtypes = _dtypes(rows)
    kernels = _unique([r["kernel"] for r in rows])
    fig = Figure(figsize=(13, 9), layout="constrained")
    axes = fig.subplots(2, 2)
    for i, dtype in enumerate(dtypes):
        for j, kernel in enumerate(kernels):
            sel = sorted((r for r in rows if r["dtype"] == dtype and r["kernel"] == kernel), key=_n)
            if not sel:
                continue
            name = dtype if len(kernels) == 1 else f"{kernel} {dtype}"
            color = _color(dtype, i) if len(dtypes) > 1 else f"C{j}"
            style = {"color": color, "marker": _MARKERS[j % len(_MARKERS)], "label": name}
            baseline_color = color if len(dtypes) > 1 else "0.35"
            _seqlen_series(axes, sel, style, dtype=dtype, baseline_color=baseline_color if j == 0 else None)
    _seqlen_axes(axes, rows)
    _caption(fig, rows, f"kernels: {', '.join(kernels)}")
    return save_figure(fig, path)


def _seqlen_series(
    axes: Any, sel: Sequence[Row], style: dict[str, Any], *, dtype: str, baseline_color: str | None
) -> None:
    """One (kernel, dtype) on the panels of :func:`plot_seqlen`; with ``baseline_color`` the baseline too."""
    (ax_pb, ax_rel), (ax_g, ax_r) = axes
    xs = [_n(r) for r in sel]
    _plot_series(ax_pb, xs, sel, "primary_baseline_max_abs", **style)
    _plot_growth(ax_rel, xs, sel, "primary_golden_rel_l2", **style)
    base_style = {"color": baseline_color, "marker": "x", "linestyle": "--", "label": f"baseline {dtype}"}
    if baseline_color is not None:
        _plot_growth(ax_rel, xs, sel, "baseline_golden_rel_l2", **{**style, **base_style})
    _plot_series(ax_g, xs, sel, "primary_golden_max_abs", **style)
    if baseline_color is not None:
        _plot_series(ax_g, xs, sel, "baseline_golden_max_abs", spread=False, **base_style)
    ratio = [(x, r["error_ratio"]) for x, r in zip(xs, sel, strict=True) if _finite_pos(r["error_ratio"])]
    if ratio:
        ax_r.plot(*zip(*ratio, strict=True), **style)


def _seqlen_axes(axes: Any, rows: Sequence[Row]) -> None:
    """Scales, ticks, labels and legends of the four panels of :func:`plot_seqlen`."""
    (ax_pb, ax_rel), (ax_g, ax_r) = axes
    for ax in (ax_pb, ax_rel, ax_g, ax_r):
        _n_panel(ax, rows, legend_size=7)
    if not ax_rel.lines:
        ax_rel.text(0.5, 0.5, "no rel_l2 in these rows", transform=ax_rel.transAxes, ha="center")
    ax_rel.axhline(1.0, color="0.5", linewidth=0.8)
    if max((y for line in ax_rel.lines for y in line.get_ydata()), default=1.0) > 10:
        ax_rel.set_yscale("log")
    ax_pb.set(yscale="log", ylabel=f"max |primary − baseline| ({_UNITS})")
    ax_pb.set_title("Fig 5: primary vs baseline, max")
    ax_rel.set_ylabel("‖out − golden‖₂ / ‖golden‖₂, ÷ its value at the smallest N")
    ax_rel.set_title("growth of the relative error: primary (solid), baseline (dashed)")
    ax_g.set(yscale="log", ylabel=f"max |output − FP64 golden| ({_UNITS})")
    ax_g.set_title("vs golden: primary (solid), baseline (dashed)")
    ax_r.axhline(1.0, color="0.5", linewidth=0.8)
    ratios = [y for line in ax_r.lines for y in line.get_ydata() if _finite_pos(y)]
    if ratios and max(ratios) / min(ratios) > 10:
        ax_r.set_yscale("log")
    ax_r.set(ylabel="error ratio  max|p−g| / max|b−g|", title="error ratio (FP64 omitted: baseline = golden)")


def _plot_growth(ax: Axes, xs: Sequence[int], rows: Sequence[Row], key: str, **style: Any) -> None:
    """Plot ``rows[i][key] / rows[0][key]`` (growth relative to the first point), if defined."""
    if not rows or key not in rows[0] or not _finite_pos(rows[0][key]):
        return
    first = rows[0][key]
    pts = [(x, r[key] / first) for x, r in zip(xs, rows, strict=True) if _finite_pos(r.get(key))]
    ax.plot(*zip(*pts, strict=True), **style)


def _n(row: Row) -> int:
    return int(row["seq_len"])


def _n_panel(ax: Axes, rows: Sequence[Row], *, legend_size: int) -> None:
    """A panel against the sequence length: log-2 x axis ticked at the swept values, grid, legend."""
    ax.set_xscale("log", base=2)
    ticks = sorted({_n(r) for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("sequence length N")
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend_size)


def plot_tiles(rows: Sequence[Row], path: Path | str) -> Path:
    """Paper Fig 6 from ``flashprobe bench tiles`` rows: max ``|primary − baseline|`` vs block area
    Br·Bc, one panel per dtype and one line per variant."""
    dtypes = _dtypes(rows)
    variants = _unique([r["variant"] for r in rows])
    ncols = min(len(dtypes), 2)
    nrows = math.ceil(len(dtypes) / ncols)
    fig = Figure(figsize=(6.5 * ncols, 4.5 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, dtype in zip(axes, dtypes, strict=False):
        for j, variant in enumerate(variants):
            sel = sorted(
                (r for r in rows if r["dtype"] == dtype and r["variant"] == variant),
                key=lambda r: (r["block_area"], r["block_k"]),
            )
            if not sel:
                continue
            _plot_series(
                ax,
                [r["block_area"] for r in sel],
                sel,
                "primary_baseline_max_abs",
                color=f"C{j}",
                marker=_MARKERS[j % len(_MARKERS)],
                markersize=max(9 - 2 * j, 3),
                linestyle=_STYLES[j % len(_STYLES)],
                label=variant,
            )
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="block area Br·Bc (score elements per tile)")
        ax.set(ylabel=f"max |primary − baseline| ({_UNITS})", title=f"Fig 6 at {dtype}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(dtypes) :]:
        ax.set_visible(False)
    _caption(fig, rows, "Bc=⌈M/4d⌉, Br=min(Bc, d) over SRAM sizes M")
    return save_figure(fig, path)


def plot_paper_tiles(rows: Sequence[Row], path: Path | str) -> Path:
    """Paper Fig 6 from the tiles sweep of ``flashprobe bench paper``; returns ``path``.

    Left (F6c, F6a as tile shape): max ``|primary − baseline|`` against the SRAM size M, per preset
    and with Br ↔ Bc swapped. Middle (F6a as order): key tiles forward, reversed and shuffled. Right
    (F6b): a square tile against a non-square one of the same Bc. Medians with min–max error bars.
    """
    fig = Figure(figsize=(15, 4.8), layout="constrained")
    ax_m, ax_order, ax_square = fig.subplots(1, 3, width_ratios=[1.6, 1, 1])
    key = "primary_baseline_max_abs"
    series = [("paper", "default", "C3", "o", "-"), ("paper", "swapped", "C1", "s", "--")]
    series += [("fa2", "default", "C0", "D", "-")]
    for role, variant, color, marker, style in series:
        sel = sorted((r for r in rows if r.get("role") == role and r.get("variant") == variant), key=_sram)
        sel = [r for r in sel if r.get("sram") is not None]
        if sel:
            label = f"{role} preset" + (", Br↔Bc swapped" if variant == "swapped" else "")
            _plot_series(
                ax_m,
                [_sram(r) for r in sel],
                sel,
                key,
                color=color,
                marker=marker,
                linestyle=style,
                label=label,
            )
    defaults = [r for r in rows if r.get("variant") == "default" and r.get("sram") is not None]
    bcs = {_sram(r): r["block_k"] for r in defaults}
    srams = sorted(bcs)
    ax_m.set_xscale("log", base=2)
    ax_m.set_xticks(srams, [f"{m}\nBc={bcs.get(m, '?')}" for m in srams], fontsize=7)
    ax_m.minorticks_off()
    ax_m.set(yscale="log", xlabel="SRAM size M (elements); Bc = ⌈M/4d⌉, Br = min(Bc, d)")
    ax_m.set_ylabel(f"max |primary − baseline| ({_UNITS})")
    ax_m.set_title("F6c: larger tiles, smaller deviation?\nF6a (tile shape): Br and Bc swapped")
    ax_m.grid(True, which="major", alpha=0.3)
    ax_m.legend(fontsize=8)
    orders = [(role, order) for role in ("paper", "fa2") for order in ("forward", "reverse", "shuffle")]
    order_rows = {(r.get("role"), r.get("order")): r for r in rows if _is_order_row(r, rows)}
    _bars(ax_order, [(f"{role}\n{order}", order_rows.get((role, order))) for role, order in orders], key)
    ax_order.set_title("F6a (block order): key tiles consumed\nforward, reversed or shuffled")
    pairs = [(role, variant) for role in ("paper", "fa2") for variant in ("square", "narrow")]
    shape_rows = {
        (r.get("role"), r.get("variant")): r for r in rows if r.get("variant") in ("square", "narrow")
    }
    labelled = []
    for role, variant in pairs:
        row = shape_rows.get((role, variant))
        tile = f"{row['block_q']}×{row['block_k']}" if row else "?"
        labelled.append((f"{role}\n{tile}", row))
    _bars(ax_square, labelled, key)
    ax_square.set_title("F6b: square vs non-square tile\nof the same Bc (Br×Bc, loop over query tiles)")
    for ax in (ax_order, ax_square):
        ax.set(yscale="log", ylabel=f"max |primary − baseline| ({_UNITS})")
        ax.grid(True, axis="y", which="major", alpha=0.3)
    _caption(fig, rows, "bf16")
    return save_figure(fig, path)


def _sram(row: Row) -> int:
    return int(row.get("sram") or 0)


def _is_order_row(row: Row, rows: Sequence[Row]) -> bool:
    """Whether ``row`` is one of the key-tile order runs: the SRAM size where the order variants ran."""
    srams = {r.get("sram") for r in rows if r.get("variant") in ("reverse", "shuffle", "forward")}
    return row.get("sram") in srams and row.get("variant") in ("default", "reverse", "shuffle", "forward")


def _bars(ax: Axes, labelled: Sequence[tuple[str, Row | None]], key: str) -> None:
    """One bar per ``(label, row)`` with min–max error bars; missing rows are left empty."""
    for x, (_, row) in enumerate(labelled):
        if row is None or not _finite_pos(row.get(key)):
            continue
        y, (lo, hi) = row[key], _yerr(row, key)
        color = "C3" if row.get("role") == "paper" else "C0"
        ax.bar(x, y, 0.7, yerr=[[lo], [hi]], capsize=3, color=color)
        ax.annotate(f"{y:.2g}", (x, y), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=7)
    ax.set_xticks(range(len(labelled)), [label for label, _ in labelled], fontsize=8)


def plot_speed(rows: Sequence[Row], path: Path | str, skipped: Sequence[Row] = ()) -> Path:
    """Time and peak memory of each kernel vs sequence length, from ``flashprobe bench speed`` rows;
    the ``skipped`` runs are listed under the plot."""
    series = _unique([(r["kernel"], r["dtype"]) for r in rows])
    dtypes = _unique([r["dtype"] for r in rows])
    fig = Figure(figsize=(13, 5), layout="constrained")
    ax_t, ax_m = fig.subplots(1, 2)
    for j, (kernel, dtype) in enumerate(series):
        sel = sorted((r for r in rows if r["kernel"] == kernel and r["dtype"] == dtype), key=_n)
        name = kernel if len(dtypes) == 1 else f"{kernel} {dtype}"
        style = {"color": f"C{j}", "marker": _MARKERS[j % len(_MARKERS)], "label": name}
        _plot_series(ax_t, [_n(r) for r in sel], sel, "ms", **style)
        mem = [r for r in sel if _finite_pos(r.get("peak_mb"))]
        if mem:
            ax_m.plot([_n(r) for r in mem], [r["peak_mb"] for r in mem], **style)
    for ax in (ax_t, ax_m):
        ax.set_yscale("log")
        _n_panel(ax, rows, legend_size=8)
    if not ax_m.lines:
        ax_m.text(0.5, 0.5, "peak memory not measured", transform=ax_m.transAxes, ha="center")
    ax_t.set(ylabel="forward time per call (ms, median; bars: min–max)", title="time")
    ax_m.set_ylabel("peak extra memory of one call (MB)")
    ax_m.set_title("peak memory (resident set growth, fresh process)")
    notes = [f"{s['kernel']} {s['dtype']} N={s['seq_len']} skipped: {s['reason']}" for s in skipped]
    r = rows[0]
    text = f"B={r.get('batch')} H={r.get('heads')} D={r.get('head_dim')} · device {r.get('device', 'cpu')}"
    fig.text(0.5, -0.02, "\n".join([text, *notes]), ha="center", va="top", fontsize=8, color="0.3")
    return save_figure(fig, path)


def plot_overhead(rows: Sequence[Row], path: Path | str, subtitle: str = "") -> Path:
    """Median training-step time per mode (one bar each, with its ratios), from ``flashprobe bench
    overhead`` rows, under a title with ``subtitle`` (the run's settings); returns ``path``."""
    labels = [row["mode"] for row in rows]
    values = [row["step_ms"] for row in rows]
    fig = Figure(figsize=(7.5, 3.2), layout="tight")
    ax = fig.subplots()
    colors = ["#9e9e9e", "#f4a259", "#2e86ab", "#5fb49c"]
    bars = ax.barh(labels[::-1], values[::-1], color=colors[: len(rows)][::-1])
    for bar, row in zip(bars, rows[::-1], strict=True):
        text = (
            f" {row['step_ms']:.0f} ms  ×{row['ratio_vs_no_probe']:.2f} vs no probe, "
            f"×{row['ratio_vs_control']:.2f} vs control"
        )
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
    ax.set_xlabel("median training step time (ms)")
    ax.set_xlim(0, max(values) * 1.9)
    ax.set_title("flashprobe bench overhead" + (f"\n{subtitle}" if subtitle else ""), fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    return save_figure(fig, path)
