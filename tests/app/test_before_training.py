"""Settings that would fail inside training are refused before it, and whatever still fails inside
training leaves ``run.json`` saying so, never "running"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashprobe.app.train import compose, train
from flashprobe.formats.run_record import read_run_record
from tests.safety._runs import SHORT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA-only kernel runs here")
@pytest.mark.parametrize("key", ["attention.kernel", "attention.probe.baseline"])
def test_a_cuda_only_kernel_on_the_cpu_is_refused_before_training(tmp_path: Path, key: str) -> None:
    run = tmp_path / "run"
    expected = rf"{key}=sdpa_cudnn: runs on CUDA devices only, not CPU.*trains on cpu"
    with pytest.raises(ValueError, match=expected):
        train(compose([*SHORT, f"{key}=sdpa_cudnn"], run_dir=run))
    assert not run.exists()


def test_probe_sites_that_name_no_module_are_refused_before_training(tmp_path: Path) -> None:
    run = tmp_path / "run"
    expected = r"sites=\['nosuch\.\*'\] matches no module of the model.*model\.blocks\.0\.attn"
    with pytest.raises(ValueError, match=expected):
        train(compose([*SHORT, "attention.probe.sites=[nosuch.*]"], run_dir=run))
    assert not (run / "run.json").exists()  # nothing of a run: no record left "running"


def test_a_crash_inside_training_is_recorded_in_run_json(tmp_path: Path) -> None:
    crash = ["+callbacks.crash._target_=tests.app._kill.RaiseAt", "+callbacks.crash.step=1"]
    with pytest.raises(RuntimeError, match="a crash at step 1"):
        train(compose([*SHORT, *crash], run_dir=tmp_path))
    record = read_run_record(tmp_path)
    assert record["status"] == "failed"
    assert record["sessions"][-1]["failed"] == "RuntimeError: a crash at step 1"


def test_an_unknown_hydra_launcher_is_refused_before_a_study_starts(tmp_path: Path, capsys) -> None:
    from flashprobe.app.study import main
    from tests.app._study import TINY

    out = tmp_path / "study"
    assert main(["--out", str(out), "--runs", "flash,baseline", *TINY, "hydra/launcher=nosuch"]) == 2
    err = capsys.readouterr().err
    assert "hydra/launcher=nosuch is not a Hydra launcher installed here (found: basic" in err
    assert not out.exists()


def test_a_study_refuses_probe_sites_that_name_no_module_before_its_first_run(tmp_path: Path, capsys) -> None:
    """The study built its first run before checking the sites: refused inside it, after OUT/runs/flash
    was made (issue 42's table); now refused with the same paragraph before OUT exists."""
    from flashprobe.app.study import main
    from tests.app._study import TINY

    out = tmp_path / "study"
    assert (
        main(["--out", str(out), "--runs", "flash,baseline", *TINY, "attention.probe.sites=[nosuch.*]"]) == 2
    )
    assert "sites=['nosuch.*'] matches no module of the model" in capsys.readouterr().err
    assert not out.exists()
