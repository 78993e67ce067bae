"""A full disk (a real tmpfs, mounted where allowed) stops a run with one line, ``run.json`` records the
failure, and once space is freed ``resume=`` finishes the run with every artefact and the same bits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flashprobe.app.train import RunStoppedError, compose, train
from flashprobe.formats.run_record import read_run_record
from tests._disk import fill, tiny_disk
from tests.safety._runs import SHORT

RUN = [*SHORT, "threads=1"]


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_a_full_disk_in_the_last_step_then_resume_gives_the_whole_run(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    train(compose(RUN, run_dir=reference))
    last = (reference / "checkpoints" / "last.ckpt").stat().st_size
    with tiny_disk(tmp_path / "disk", 16 * 1024) as disk:
        run = disk / "run"
        fill(disk, (_size(reference) - 2 * last) // 1024)  # room for all but the last step's checkpoints
        with pytest.raises(RunStoppedError) as stopped:
            train(compose(RUN, run_dir=run))
        message = str(stopped.value)
        assert "\n" not in message and stopped.value.exit_code == 1
        assert message.startswith(f"the disk holding {run} is full (") and " MiB free) writing " in message
        assert "; kept: checkpoint checkpoints/" in message and message.endswith(f"resume={run}")
        record = read_run_record(run)
        assert record["status"] == "failed" and record["sessions"][-1]["failed"] == message
        assert not list(run.rglob("*.tmp"))  # the failed write's temporary file is gone

        (disk / "filler").unlink()
        train(compose([*RUN, f"resume={run}"], run_dir=run))
        record = read_run_record(run)
        assert record["status"] == "finished" and record["global_step"] == 2
        for artefact in ("checkpoints/last.ckpt", "probe.png", "snapshots/step_0000002.safetensors"):
            assert (run / artefact).is_file(), artefact
        assert list(run.glob("csv/version_*/samples/step_0000002.png"))
        assert (run / "probe.jsonl").read_text() == (reference / "probe.jsonl").read_text()
        for snapshot in (reference / "snapshots").glob("*.safetensors"):
            ours, theirs = load_file(run / "snapshots" / snapshot.name), load_file(snapshot)
            assert all(ours[k].equal(theirs[k]) for k in theirs), snapshot.name
        shutil.rmtree(run)


def test_a_study_that_fills_the_disk_ends_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """The study's own files (study.json, report.md, figures) on a full disk: one line, exit code 1."""
    from flashprobe.app import study
    from flashprobe.formats.atomic import atomic_write_text

    def fill_the_disk(out: str, *args, **kwargs) -> Path:
        with tiny_disk(Path(out), 64) as disk:
            fill(disk, 0)
            atomic_write_text(disk / "study.json", "{}" * 4096)
        raise AssertionError("the write above must fail")

    monkeypatch.setattr(study, "run_study", fill_the_disk)
    assert study.main(["--out", str(tmp_path / "study")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flashprobe study: error: the disk holding {tmp_path}")
    assert "no study.json written" in err and "run the same command again" in err


def test_a_run_on_a_disk_already_full_is_refused_before_hydra_writes(tmp_path: Path, capsys) -> None:
    from flashprobe.app.train import cli_main

    with tiny_disk(tmp_path / "disk", 256) as disk:
        fill(disk, 0)
        assert cli_main([*RUN, f"hydra.run.dir={disk / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert f"the disk holding {disk / 'run'} is full (0.0 MiB free)" in err and "Traceback" not in err
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_a_study_on_a_disk_already_full_is_refused_before_it_writes(tmp_path: Path, capsys) -> None:
    """It made OUT and its lock, then ended in a bare ``[Errno 28]`` (issue 42's table)."""
    from flashprobe.app.study import main
    from tests.app._study import TINY

    with tiny_disk(tmp_path / "disk", 256) as disk:
        fill(disk, 0)
        assert main(["--out", str(disk / "study"), "--runs", "flash,baseline", *TINY]) == 2
        err = capsys.readouterr().err
        assert f"the disk holding {disk / 'study'} is full (0.0 MiB free)" in err and "Traceback" not in err
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
