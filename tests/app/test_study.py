"""``flashprobe study`` end to end on a tiny budget, and ``flashprobe report`` from its files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flashprobe.report.cli import report_main
from flashprobe.report.study_report import verdict
from flashprobe.study import run_study

TINY = ["experiment=smoke", "trainer.max_steps=4", "callbacks.weight_snapshot.every_n_steps=2", "logger=csv"]


def test_study_trains_compares_and_reports(tmp_path: Path) -> None:
    report = run_study(tmp_path, ["flash", "baseline", "identical", "seed1"], TINY)
    study = json.loads((tmp_path / "study.json").read_text())
    pairs = study["pairs"]
    assert set(pairs) == {"flash_vs_baseline", "identical", "seed1_vs_seed0"}
    assert pairs["flash_vs_baseline"]["steps"] == [0, 2, 4]
    # identical runs on a deterministic CPU: exactly zero at every step
    assert pairs["identical"]["model"]["wasserstein"] == [0.0, 0.0, 0.0]
    assert pairs["identical"]["model"]["max_abs"] == [0.0, 0.0, 0.0]
    # flash and baseline start from the same weights and drift apart, far less than another seed
    flash = pairs["flash_vs_baseline"]["model"]["wasserstein"]
    seed = pairs["seed1_vs_seed0"]["model"]["wasserstein"]
    assert flash[0] == 0.0 and flash[-1] > 0.0
    assert flash[-1] < seed[-1]
    v = verdict(pairs)
    assert v["step"] == 4
    assert v["context"]["seed"]["flash_over_context"] == pytest.approx(flash[-1] / seed[-1])
    text = report.read_text()
    assert "## Verdict" in text and "within the bound set by random initialisation" in text
    assert "| flash |" in text  # the probe's error ratios of the flash run
    assert (tmp_path / "fig8_wasserstein.png").is_file() and (
        tmp_path / "fig7_flash_vs_baseline.png"
    ).is_file()
    # `flashprobe report` regenerates the same report from the files alone
    report.unlink()
    assert report_main([str(tmp_path)]) == 0
    assert report.read_text() == text


def test_study_rejects_unknown_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown study run 'nope'; choose from: baseline, bf16"):
        run_study(tmp_path, ["nope"])


def test_report_without_study_json_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert report_main([str(tmp_path)]) == 2
    assert "flashprobe study --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"pairs": ', r"study.json: not valid JSON at line 1"),
        ('{"format": "other/1", "pairs": {}}', r"format 'other/1', expected 'flashprobe.compare/1'"),
        ('{"format": "flashprobe.compare/1", "pairs": {}}', r"no comparison under 'pairs'"),
        (
            '{"format": "flashprobe.compare/1", "pairs": {"x": {"steps": [0, 1], "model": '
            '{"wasserstein": [0.0], "max_abs": [0.0, 0.0]}}}}',
            r"pair 'x' column model.wasserstein does not align with its 2 steps",
        ),
    ],
)
def test_report_on_a_malformed_study_json_names_the_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    (tmp_path / "study.json").write_text(content)
    for argv in ([str(tmp_path)], [str(tmp_path), "--figures"]):
        assert report_main(argv) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), err
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "report.md").exists()


def test_report_on_a_missing_directory_or_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert report_main([str(tmp_path / "f")]) == 2


def _pair(values: list[float]) -> dict:
    return {"steps": [0, 10], "model": {"wasserstein": values, "max_abs": values}, "runs": {}}


@pytest.mark.parametrize(
    ("flash", "finding"),
    [
        (2e-7, "100× below the low-precision deviation (paper: 2–5× below). The paper's finding holds"),
        (
            4e-5,
            "0.5× below the low-precision deviation (paper: 2–5× below). The paper's finding does not hold",
        ),
    ],
)
def test_report_verdict_against_low_precision(tmp_path: Path, flash: float, finding: str) -> None:
    pairs = {"flash_vs_baseline": _pair([0.0, flash]), "fp16_vs_fp32": _pair([0.0, 2e-5])}
    (tmp_path / "study.json").write_text(json.dumps({"format": "flashprobe.compare/1", "pairs": pairs}))
    assert verdict(pairs)["context"]["fp16_vs_fp32"]["flash_over_context"] == pytest.approx(flash / 2e-5)
    assert report_main([str(tmp_path)]) == 0
    assert finding in (tmp_path / "report.md").read_text()
