"""Lightning's W&B logger without the deprecation noise it causes in current wandb releases, and
with a fallback for a home directory it cannot write to."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger

__all__ = ["WandbLogger"]

log = logging.getLogger(__name__)

#: Where wandb keeps its settings, cache and artifact staging unless told otherwise: all under HOME.
_HOME_DIRS = {
    "WANDB_CONFIG_DIR": "~/.config/wandb",
    "WANDB_CACHE_DIR": "~/.cache/wandb",
    "WANDB_DATA_DIR": "~/.local/share/wandb",
}


def _writable(path: Path) -> bool:
    """Whether ``path`` (or, where it does not exist yet, its nearest existing parent) can be written."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _fall_back_from_home(save_dir: str | os.PathLike[str] | None) -> None:
    """Point wandb's HOME directories that cannot be written (a read-only HOME, a cluster's home
    quota) into the run's own ``wandb/`` directory, with a warning, instead of failing mid-training."""
    base = Path(save_dir or ".") / "wandb"
    for var, default in _HOME_DIRS.items():
        if os.environ.get(var) or _writable(Path(default).expanduser()):
            continue
        fallback = base / f".{var.lower()}"
        os.environ[var] = str(fallback)
        log.warning(
            "W&B: %s is not writable; wandb uses %s instead (set %s to choose)",
            Path(default).expanduser(),
            fallback,
            var,
        )


class WandbLogger(_LightningWandbLogger):
    """:class:`lightning.pytorch.loggers.WandbLogger`, quieter on the console.

    * Lightning always passes ``anonymous`` (``None`` unless asked for) and wandb ≥ 0.19 warns on
      every run that the setting "has no effect": it is passed only when the user sets it.
    * wandb prints a run history and summary block at the end of every run, where values below
      1e-5 (the probe's deviations) show as ``0.0`` beside meaningful ratios. ``quiet`` (wandb's
      own setting) is on unless ``settings`` are given; ``flashprobe train`` logs the run's
      directory and the ``wandb sync`` command instead.
    * wandb keeps settings, a cache and artifact staging under HOME; those that cannot be written
      are moved into ``SAVE_DIR/wandb/`` with a warning (not a failure after training started).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _fall_back_from_home(kwargs.get("save_dir") or kwargs.get("dir"))
        kwargs.setdefault("settings", {"quiet": True})
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
