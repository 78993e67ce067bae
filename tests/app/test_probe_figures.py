"""The per-site deviation plot and ``flashprobe report RUN_DIR``, from hand-written probe.jsonl files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flashprobe.formats.probe_log import load_probe_records
from flashprobe.probing.summary import summarize
from flashprobe.report.cli import report_main
from flashprobe.report.probe_figures import MAX_LINES, plot_probe, site_series


def _site(ratio: float | None, pb: float, pg: float, bg: float, dq: float | None = None) -> dict:
    pair = {"mean_abs": 0.0, "rel_l2": 0.0, "nonfinite": 0, "numel": 8}
    grad = {"error_ratio": dq} if dq is not None else {"error_ratio": None}
    return {
        "forward": {
            "calls": 1,
            "out": {
                "primary_baseline": {**pair, "max_abs": pb},
                "primary_golden": {**pair, "max_abs": pg},
                "baseline_golden": {**pair, "max_abs": bg},
                "error_ratio": ratio,
            },
        },
        "backward": {"calls": 0, "dq": grad, "dk": {"error_ratio": None}, "dv": {"error_ratio": None}},
    }


def _summary(**values: object) -> dict:
    """A record's summary of no judged call (verdict undetermined) holding ``values``."""
    return {**summarize({}).to_dict(), **values}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records() -> list[dict]:
    return [
        {
            "step": 5,
            "summary": _summary(nonfinite=0, max_error_ratio=2.0),
            "sites": {
                "model.a.attn": _site(2.0, 1e-6, 2e-6, 1e-6, dq=3.0),
                "model.b.attn": _site(0.5, 4e-7, 1e-7, 2e-7),
            },
        },
        {
            "step": 10,
            "summary": _summary(nonfinite=1, max_error_ratio=1.5),
            "sites": {
                "model.a.attn": _site(1.5, 3e-6, 3e-6, 2e-6),
            },
        },
    ]


def test_site_series_reads_every_quantity(tmp_path: Path) -> None:
    series = site_series(load_probe_records(_write(tmp_path / "probe.jsonl", _records())))
    assert list(series) == ["model.a.attn", "model.b.attn"]
    a, b = series["model.a.attn"], series["model.b.attn"]
    assert a["error_ratio"] == [2.0, 1.5]
    assert a["backward_error_ratio"][0] == 3.0 and math.isnan(a["backward_error_ratio"][1])
    assert a["primary_baseline"] == [1e-6, 3e-6]
    assert b["error_ratio"][0] == 0.5 and math.isnan(b["error_ratio"][1])  # not probed at step 10


@pytest.mark.parametrize("sites", [2, MAX_LINES + 3])  # line plot and heat map
def test_plot_probe_writes_a_png(tmp_path: Path, sites: int) -> None:
    records = [
        {
            "step": s,
            "summary": _summary(),
            "sites": {f"model.blocks.{i}.attn": _site(1 + i / 10, 1e-6, 1e-6, 1e-6) for i in range(sites)},
        }
        for s in (1, 2, 3)
    ]
    out = plot_probe(_write(tmp_path / "probe.jsonl", records), tmp_path / "figs" / "probe.png")
    assert out.read_bytes().startswith(b"\x89PNG")
    assert not list(out.parent.glob(".*tmp"))  # written atomically, no temporary left


def test_bad_files_give_clear_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(FileNotFoundError, match="AttentionProbe"):
        plot_probe(tmp_path / "missing.jsonl", tmp_path / "p.png")
    path = tmp_path / "probe.jsonl"
    path.write_text(json.dumps(_records()[0]) + '\n{"step": 10, "sum')  # a kill mid-append
    with caplog.at_level("WARNING"):
        plot_probe(path, tmp_path / "p.png")  # the valid prefix is drawn, the torn line reported
    assert "dropped a torn last line" in caplog.text
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    _write(path, [{"step": 1, "summary": {}, "sites": {}}])
    with pytest.raises(ValueError, match="no per-site statistics"):
        plot_probe(path, tmp_path / "p.png")


def test_report_command_on_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path / "probe.jsonl", _records())
    assert report_main([str(tmp_path)]) == 4  # records without a judged call: UNDETERMINED
    out = capsys.readouterr().out
    assert "verdict UNDETERMINED" in out
    # (no error / limit in these records: the ratio of maxima under its own name)
    assert "| 5 | undetermined | - | - | 2 |" in out and "| 10 | undetermined | - | - | 1.5 |" in out
    assert (tmp_path / "probe.png").read_bytes().startswith(b"\x89PNG")
    # a record whose summary is not a probe summary: one line naming the file and the keys, exit 2
    _write(tmp_path / "probe.jsonl", [{**_records()[0], "summary": {"nonfinite": 0, "colour": 1}}])
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "the record of step 5: not a probe summary: unknown keys colour; missing keys sites" in err


def test_non_finite_values_as_stored_in_probe_jsonl(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The callback stores inf/nan as strings; the series keep them and the report prints them."""
    site = _site(None, 1e-6, 1e-6, 0.0)
    site["forward"]["out"]["error_ratio"] = "inf"  # baseline exact, primary not
    records = [
        {
            "step": 1,
            "summary": _summary(nonfinite=0, max_error_ratio="inf", max_abs={"primary_baseline": 1e-6}),
            "sites": {"model.a.attn": site},
        },
        {
            "step": 2,
            "summary": _summary(nonfinite=2, max_error_ratio=1.5, max_abs={"primary_baseline": "nan"}),
            "sites": {"model.a.attn": _site(1.5, 2e-6, 2e-6, 1e-6)},
        },
    ]
    _write(tmp_path / "probe.jsonl", records)
    series = site_series(load_probe_records(tmp_path / "probe.jsonl"))
    assert series["model.a.attn"]["error_ratio"] == [math.inf, 1.5]
    assert report_main([str(tmp_path)]) == 4  # records without a judged call: UNDETERMINED
    out = capsys.readouterr().out
    assert "| 1 | undetermined | - | - | inf | 1e-06 | 0 |" in out
    assert "| 2 | undetermined | - | - | 1.5 | nan | 2 |" in out
    assert (tmp_path / "probe.png").read_bytes().startswith(b"\x89PNG")
