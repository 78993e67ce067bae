"""JSON as flashprobe writes it: a non-finite float is the string ``"nan"``, ``"inf"`` or ``"-inf"``
(JSON has none); ``null`` means *not recorded*. :func:`number` reads any of these back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flashprobe.formats.atomic import atomic_write_text

__all__ = [
    "NONFINITE",
    "decode",
    "dumps",
    "encode",
    "flatten",
    "format_problem",
    "number",
    "read_json",
    "utc_now",
    "write_json",
]

#: How each non-finite float is written.
NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(value: Any) -> Any:
    """A JSON-ready copy of ``value``: non-finite floats become ``"nan"``/``"inf"``/``"-inf"``,
    tuples become lists, mapping keys strings, dataclasses dicts, paths and other objects ``str``."""
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode(dataclasses.asdict(value))
    return str(value)


def dumps(value: Any, *, indent: int | None = None) -> str:
    """``json.dumps`` of :func:`encode` (strict JSON: no bare NaN/Infinity)."""
    return json.dumps(encode(value), indent=indent, allow_nan=False)


def decode(value: Any, *, text_keys: frozenset[str] = frozenset()) -> Any:
    """The inverse of :func:`encode` for numbers, except under the mapping keys in ``text_keys``
    (free-text fields such as a site name)."""
    if isinstance(value, str):
        return NONFINITE.get(value, value)
    if isinstance(value, Mapping):
        return {k: v if k in text_keys else decode(v, text_keys=text_keys) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v, text_keys=text_keys) for v in value]
    return value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping's leaves under dotted keys: ``{"a": {"b": 1}}`` → ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def utc_now() -> str:
    """The current time in UTC as flashprobe's files record it, e.g. ``2026-12-06T16:06:06Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def number(value: Any) -> float | None:
    """A number as written by :func:`encode`: a float, or ``None`` for ``null``/absent.

    Raises:
        ValueError: ``value`` is neither a number, ``null``, nor one of ``"nan"``, ``"inf"``, ``"-inf"``.
    """
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value in NONFINITE:
        return NONFINITE[value]
    raise ValueError(f"expected a number, null, 'nan', 'inf' or '-inf', got {value!r}")


def write_json(path: str | os.PathLike[str], value: Any, *, indent: int | None = 1) -> Path:
    """Write ``value`` as JSON (:func:`dumps`, trailing newline) to ``path`` atomically."""
    return atomic_write_text(path, dumps(value, indent=indent) + "\n")


def read_json(path: str | os.PathLike[str], *, written_by: str) -> Any:
    """Read a JSON file, with errors that name the file and ``written_by`` (the command that writes it).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not valid JSON (line and column named).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: it is written by `{written_by}`") from None
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory, not a JSON file written by `{written_by}`") from None
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {err.start}), so not JSON flashprobe wrote; rewrite it with "
            f"`{written_by}`"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path}: not valid JSON at line {err.lineno}, column {err.colno} ({err.msg}); "
            f"rewrite it with `{written_by}`"
        ) from None


def format_problem(
    path: str | os.PathLike[str], doc: Any, expected: str, what: str = "file"
) -> str | None:
    """Why the JSON document ``doc`` read from ``path`` is not of format ``expected`` (``None`` if it is):
    written by another flashprobe version (naming both formats), or not such a file at all."""
    found = doc.get("format") if isinstance(doc, dict) else None
    if found == expected:
        return None
    if isinstance(found, str) and found.split("/")[0] == expected.split("/")[0]:
        from flashprobe import __version__

        writer = doc.get("flashprobe")
        by = f" by flashprobe {writer}" if isinstance(writer, str) else " by another flashprobe version"
        return (
            f"{path} was written{by}, in format {found!r}; this flashprobe ({__version__}) reads format "
            f"{expected!r} only: read it with the flashprobe that wrote it (pip install flashprobe==VERSION)"
        )
    shown = f"format {found!r}" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
    return f"{path} is not a flashprobe {what}: {shown}, expected {expected!r}"
