"""Lightning's W&B logger without the deprecation noise it causes in current wandb releases."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger

__all__ = ["WandbLogger"]


class WandbLogger(_LightningWandbLogger):
    """:class:`lightning.pytorch.loggers.WandbLogger`, quieter on the console.

    * Lightning always passes ``anonymous`` (``None`` unless asked for) and wandb ≥ 0.19 warns on
      every run that the setting "has no effect": it is passed only when the user sets it.
    * wandb prints a run history and summary block at the end of every run, where values below
      1e-5 (the probe's deviations) show as ``0.0`` beside meaningful ratios. ``quiet`` (wandb's
      own setting) is on unless ``settings`` are given; ``flashprobe train`` logs the run's
      directory and the ``wandb sync`` command instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("settings", {"quiet": True})
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
