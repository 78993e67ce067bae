"""A run that cannot go on ends honestly: non-finite loss or weights, Ctrl-C and a full disk each stop
it with one message saying why, what was saved and how to continue, a nonzero exit code, and
``run.json`` recording the failed session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashprobe.app.train import RunStoppedError, compose, train
from flashprobe.formats.run_record import read_run_record
from flashprobe.kernels import math_attention, register_kernel, unregister_kernel
from tests.app._study import ROOT, flashprobe_cli
from tests.safety._hold import wait_for
from tests.safety._runs import SHORT


def _as_in_a_terminal() -> None:
    """Popen's preexec_fn: Ctrl-C reaches the command as it does in a terminal. A suite started in the
    background (``cmd &`` in a shell without job control, as CI runners and ``nohup`` do) passes
    SIGINT on as ignored, and a Python started with it ignored keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def nan_row_kernel():
    """A kernel whose output's first query row is NaN (a broken kernel, as in the issue)."""

    def nan_row(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        return torch.cat([torch.full_like(out[..., :1, :], float("nan")), out[..., 1:, :]], dim=-2)

    register_kernel("safety_nan_row", nan_row, overwrite=True)
    yield "safety_nan_row"
    unregister_kernel("safety_nan_row")


def test_a_run_that_turns_nan_stops_and_says_so(tmp_path: Path, nan_row_kernel: str) -> None:
    with pytest.raises(RunStoppedError, match=r"became (nan|non-finite) at step 1: training stopped") as err:
        train(
            compose([*SHORT, "trainer.max_steps=4", f"attention.kernel={nan_row_kernel}"], run_dir=tmp_path)
        )
    assert err.value.exit_code == 1
    record = read_run_record(tmp_path)
    assert record["status"] == "failed" and record["global_step"] == 1
    assert "at step 1" in record["sessions"][-1]["failed"]
    summary = json.loads((tmp_path / "probe.jsonl").read_text().splitlines()[0])["summary"]
    assert summary["step"] == 1 and summary["primary_nonfinite"] > 0  # the headline names the primary
    assert summary["primary_nonfinite_sites"] and set(summary["primary_nonfinite_sites"]) <= set(
        summary["nonfinite_sites"]
    )


def test_on_nonfinite_continue_trains_on_and_records_it(tmp_path: Path, nan_row_kernel: str) -> None:
    overrides = [*SHORT, f"attention.kernel={nan_row_kernel}", "on_nonfinite=continue"]
    _, objects = train(compose(overrides, run_dir=tmp_path))
    assert objects["trainer"].global_step == 2
    record = read_run_record(tmp_path)
    assert record["status"] == "finished" and "at step 1" in record["sessions"][-1]["note"]


def test_a_full_disk_is_one_message_and_a_failed_session(tmp_path: Path) -> None:
    run = tmp_path / "run"
    fail = ["+callbacks.fail._target_=tests.safety._hold.FailWriteAt", "+callbacks.fail.step=1"]
    proc = flashprobe_cli("train", *SHORT, f"hydra.run.dir={run}", *fail)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"the disk holding {run} is full (" in proc.stderr and f"resume={run}" in proc.stderr
    assert "Traceback" not in proc.stderr
    record = read_run_record(run)
    assert record["status"] == "failed" and "is full" in record["sessions"][-1]["failed"]


def test_ctrl_c_stops_promptly_says_what_was_saved_and_exits_130(tmp_path: Path) -> None:
    run = tmp_path / "run"
    pause = [
        "+callbacks.pause._target_=tests.safety._hold.PauseAt",
        "+callbacks.pause.step=1",
        f"+callbacks.pause.reached={tmp_path / 'reached'}",
        f"+callbacks.pause.release={tmp_path / 'never'}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flashprobe.cli", "train", *SHORT, f"hydra.run.dir={run}", *pause]
    with (tmp_path / "log").open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_as_in_a_terminal
        )
    try:
        wait_for(tmp_path / "reached")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
    output = (tmp_path / "log").read_text()
    assert "interrupted (Ctrl-C) at step 1; saved: checkpoint checkpoints/" in output
    assert f"Continue with: flashprobe train resume={run}" in output and "Traceback" not in output
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "interrupted" and record["sessions"][-1]["seconds"] is not None
    resumed = flashprobe_cli("train", f"resume={run}", "~callbacks.pause")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_run_record(run)["status"] == "finished"


def test_ctrl_c_on_a_study_exits_130_and_the_same_command_continues_it(tmp_path: Path) -> None:
    from tests.app._study import TINY

    out = tmp_path / "study"
    pause = [  # pauses once: the same command run again passes (the "reached" file exists)
        "+callbacks.pause._target_=tests.safety._hold.PauseAt",
        "+callbacks.pause.step=1",
        f"+callbacks.pause.reached={tmp_path / 'reached'}",
        f"+callbacks.pause.release={tmp_path / 'never'}",
        "+callbacks.pause.only_in=baseline",
    ]
    command = ["study", "--out", str(out), "--runs", "flash,baseline", *TINY, *pause]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with (tmp_path / "log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flashprobe.cli", *command],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_as_in_a_terminal,
        )
    try:
        wait_for(tmp_path / "reached")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        proc.kill()
    output = (tmp_path / "log").read_text()
    assert "flashprobe study: interrupted; run the same command again to continue" in output
    assert "Traceback" not in output and not (out / "study.json").exists()
    again = flashprobe_cli(*command)
    assert again.returncode == 4, again.stderr[
        -3000:
    ]  # UNDETERMINED: flash and baseline only (docs/study.md)
    assert (out / "study.json").is_file()


def test_a_fit_that_raises_gives_the_models_attention_back(tmp_path: Path) -> None:
    """Lightning skips the module's teardown when fit raises: the run still detaches its kernel route,
    so the process's SDPA is torch's again (a route left behind sent later models to the kernel)."""
    from flashprobe.probing.intercept import active_handles

    fail = ["+callbacks.fail._target_=tests.safety._hold.FailWriteAt", "+callbacks.fail.step=1"]
    with pytest.raises(RunStoppedError, match="is full"):
        train(compose([*SHORT, *fail], run_dir=tmp_path / "run"))
    assert not active_handles()
