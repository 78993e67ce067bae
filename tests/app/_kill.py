"""A callback that kills its own process with SIGKILL at a chosen step (for kill-and-resume tests)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class KillAt(Callback):
    """SIGKILL this process when the training batch after ``step`` optimizer steps starts.

    Args:
        step: the optimizer step after which to kill.
        only_in: kill only in the run whose directory has this name (a study run, e.g. ``baseline``).
        once: a marker file: kill only if it does not exist, and create it just before the kill, so
            the same command run again (a re-invoked study) is not killed a second time.
    """

    def __init__(self, step: int, only_in: str | None = None, once: str | None = None) -> None:
        self.step, self.only_in, self.once = step, only_in, once

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step != self.step:
            return
        if self.only_in is not None and Path(trainer.default_root_dir).name != self.only_in:
            return
        if self.once is not None:
            if Path(self.once).exists():
                return
            Path(self.once).touch()
        os.kill(os.getpid(), signal.SIGKILL)


class KillAtTrainEnd(Callback):
    """SIGKILL this process when training ends: after the last checkpoint, before the end-of-run work of
    the callbacks after it (the probe's ``probe.png``, ``run.json``'s finished session). A hidden
    temporary file is left beside the checkpoints, as a writer killed mid-write leaves one."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from flashprobe.formats.atomic import temporary_path

        checkpoints = Path(trainer.default_root_dir) / "checkpoints"
        temporary_path(checkpoints / "last.ckpt").write_bytes(b"half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)


def _user_refusal() -> type[Exception]:
    """A user's kernel module's own refusal: a subclass of flashprobe's, defined outside flashprobe."""
    from flashprobe.kernels import KernelUnsupportedError

    class UserKernelRefusalError(KernelUnsupportedError):
        """What a user's kernel raises when it refuses a call."""

    return UserKernelRefusalError


class RaiseAt(Callback):
    """Raise ``RuntimeError`` when the training batch after ``step`` optimizer steps starts (a crash
    inside training that is not flashprobe's); ``kernel_refusal=True``: raise what a kernel raises
    when it refuses a call (:class:`~flashprobe.kernels.KernelUnsupportedError`), flashprobe's own;
    ``user_refusal=True``: a subclass of it defined in this module, as a user's kernel module would."""

    def __init__(self, step: int, kernel_refusal: bool = False, user_refusal: bool = False) -> None:
        self.step = step
        self.kernel_refusal = kernel_refusal
        self.user_refusal = user_refusal

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        if trainer.global_step != self.step:
            return
        if self.user_refusal:
            raise _user_refusal()(f"mykernel: head dim 59 at step {self.step} is not supported; choose math")
        if self.kernel_refusal:
            from flashprobe.kernels import KernelUnsupportedError

            raise KernelUnsupportedError(
                f"tiled: head dim 59 at step {self.step}\nis not supported; choose math"
            )
        raise RuntimeError(f"a crash at step {self.step}\nsecond line")
