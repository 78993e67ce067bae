"""flashprobe's own errors reach the user of ``flashprobe train`` as one paragraph on stderr with exit
code 2, before training where they can be known then; a bug (an exception flashprobe did not raise on
purpose) keeps its traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashprobe.app.train import cli_main
from tests.app._study import flashprobe_cli
from tests.safety._runs import SHORT, fingerprint


def _one_paragraph(stderr: str) -> str:
    """The error paragraph ``flashprobe train`` printed, checked to be the whole of stderr's error."""
    assert "Traceback" not in stderr and "Error executing job" not in stderr, stderr[-3000:]
    assert "HYDRA_FULL_ERROR" not in stderr and "Error in call to target" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "flashprobe train: error:" in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def _train(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``flashprobe train ARGS`` in this process: its exit code and stderr."""
    capsys.readouterr()
    try:
        code = cli_main(args)
    except SystemExit as exit_:  # a refusal inside the Hydra job ends it with SystemExit(2)
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="flex has a backward on CUDA")
@pytest.mark.parametrize(
    ("setting", "problem", "fix"),
    [
        (  # the kernel runs on the CPU but has no backward there: the first step would fail
            "attention.kernel=flex",
            "attention.kernel=flex has no backward on cpu, and the model trains through it",
            "choose a kernel with a backward there (math, tiled or sdpa_math), or train on a GPU",
        ),
        (  # ProbeConfig refuses it; known before the callback is built
            "attention.probe.every_n_calls=0",
            "attention.probe: every_n_calls=0 must be an int >= 1",
            "(1 = every call)",
        ),
        (  # a CUDA-only kernel on the CPU: refused by the schema, not at the first batch
            "attention.kernel=sdpa_cudnn",
            "attention.kernel=sdpa_cudnn: runs on CUDA devices only, not CPU",
            "This run trains on cpu (trainer.accelerator=cpu); for a GPU run give trainer=gpu",
        ),
        (  # sites are module paths: a pattern naming no module of the model names no site
            "attention.probe.sites=[nosuch.*]",
            "attention.probe.sites=['nosuch.*'] matches no module of the model, so no attention site",
            "its attention modules are model.text_encoder.blocks.0.attn, model.blocks.0.attn",
        ),
        (  # a callback's constructor refuses it: named by its key, without Hydra's wrapping
            "callbacks.weight_snapshot.every_n_steps=0",
            "callbacks.weight_snapshot: WeightSnapshot: every_n_steps must be a positive int",
            "or None, got 0",
        ),
    ],
)
def test_a_refused_setting_is_one_paragraph_with_exit_code_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str, problem: str, fix: str
) -> None:
    run = tmp_path / "run"
    code, stderr = _train([*SHORT, setting, f"hydra.run.dir={run}"], capsys)
    assert code == 2, stderr[-3000:]
    line = _one_paragraph(stderr)
    assert problem in line and fix in line, line
    assert not run.exists()  # refused before training; what Hydra wrote for the job is gone


def test_a_refusal_inside_the_hydra_job_is_one_paragraph_and_exit_code_2_of_the_process(
    tmp_path: Path,
) -> None:
    """The same as above, as a user's shell sees it: a separate process, its exit code and its stderr."""
    run = tmp_path / "run"
    proc = flashprobe_cli(
        "train", *SHORT, "callbacks.weight_snapshot.every_n_steps=0", f"hydra.run.dir={run}"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "every_n_steps must be a positive int" in _one_paragraph(proc.stderr)
    assert not run.exists()


@pytest.mark.slow
def test_a_kernel_refusing_a_call_inside_training_is_one_paragraph_with_exit_code_2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    refuse = ["+callbacks.crash._target_=tests.app._kill.RaiseAt", "+callbacks.crash.step=1"]
    proc = flashprobe_cli(
        "train", *SHORT, *refuse, "+callbacks.crash.kernel_refusal=true", f"hydra.run.dir={run}"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_paragraph(proc.stderr)
    assert line.endswith("error: tiled: head dim 59 at step 1 is not supported; choose math"), line
    assert (run / "run.json").is_file()  # the run recorded why it ended


def test_a_users_subclass_of_a_flashprobe_error_is_recognised_by_its_class_not_its_module(
    tmp_path: Path,
) -> None:
    """A kernel module of the user's raises its own subclass of ``KernelUnsupportedError`` at the first
    step: a ``FlashprobeError``, so one paragraph and exit code 2, though its module is not flashprobe's
    (a process of its own: a Hydra job that ends inside training leaves Hydra's state set)."""
    run = tmp_path / "run"
    refuse = ["+callbacks.crash._target_=tests.app._kill.RaiseAt", "+callbacks.crash.step=0"]
    refuse.append("+callbacks.crash.user_refusal=true")
    proc = flashprobe_cli("train", *SHORT, *refuse, f"hydra.run.dir={run}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_paragraph(proc.stderr)
    assert line.endswith("error: mykernel: head dim 59 at step 0 is not supported; choose math"), line


@pytest.mark.slow
def test_a_bug_inside_training_keeps_its_traceback(tmp_path: Path) -> None:
    crash = ["+callbacks.crash._target_=tests.app._kill.RaiseAt", "+callbacks.crash.step=1"]
    proc = flashprobe_cli("train", *SHORT, *crash, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "RuntimeError: a crash at step 1" in proc.stderr and "flashprobe train: error:" not in proc.stderr


def test_a_setting_refused_inside_the_job_leaves_a_run_directorys_record_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hydra rewrites ``RUN/.hydra`` before the run's objects are built; a refusal there restores it, so
    the next ``resume=RUN`` replays the run's own overrides, not the refused one."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in SHORT))
    before = fingerprint(run)
    code, stderr = _train([f"resume={run}", "callbacks.weight_snapshot.every_n_steps=0"], capsys)
    assert code == 2, stderr[-3000:]
    assert "every_n_steps must be a positive int" in _one_paragraph(stderr)
    assert fingerprint(run) == before
