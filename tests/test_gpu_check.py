"""scripts/gpu_check.sh: on a machine without CUDA it prints its plan and exits 0; every command of
the plan parses with the real parsers (bench overhead, fuzz) and composes with the real Hydra config
(the study's overrides), so the check cannot rot between the rare runs on a GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


gpu_check = _module()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_prints_the_plan_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "check"
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = ["bash", str(SCRIPT), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here" in proc.stdout
    for step in gpu_check.STEPS:
        assert f"{step.name} (<= {step.limit_s} s): " in proc.stdout
    assert not out.exists()  # nothing run, nothing written


def test_usage_error_exits_2() -> None:
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "usage: scripts/gpu_check.sh OUT_DIR" in proc.stderr


def test_the_limits_fit_the_budget() -> None:
    assert sum(s.limit_s for s in gpu_check.STEPS) <= gpu_check.TOTAL_LIMIT_S <= 8 * 60
    names = {s.name for s in gpu_check.STEPS}
    assert names >= {"gpu_tests", "overhead_forward", "overhead_backward", "reference_cost"}
    assert names >= {"fuzz_cuda_sdpa", "study_50_steps"}


def _argv(name: str, out: Path) -> list[str]:
    step = next(s for s in gpu_check.STEPS if s.name == name)
    return step.command(out)[1:]


def test_overhead_commands_parse(tmp_path: Path) -> None:
    from flashprobe.bench.overhead import _parser

    for name, backward in (("overhead_forward", False), ("overhead_backward", True)):
        argv = _argv(name, tmp_path)
        assert argv[:4] == ["-m", "flashprobe.cli", "bench", "overhead"]
        config = _parser().parse_args(argv[4:])  # (the config itself refuses cuda on a CPU machine)
        assert (config.device, config.autocast, config.layers, config.seq_len) == ("cuda", "bf16", 8, 2048)
        assert config.d_model // config.heads == 128
        assert config.backward is backward


def test_fuzz_command_parses(tmp_path: Path) -> None:
    from flashprobe.fuzz.cli import _parser

    argv = _argv("fuzz_cuda_sdpa", tmp_path)
    args = _parser().parse_args(argv[3:])
    assert args.device == "cuda"
    assert set(args.kernel) == {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math"}


def test_study_overrides_compose(tmp_path: Path) -> None:
    from flashprobe.app.train import compose

    argv = _argv("study_50_steps", tmp_path)
    overrides = [a for a in argv if "=" in a]
    cfg = compose(["experiment=study", "study_run=flash", *overrides])
    assert cfg.trainer.accelerator == "gpu"
    assert cfg.trainer.max_steps == 50 and cfg.study.replicates == 1
    assert cfg.callbacks.weight_snapshot.every_n_steps == 10


def test_figures_and_markdown_from_real_outputs(tmp_path: Path) -> None:
    """A tiny CPU `bench overhead` run's JSON is read back into the summary's figures."""
    out = tmp_path / "overhead_forward"
    cmd = [
        sys.executable, "-m", "flashprobe.cli", "bench", "overhead", "--steps", "2", "--warmup", "0",
        "--every", "2", "--layers", "1", "--seq-len", "8", "--d-model", "16", "--heads", "2", "--batch", "1",
        "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    figs = gpu_check.figures("overhead_forward", out, proc.stdout)
    modes = [r["mode"] for r in figs["rows"]]
    assert "no_probe" in modes and "probe" in modes
    assert all(r["step_ms"] > 0 for r in figs["rows"])
    summary = {
        "device": "test",
        "torch": torch.__version__,
        "cuda": None,
        "seconds": 1.0,
        "steps": [{"step": "overhead_forward", "command": shlex.join(cmd), "status": "ok", "seconds": 1.0,
                   "figures": figs}],
    }  # fmt: skip
    md = gpu_check.markdown(summary)
    assert "| overhead_forward | ok | 1.0 |" in md
    assert json.loads(md.split("```json\n")[1].split("\n```")[0]) == figs
