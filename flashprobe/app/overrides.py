"""Hydra override strings (``key=value``, ``+key=value``, ``~key``) read before Hydra composes them.

``flashprobe train`` and ``flashprobe study`` look at a few overrides (``resume``,
``hydra.run.dir``, ``hydra/launcher``, ``experiment``, ...) to check them before any work; this
module is the one reader. It imports nothing heavy, so ``--help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["override_key", "override_path", "override_value"]


def override_key(override: str) -> str:
    """The key an override sets: ``"trainer.max_steps"`` for ``"+trainer.max_steps=4"``."""
    return override.split("=", 1)[0].lstrip("+~")


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value ``key`` gets from ``overrides`` — the last one given, as in Hydra — or ``None``."""
    values = [o.split("=", 1)[1] for o in overrides if "=" in o and override_key(o) == key]
    return values[-1] if values else None


def override_path(overrides: Sequence[str], key: str) -> str | None:
    """The value ``key`` gets from ``overrides`` as Hydra reads it: quotes removed (``'/a b'`` → ``/a b``).

    Returns ``None`` when ``key`` is not given. Hydra's override parser is imported only here.

    Raises:
        ValueError: the value is not one value Hydra could use as a path (a sweep such as ``a,b``,
            a list, or an override Hydra cannot parse).
    """
    given = [o for o in overrides if "=" in o and override_key(o) == key]
    if not given:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        value = OverridesParser.create().parse_override(given[-1]).value()
    except HydraException as err:
        raise ValueError(f"{given[-1]!r} is not a valid override: {' '.join(str(err).split())}") from None
    if isinstance(value, str):
        return value
    if isinstance(value, list | dict) or hasattr(value, "list") or hasattr(value, "start"):
        raise ValueError(f"{given[-1]!r}: {key} must be one directory path, not a sweep or a list")
    return given[-1].split("=", 1)[1]  # a number or a boolean: the text as given
