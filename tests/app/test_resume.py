"""A run killed with SIGKILL and resumed is bit-identical to the uninterrupted run; runs are never
deleted by accident; bad resumes fail before any work."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashprobe.app.train import cli_main, command_line, compose, train
from flashprobe.formats.run_record import read_run_record
from tests.app._study import flashprobe_cli

#: 6 steps; a checkpoint, a snapshot and a probe record every 2 steps; one torch thread in the test
#: process and in the `flashprobe train` subprocesses alike (the thread count changes the sums' order,
#: so the bits, when left to torch's default).
RUN = [
    "experiment=smoke",
    "threads=1",
    "trainer.max_steps=6",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=2",
    "callbacks.weight_snapshot.every_n_steps=2",
]


def _flashprobe_train(*args: str) -> subprocess.CompletedProcess:
    return flashprobe_cli("train", *args)


def _snapshots(run: Path) -> dict[int, dict[str, torch.Tensor]]:
    return {int(p.stem[5:]): load_file(p) for p in sorted((run / "snapshots").glob("step_*.safetensors"))}


def _assert_same_run(a: Path, b: Path) -> None:
    sa, sb = _snapshots(a), _snapshots(b)
    assert sa.keys() == sb.keys() == {0, 2, 4, 6}
    for step in sa:
        assert all(torch.equal(sa[step][k], sb[step][k]) for k in sa[step]), f"weights differ at step {step}"
    assert (a / "probe.jsonl").read_text() == (b / "probe.jsonl").read_text()
    assert [s["step"] for s in json.loads((b / "snapshots" / "manifest.json").read_text())["snapshots"]] == [
        0,
        2,
        4,
        6,
    ]


#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("app/test_resume")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    train(compose([*RUN, "logger=csv"], run_dir=run))
    return run


@pytest.mark.parametrize("kill_at", [3, 4])  # between checkpoints, and just after one
def test_kill_9_then_resume_is_bit_identical(uninterrupted: Path, tmp_path: Path, kill_at: int) -> None:
    run = tmp_path / "run"
    killed = _flashprobe_train(
        *RUN,
        "logger=csv",
        f"hydra.run.dir={run}",
        "+callbacks.kill._target_=tests.app._kill.KillAt",
        f"+callbacks.kill.step={kill_at}",
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    record = read_run_record(run)
    assert record["status"] == "running" and record["sessions"][-1]["seconds"] is None
    assert cli_main([f"resume={run}", "~callbacks.kill"]) == 0  # in this process; it must not be killed
    _assert_same_run(uninterrupted, run)
    record = read_run_record(run)
    assert record["status"] == "finished"
    if kill_at < 2:  # killed before the first checkpoint: trained again from step 0, a fresh record
        assert [s["from_step"] for s in record["sessions"]] == [0]
    else:
        assert [s["from_step"] for s in record["sessions"]] == [0, kill_at // 2 * 2]  # its last checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [1, 2, 3, 4, 5])
def test_kill_at_every_step_then_resume_is_bit_identical(
    uninterrupted: Path, tmp_path: Path, kill_at: int
) -> None:
    test_kill_9_then_resume_is_bit_identical(uninterrupted, tmp_path, kill_at)


def _kill_and_resume_a_copy(uninterrupted: Path, tmp_path: Path, kill_at: int) -> None:
    """A run killed at step 3 and copied elsewhere; its copy resumed and killed at ``kill_at``, then
    resumed to the end: the same weights as the uninterrupted run, each resume from the copy's newest
    checkpoint (a copy's Lightning does not know its last.ckpt: it once saved beside it, as last-v1.ckpt,
    and the next resume took the stale last.ckpt and deleted the newer checkpoints)."""
    import shutil

    original, run = tmp_path / "original", tmp_path / "copy"
    kill = ["+callbacks.kill._target_=tests.app._kill.KillAt"]
    at_3 = [*kill, "+callbacks.kill.step=3"]
    killed = _flashprobe_train(*RUN, "logger=csv", f"hydra.run.dir={original}", *at_3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    shutil.copytree(original, run)
    killed = _flashprobe_train(f"resume={run}", *kill, f"+callbacks.kill.step={kill_at}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    newest = max(int(p.stem[4:]) for p in (run / "checkpoints").glob("step*.ckpt"))
    before = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").glob("step*.ckpt")}
    assert cli_main([f"resume={run}", "~callbacks.kill"]) == 0
    _assert_same_run(uninterrupted, run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        p.name for p in (uninterrupted / "checkpoints").iterdir()
    )  # no last-v1.ckpt
    after = {p.name: p.stat().st_mtime_ns for p in (run / "checkpoints").glob("step*.ckpt")}
    assert all(after.get(name) == mtime for name, mtime in before.items()), "a newer checkpoint was replaced"
    assert [s["from_step"] for s in read_run_record(run)["sessions"]] == [0, 2, newest]
    assert [p.name for p in (run / "csv").iterdir()] == ["version_0"]  # one csv version per run


def test_a_copied_run_killed_and_resumed_is_bit_identical_and_keeps_newer_checkpoints(
    uninterrupted: Path, tmp_path: Path
) -> None:
    _kill_and_resume_a_copy(uninterrupted, tmp_path, kill_at=5)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [2, 3, 4])
def test_a_copied_run_killed_at_every_step_then_resumed_is_bit_identical(
    uninterrupted: Path, tmp_path: Path, kill_at: int
) -> None:
    _kill_and_resume_a_copy(uninterrupted, tmp_path, kill_at)


def test_a_kill_at_the_end_of_training_then_resume_has_every_artefact(
    uninterrupted: Path, tmp_path: Path
) -> None:
    """Killed after the last checkpoint, before probe.png and run.json's finish: resume trains the last
    interval again (from step 4) and the run is the uninterrupted one, probe.png and all, no stray files."""
    run = tmp_path / "run"
    killed = _flashprobe_train(
        *RUN, "logger=csv", f"hydra.run.dir={run}", "+callbacks.kill._target_=tests.app._kill.KillAtTrainEnd"
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (run / "probe.png").exists() and list((run / "checkpoints").glob(".last.ckpt.*.tmp"))
    assert cli_main([f"resume={run}", "~callbacks.kill"]) == 0
    _assert_same_run(uninterrupted, run)
    assert (run / "probe.png").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert list(run.glob("csv/version_*/samples/step_0000006.png"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        p.name for p in (uninterrupted / "checkpoints").iterdir()
    )  # no step0000006-v1.ckpt beside the one written again
    assert not [p for p in run.rglob(".*.tmp")]
    record = read_run_record(run)
    assert record["status"] == "finished" and [s["from_step"] for s in record["sessions"]] == [0, 4]


def test_a_finished_run_that_lost_artefacts_is_rebuilt_by_resume(uninterrupted: Path, tmp_path: Path) -> None:
    """probe.png alone is redrawn from probe.jsonl; a lost last.ckpt is trained again from step 4."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    figure = (run / "probe.png").read_bytes()
    (run / "probe.png").unlink()
    _, objects = train(compose([*RUN, "logger=csv", f"resume={run}"], run_dir=run))
    assert "finished 6 steps already" in objects["skipped"] and (run / "probe.png").read_bytes() == figure
    (run / "checkpoints" / "last.ckpt").unlink()
    train(compose([*RUN, "logger=csv", f"resume={run}"], run_dir=run))
    _assert_same_run(uninterrupted, run)
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert [s["from_step"] for s in read_run_record(run)["sessions"]] == [0, 4]


