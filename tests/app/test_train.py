"""``flashprobe train`` end to end: real Hydra composition, real Lightning runs, real files."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashprobe.app.train import cli_main, compose, train
from flashprobe.kernels import KernelSpecError

SMOKE = ["experiment=smoke"]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_train_writes_the_run_directory(tmp_path: Path) -> None:
    metrics, objects = train(compose([*SMOKE, "logger=default"], run_dir=tmp_path))
    assert objects["trainer"].global_step == 4
    assert (tmp_path / "config.yaml").is_file()
    # probe.jsonl: one line per logging step (2, 4), every site of the DiT, error ratios present
    records = _jsonl(tmp_path / "probe.jsonl")
    assert [r["step"] for r in records] == [2, 4]
    sites = set(records[-1]["sites"])
    assert any(".cross_attn" in s for s in sites) and any(".attn" in s for s in sites)
    assert 0 < records[-1]["summary"]["max_error_ratio"] < 10  # flash vs math at fp32: the noise floor
    ratio = records[-1]["summary"]["limit_ratio"]  # the verdict's statistic: error / limit
    assert ratio is not None and 0 < ratio < 1
    # the same statistics reached the CSV logger and the progress bar metric
    with (tmp_path / "csv" / "version_0" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    logged = [float(r["probe/limit_ratio"]) for r in rows if r.get("probe/limit_ratio")]
    assert logged[-1] == pytest.approx(ratio)
    assert metrics["probe/limit_ratio"] == pytest.approx(ratio, rel=1e-6)  # the progress bar's
    # one name per metric, and every probe value of a logging step in its row (no per-site columns)
    probe_columns = {c for c in rows[0] if c.startswith("probe/")}
    assert "probe/err_ratio" not in probe_columns and not any(c.count("/") > 2 for c in probe_columns)
    last = next(r for r in reversed(rows) if r.get("probe/limit_ratio"))
    assert last["probe/failed"] == "0.0" and last["probe/nonfinite"] == "0.0"
    # W&B ran offline into the run directory
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    # snapshots at 0, 2, 4 and a sample grid
    manifest = json.loads((tmp_path / "snapshots" / "manifest.json").read_text())
    assert [s["step"] for s in manifest["snapshots"]] == [0, 2, 4]
    assert manifest["attention"] == "sdpa_flash"  # the kernel the model trained with (routed)
    from flashprobe.formats.run_record import read_run_record

    assert read_run_record(tmp_path)["sessions"][-1]["attention"] == "sdpa_flash"  # run.json says it too
    assert records[-1]["summary"]["backward_calls"] > 0  # gradients compared by default
    assert list(tmp_path.glob("csv/version_0/samples/step_*.png"))
    # the per-site deviation plot, drawn from probe.jsonl at the end of training
    png = (tmp_path / "probe.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


#: flash attention at fp32, no probe: the reference the probed run and a second run must equal bit for bit
PLAIN = [*SMOKE, "attention=flash", "logger=csv", "attention.probe.enabled=false"]


#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("app/test_train")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("plain") / "run"
    train(compose(PLAIN, run_dir=run))
    return run


def _same_weights(a: Path, b: Path, steps: tuple[int, ...] = (0, 2, 4)) -> None:
    for step in steps:
        name = f"snapshots/step_{step:07d}.safetensors"
        wa, wb = load_file(a / name), load_file(b / name)
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f"step {step}"


def test_same_seed_gives_identical_weights(plain: Path, tmp_path: Path) -> None:
    train(compose(PLAIN, run_dir=tmp_path / "again"))
    _same_weights(plain, tmp_path / "again")


def test_the_probe_leaves_training_bit_identical(plain: Path, tmp_path: Path) -> None:
    """flashprobe train with the probe on (forward and backward, golden) vs off: the same weights."""
    probed = [*SMOKE, "attention=flash", "logger=csv", "attention.probe.backward=true"]
    train(compose(probed, run_dir=tmp_path / "probed"))
    assert (tmp_path / "probed" / "probe.jsonl").is_file()
    assert not (plain / "probe.jsonl").exists()
    _same_weights(tmp_path / "probed", plain)


def test_bad_config_fails_before_training(tmp_path: Path) -> None:
    with pytest.raises(KernelSpecError, match="unknown kernel 'nope'"):
        train(compose([*SMOKE, "attention.kernel=nope"], run_dir=tmp_path))
    with pytest.raises(ValueError, match="max_steps=-5 must be positive"):
        train(compose([*SMOKE, "trainer.max_steps=-5"], run_dir=tmp_path))
    assert not (tmp_path / "probe.jsonl").exists()


def test_multirun_sweeps_attention_kernels(tmp_path: Path) -> None:
    import __main__

    argv, spec = list(sys.argv), getattr(__main__, "__spec__", None)
    cli_main(
        [
            "-m",
            *SMOKE,
            "attention=flash,math",
            "trainer.max_steps=2",
            f"hydra.sweep.dir={tmp_path}",
            "hydra.sweep.subdir=${run_name}",
        ]
    )
    # Hydra and Lightning's launcher read sys.argv and __main__.__spec__: set for the command, then put back
    assert sys.argv == argv
    assert getattr(__main__, "__spec__", None) is spec
    assert (tmp_path / "flash-seed0" / "probe.jsonl").is_file()
    assert not (tmp_path / "math-seed0" / "probe.jsonl").exists()  # math is the baseline: no probe
    assert (tmp_path / "math-seed0" / "snapshots" / "manifest.json").is_file()


def test_ddp_on_two_cpu_processes_gives_one_probe_jsonl(tmp_path: Path) -> None:
    overrides = [*SMOKE, "trainer.max_steps=2", "trainer.log_every_n_steps=1"]
    cmd = [
        sys.executable,
        "-m",
        "flashprobe.cli",
        "train",
        *overrides,
        "trainer=ddp_cpu",
        f"hydra.run.dir={tmp_path / 'ddp'}",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "WANDB_MODE": "offline"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = _jsonl(tmp_path / "ddp" / "probe.jsonl")
    assert [r["step"] for r in ddp] == [1, 2]  # rank zero wrote each logging step once
    # the oracle: one process on the same config; DDP's statistics are reduced over both ranks,
    # so every site has twice the calls, and maxima are at least the single process's
    train(compose(overrides, run_dir=tmp_path / "single"))
    single = _jsonl(tmp_path / "single" / "probe.jsonl")
    for d, s in zip(ddp, single, strict=True):
        assert d["sites"].keys() == s["sites"].keys()
        for site in s["sites"]:
            assert d["sites"][site]["forward"]["calls"] == 2 * s["sites"][site]["forward"]["calls"], site
        assert d["summary"]["nonfinite"] == 0


@pytest.mark.parametrize(
    ("env", "launched"),
    [
        ({}, False),
        ({"LOCAL_RANK": "1"}, True),
        ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, True),
        ({"RANK": "3"}, True),
        ({"SLURM_NTASKS": "8", "SLURM_PROCID": "5"}, True),
        ({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}, False),
        ({"SLURM_NTASKS": "1", "SLURM_PROCID": "5"}, False),  # one task: Lightning launches the ranks
    ],
)
def test_only_rank_zero_decides_how_a_run_starts(
    monkeypatch: pytest.MonkeyPatch, env: dict, launched: bool
) -> None:
    from flashprobe.app.run_dir import launched_rank

    for var in ("LOCAL_RANK", "NODE_RANK", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert launched_rank() is launched


def test_a_library_train_with_another_jobs_hydra_config_writes_no_record(tmp_path: Path) -> None:
    """A Hydra job's config left in the process (Hydra sets it for a job and clears it after; a job that
    ends abnormally can leave it) is not a later ``train(compose(...))``'s: that run writes no
    ``.hydra/`` record, where it wrote the other job's config and overrides. In a process of its own:
    the job's config is process-wide state."""
    first, second = tmp_path / "first", tmp_path / "second"
    script = f"""
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import open_dict
from flashprobe.app.train import compose, train
from tests.safety._runs import SHORT
job = compose(SHORT, run_dir={str(first)!r}, hydra=True)
with open_dict(job):
    job.hydra.runtime.output_dir = {str(first)!r}
    job.hydra.mode = RunMode.RUN
HydraConfig.instance().set_config(job)
train(compose(SHORT, run_dir={str(second)!r}))
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (second / "run.json").exists()
    assert not (second / ".hydra").exists()
