"""Lightning's W&B and CSV loggers as a run directory needs them."""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from flashprobe.formats.atomic import atomic_write_file, atomic_write_text

__all__ = ["CSVLogger", "WandbLogger"]

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
    """Point wandb's HOME directories that cannot be written into the run's ``wandb/``, with a warning."""
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
    """:class:`lightning.pytorch.loggers.WandbLogger`, quieter: ``anonymous`` passed only when set
    (wandb ≥ 0.19 warns otherwise), ``quiet`` on unless ``settings`` are given, and unwritable HOME
    directories moved into ``SAVE_DIR/wandb/``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _fall_back_from_home(kwargs.get("save_dir") or kwargs.get("dir"))
        kwargs.setdefault("settings", {"quiet": True})
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)


class CSVLogger(_LightningCSVLogger):
    """:class:`lightning.pytorch.loggers.CSVLogger` keeping one version of a run (``version=0``): a
    resumed run continues its ``metrics.csv`` (rows of steps trained again replaced); every file is
    written atomically, never through a link."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("version", 0)
        super().__init__(*args, **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._experiment = _RunMetrics(self.log_dir)
        return self._experiment


class _RunMetrics(ExperimentWriter):
    """Keeps ``metrics.csv``'s rows before this session's first step; rewrites the file at every save."""

    def __init__(self, log_dir: str) -> None:  # not Lightning's: it deletes an existing metrics.csv
        self.log_dir, self.hparams = log_dir, {}
        self.metrics: list[dict[str, Any]] = []
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self._rows: list[dict[str, Any]] | None = None  # the earlier session's, until this one saves
        self._kept: list[dict[str, Any]] = []
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="", encoding="utf-8", errors="replace") as fh:
                self._rows = list(csv.DictReader(fh))
        self.metrics_keys = sorted({k for row in self._rows or [] for k in row if k})

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        path = os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)
        atomic_write_file(path, lambda tmp: save_hparams_to_yaml(tmp, self.hparams))

    def save(self) -> None:
        if not self.metrics:
            return
        if self._rows is not None:  # the steps this session logs replace those of the abandoned one
            first = min(int(m["step"]) for m in self.metrics)
            self._kept = [r for r in self._rows if _step(r) is not None and _step(r) < first]
            self._rows = None
        self._kept += self.metrics
        self.metrics = []
        self.metrics_keys = sorted({*self.metrics_keys, *(k for m in self._kept for k in m)})
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.metrics_keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self._kept)
        atomic_write_text(self.metrics_file_path, out.getvalue())


def _step(row: dict[str, Any]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None
