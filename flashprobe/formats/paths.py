"""Checks on where results go, made before any work starts.

* :func:`prepare_output_dir` — ``--out DIR`` must be a directory flashprobe can create and write
  to; a path that is a file, lies under a file, or is not writable fails at once, naming the path
  and the fix, instead of after minutes of work;
* :func:`safe_name` — a name that becomes part of a file name (a comparison pair's name, a case
  name) must stay inside its directory: no path separators, no ``..``, nothing hidden.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

__all__ = ["OutputPathError", "check_output_dir", "output_dir_arg", "prepare_output_dir", "safe_name"]

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*")


class OutputPathError(ValueError):
    """An output directory or a name used in a file name is unusable."""


def _not_under_a_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path`` as a Path, if it is not empty, not a file and not under a file."""
    if not str(os.fspath(path)).strip():
        raise OutputPathError(
            f"{flag} is empty: it would write into the working directory; give a directory, e.g. "
            f"{flag} out/run1 (or {flag} . to mean the working directory)"
        )
    path = Path(path)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            where = "is a file" if parent == path else f"lies under {parent}, which is a file"
            raise OutputPathError(f"{flag} {path} {where}; give a directory path")
    return path


def check_output_dir(path: str | os.PathLike[str], *, flag: str = "--out") -> Path:
    """Check, without creating anything, that ``path`` could be created and written as a directory.

    Args:
        path: the output directory.
        flag: how the user gave it, for the error message.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OutputPathError: ``path`` is empty, a file, lies under a file, or its nearest existing
            directory is not writable.
    """
    path = _not_under_a_file(path, flag)
    if path.is_dir():
        _write_check(path, flag)  # a probe file, removed at once: the directory is left as it was
        return path
    existing = next((p for p in path.parents if p.exists()), Path("."))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {path} is not writable ({existing}); give a writable directory")
    return path


def prepare_output_dir(path: str | os.PathLike[str], *, flag: str = "--out") -> Path:
    """Create ``path`` (and its parents) if needed and check that files can be written there.

    Args:
        path: the output directory.
        flag: how the user gave it, for the error message (``--out``, ``hydra.run.dir``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OutputPathError: ``path`` is empty (it would mean the working directory), a file, lies under
            a file, or is not writable.
    """
    path = _not_under_a_file(path, flag)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputPathError(
            f"{flag} {path} is not writable ({err.strerror or err}); give a directory you can write to"
        ) from None
    _write_check(path, flag)
    return path


def _write_check(path: Path, flag: str) -> None:
    """Create and remove a probe file in the directory ``path``.

    Raises:
        OutputPathError: it cannot be written.
    """
    try:
        probe = path / f".flashprobe-write-check.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as err:
        raise OutputPathError(
            f"{flag} {path} is not writable ({err.strerror or err}); give a directory you can write to"
        ) from None


def output_dir_arg(text: str) -> Path:
    """An ``argparse`` type for ``--out DIR``: refuses an empty string (``Path("")`` is the working
    directory, which ``--out ''`` never means)."""
    import argparse

    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty: it would write into the working directory; give a directory, e.g. --out out/run1"
        )
    return Path(text)


def safe_name(name: str, *, what: str = "name") -> str:
    """``name`` if it can be used as (part of) a file name inside an output directory.

    Args:
        name: the name, e.g. a comparison pair's name.
        what: what the name is, for the error message (``--pair name``).

    Returns:
        ``name`` unchanged.

    Raises:
        OutputPathError: empty, a path separator, ``..``, a leading dot or dash, or characters
            other than letters, digits and ``_ . + = -``.
    """
    if not isinstance(name, str) or not _SAFE.fullmatch(name) or ".." in name:
        raise OutputPathError(
            f"{what} {name!r} cannot be used in a file name: use letters, digits and _ . + = - only "
            "(no '/', no '..', not starting with '.' or '-'), e.g. flash_vs_baseline"
        )
    return name