def test_a_run_killed_in_its_start_up_is_resumable_and_the_messages_agree(tmp_path: Path, capsys) -> None:
    """Killed after run.json claimed its outputs and before training started ("starting", no session):
    the original command points to resume=, and resume= trains it from step 0."""
    from omegaconf import OmegaConf

    from flashprobe.app.train import RUN_OUTPUTS
    from flashprobe.formats.run_record import claim_outputs

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create([*RUN, "trainer.max_steps=2"]), run / ".hydra" / "overrides.yaml")
    claim_outputs(run, list(RUN_OUTPUTS))
    assert cli_main([*RUN, "trainer.max_steps=2", f"hydra.run.dir={run}"]) == 2
    assert f"resume={run}" in capsys.readouterr().err
    assert cli_main([f"resume={run}"]) == 0
    record = read_run_record(run)
    assert record["status"] == "finished" and [s["from_step"] for s in record["sessions"]] == [0]


def test_resume_in_process_from_an_older_checkpoint(uninterrupted: Path, tmp_path: Path) -> None:
    """A run whose last checkpoint is step 2 (killed later) continues from there, exactly."""
    run = tmp_path / "run"
    train(compose([*RUN, "logger=csv", "trainer.max_steps=2"], run_dir=run))
    # the "crashed" session also wrote a probe record and a snapshot at step 4, after the checkpoint
    lines = (uninterrupted / "probe.jsonl").read_text().splitlines(keepends=True)
    (run / "probe.jsonl").write_text("".join(lines[:2]) + '{"step": 6, "su')  # and a torn last line
    train(compose([*RUN, "logger=csv", f"resume={run}"], run_dir=run))
    _assert_same_run(uninterrupted, run)


