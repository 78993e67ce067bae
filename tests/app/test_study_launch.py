"""A study on Hydra launchers (basic, joblib, submitit's local executor), DDP runs, interrupted and
re-invoked studies, and users' own conf/ directories — each against the basic launcher's numbers."""

from __future__ import annotations

import importlib.util
import json
import signal
from pathlib import Path

import pytest

import flashprobe.app.study as study_module
from flashprobe.app.study import check_launcher, run_study
from flashprobe.formats.run_record import read_run_record
from flashprobe.formats.study_file import read_study
from flashprobe.report.study_verdict import EXIT_CODES, UNDETERMINED
from tests.app._study import ROOT, TINY, flashprobe_cli

RUNS = ["flash", "baseline"]
#: two replicates: replicate 0's runs are one Hydra multirun, replicate 1's (flash_seed2, baseline_seed2)
#: another, so every launcher here starts both
STUDY = [*TINY, "study.replicates=2"]
TRAINED = ["flash", "baseline", "flash_seed2", "baseline_seed2"]
#: flash and baseline answer no question of the rule's (no seed or low-precision pair)
UNDETERMINED_EXIT = EXIT_CODES[UNDETERMINED]


def _pairs(out: Path) -> dict:
    """study.json's numbers: every pair's distances at every step (without the runs' paths)."""
    pairs = read_study(out)["pairs"]
    return {n: {k: v for k, v in p.items() if k not in ("run_a", "run_b")} for n, p in pairs.items()}


#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("app/test_study_launch")


@pytest.fixture(scope="module")
def basic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the study on Hydra's basic launcher (runs one after another in this process)."""
    out = tmp_path_factory.mktemp("basic")
    run_study(out, RUNS, STUDY)
    return out


def _plugin(module: str) -> pytest.MarkDecorator:
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing, reason=f"{module} not installed: pip install -e '.[cluster]'")


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param(
            ["hydra/launcher=submitit_local"], marks=_plugin("hydra_plugins.hydra_submitit_launcher")
        ),
        pytest.param(
            ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
            marks=_plugin("hydra_plugins.hydra_joblib_launcher"),
        ),
    ],
)
def test_a_launcher_gives_the_basic_launchers_numbers(
    basic: Path, tmp_path: Path, launcher: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``flashprobe study`` in this process (the launcher starts the runs' processes; the killed study
    below is the command run as a user's shell runs it)."""
    out = tmp_path / "study"
    code = study_module.main(["--out", str(out), "--runs", ",".join(RUNS), *STUDY, *launcher])
    printed = capsys.readouterr()
    assert code == UNDETERMINED_EXIT, printed.err[-3000:]
    assert _pairs(out) == _pairs(basic)  # every distance at every step, exactly
    assert "flash_vs_baseline_seed2" in _pairs(out)
    for run in TRAINED:
        assert read_run_record(out / "runs" / run)["status"] == "finished"
    if "submitit" in launcher[0]:  # each run was a submitit job of its own
        assert len(list((out / "runs" / ".submitit").glob("*/*_result.pkl"))) == len(TRAINED)
    assert printed.out.rstrip().splitlines()[-4].startswith("report:")


def test_a_killed_study_invoked_again_trains_only_what_had_not_finished(basic: Path, tmp_path: Path) -> None:
    out = tmp_path / "study"
    kill = [  # SIGKILL the whole study during run 2 of 4 (after its step 3), the first time only
        "+callbacks.kill._target_=tests.app._kill.KillAt",
        "+callbacks.kill.step=3",
        "+callbacks.kill.only_in=baseline",
        f"+callbacks.kill.once={tmp_path / 'killed-once'}",
    ]
    command = ["study", "--out", str(out), "--runs", ",".join(RUNS), *STUDY, *kill]
    killed = flashprobe_cli(*command)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert read_run_record(out / "runs" / "flash")["status"] == "finished"
    assert read_run_record(out / "runs" / "baseline")["status"] == "running"
    assert not (out / "runs" / "flash_seed2").exists() and not (out / "study.json").exists()

    # the same command, in this process (the kill callback's marker exists: it kills no more)
    assert study_module.main(command[1:]) == UNDETERMINED_EXIT
    flash, baseline, *replicate1 = (read_run_record(out / "runs" / r) for r in TRAINED)
    assert len(flash["sessions"]) == 1  # finished: skipped, not retrained
    assert [s["from_step"] for s in baseline["sessions"]] == [0, 2]  # resumed from its step-2 checkpoint
    assert all(len(r["sessions"]) == 1 and r["status"] == "finished" for r in replicate1)  # then trained
    assert _pairs(out) == _pairs(basic)  # equal to the uninterrupted study


def test_each_study_run_can_be_a_ddp_run(tmp_path: Path) -> None:
    out = tmp_path / "study"
    proc = flashprobe_cli(
        "study", "--out", str(out), "--runs", "flash,baseline", *TINY, "trainer=ddp_cpu", cwd=tmp_path
    )
    assert proc.returncode == UNDETERMINED_EXIT, proc.stderr[-3000:]
    for run in ("flash", "baseline"):
        record = read_run_record(out / "runs" / run)
        assert record["status"] == "finished" and record["global_step"] == 4, run
        manifest = json.loads((out / "runs" / run / "snapshots" / "manifest.json").read_text())
        assert [s["step"] for s in manifest["snapshots"]] == [0, 2, 4]
        assert (out / "runs" / run / "train_ddp_process_1.log").is_file()  # rank 1 ran in this run's dir
    probe = [json.loads(line) for line in (out / "runs" / "flash" / "probe.jsonl").read_text().splitlines()]
    assert [r["step"] for r in probe] == [4]  # one record per logging step, from rank zero
    assert not (tmp_path / "outputs").exists()  # no rank wandered off into a directory of its own
    assert _pairs(out)["flash_vs_baseline"]["steps"] == [0, 2, 4]


def test_a_launcher_plugin_that_is_not_installed_is_named_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        study_module._LAUNCHER_MODULES, "hydra-submitit-launcher", "hydra_plugins.not_installed"
    )
    with pytest.raises(ValueError, match="pip install hydra-submitit-launcher"):
        check_launcher(["hydra/launcher=submitit_slurm"])
    with pytest.raises(ValueError, match="pip install hydra-submitit-launcher"):
        run_study(tmp_path / "s", RUNS, [*TINY, "hydra/launcher=submitit_local"])
    assert not (tmp_path / "s").exists()
    check_launcher(["hydra/launcher=basic"])  # Hydra's own: nothing to install


@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None,
    reason="hydra-ray-launcher is installed here",
)
def test_the_cli_names_the_missing_ray_plugin(tmp_path: Path) -> None:
    proc = flashprobe_cli("study", "--out", str(tmp_path / "s"), "hydra/launcher=ray")
    assert proc.returncode == 2
    assert "pip install hydra-ray-launcher" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "s").exists()


