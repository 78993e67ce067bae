"""Checks on where results go, made before any work starts: output directories
(:func:`check_write_dir`), names used in file names (:func:`safe_name`), and text shown on a
terminal (:func:`printable`).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

from flashprobe.errors import FlashprobeError

__all__ = [
    "OutputPathError",
    "check_output_dir",
    "check_write_dir",
    "library_path",
    "output_dir_arg",
    "prepare_output_dir",
    "printable",
    "safe_name",
]

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*")


class OutputPathError(ValueError, FlashprobeError):
    """An output directory or a name used in a file name is unusable."""


#: Directories no command writes into: the root, the system's own trees (and everything under them).
SYSTEM_ROOTS = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/sbin")
SYSTEM_ROOTS += ("/sys", "/usr")
#: Directories shared by everything on the machine: refused themselves (a directory inside is fine).
SHARED_DIRS = ("/home", "/mnt", "/media", "/opt", "/root", "/run", "/srv", "/tmp", "/var", "/Users")


def _system_dir(resolved: Path) -> str | None:
    """Why the resolved directory ``resolved`` is not one to write into, or ``None``."""
    home = Path.home().resolve()
    if resolved == home or (resolved != Path("/") and home.is_relative_to(resolved)):
        return "your home directory" if resolved == home else f"above your home directory ({home})"
    for root in SYSTEM_ROOTS:
        if resolved == Path(root) or (root != "/" and resolved.is_relative_to(root)):
            return f"a system directory ({root})" if resolved == Path(root) else f"inside the system's {root}"
    if str(resolved) in SHARED_DIRS:
        return "a directory shared by the whole machine"
    return None


def check_write_dir(
    path: str | os.PathLike[str],
    named_by: str,
    *,
    owned: tuple[str, ...] | None = None,
    inside: str | os.PathLike[str] | None = None,
) -> Path:
    """The one check of a directory flashprobe will write into, before any work; nothing is created.

    Refused: an empty path, a file or a path under one, a system directory once resolved
    (:data:`SYSTEM_ROOTS`, :data:`SHARED_DIRS`, the home directory or above), with ``owned`` a
    non-empty directory holding none of those names, with ``inside`` a path outside that directory.

    Args:
        path: the directory (returned as a :class:`~pathlib.Path`).
        named_by: what named it, for the message: ``--out``, ``hydra.run.dir (set in conf/x.yaml)``.
        owned: the names the command writes there (``None``: any directory).
        inside: the directory ``path`` must resolve inside (a run's own directory).

    Raises:
        OutputPathError: naming ``named_by``, the path, the problem and the fix.
    """
    key = named_by.split()[0]
    example = f"{key}=out/run1" if not key.startswith("-") else f"{key} out/run1"
    if not str(os.fspath(path)).strip():
        raise OutputPathError(
            f"{named_by} is empty: it would write into the working directory; give a directory, e.g. "
            f"{example} (or {example.removesuffix('out/run1')}. to mean the working directory)"
        )
    path = Path(path)
    for parent in (path, *path.parents):
        if parent.exists() and not parent.is_dir():
            where = "is a file" if parent == path else f"lies under {parent}, which is a file"
            raise OutputPathError(f"{named_by} {path} {where}; give a directory path")
    resolved = path.resolve()
    shown = f"{path}" if resolved == path.absolute() else f"{path} (which is {resolved})"
    if inside is not None and not resolved.is_relative_to(Path(inside).resolve()):
        raise OutputPathError(
            f"{named_by} {shown} lies outside the run directory {inside}; a run writes only into its own "
            "directory: leave it at its default (inside the run) or choose the run directory with "
            "hydra.run.dir"
        )
    why = _system_dir(resolved)
    if why is not None:
        raise OutputPathError(
            f"{named_by} {shown} is {why}; flashprobe writes only into directories of its own: give a new "
            f"directory, e.g. {example}"
        )
    if owned is not None and resolved.is_dir():
        present = sorted(os.fsdecode(n) for n in os.listdir(resolved))
        if present and not set(present) & set(owned):
            listed = ", ".join(printable(n) for n in present[:5]) + (", ..." if len(present) > 5 else "")
            raise OutputPathError(
                f"{named_by} {path} holds files flashprobe did not write there ({listed}); give a new or "
                f"empty directory (or one this command wrote before: it holds {' or '.join(owned[:2])})"
            )
    return path


def check_output_dir(
    path: str | os.PathLike[str], *, flag: str = "--out", owned: tuple[str, ...] | None = None
) -> Path:
    """:func:`check_write_dir` (``flag`` naming ``path``), and that ``path`` could be created and
    written as a directory; nothing is created.

    Raises:
        OutputPathError: as for :func:`check_write_dir`, or it is not writable.
    """
    path = check_write_dir(path, flag, owned=owned)
    if path.is_dir():
        _write_check(path, flag)  # a probe file, removed at once: the directory is left as it was
        return path
    existing = next((p for p in path.parents if p.exists()), Path("."))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {path} is not writable ({existing}); give a writable directory")
    return path


def prepare_output_dir(
    path: str | os.PathLike[str], *, flag: str = "--out", owned: tuple[str, ...] | None = None
) -> Path:
    """:func:`check_output_dir`, creating ``path`` (and its parents) if needed.

    Raises:
        OutputPathError: as for :func:`check_output_dir`, or ``path`` cannot be created.
    """
    path = check_write_dir(path, flag, owned=owned)
    _write_check(path, flag, create=True)
    return path


def _write_check(path: Path, flag: str, *, create: bool = False) -> None:
    """Create (with ``create``) the directory ``path`` and a probe file in it, then remove the file.

    Raises:
        OutputPathError: it cannot be done.
    """
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        probe = path / f".flashprobe-write-check.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as err:
        raise OutputPathError(
            f"{flag} {path} is not writable ({err.strerror or err}); give a directory you can write to"
        ) from None


@contextlib.contextmanager
def library_path(path: str | os.PathLike[str], *, create: bool = False) -> Iterator[str]:
    """``path`` as a string a library that wants UTF-8 (safetensors) can open: a non-UTF-8 path is
    opened here and handed over as ``/proc/self/fd/N``.

    Args:
        create: create the file (empty) if it does not exist.

    Raises:
        OSError: a non-UTF-8 path on a system without ``/proc/self/fd``, or the file cannot be opened.
    """
    raw = os.fsencode(path)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        yield os.fsdecode(raw)
        return
    if not os.path.isdir("/proc/self/fd"):
        raise OSError(f"{os.fsdecode(raw)!r}: this system cannot hand a non-UTF-8 path to the library")
    fd = os.open(raw, os.O_RDONLY | (os.O_CREAT if create else 0), 0o666)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


#: Control characters other than tab and newline (escape sequences, carriage returns, C1 controls).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """``text`` for a terminal or log: non-UTF-8 bytes (``surrogateescape``) and control characters
    shown as ``\\xNN``, never acted on by the terminal."""
    text = str(text).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def output_dir_arg(text: str) -> Path:
    """An ``argparse`` type for ``--out DIR`` that refuses an empty string (not the working directory)."""
    import argparse

    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty: it would write into the working directory; give a directory, e.g. --out out/run1"
        )
    return Path(text)


def safe_name(name: str, *, what: str = "name") -> str:
    """``name`` if it can be used as (part of) a file name inside an output directory.

    Raises:
        OutputPathError: empty, ``..``, a leading dot or dash, or characters other than letters,
            digits and ``_ . + = -`` (named by ``what``).
    """
    if not isinstance(name, str) or not _SAFE.fullmatch(name) or ".." in name:
        raise OutputPathError(
            f"{what} {name!r} cannot be used in a file name: use letters, digits and _ . + = - only "
            "(no '/', no '..', not starting with '.' or '-'), e.g. flash_vs_baseline"
        )
    return name
