"""What a user sees: a study's console is short, progress per run, the verdict and paths last;
``flashprobe train`` prints every line once, without tips or third-party deprecation noise."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashprobe.app.study_progress import StudyProgress, format_seconds
from flashprobe.formats.run_record import finish_session, start_session
from tests.app._study import ROOT, flashprobe_cli

TINY = [
    "model=tiny",
    "threads=1",  # (experiment=study's two threads beside the other test workers: runs several times slower)
    "data.num_train=64",
    "data.num_val=16",
    "data.batch_size=16",
    "trainer.val_check_interval=4",
    "callbacks.weight_snapshot.every_n_steps=2",
    "module.num_samples=2",
    "module.num_sample_steps=2",
]
NOISE = ("💡", "Tip:", "LeafSpec", "anonymous setting", "Run summary", "Run history")


def _run(*args: str, cwd: Path) -> tuple[int, list[str]]:
    proc = flashprobe_cli(*args, cwd=cwd, unset=["WANDB_SILENT"])  # WANDB_SILENT: not in a user's shell
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


def test_a_tiny_study_prints_at_most_40_lines_ending_with_the_verdict_and_paths(tmp_path: Path) -> None:
    out = tmp_path / "study"
    command = ["study", "--out", str(out), "--runs", "flash,baseline,identical", "trainer.max_steps=4", *TINY]
    command += ["study.replicates=1"]
    rc, lines = _run(*command, cwd=tmp_path)
    assert rc == 4, "\n".join(lines[-40:])  # UNDETERMINED: no seed or low-precision pair (docs/study.md)
    assert len(lines) <= 40, "\n".join(lines)
    text = [line for line in lines if line.strip()]
    assert len(text) == len(set(text)), "a line is printed twice"
    assert not [line for line in lines if any(n in line for n in NOISE)]
    for k, run in enumerate(("flash", "baseline", "identical"), start=1):
        assert any(re.match(rf"\[{k}/3\] {run} +training \(", line) for line in lines), run
        probe = r" · probe PASS \(5 sites, worst error/limit [0-9.e-]+\)" if run == "flash" else ""
        assert any(re.match(rf"\[{k}/3\] {run} +done in \d+ s{probe} · elapsed", line) for line in lines), run
    # a passing run's verdict is its one line: no per-site table (17 lines a flash run), no block
    assert not [line for line in lines if "site" in line.split() and "dir" in line.split()]
    assert not [line for line in lines if "AttentionProbe: verdict" in line]
    assert [line.split(":")[0] for line in lines[-4:]] == ["report", "numbers", "figures", "runs"]
    verdict = lines[lines.index("") + 1 : -5] if "" in lines else []
    # the answer comes first
    assert verdict[0].startswith("UNDETERMINED: no seed pair (runs that differ in the seed alone")
    assert any(line.startswith("flash_vs_baseline (sdpa_flash vs math attention") for line in verdict)
    assert (out / "report.md").is_file() and str(out / "report.md") in lines[-4]
    # everything else went to the runs' logs
    log = (out / "runs" / "flash" / "train.log").read_text()
    assert "WeightSnapshot: saved step 4" in log and "Trainer.fit` stopped" in log

    rc, again = _run(*command, cwd=tmp_path)
    assert rc == 4 and sum("finished earlier: skipped" in line for line in again) == 3


def test_flashprobe_train_prints_each_line_once_without_noise(tmp_path: Path) -> None:
    rc, lines = _run("train", f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=4", *TINY, cwd=tmp_path)
    assert rc == 0, "\n".join(lines[-40:])
    assert not [line for line in lines if any(n in line for n in NOISE)]
    messages = [line.split("] - ", 1)[-1] for line in lines if line.strip()]
    assert len(messages) == len(set(messages)), "a line is printed twice"
    assert any("W&B run (offline)" in line and "wandb sync" in line for line in lines)
    assert not any("Epoch 0" in line for line in lines)  # no progress bar in a log (stdout is not a TTY)


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _in_a_terminal(args: list[str], cwd: Path) -> tuple[int, list[str]]:
    """Run ``flashprobe ARGS`` with stdout and stderr on a pseudo-terminal (200 columns); the
    screen's lines, ANSI escapes removed, each ``\\r`` a new line (a bar redraw)."""
    master, slave = os.openpty()
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.update({"COLUMNS": "200", "LINES": "50", "TERM": "xterm"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashprobe.cli", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env=env,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    rc = proc.wait(timeout=600)
    screen = _ANSI.sub("", b"".join(chunks).decode("utf-8", "replace"))
    return rc, [line for line in re.split(r"\r\n|\r|\n", screen) if line.strip()]


def test_flashprobe_train_in_a_terminal_bar_records_and_last_lines(tmp_path: Path) -> None:
    rc, lines = _in_a_terminal(
        ["train", f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=4", *TINY], tmp_path
    )
    assert rc == 0, "\n".join(lines[-40:])
    bar = [line for line in lines if re.match(r"train +\S* *\d/4 ", line)]
    assert bar, "\n".join(lines)  # the bar counts steps: "train ... 3/4"
    assert not any("Epoch 0" in line for line in lines), "Lightning's 'Epoch 0/-2' label"
    assert not any("GPU available: False" in line or "TPU available: False" in line for line in lines)
    records = [line for line in lines if "][INFO] - " in line or "][WARNING] - " in line]
    assert records and all(line.startswith("[20") for line in records), "a record glued onto the bar's line"
    assert "flashprobe.callbacks.attention_probe" in records[-1]  # the probe's summary is the last record
    assert any("AttentionProbe: verdict PASS" in line for line in records[-2:])


def _record(runs: Path, name: str, seconds: float | None, from_step: int = 0) -> None:
    start_session(runs / name, from_step=from_step, max_steps=4, machine={}, resumed_from=None)
    if seconds is not None:
        finish_session(runs / name, global_step=4, seconds=seconds)


def test_progress_reads_the_runs_records(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for name in ("a", "b", "c"):
        (runs / name).mkdir(parents=True)
    _record(runs, "a", 30.0)  # finished before this invocation
    stream = io.StringIO()
    progress = StudyProgress(runs, {"a": "math", "b": "flash", "c": "math"}, stream=stream, interval=3600)
    with progress:
        _record(runs, "b", None, from_step=2)
        progress.poll()
        finish_session(runs / "b", global_step=4, seconds=100.0)
        progress.poll()
        _record(runs, "c", 50.0)  # started and finished between two polls
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[1/3] a  finished earlier: skipped"
    assert lines[1] == "[2/3] b  training (flash, resumed at step 2)"
    assert lines[2].startswith("[2/3] b  done in 1 min 40 s · elapsed ") and lines[2].endswith(
        "ETA 1 min 40 s"
    )
    assert lines[3] == "[3/3] c  training (math)"
    assert lines[4].startswith("[3/3] c  done in 50 s · elapsed ") and "ETA" not in lines[4]
    assert lines[5].startswith("trained 2 runs in ") and lines[5].endswith("(1 finished earlier)")


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0 s"), (59.6, "1 min 00 s"), (125, "2 min 05 s"), (3720, "1 h 02 min")]
)
def test_format_seconds(seconds: float, text: str) -> None:
    assert format_seconds(seconds) == text
