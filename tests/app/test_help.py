"""``flashprobe train --help``: a description, the common overrides and examples (Hydra app help)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from flashprobe.app.train import cli_main, compose
from tests.app._study import flashprobe_cli

#: the overrides a new user reaches for first; each must be explained by --help
COMMON = (
    "experiment=",
    "model=",
    "attention=",
    "attention.kernel=",
    "trainer.precision=",
    "trainer.max_steps=",
    "seed=",
    "resume=RUN_DIR",
    "overwrite=true",
    "threads=",
    "logger=default|csv",
)


def _flashprobe(*args: str, cwd: Path) -> str:
    proc = flashprobe_cli(*args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("app/test_help")


@pytest.fixture(scope="module")
def train_help(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _flashprobe("train", "--help", cwd=tmp_path_factory.mktemp("help"))


def test_help_describes_the_command_and_its_common_overrides(train_help: str) -> None:
    lines = train_help.splitlines()
    assert lines[0].startswith("usage: flashprobe train")
    assert "Train the text-to-image DiT" in train_help and "probe" in train_help
    assert "powered by Hydra" not in train_help  # Hydra's generic header is replaced
    assert "_target_" not in train_help and "module:" not in train_help  # no 100-line config dump
    for override in COMMON:
        assert any(line.lstrip().startswith(override) for line in lines), override
    groups = {line.split(":")[0]: line for line in lines if ": " in line and not line.startswith(" ")}
    assert {"attention", "experiment", "model", "trainer", "logger"} <= groups.keys()
    assert "smoke" in groups["experiment"] and "tiny" in groups["model"]
    assert "--hydra-help" in train_help and "--cfg job" in train_help
    assert len(lines) < 60


def test_help_examples_compose(train_help: str, tmp_path: Path) -> None:
    """Every example of --help (but resume=, which needs a run) is a valid command line."""
    block = train_help.split("examples:\n", 1)[1].split("\n\n", 1)[0]
    examples = [shlex.split(line.strip().split("  ")[0]) for line in block.splitlines()]
    assert len(examples) >= 3 and all(e[:2] == ["flashprobe", "train"] for e in examples)
    composed = 0
    for example in examples:
        overrides = example[2:]
        if any(o.startswith("resume=") for o in overrides):
            continue
        cfg = compose(overrides, run_dir=tmp_path / str(composed))
        for override in overrides:
            key, _, value = override.partition("=")
            if "." in key:  # a value override: the composed config holds it
                node = cfg
                for part in key.split("."):
                    node = node[part]
                assert str(node) == value.strip("'"), override
        composed += 1
    assert composed >= 3


def test_hydra_help_still_shows_hydras_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (``train --help`` above is the real command's test): Hydra prints and exits 0."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--hydra-help"])
    assert exit_.value.code in (0, None)
    text = capsys.readouterr().out
    assert "== Flags ==" in text and "--cfg,-c" in text and "--multirun,-m" in text


def test_version_names_flashprobe_and_torch(capsys) -> None:
    from importlib.metadata import version

    from flashprobe import __version__
    from flashprobe.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flashprobe {__version__} (torch {version('torch')})"
