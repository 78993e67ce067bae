"""What flashprobe's commands print: Lightning's and Hydra's logging once each, without noise.

The logging handlers and filters here are named by ``flashprobe/conf/hydra/job_logging/*.yaml``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Iterable
from typing import Any, TextIO

__all__ = ["DropLoggers", "LiveStdoutHandler", "RunLogFile", "StepProgressBar", "quiet_third_party"]

#: Lightning's own loggers, which add a console handler when imported before logging is set up.
_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


class DropLoggers(logging.Filter):
    """Drop the records of the named loggers (and their children)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__()
        self.names = tuple(names)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.name == n or record.name.startswith(n + ".") for n in self.names)


#: Lightning's device banner lines that report a device that is not there.
_ABSENT_DEVICE = re.compile(r"^(GPU|TPU|HPU) available: False\b")


class _NoTips(logging.Filter):
    """Drop Lightning's "💡 Tip" lines (litlogger/litmodels) and its banner of absent devices."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith("💡 Tip") or _ABSENT_DEVICE.match(message))


class RunLogFile(logging.FileHandler):
    """A run's ``train.log``: opened at the first record (a refused run leaves none), appended to,
    never through a link (:func:`flashprobe.formats.nofollow.open_append`)."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = "utf-8") -> None:
        super().__init__(filename, mode, encoding=encoding, delay=True)

    def _open(self) -> TextIO:
        from flashprobe.formats.nofollow import open_append

        with open_append(self.baseFilename) as fd:
            return open(os.dup(fd), "a", encoding=self.encoding, errors=self.errors)


class LiveStdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A console handler that writes to the *current* ``sys.stdout``, which Rich's live progress bar
    redirects to print records above the bar (a plain ``StreamHandler`` writes over its line)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:  # logging.StreamHandler.__init__ assigns it
        pass


def StepProgressBar() -> Any:  # noqa: N802 (a class factory: Lightning is imported only when a bar is wanted)
    """Lightning's Rich progress bar, labelled ``train`` instead of ``Epoch 0/-2`` for step-bounded
    runs (``max_epochs=-1``); Lightning's tqdm bar where Rich is not installed."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    if not _RICH_AVAILABLE:
        return TQDMProgressBar()

    class _StepRichProgressBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            max_epochs = self.trainer.max_epochs
            if max_epochs is not None and max_epochs > 0:
                return super()._get_train_description(current_epoch)
            description = "train" if current_epoch == 0 else f"train (epoch {current_epoch})"
            return f"{description:{len(self.validation_description)}}"

    return _StepRichProgressBar()


def quiet_third_party() -> None:
    """Print each Lightning line once (removing the console handler it adds at import when the root
    logger has one), without tips or absent-device banners; silence torch's LeafSpec deprecation.

    Idempotent; call it after logging is configured.
    """
    root_has_handlers = bool(logging.getLogger().handlers)
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if root_has_handlers:
            for handler in list(logger.handlers):
                if type(handler) is logging.StreamHandler:  # Lightning's import-time console handler
                    logger.removeHandler(handler)
            logger.propagate = True
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
