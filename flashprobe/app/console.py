"""What flashprobe's commands print: Lightning's and Hydra's logging once each, without noise.

Lightning adds a console handler of its own when it is imported before logging is configured;
under Hydra, which configures the root logger later, every Lightning line then prints twice.
:func:`quiet_third_party` removes that handler once the root logger has one (so each line is
printed once, by Hydra's handler, and also lands in the run's ``train.log``), drops Lightning's
advertising tips, and silences a deprecation warning that torch raises inside Lightning (nothing
a user can act on). :class:`DropLoggers` is the logging filter the study's console handler uses
(``flashprobe/conf/hydra/job_logging/study.yaml``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

__all__ = ["DropLoggers", "quiet_third_party"]

#: Lightning's own loggers, which add a console handler when imported before logging is set up.
_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")


class DropLoggers(logging.Filter):
    """Drop the records of the named loggers (and their children)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__()
        self.names = tuple(names)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(record.name == n or record.name.startswith(n + ".") for n in self.names)


class _NoTips(logging.Filter):
    """Drop Lightning's "💡 Tip: try installing litlogger/litmodels" lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


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
