"""Helpers that keep a directory busy for the concurrency tests, synchronised by files (no sleeps to time).

* :class:`PauseAt` — a callback: when training reaches ``step``, create ``reached`` and wait until
  ``release`` exists (a second process is started meanwhile);
* :class:`FailWriteAt` — a callback: a write fails as on a full disk at ``step``;
* ``python -m tests.safety._hold DIR READY`` — hold ``directory_lock(DIR)``, create ``READY``, and
  wait to be killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

#: How long a paused run waits for its release before giving up (a test that hangs fails instead).
GIVE_UP_S = 300


def wait_for(path: Path, timeout: float = GIVE_UP_S) -> None:
    """Poll until ``path`` exists; ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


class PauseAt(Callback):
    """Pause training at ``step`` (once, in the run directory named ``only_in`` if given) until released.

    Args:
        step: the optimizer step at which to pause.
        reached: created when the pause begins.
        release: the pause ends when this file exists.
        only_in: pause only in the run whose directory has this name (a study run).
    """

    def __init__(self, step: int, reached: str, release: str, only_in: str | None = None) -> None:
        self.step, self.reached, self.release, self.only_in = step, Path(reached), Path(release), only_in

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step != self.step or self.reached.exists():
            return
        if self.only_in is not None and Path(trainer.default_root_dir).name != self.only_in:
            return
        self.reached.touch()
        wait_for(self.release)


class FailWriteAt(Callback):
    """Raise ``OSError(ENOSPC)`` — what a write on a full disk raises — when training reaches ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.step:
            import errno
            import os

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(trainer.default_root_dir) / "x"))


def _hold(directory: str, ready: str) -> None:
    from flashprobe.formats.lock import directory_lock

    with directory_lock(directory, what="test directory"):
        Path(ready).touch()
        while True:
            time.sleep(1)


if __name__ == "__main__":
    _hold(*sys.argv[1:3])
