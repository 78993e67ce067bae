"""One writer per run and per study directory: a second process is refused before it writes, with a
message naming the first; the first's files are those of a lone run; a lock left by a killed
process is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashprobe.app.study import run_study
from flashprobe.formats.lock import LOCK_NAME, DirectoryLockedError, directory_lock
from flashprobe.formats.study_file import read_study
from tests.app._study import ROOT, TINY, flashprobe_cli
from tests.safety._hold import wait_for
from tests.safety._runs import fingerprint

#: 4 steps, a checkpoint, snapshot and probe record every 2; the resume pauses at step 3.
RUN = [
    "experiment=smoke",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=2",
    "callbacks.weight_snapshot.every_n_steps=2",
]


def _pause(tmp_path: Path, step: int, only_in: str | None = None) -> list[str]:
    pause = [
        "+callbacks.pause._target_=tests.safety._hold.PauseAt",
        f"+callbacks.pause.step={step}",
        f"+callbacks.pause.reached={tmp_path / 'reached'}",
        f"+callbacks.pause.release={tmp_path / 'release'}",
    ]
    return pause + ([f"+callbacks.pause.only_in={only_in}"] if only_in else [])


def _start(log: Path, *args: str) -> subprocess.Popen:
    """``flashprobe ARGS`` started in the background, its output to ``log`` (a pipe could fill and block)."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flashprobe.cli", *args]
    with log.open("w") as fh:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)


def _refused_while_busy(proc: subprocess.CompletedProcess, first: subprocess.Popen) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is in use by another flashprobe process" in proc.stderr
    assert f"pid {first.pid} " in proc.stderr  # the message names the process holding it
    assert "Traceback" not in proc.stderr


def test_a_second_resume_of_a_run_is_refused_and_the_first_ends_as_a_lone_run(tmp_path: Path) -> None:
    lone, run = tmp_path / "lone", tmp_path / "run"
    assert flashprobe_cli("train", *RUN, f"hydra.run.dir={lone}").returncode == 0
    assert flashprobe_cli("train", *RUN, "trainer.max_steps=2", f"hydra.run.dir={run}").returncode == 0
    first = _start(
        tmp_path / "first.log", "train", f"resume={run}", "trainer.max_steps=4", *_pause(tmp_path, 3)
    )
    try:
        wait_for(tmp_path / "reached")
        before = fingerprint(run, skip=(LOCK_NAME,))
        # the first resume recorded its pause callback: a resume of it replaces that (it is not data)
        second = flashprobe_cli("train", f"resume={run}", "trainer.max_steps=4", "~callbacks.pause")
        _refused_while_busy(second, first)
        fresh = flashprobe_cli("train", *RUN, f"hydra.run.dir={run}", "overwrite=true")  # a second train
        _refused_while_busy(fresh, first)
        assert fingerprint(run, skip=(LOCK_NAME,)) == before  # neither wrote anything
        (tmp_path / "release").touch()
        first.wait(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert (run / "probe.jsonl").read_text() == (lone / "probe.jsonl").read_text()  # each step once, in order
    for step in (0, 2, 4):
        name = f"snapshots/step_{step:07d}.safetensors"
        mine, theirs = load_file(run / name), load_file(lone / name)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), step
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "finished" and all(s["seconds"] is not None for s in record["sessions"])
    assert not (run / LOCK_NAME).exists()  # let go at the end


def test_a_second_study_into_the_same_out_is_refused_and_the_first_matches_a_lone_study(
    tmp_path: Path,
) -> None:
    out, runs = tmp_path / "study", ["--runs", "flash,baseline"]
    first = _start(
        tmp_path / "first.log",
        "study",
        "--out",
        str(out),
        *runs,
        *TINY,
        *_pause(tmp_path, 1, only_in="baseline"),
    )
    try:
        wait_for(tmp_path / "reached")
        before = fingerprint(out, skip=(LOCK_NAME,))
        second = flashprobe_cli("study", "--out", str(out), *runs, *TINY)
        _refused_while_busy(second, first)
        assert fingerprint(out, skip=(LOCK_NAME,)) == before
        (tmp_path / "release").touch()
        first.wait(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 4, (tmp_path / "first.log").read_text()[
        -3000:
    ]  # UNDETERMINED: no context pair
    lone = tmp_path / "lone"
    run_study(lone, ["flash", "baseline"], TINY)
    probe = (out / "runs" / "flash" / "probe.jsonl").read_text()  # every step trained and logged once
    assert probe == (lone / "runs" / "flash" / "probe.jsonl").read_text()
    mine, theirs = read_study(out)["pairs"], read_study(lone)["pairs"]
    for pair in mine.values():
        pair.pop("run_a", None), pair.pop("run_b", None)
    for pair in theirs.values():
        pair.pop("run_a", None), pair.pop("run_b", None)
    assert mine == theirs


def test_a_lock_is_refused_in_process_and_a_killed_holders_lock_is_taken_over(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.safety._hold", str(tmp_path / "dir"), str(ready)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_for(ready)
        busy = rf"in use by another flashprobe process \(pid {holder.pid} "
        with pytest.raises(DirectoryLockedError, match=busy), directory_lock(tmp_path / "dir"):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / "dir" / LOCK_NAME).is_file()  # a stale lock file, its holder dead
    with directory_lock(tmp_path / "dir") as lock:
        assert f"pid {os.getpid()} " in lock.read_text()
        with directory_lock(tmp_path / "dir"):  # re-entrant in one process
            pass
        assert lock.exists()
    assert not (tmp_path / "dir" / LOCK_NAME).exists()
