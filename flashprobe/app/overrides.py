"""Hydra override strings (``key=value``, ``+key=value``, ``~key``) read before Hydra composes them,
and a run's recorded overrides read as data for ``resume=RUN`` (:func:`recorded_overrides`).
Imports nothing heavy, so ``--help`` stays fast.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from flashprobe.errors import FlashprobeError

__all__ = [
    "RecordedOverrideError",
    "config_groups",
    "override_key",
    "override_path",
    "override_value",
    "recorded_overrides",
]


def override_key(override: str) -> str:
    """The key an override sets: ``"trainer.max_steps"`` for ``"+trainer.max_steps=4"``."""
    return override.split("=", 1)[0].lstrip("+~")


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value ``key`` gets from ``overrides`` — the last one given, as in Hydra — or ``None``."""
    values = [o.split("=", 1)[1] for o in overrides if "=" in o and override_key(o) == key]
    return values[-1] if values else None


def override_path(overrides: Sequence[str], key: str) -> str | None:
    """The value ``key`` gets from ``overrides`` as Hydra reads it (quotes removed), or ``None``.

    Raises:
        ValueError: not one value Hydra could use as a path (a sweep, a list, unparsable).
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


class RecordedOverrideError(ValueError, FlashprobeError):
    """A run directory's recorded overrides ask for more than settings: refused, nothing was run."""


#: A plain reference to another config value, ``${a.b}``: data. Anything else in ``${...}`` is a
#: resolver call (``${oc.env:...}``, ``${oc.decode:...}``, a user-registered resolver): code.
_NODE_REFERENCE = re.compile(r"\$\{[A-Za-z0-9_.\-\[\]]+\}")
#: A config group option as flashprobe's groups spell them: names, optionally nested with ``/``.
_GROUP_OPTION = re.compile(r"[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*")


def config_groups(config_dirs: Iterable[Path]) -> set[str]:
    """The config group names (``experiment``, ``callbacks``, ...) of the config directories given."""
    groups: set[str] = set()
    for root in config_dirs:
        if root.is_dir():
            groups.update(str(d.relative_to(root)) for d in root.rglob("*") if d.is_dir())
    return groups


def recorded_overrides(
    path: Path, groups: set[str], given: Sequence[str] = (), skip: Iterable[str] = ()
) -> list[str]:
    """The overrides a resume runs with: those recorded in ``path`` (``.hydra/overrides.yaml``), read
    as data, then ``given``.

    A run directory is data, never instructions. A recorded override the command replaces is left
    out unread (its key set by ``given`` or ``skip``, or under a key ``given`` deletes; a deletion
    that only undoes recorded additions is dropped too). Every other line may only set a value or
    choose a config group option; refused (:func:`_unsafe`), with file and line: ``_``-keys such as
    ``_target_``, ``hydra`` settings, resolvers, ``group@pkg``, sweeps and option paths.

    Args:
        path: the recorded overrides file.
        groups: the config group names on the search path (:func:`config_groups`).
        given: the overrides of the command given now.
        skip: further keys the command sets itself (``resume``, ``hydra.run.dir``, ...).

    Returns:
        The recorded overrides the command given now does not replace, in order, then ``given``.

    Raises:
        FileNotFoundError: ``path`` is not a YAML list of strings as Hydra writes it.
        RecordedOverrideError: a recorded override asks for more than settings.
    """
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        node = yaml.compose(path.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        reason = " ".join(str(err).split())
        raise FileNotFoundError(f"{path} is not Hydra's overrides file ({reason})") from None
    if node is None:
        return list(given)
    if not isinstance(node, yaml.SequenceNode) or not all(
        isinstance(item, yaml.ScalarNode) and item.tag == "tag:yaml.org,2002:str" for item in node.value
    ):
        raise FileNotFoundError(f"{path} is not a list of overrides as Hydra writes it")
    parser = OverridesParser.create()
    overrides = []
    replaced = {override_key(o) for o in given} | set(skip)
    deleted = [override_key(o) for o in given if o.startswith("~")]
    undone: dict[str, bool] = {}  # a deletion given now -> whether it only undoes recorded additions
    for item in node.value:
        text, where = item.value, f"{path}, line {item.start_mark.line + 1}"
        key = override_key(text).split("@", 1)[0]
        under = [d for d in deleted if key == d or key.startswith(d + ".")]
        for d in under:
            undone[d] = undone.get(d, True) and text.startswith("+")
        if key in replaced or under:
            continue
        try:
            override = parser.parse_override(text)
        except HydraException as err:
            raise RecordedOverrideError(f"{where}: {text!r} is not a Hydra override ({err})") from None
        reason = _unsafe(override, groups)
        if reason:
            parts = key.split(".")
            entry = ".".join(parts[: next((i for i, p in enumerate(parts) if p.startswith("_")), None)])
            raise RecordedOverrideError(
                f"{where}: {text!r} {reason}. A run directory is data, never instructions: resume takes "
                "from it only flashprobe's settings and config group options, so this run is not resumed "
                "and nothing of it was run. If the run is yours and you mean it, give the override "
                "yourself, resuming with only the settings you give now: flashprobe train "
                f"hydra.run.dir=RUN resume=auto {shlex.quote(text)} ...; or drop it: resume=RUN "
                f"~{entry or key}"
            )
        overrides.append(text)
    return overrides + [o for o in given if not (o.startswith("~") and undone.get(override_key(o)))]


def _unsafe(override: Any, groups: set[str]) -> str | None:
    """Why a parsed recorded override is more than a setting, or ``None``."""
    key = override.key_or_group
    if key.split(".")[0].split("/")[0] == "hydra":
        return "sets Hydra's own configuration (its search path, launcher and callbacks can load code)"
    if any(part.startswith("_") for part in re.split(r"[./]", key)):
        return f"sets {key.rsplit('.', 1)[-1]}, which makes Hydra import and build an object"
    if override.package is not None:
        return "moves a config group to another package (group@package)"
    if override.is_delete():
        return None
    if override.is_sweep_override():
        return "is a sweep, not one run's setting"
    value = override.value()
    bad = _unsafe_value(value)
    if bad:
        return bad
    options = value if isinstance(value, list) else [value]
    names = all(o is None or (isinstance(o, str) and _GROUP_OPTION.fullmatch(o)) for o in options)
    if key in groups and not names:
        return f"chooses {key} option {value!r}, which is not an option name (a path?)"
    return None


def _unsafe_value(value: Any) -> str | None:
    if isinstance(value, str) and "${" in _NODE_REFERENCE.sub("", value):
        return "calls a resolver (${name:...}), which runs code when the config is read"
    mapping = isinstance(value, dict)
    for k, v in value.items() if mapping else enumerate(value) if isinstance(value, list) else ():
        if mapping and str(k).startswith("_"):
            return f"holds the key {k}, which makes Hydra import and build an object"
        bad = _unsafe_value(v)
        if bad:
            return bad
    return None
