"""Hydra override strings (``key=value``, ``+key=value``, ``~key``) read before Hydra composes them.

``flashprobe train`` and ``flashprobe study`` look at a few overrides (``resume``,
``hydra.run.dir``, ``hydra/launcher``, ``experiment``, ...) to check them before any work; this
module is the one reader. It imports nothing heavy, so ``--help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["override_key", "override_value"]


def override_key(override: str) -> str:
    """The key an override sets: ``"trainer.max_steps"`` for ``"+trainer.max_steps=4"``."""
    return override.split("=", 1)[0].lstrip("+~")


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value ``key`` gets from ``overrides`` — the last one given, as in Hydra — or ``None``."""
    values = [o.split("=", 1)[1] for o in overrides if "=" in o and override_key(o) == key]
    return values[-1] if values else None
