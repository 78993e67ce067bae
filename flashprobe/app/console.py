"""What flashprobe's commands print: Lightning's and Hydra's logging once each, without noise.

Lightning adds a console handler of its own when it is imported before logging is configured;
under Hydra, which configures the root logger later, every Lightning line then prints twice.
:func:`quiet_third_party` removes that handler once the root logger has one (so each line is
printed once, by Hydra's handler, and also lands in the run's ``train.log``), drops Lightning's
advertising tips and its "GPU available: False" / "TPU available: False" banner (a line that
says nothing on a CPU; it is kept where a device exists), and silences a deprecation warning that
torch raises inside Lightning (nothing a user can act on). :class:`DropLoggers` is the logging
filter the study's console handler uses (``flashprobe/conf/hydra/job_logging/study.yaml``).

In a terminal, ``flashprobe train`` shows :class:`StepProgressBar` (Lightning's Rich bar, labelled
with the step count instead of ``Epoch 0/-2``) and logs through :class:`LiveStdoutHandler`
(``flashprobe/conf/hydra/job_logging/train.yaml``), which writes to whatever ``sys.stdout`` is at
the time of the record: while the bar is live, Rich has redirected it, so each record is printed
on its own line above the bar instead of being glued onto the bar's line.

The run's ``train.log`` is written by :class:`RunLogFile`: opened at its first record (a run refused
before it starts leaves none) and appended to, never through a link.
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
    """A run's log file (``train.log``): opened when the first record comes, appended to without following
    a link (:func:`flashprobe.formats.nofollow.open_append`: a symbolic or hard link planted there is
    refused, never written through)."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = "utf-8") -> None:
        super().__init__(filename, mode, encoding=encoding, delay=True)

    def _open(self) -> TextIO:
        from flashprobe.formats.nofollow import open_append

        with open_append(self.baseFilename) as fd:
            return open(os.dup(fd), "a", encoding=self.encoding, errors=self.errors)


class LiveStdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A console handler that writes to the *current* ``sys.stdout`` (not the one at configuration).

    Rich's live progress bar redirects ``sys.stdout`` while it is shown and prints what is written
    there above the bar; a plain ``StreamHandler`` keeps the stream it was given and writes over
    the bar's line instead.
    """

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:  # logging.StreamHandler.__init__ assigns it
        pass


def StepProgressBar() -> Any:  # noqa: N802 (a class factory: Lightning is imported only when a bar is wanted)
    """Lightning's Rich progress bar, labelled ``train`` instead of ``Epoch 0/-2`` for step-bounded runs.

    ``flashprobe train`` bounds runs by ``trainer.max_steps`` with ``max_epochs=-1``, which
    Lightning's bar prints as ``Epoch 0/-2``. Falls back to Lightning's tqdm bar where Rich is
    not installed.

    Returns:
        A ``lightning.pytorch.callbacks.ProgressBar`` instance.
    """
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
    """Print each Lightning line once, without tips; silence torch's LeafSpec deprecation in Lightning.

    Idempotent; call it after logging is configured (inside a Hydra job, or after
    ``logging.basicConfig``). Without a root handler, Lightning's own handler is left in place.
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
