"""Figures of ``flashprobe bench fp8``: FP8 error vs N, D and inputs, and the P-cast collapse."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from flashprobe.report.bench_figures import _MARKERS, Row, _plot_series, _unique, save_figure

__all__ = ["plot_fp8_errors", "plot_fp8_pcast"]


def plot_fp8_errors(rows: Sequence[Row], path: Path | str) -> Path:
    """Relative L2 error against the FP64 golden value of the ``error`` rows, one line or bar group per
    variant: vs N, vs D and per input distribution; returns ``path``."""
    errors = [r for r in rows if r["part"] == "error"]
    variants = _unique([r["variant"] for r in errors])
    fig = Figure(figsize=(16, 5), layout="constrained")
    ax_n, ax_d, ax_dist = fig.subplots(1, 3)
    for ax, axis, key, label in (
        (ax_n, "seq_len", "seq_len", "N (sequence length)"),
        (ax_d, "head_dim", "head_dim", "D (head dim)"),
    ):
        for i, variant in enumerate(variants):
            series = sorted(
                (r for r in errors if r.get("axis") == axis and r["variant"] == variant), key=lambda r: r[key]
            )
            if series:
                _plot_series(
                    ax,
                    [r[key] for r in series],
                    series,
                    "rel_l2",
                    marker=_MARKERS[i % len(_MARKERS)],
                    color=f"C{i}",
                    label=variant,
                )
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel=label)
        ax.grid(True, which="major", alpha=0.3)
    ax_n.set(ylabel="‖out − golden‖ / ‖golden‖ (gaussian inputs)", title="error vs N (cf. paper Fig 5)")
    ax_d.set_title("error vs head dim")
    ax_n.legend(fontsize=7)
    dist_rows = [r for r in errors if r.get("axis") == "distribution"]
    dists = _unique([r["distribution"] for r in dist_rows])
    width = 0.8 / max(len(variants), 1)
    for i, variant in enumerate(variants):
        for j, dist in enumerate(dists):
            row = next((r for r in dist_rows if r["variant"] == variant and r["distribution"] == dist), None)
            if row is None or not row.get("rel_l2"):
                continue
            lo, hi = row.get("rel_l2_lo") or row["rel_l2"], row.get("rel_l2_hi") or row["rel_l2"]
            ax_dist.bar(
                j + (i - (len(variants) - 1) / 2) * width,
                row["rel_l2"],
                width,
                color=f"C{i}",
                yerr=[[row["rel_l2"] - lo], [hi - row["rel_l2"]]],
                capsize=2,
                label=variant if j == 0 else None,
            )
    ax_dist.set_xticks(range(len(dists)), [d.replace("_", "\n") for d in dists])
    ax_dist.set(yscale="log", title="error per input distribution (cf. paper Figs 3-4)")
    ax_dist.grid(True, axis="y", which="major", alpha=0.3)
    shape = next(iter(dist_rows or errors))
    fig.suptitle(
        f"flashprobe bench fp8: FP8 attention variants vs 16-bit flash and the bf16 baseline "
        f"(H={shape['heads']}, {shape['repeats']} seeds; FP8 emulated on {'CPU'})",
        fontsize=10,
    )
    return save_figure(fig, path)


def plot_fp8_pcast(rows: Sequence[Row], path: Path | str) -> Path:
    """The P-cast collapse of the ``pcast`` rows: P underflow (left) and output MSE (right) vs sink
    strength, one line per (order, S), forward solid and reverse dashed; returns ``path``."""
    pcast = [r for r in rows if r["part"] == "pcast"]
    scales = sorted(_unique([r["p_scale"] for r in pcast]))
    fig = Figure(figsize=(12, 5), layout="constrained")
    ax_u, ax_m = fig.subplots(1, 2)
    for i, s in enumerate(scales):
        for order, style in (("forward", "-"), ("reverse", "--")):
            series = sorted(
                (r for r in pcast if r["p_scale"] == s and r["order"] == order),
                key=lambda r: r["sink_strength"],
            )
            xs = [r["sink_strength"] for r in series]
            kw = {"color": f"C{i}", "linestyle": style, "marker": _MARKERS[i], "label": f"{order}, S={s:g}"}
            ax_u.plot(xs, [r["p_underflow"] for r in series], **kw)
            _plot_series(ax_m, xs, series, "mse", **kw)
    ax_u.set_ylabel("fraction of non-sink P that underflows to 0 in E4M3")
    ax_m.set(ylabel="MSE of the output vs FP64 golden", yscale="log")
    for ax in (ax_u, ax_m):
        ax.set_xlabel("sink strength (key 0's logit)")
        ax.grid(True, which="major", alpha=0.3)
    ax_u.set_title("P-cast underflow (arXiv 2606.06521)")
    ax_m.set_title("output error: forward vs reverse key order × S")
    ax_u.legend(fontsize=7)
    first = pcast[0] if pcast else {}
    fig.suptitle(
        f"flashprobe bench fp8: sink at key 0, only P cast to E4M3 (Q, K, V bf16), fa2 numerics; "
        f"N={first.get('seq_len')}, D={first.get('head_dim')}, {first.get('repeats')} seeds",
        fontsize=10,
    )
    return save_figure(fig, path)
