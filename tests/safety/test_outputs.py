"""``resume=auto`` and ``overwrite=true`` delete only what the run's ``run.json`` records as created by
flashprobe; a user's files in the run directory are refused, named, and kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashprobe.app.train import RUN_OUTPUTS, compose, train
from flashprobe.formats.run_record import read_run_record
from tests.app._study import flashprobe_cli
from tests.safety._runs import SHORT, fingerprint


def _users_files(proj: Path) -> None:
    (proj / "csv").mkdir(parents=True)
    (proj / "csv" / "mine.csv").write_text("a,b\n")
    (proj / "config.yaml").write_text("x\n")
    (proj / "samples").mkdir()


@pytest.mark.parametrize("mode", ["resume=auto", "overwrite=true"])
def test_the_users_files_are_never_deleted_from_the_cli(tmp_path: Path, cli, mode: str) -> None:
    """The issue's case: a user's proj/csv and proj/config.yaml, then train there with resume=auto (a real
    ``flashprobe`` process) or overwrite=true (the same entry point in this process)."""
    proj = tmp_path / "proj"
    _users_files(proj)
    before = fingerprint(proj)
    args = ("train", "experiment=smoke", f"hydra.run.dir={proj}", mode)
    proc = flashprobe_cli(*args) if mode == "resume=auto" else cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "holds config.yaml, samples, csv, which no flashprobe run recorded as its own" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert fingerprint(proj) == before  # refused before Hydra started: nothing written, nothing deleted


def test_in_process_the_same_refusal_keeps_the_files(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    _users_files(proj)
    before = fingerprint(proj)
    with pytest.raises(FileExistsError, match="which no flashprobe run recorded as its own"):
        train(compose([*SHORT, "resume=auto"], run_dir=proj))
    assert fingerprint(proj) == before


def test_a_run_records_its_outputs_and_overwrite_removes_only_those(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")  # not a name a run writes: never touched
    train(compose(SHORT, run_dir=run))
    record = read_run_record(run)
    assert set(record["outputs"]) == set(RUN_OUTPUTS)  # claimed before any was written
    (run / "probe.jsonl").write_text("stale\n")
    train(compose([*SHORT, "overwrite=true"], run_dir=run))
    assert (run / "notes.txt").read_text() == "mine"
    assert (run / "probe.jsonl").read_text() != "stale\n"
    assert len(read_run_record(run)["sessions"]) == 1


def test_a_run_killed_before_its_first_checkpoint_removes_its_own_outputs_only(tmp_path: Path) -> None:
    """What a kill before the first checkpoint leaves: a running record listing what the run created."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "probe.jsonl").write_text('{"step": 1}\n')
    (run / "samples").mkdir()  # the user's, created before the run: the record does not list it
    record = {"format": "flashprobe.run/1", "status": "running", "sessions": [{"from_step": 0}]}
    (run / "run.json").write_text(json.dumps({**record, "outputs": ["run.json", "probe.jsonl"]}))
    with pytest.raises(FileExistsError, match=r"holds samples, which no flashprobe run recorded"):
        train(compose([*SHORT, "resume=auto"], run_dir=run))
    assert (run / "samples").is_dir() and (run / "probe.jsonl").read_text() == '{"step": 1}\n'
    (run / "samples").rmdir()
    _, objects = train(compose([*SHORT, "resume=auto"], run_dir=run))  # its own outputs go: a fresh start
    assert objects["trainer"].global_step == 2
    assert [s["from_step"] for s in read_run_record(run)["sessions"]] == [0]