def test_a_fresh_start_in_an_existing_run_is_refused(uninterrupted: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    train(compose([*RUN, "logger=csv", "trainer.max_steps=2"], run_dir=run))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(FileExistsError, match=r"already holds a run .*resume=.*overwrite=true"):
        train(compose([*RUN, "logger=csv"], run_dir=run))
    assert cli_main([*RUN, f"hydra.run.dir={run}"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing touched
    train(compose([*RUN, "logger=csv", "overwrite=true"], run_dir=run))
    assert read_run_record(run)["global_step"] == 6 and len(read_run_record(run)["sessions"]) == 1


def test_a_finished_run_is_skipped_by_resume_auto(uninterrupted: Path) -> None:
    before = (uninterrupted / "run.json").read_text()
    _, objects = train(compose([*RUN, "logger=csv", "resume=auto"], run_dir=uninterrupted))
    assert "finished 6 steps already" in objects["skipped"]
    assert (uninterrupted / "run.json").read_text() == before


def test_bad_resumes_fail_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"resume=.*nowhere.*overrides.yaml is missing"):
        command_line([f"resume={tmp_path / 'nowhere'}"])
    run = tmp_path / "run"
    train(compose([*RUN, "logger=csv", "trainer.max_steps=2", "callbacks.checkpoint=null"], run_dir=run))
    assert not (run / "checkpoints").exists()  # no checkpoint configured: none written
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        train(compose([*RUN, f"resume={run}"], run_dir=run))
    with pytest.raises(ValueError, match="but the run directory is"):
        train(compose([*RUN, f"resume={tmp_path / 'other'}"], run_dir=run))


def test_resume_reuses_the_runs_own_overrides(tmp_path: Path) -> None:
    saved = tmp_path / "run" / ".hydra"
    saved.mkdir(parents=True)
    (saved / "overrides.yaml").write_text("- experiment=smoke\n- trainer.max_steps=6\n- seed=3\n")
    args = command_line([f"resume={tmp_path / 'run'}", "trainer.max_steps=8"])
    assert args == [
        "experiment=smoke",
        "seed=3",
        f"resume={tmp_path / 'run'}",
        "trainer.max_steps=8",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]


def test_a_run_directory_under_a_file_is_refused_before_hydra_starts(tmp_path: Path, capsys) -> None:
    (tmp_path / "f").write_text("x")
    assert cli_main([*RUN, f"hydra.run.dir={tmp_path / 'f' / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "hydra.run.dir" in err and "which is a file" in err


def test_a_checkpoint_interval_that_splits_a_probe_interval_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from flashprobe.app.train import check_config

    check_config(compose([*RUN, "callbacks.checkpoint.every_n_train_steps=2"], run_dir=tmp_path))
    assert "not a multiple" not in caplog.text  # 2 is a multiple of log_every_n_steps=2
    check_config(compose([*RUN, "callbacks.checkpoint.every_n_train_steps=3"], run_dir=tmp_path))
    assert "every_n_train_steps=3 is not a multiple of trainer.log_every_n_steps=2" in caplog.text
