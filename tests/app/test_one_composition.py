"""``flashprobe train`` composes a run's config once (Hydra's own composition, counted where Hydra
composes: ``ConfigLoaderImpl.load_configuration``), and a refused run never has its directory made:
every directory this process creates is recorded (``os.mkdir``, which ``Path.mkdir`` and Hydra's job
use), so a directory made and removed again is seen."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl

from flashprobe.app.train import cli_main
from tests.safety._runs import SHORT, fingerprint


@pytest.fixture
def compositions(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The run modes of every composition of a config in this test (Hydra's real composition)."""
    calls: list[object] = []
    compose = ConfigLoaderImpl.load_configuration

    def counted(self: ConfigLoaderImpl, *args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("run_mode"))
        return compose(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    return calls


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Every directory this process creates under ``tmp_path`` during the test."""
    created: list[Path] = []
    mkdir = os.mkdir

    def recorded(path: object, *args: object, **kwargs: object) -> None:
        mkdir(path, *args, **kwargs)  # type: ignore[arg-type]
        if Path(os.fsdecode(path)).absolute().is_relative_to(tmp_path):  # type: ignore[arg-type]
            created.append(Path(os.fsdecode(path)))  # type: ignore[arg-type]

    monkeypatch.setattr(os, "mkdir", recorded)
    return created


def _train(args: list[str]) -> int:
    try:
        return cli_main(args)
    except SystemExit as exit_:  # a refusal inside a Hydra job ends it with SystemExit(2)
        return int(exit_.code or 0)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("callbacks.weight_snapshot.every_n_steps=0", True),  # a callback's constructor refuses it
        ("callbacks.weight_snapshot.every_n_steps=0", False),  # ... in a ${now:...} directory of Hydra's
        ("+trainer.bogus=1", True),  # Lightning's Trainer refuses it
    ],
)
def test_a_refused_run_is_composed_once_and_never_has_its_directory_made(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    compositions: list[object],
    made: list[Path],
    setting: str,
    named: bool,
) -> None:
    monkeypatch.chdir(tmp_path)
    where = [f"hydra.run.dir={tmp_path / 'run'}"] if named else []
    assert _train([*SHORT, setting, *where]) == 2
    assert "flashprobe train: error:" in capsys.readouterr().err
    assert made == [] and sorted(os.listdir(tmp_path)) == []
    assert len(compositions) == 1


def test_a_run_and_its_skipped_resume_are_each_composed_once(
    tmp_path: Path, compositions: list[object], capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert _train([*SHORT, f"hydra.run.dir={run}"]) == 0
    assert len(compositions) == 1
    assert {".hydra", "run.json", "config.yaml", "train.log", "checkpoints"} <= set(os.listdir(run))
    assert sorted(os.listdir(run / ".hydra")) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    (run / "train.log").unlink()  # as a run trained by train() has none: a skip writes none either
    before = fingerprint(run)
    capsys.readouterr()
    assert _train([f"resume={run}"]) == 0
    assert f"skipping the run: {run} finished 2 steps already" in capsys.readouterr().out
    assert fingerprint(run) == before
    assert len(compositions) == 2
