"""Checkpoints are read with ``weights_only=True``: a crafted pickle never runs, bad files are refused
with a message naming the file and the fix, and real Lightning checkpoints still resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flashprobe.app.train import compose, train
from flashprobe.formats.checkpoint_io import AtomicCheckpointIO, CheckpointError, load_checkpoint
from flashprobe.formats.run_record import read_run_record
from tests.app._study import flashprobe_cli
from tests.safety._runs import SHORT, fingerprint, write_crafted_checkpoint, write_crafted_pickle

#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("safety/test_checkpoints")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-step run with a checkpoint at every step, and the Hydra overrides a CLI run records."""
    run = tmp_path_factory.mktemp("finished") / "run"
    train(compose(SHORT, run_dir=run))
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in SHORT))
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def test_the_crafted_payload_really_runs_when_unpickled_unsafely(tmp_path: Path) -> None:
    """The control: the crafted file does create its marker when loaded with weights_only=False."""
    marker = tmp_path / "marker"
    torch.load(write_crafted_checkpoint(tmp_path / "x.ckpt", marker), weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (write_crafted_checkpoint, r"refused: loading it would run code .*weights_only=True"),
        (write_crafted_pickle, r"refused: torch\.load\(weights_only=True\) cannot read it"),
    ],
)
def test_a_crafted_checkpoint_is_refused_without_running_code(tmp_path: Path, write, message: str) -> None:
    marker = tmp_path / "marker"
    path = write(tmp_path / "last.ckpt", marker)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="refused"):  # Lightning's restore asks for weights_only=False
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
    assert not marker.exists()


def test_resume_from_a_crafted_last_ckpt_runs_no_code(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path)
    marker = tmp_path / "marker"
    write_crafted_checkpoint(run / "checkpoints" / "last.ckpt", marker)
    before = fingerprint(run)
    proc = flashprobe_cli("train", f"resume={run}", "trainer.max_steps=3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "last.ckpt is refused: loading it would run code" in proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr
    assert not marker.exists()
    assert fingerprint(run) == before  # refused before Hydra started: not even Hydra's files were written


def test_ckpt_path_to_a_crafted_file_is_refused_in_process(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = write_crafted_checkpoint(tmp_path / "given.ckpt", marker)
    with pytest.raises(CheckpointError, match=r"given\.ckpt is refused"):
        train(compose([*SHORT, f"ckpt_path={ckpt}"], run_dir=tmp_path / "run"))
    assert not marker.exists()
    assert not (tmp_path / "run" / "run.json").exists() and not (tmp_path / "run" / "config.yaml").exists()


def test_a_truncated_or_foreign_checkpoint_is_refused_clearly(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"last.ckpt cannot be read .*truncated, corrupt"):
        train(compose([*SHORT, "trainer.max_steps=3", f"resume={run}"], run_dir=run))
    torch.save({"weights": torch.zeros(2)}, last)
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint"):
        train(compose([*SHORT, "trainer.max_steps=3", f"resume={run}"], run_dir=run))
    assert read_run_record(run) == read_run_record(finished)  # no session was started


def test_max_steps_below_the_checkpoint_is_refused(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path)
    (run / "run.json").unlink()  # not finished as far as the record goes: resume reads the checkpoint
    with pytest.raises(ValueError, match=r"max_steps=1 lies below the step of the checkpoint .*step 2"):
        train(compose([*SHORT, "trainer.max_steps=1", f"resume={run}"], run_dir=run))


def test_a_real_checkpoint_still_resumes(finished: Path, tmp_path: Path) -> None:
    run = _copy(finished, tmp_path)
    _, objects = train(compose([*SHORT, "trainer.max_steps=3", f"resume={run}"], run_dir=run))
    assert objects["trainer"].global_step == 3
    record = read_run_record(run)
    assert record["status"] == "finished" and [s["from_step"] for s in record["sessions"]] == [0, 2]
