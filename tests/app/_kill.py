"""A callback that kills its own process with SIGKILL at a chosen step (for kill-and-resume tests)."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class KillAt(Callback):
    """SIGKILL this process when the training batch after ``step`` optimizer steps starts."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
