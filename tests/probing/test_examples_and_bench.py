"""The example script and ``flashprobe bench overhead`` run end to end (tiny settings)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from flashprobe.bench.overhead import limit_checks
from flashprobe.bench.overhead import main as overhead_main
from flashprobe.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def test_example_prints_a_table_per_site(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(sys, "argv", ["probe_any_model.py", "--steps", "1"])
    runpy.run_path(str(ROOT / "examples" / "probe_any_model.py"), run_name="__main__")
    out = capsys.readouterr().out
    for i in range(3):
        assert f"1.layers.{i}.self_attn" in out
    assert "verdict PASS: worst error / limit" in out


def test_overhead_bench_writes_rows_and_figure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    figure = tmp_path / "fig" / "overhead.png"
    argv = ["--steps", "2", "--warmup", "1", "--every", "2", "--batch", "1", "--seq-len", "8"]
    argv += ["--d-model", "16", "--heads", "2", "--layers", "1", "--backward", "--out", str(tmp_path)]
    assert overhead_main([*argv, "--figure", str(figure)]) == 0
    doc = json.loads((tmp_path / "overhead.json").read_text())
    rows = {row["mode"]: row for row in doc["rows"]}
    assert list(rows) == ["no_probe", "control", "probe", "probe_every_2"]
    assert rows["no_probe"]["ratio_vs_no_probe"] == 1 and rows["control"]["ratio_vs_control"] == 1
    assert all(row["step_ms"] > 0 and row["steps"] == 2 for row in rows.values())
    assert rows["probe"]["compared_calls"] == 3  # 1 layer x (1 warm-up + 2 timed) steps
    assert rows["probe_every_2"]["compared_calls"] == 2  # warm-up and step 0
    assert {c["mode"] for c in doc["limits"]} == {"probe", "probe_every_2"}
    assert doc["environment"]["torch"]  # what the figures depend on
    assert figure.stat().st_size > 1000 and (tmp_path / "overhead.csv").exists()
    assert cli_main(["bench", "overhead", "--steps", "0"]) == 2  # bad input: one clear error


def test_overhead_bench_compiled(tmp_path: Path) -> None:
    argv = ["--steps", "2", "--warmup", "1", "--every", "2", "--batch", "1", "--seq-len", "8"]
    argv += ["--d-model", "16", "--heads", "2", "--layers", "1", "--compile", "eager", "--out", str(tmp_path)]
    assert overhead_main(argv) == 0
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert doc["config"]["compile"] == "eager"
    rows = {row["mode"]: row for row in doc["rows"]}
    assert rows["probe"]["compared_calls"] == 3  # the compiled model's calls were compared
    assert overhead_main(["--compile", "no_such_backend", "--out", str(tmp_path)]) == 2


def test_overhead_bench_under_autocast_and_device_checks(tmp_path: Path) -> None:
    argv = ["--steps", "2", "--warmup", "0", "--every", "2", "--batch", "1", "--seq-len", "8"]
    argv += ["--d-model", "16", "--heads", "2", "--layers", "1", "--autocast", "bf16", "--out", str(tmp_path)]
    assert overhead_main(argv) == 0
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert doc["config"]["autocast"] == "bf16" and doc["config"]["device"] == "cpu"
    assert {row["mode"]: row for row in doc["rows"]}["probe"]["compared_calls"] == 2
    assert overhead_main(["--device", "nosuch", "--out", str(tmp_path)]) == 2
    if not torch.cuda.is_available():
        assert overhead_main(["--device", "cuda", "--out", str(tmp_path)]) == 2


@pytest.mark.parametrize(
    ("probe_ratio", "backward", "ok"),
    [(1.09, False, True), (1.11, False, False), (1.14, True, True), (1.16, True, False)],
)
def test_overhead_limits_are_1_10_forward_and_1_15_with_gradients(
    probe_ratio: float, backward: bool, ok: bool
) -> None:
    """Issue 55's floors: probe x control <= 1.10 forward and <= 1.15 with ``--backward``; the sampled
    mode stays at <= 1.10 x no probe either way."""
    rows = [
        {"mode": "no_probe", "ratio_vs_no_probe": 1.0, "ratio_vs_control": 0.8},
        {"mode": "control", "ratio_vs_no_probe": 1.25, "ratio_vs_control": 1.0},
        {"mode": "probe", "ratio_vs_no_probe": 1.25 * probe_ratio, "ratio_vs_control": probe_ratio},
        {"mode": "probe_every_10", "ratio_vs_no_probe": 1.105, "ratio_vs_control": 0.9},
    ]
    probe, every = limit_checks(rows, backward=backward)
    assert (probe["mode"], probe["reference"], probe["ok"]) == ("probe", "control", ok)
    assert probe["limit"] == (1.15 if backward else 1.10) and probe["ratio"] == probe_ratio
    expected = ("probe_every_10", "no_probe", 1.10, False)  # 1.105 > 1.10
    assert (every["mode"], every["reference"], every["limit"], every["ok"]) == expected
