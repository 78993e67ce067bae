"""The one way flashprobe writes a file: a unique temporary file beside it, fsync, ``os.replace``.

A crash mid-write leaves the previous file (or none), never a truncated one, and a killed writer
leaves at worst a hidden ``.NAME.PID.XXXXXXXX.tmp`` beside the target. Every file gets the usual
permissions from the umask: the temporary file is created with mode ``"x"`` (not
:func:`tempfile.mkstemp`, whose files are private ``0600``), and files written by a library that
sets its own mode (safetensors writes ``0600``) are given that mode back before the rename.

* :func:`atomic_write` — write through an open file handle (text or binary);
* :func:`atomic_write_text`, :func:`atomic_write_bytes` — a string or bytes;
* :func:`atomic_write_file` — a library that writes to a path (``torch.save``,
  ``safetensors.torch.save_file``).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_file", "atomic_write_text", "temporary_path"]

TMP_SUFFIX = ".tmp"


def temporary_path(path: str | os.PathLike[str]) -> Path:
    """A fresh hidden temporary name beside ``path``: ``.NAME.PID.XXXXXXXX.tmp``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


def _replace(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it over ``path``, and fsync the directory (so the rename survives a crash)."""
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # not every platform can open a directory
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    tmp = temporary_path(path)
    try:
        with open(tmp, "xb") if binary else open(tmp, "x", encoding="utf-8", newline="") as fh:
            write(fh)
        _replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def atomic_write_file(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` (a library that writes to a path), then rename the result over ``path``.

    The temporary file is created first (mode ``"x"``, so it gets the umask's permissions); if
    ``write`` changes its mode (safetensors makes files ``0600``) the umask's mode is restored.

    Args:
        path: the file to write; parent folders are created.
        write: writes the whole file at the given path (it may replace the empty file there).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        with open(tmp, "xb"):
            pass
        mode = tmp.stat().st_mode & 0o7777
        write(tmp)
        if tmp.stat().st_mode & 0o7777 != mode:
            os.chmod(tmp, mode)
        _replace(tmp, path)
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
