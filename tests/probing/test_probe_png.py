"""probe.png reads like probe.jsonl: the same site names, honest distances, readable labels."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from flashprobe.probing.summary import summarize
from flashprobe.report import probe_figures
from flashprobe.report.probe_figures import plot_probe


def _site(pg: float, bg: float) -> dict:
    pair = {"mean_abs": 0.0, "rel_l2": 0.0, "nonfinite": 0, "numel": 8}
    return {
        "forward": {
            "calls": 1,
            "out": {
                "primary_baseline": {**pair, "max_abs": 1e-7},
                "primary_golden": {**pair, "max_abs": pg},
                "baseline_golden": {**pair, "max_abs": bg},
                "error_ratio": pg / bg,
            },
        },
        "backward": {"calls": 0, "dq": {"error_ratio": None}, "dk": {}, "dv": {}},
    }


def test_site_names_keep_the_model_prefix_and_long_names_keep_both_ends() -> None:
    assert probe_figures._short("model.blocks.0.attn") == "model.blocks.0.attn"
    long = "model.down_blocks.1.attentions.0.transformer_blocks.0.attn2.processor"
    short = probe_figures._short(long)
    assert short.startswith("model.down_blocks.1") and short.endswith("attn2.processor") and "…" in short


def test_per_site_panel_is_dots_on_a_log_axis_without_overlapping_labels(tmp_path: Path, monkeypatch) -> None:
    panels = []
    real = probe_figures._per_site_panel

    def spy(ax, series):
        real(ax, series)
        panels.append(ax)

    monkeypatch.setattr(probe_figures, "_per_site_panel", spy)
    sites = {f"model.blocks.{i}.attn": _site(1.3e-7 * (1 + i), 1e-7 * (1 + i)) for i in range(16)}
    records = [{"step": s, "summary": summarize({}).to_dict(), "sites": sites} for s in (1, 2)]
    path = tmp_path / "probe.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_probe(path, tmp_path / "probe.png")
    (ax,) = panels
    assert not ax.patches  # no bars: a bar's length on a log axis depends on where the axis starts
    assert ax.get_xscale() == "log"
    assert next(t.get_text() for t in ax.get_yticklabels()) == "model.blocks.0.attn"
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for labels in (
        [t for t in ax.get_yticklabels() if t.get_text()],
        [t for t in ax.get_xticklabels() if t.get_text()],
    ):
        boxes = [t.get_window_extent(renderer) for t in labels]
        for a, b in itertools.pairwise(boxes):
            assert not a.overlaps(b), "tick labels overlap"
