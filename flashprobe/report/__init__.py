"""Figures and reports drawn from flashprobe's results (matplotlib, Agg canvas, no display needed)."""

from flashprobe.report.bench_figures import plot_precision, plot_seqlen, plot_speed, plot_tiles, save_figure

__all__ = ["plot_precision", "plot_seqlen", "plot_speed", "plot_tiles", "save_figure"]
