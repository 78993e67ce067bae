"""``flashprobe study`` end to end on a tiny budget, and ``flashprobe report`` from its files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from flashprobe.app.study import PRECISIONS, run_study, study_plan
from flashprobe.formats.study_file import read_study
from flashprobe.report.cli import report_main
from flashprobe.report.study_report import verdict
from tests.app._study import TINY

RUNS = ["flash", "baseline", "identical", "seed1", "fp32"]


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("study")
    run_study(out, RUNS, TINY)
    return out


def test_study_trains_like_for_like_compares_and_reports(study: Path) -> None:
    doc = json.loads((study / "study.json").read_text())
    pairs, meta = doc["pairs"], doc["study"]
    assert set(pairs) == {"flash_vs_baseline", "identical", "seed1_vs_seed0", "bf16_vs_fp32"}
    # every pair differs in exactly one thing: attention, nothing, seed, precision
    runs = meta["runs"]
    assert runs["flash"] == {"name": "flash", "attention": "flash", "precision": "bf16-mixed", "seed": 0}
    for name, c in meta["comparisons"].items():
        a, b = runs[c["run_a"]], runs[c["run_b"]]
        differ = [k for k in ("attention", "precision", "seed") if a[k] != b[k]]
        assert (
            differ
            == {"kernel": ["attention"], "noise": [], "seed": ["seed"], "precision": ["precision"]}[c["kind"]]
        ), name
    # the runs really trained at the precision their plan says
    for name, run in runs.items():
        manifest = json.loads((study / "runs" / name / "snapshots" / "manifest.json").read_text())
        assert manifest["precision"] == run["precision"], name
    assert pairs["flash_vs_baseline"]["steps"] == [0, 2, 4]
    assert pairs["identical"]["model"]["wasserstein"] == [0.0, 0.0, 0.0]  # deterministic CPU
    flash = pairs["flash_vs_baseline"]["model"]["wasserstein"]
    seed = pairs["seed1_vs_seed0"]["model"]["wasserstein"]
    assert flash[0] == 0.0 and flash[-1] > 0.0 and flash[-1] < seed[-1]
    assert meta["machine"]["torch_threads"] == 2 and meta["machine"]["torch"] == torch.__version__
    v = verdict(read_study(study))
    assert v["step"] == 4 and v["noise_floor"] == 0.0
    assert v["context"]["seed"]["ratio"] == pytest.approx(flash[-1] / seed[-1])
    low = pairs["bf16_vs_fp32"]["model"]["wasserstein"][-1]
    assert v["context"]["bf16_vs_fp32"]["ratio"] == pytest.approx(flash[-1] / low)
    text = (study / "report.md").read_text()
    assert "Noise floor: 0" in text and "within the bound set by random initialisation" in text
    assert "| identical | nothing: the same configuration trained twice |" in text and "inf" not in text
    assert "[probe.png](runs/flash/probe.png)" in text and "| flash | pass | 1 |" in text  # logged at step 4
    assert (study / "fig8_wasserstein.png").is_file() and (study / "fig7_flash_vs_baseline.png").is_file()
    # `flashprobe report` regenerates the same report from the files alone
    (study / "report.md").unlink()
    assert report_main([str(study)]) == 0
    assert (study / "report.md").read_text() == text


def test_a_study_invoked_again_skips_its_finished_runs(study: Path) -> None:
    before = {r: (study / "runs" / r / "run.json").read_text() for r in RUNS}
    numbers = json.loads((study / "study.json").read_text())["pairs"]
    run_study(study, RUNS, TINY)
    assert {r: (study / "runs" / r / "run.json").read_text() for r in RUNS} == before  # nothing retrained
    assert json.loads((study / "study.json").read_text())["pairs"] == numbers


def test_two_invocations_give_identical_numbers(study: Path, tmp_path: Path) -> None:
    run_study(tmp_path, ["flash", "baseline"], TINY)
    again = json.loads((tmp_path / "study.json").read_text())["pairs"]["flash_vs_baseline"]
    first = json.loads((study / "study.json").read_text())["pairs"]["flash_vs_baseline"]
    assert again["model"] == first["model"] and again["tensors"] == first["tensors"]


@pytest.mark.parametrize(
    ("runs", "overrides", "message"),
    [
        (
            ["nope"],
            [],
            "unknown study run 'nope' at study.precision=bf16-mixed; choose from: flash, baseline",
        ),
        (["flash", "bf16"], [], "unknown study run 'bf16'"),  # at bf16, the baseline is the bf16 run
        (["flash", "seed1"], [], "form no like-for-like flash_vs_baseline pair"),
        (None, ["study.precision=fp8"], "study.precision='fp8' is not a study precision; use one of 32-true"),
    ],
)
def test_bad_studies_fail_before_any_training(tmp_path: Path, runs, overrides, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        run_study(tmp_path / "out", runs, overrides)
    assert not (tmp_path / "out").exists()


def test_the_plan_at_each_precision_pairs_runs_that_differ_in_one_thing() -> None:
    for precision in PRECISIONS:
        plan = study_plan(precision)
        for c in plan.comparisons.values():
            a, b = plan.runs[c.run_a], plan.runs[c.run_b]
            assert sum(getattr(a, k) != getattr(b, k) for k in ("attention", "precision", "seed")) == (
                c.kind != "noise"
            ), (precision, c.name)
    assert "flash_fp32" not in study_plan("32-true").runs
    assert study_plan("16-mixed").comparisons["fp16_vs_fp32"].run_a == "baseline"


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
            '{"format": "flashprobe.compare/1", "pairs": {"../../../x": {"steps": [0], "model": '
            '{"wasserstein": [0.0], "max_abs": [0.0]}}}}',
            r"pair name '\.\./\.\./\.\./x' cannot be used in a file name",
        ),
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
    return {"run_a": "a", "run_b": "b", "steps": [0, 10], "model": {"wasserstein": values, "max_abs": values}}


def _comparison(name: str, kind: str) -> dict:
    return {"name": name, "run_a": "a", "run_b": "b", "kind": kind, "isolates": f"what {name} isolates"}


@pytest.mark.parametrize(
    ("flash", "finding"),
    [
        (2e-7, "flash's deviation is 100× below that of fp16_vs_fp32"),
        (4e-5, "flash's deviation is 2× above that of fp16_vs_fp32"),
    ],
)
def test_report_verdict_against_low_precision(tmp_path: Path, flash: float, finding: str) -> None:
    pairs = {"flash_vs_baseline": _pair([0.0, flash]), "fp16_vs_fp32": _pair([0.0, 2e-5])}
    meta = {
        "precision": "bf16-mixed",
        "comparisons": {
            "flash_vs_baseline": _comparison("flash", "kernel"),
            "fp16_vs_fp32": _comparison("fp16", "precision"),
        },
    }
    (tmp_path / "study.json").write_text(
        json.dumps({"format": "flashprobe.compare/1", "pairs": pairs, "study": meta})
    )
    assert verdict(read_study(tmp_path))["context"]["fp16_vs_fp32"]["ratio"] == pytest.approx(flash / 2e-5)
    assert report_main([str(tmp_path)]) == 0
    assert finding in (tmp_path / "report.md").read_text()


def test_other_settings_into_the_same_out_are_refused_before_any_training(study: Path, capsys) -> None:
    from flashprobe.app.study import SETTINGS_FILE, main

    assert (study / SETTINGS_FILE).is_file()
    before = {p: p.stat().st_mtime_ns for p in study.rglob("*") if p.is_file()}
    for changed in ("trainer.max_steps=6", "study.precision=16-mixed"):
        assert main(["--out", str(study), "--runs", ",".join(RUNS), *TINY, changed]) == 2
        err = capsys.readouterr().err
        assert "holds a study trained with other settings" in err and changed.split("=")[0] in err
    assert {p: p.stat().st_mtime_ns for p in study.rglob("*") if p.is_file()} == before  # nothing written
    # the same settings are accepted (compare-only here: no retraining)
    assert main(["--out", str(study), "--runs", ",".join(RUNS), "--compare-only", *TINY]) == 0
