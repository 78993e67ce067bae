"""Atomic file writes: a unique temporary file in the target's directory, fsync, ``os.replace``.

A crash mid-write leaves the previous file (or none), never a truncated one. The temporary file is
opened with mode ``"x"`` (not :func:`tempfile.mkstemp`, whose files are private ``0600``), so the
result gets the usual permissions from the umask.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text"]


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[IO[Any]], None], *, binary: bool = False
) -> Path:
    """Call ``write(fh)`` on a temporary file next to ``path``, then rename it over ``path``.

    Args:
        path: the file to write; parent folders are created.
        write: writes the content to the open file handle.
        binary: open the handle in binary mode (else UTF-8 text, ``newline=""``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") if binary else open(tmp, "x", encoding="utf-8", newline="") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda fh: fh.write(text))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda fh: fh.write(data), binary=True)
