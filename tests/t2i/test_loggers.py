"""The W&B logger falls back from a home directory it cannot write to, before training starts."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from flashprobe.t2i.loggers import WandbLogger

VARS = ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")


@pytest.fixture
def no_wandb_dirs(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in VARS:  # set, then removed: the test's own settings are undone afterwards
        monkeypatch.setenv(var, "unset")
        monkeypatch.delenv(var)


def test_an_unwritable_home_moves_wandb_into_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, no_wandb_dirs: None
) -> None:
    (tmp_path / "file").write_text("a file where HOME's parent should be")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))  # nothing can be created under it
    with caplog.at_level(logging.WARNING):
        WandbLogger(save_dir=str(tmp_path / "run"), offline=True)
    for var in VARS:
        assert os.environ[var] == str(tmp_path / "run" / "wandb" / f".{var.lower()}")
    assert caplog.text.count("is not writable; wandb uses") == 3


def test_a_writable_home_or_a_chosen_directory_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_wandb_dirs: None
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "mine"))
    WandbLogger(save_dir=str(tmp_path / "run"), offline=True)
    assert os.environ["WANDB_DATA_DIR"] == str(tmp_path / "mine")
    assert "WANDB_CONFIG_DIR" not in os.environ and "WANDB_CACHE_DIR" not in os.environ