# --- users' own conf/ --------------------------------------------------------------------------


def _user_conf(root: Path) -> Path:
    """A user's conf/: a packaged group option replaced (model=tiny) and a new experiment."""
    conf = root / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "experiment").mkdir()
    (conf / "model" / "tiny.yaml").write_text(
        (ROOT / "flashprobe" / "conf" / "model" / "tiny.yaml").read_text() + "\ndepth: 3\n"
    )
    (conf / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - study\n  - _self_\n"
        "study:\n  kernel: tiled:block_k=16\nmodule:\n  guidance_scale: 2.5\n"
    )
    return conf


def _job_config(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> dict:
    """``flashprobe train ARGS --cfg job`` run in ``cwd`` (in this process: the search path plugin reads
    ``./conf`` and ``$FLASHPROBE_CONFIG_DIR`` at composition, as in a new one): the job's config."""
    import yaml

    from flashprobe.app.train import cli_main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    assert cli_main([*args, "--cfg", "job"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_a_conf_dir_in_the_working_directory_overrides_and_extends_the_packaged_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    _user_conf(tmp_path)
    cfg = _job_config(["experiment=mine", "model=tiny"], tmp_path, monkeypatch, capsys)
    assert cfg["model"]["depth"] == 3 and cfg["module"]["guidance_scale"] == 2.5
    assert cfg["study"]["kernel"] == "tiled:block_k=16"
    assert cfg["threads"] == 2  # from the packaged experiment=study the user's file builds on
    packaged = _job_config(["model=tiny"], ROOT, monkeypatch, capsys)
    assert "depth" not in packaged["model"]  # the repository's own conf/ replaces nothing


def test_config_dir_and_the_environment_variable_point_at_a_conf_dir_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    conf = _user_conf(tmp_path / "mine")
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    by_flag = _job_config(["--config-dir", str(conf), "experiment=mine"], elsewhere, monkeypatch, capsys)
    assert by_flag["module"]["guidance_scale"] == 2.5
    monkeypatch.setenv("FLASHPROBE_CONFIG_DIR", str(conf))
    by_env = _job_config(["experiment=mine"], elsewhere, monkeypatch, capsys)
    assert by_env["module"]["guidance_scale"] == 2.5
    monkeypatch.delenv("FLASHPROBE_CONFIG_DIR")
    missing = ["--config-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "s")]
    assert study_module.main(missing) == 2
    assert "--config-dir" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_a_study_runs_a_users_experiment_from_config_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = _user_conf(tmp_path / "mine")
    out = tmp_path / "study"
    monkeypatch.chdir(tmp_path)
    assert (
        study_module.main(
            [
                "--config-dir",
                str(conf),
                "--out",
                str(out),
                "--runs",
                "flash,baseline",
                "experiment=mine",
                *TINY,
            ]
        )
        == UNDETERMINED_EXIT
    )
    doc = read_study(out)
    assert doc["study"]["kernel"] == "tiled:block_k=16"
    config = (out / "runs" / "flash" / "config.yaml").read_text()
    assert "tiled:block_k=16" in config and "guidance_scale: 2.5" in config
