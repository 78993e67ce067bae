"""The one way flashprobe writes a file: a temporary file beside it, fsync, ``os.replace``.

A crash leaves the previous file (or none), at worst with a hidden ``.NAME.PID.XXXXXXXX.tmp`` beside
it. Files get the umask's permissions. A write that runs out of space raises :class:`DiskFullError`,
the temporary removed. Inside a directory this process writes into, no link is followed
(:mod:`flashprobe.formats.nofollow`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from flashprobe.errors import FlashprobeError
from flashprobe.formats.nofollow import open_new, parent_directory

__all__ = [
    "DiskFullError",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_file",
    "atomic_write_text",
    "disk_full",
    "exception_chain",
    "free_space",
    "remove_temporary",
    "stray_temporaries",
    "temporary_path",
]

TMP_SUFFIX = ".tmp"

#: Free space below which a failed write is read as a full disk, whatever the library's message: a
#: writer that ran out of space leaves (with its temporary file still there) less than this.
FULL_BELOW = 1 << 20

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError, FlashprobeError):
    """A write that failed for lack of space; one line naming the directory, its free space and what
    was kept.

    Attributes:
        path: the file that could not be written.
        free: free bytes on its disk (``None`` when the disk cannot be asked).
    """

    def __init__(self, path: str | os.PathLike[str], *, kept: str | None = None) -> None:
        self.path = Path(path)
        self.free = free_space(self.path.parent)
        if kept is None:
            name = self.path.name
            kept = f"the earlier {name} is kept" if self.path.exists() else f"no {name} written"
        free = "free space unknown" if self.free is None else f"{self.free / 2**20:.1f} MiB free"
        super().__init__(
            errno.ENOSPC,
            f"the disk holding {self.path.parent} is full ({free}) writing {self.path.name}; {kept}. Free "
            "some space (or use another disk) and run the command again",
        )

    def __str__(self) -> str:
        return str(self.strerror)


def free_space(directory: str | os.PathLike[str]) -> int | None:
    """Free bytes (for this user) on the disk holding ``directory`` or its nearest existing parent."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def exception_chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err`` and the exceptions that caused it."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an exception that caused it) is a write that failed for lack of space."""
    for e in exception_chain(err):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
    return False


def _failed_for_space(err: BaseException, directory: Path) -> bool:
    """Whether a write into ``directory`` that raised ``err`` ran out of space: said so, or an I/O-like
    error while the disk is nearly full (torch's zip writer says only ``unexpected pos``)."""
    if disk_full(err):
        return True
    if not isinstance(err, OSError | RuntimeError):
        return False
    free = free_space(directory)
    return free is not None and free < FULL_BELOW


def temporary_path(path: str | os.PathLike[str]) -> Path:
    """A fresh hidden temporary name beside ``path``: ``.NAME.PID.XXXXXXXX.tmp``."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


#: The name :func:`temporary_path` gives: ``.NAME.PID.XXXXXXXX.tmp``.
_TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]{8}" + re.escape(TMP_SUFFIX) + "$")


def stray_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """The temporaries a killed writer left in ``directory`` and below (named as :func:`temporary_path`
    names them; no link)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = directory.rglob(f".*{TMP_SUFFIX}")
    return sorted(p for p in found if _TEMPORARY.match(p.name) and not p.is_symlink() and p.exists())


def remove_temporary(path: Path) -> None:
    """Delete a temporary :func:`stray_temporaries` found (a directory with its contents)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[IO[Any]], None], *, binary: bool = False
) -> Path:
    """Call ``write(fh)`` on a temporary file next to ``path`` (parents created), then rename it over
    ``path``; returns ``path`` as a :class:`~pathlib.Path`.

    Args:
        path: the file to write.
        write: writes the content to the open file handle.
        binary: open the handle in binary mode (else UTF-8 text with ``surrogateescape``, ``newline=""``).

    Raises:
        DiskFullError: the disk ran out of space; ``path`` is as it was before.
        LinkError: a directory on the way below a directory this process writes into is a link.
    """
    text = {"encoding": "utf-8", "errors": "surrogateescape", "newline": ""}

    def write_to(name: str, directory: int) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
        with open(fd, "wb") if binary else open(fd, "w", **text) as fh:
            write(fh)

    return _write_atomically(Path(path), write_to)


def atomic_write_file(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` (a library that writes to a path), then rename the result over ``path``.

    The library writes an ASCII name in a private temporary directory beside ``path`` (through
    ``/proc/self/fd/N`` where there is one); a mode it sets (safetensors: ``0600``) is reset to the
    umask's. Returns ``path`` as a :class:`~pathlib.Path`; raises as :func:`atomic_write`.
    """
    path = Path(path)

    def write_to(name: str, directory: int) -> None:
        through = Path(f"/proc/self/fd/{directory}")
        write((through if through.is_dir() else temporary) / name)

    temporary = path.parent / temporary_path(path).name  # the fallback path where /proc is absent
    return _write_atomically(path, write_to, temporary)


def _write_atomically(path: Path, write: Callable[[str, int], None], temporary: Path | None = None) -> Path:
    """In a private temporary directory beside ``path``: create an empty file, ``write(its name, the
    directory's descriptor)``, fsync, rename it over ``path``, fsync the parent; remove the directory."""
    temporary = temporary or temporary_path(path)
    name = "file" + (path.suffix if path.suffix.isascii() else "")
    with parent_directory(path) as parent:
        try:
            os.mkdir(temporary.name, 0o700, dir_fd=parent)
            inner = os.open(temporary.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            try:
                fd = open_new(name, inner, temporary / name)
                mode = os.fstat(fd).st_mode & 0o7777
                os.close(fd)
                write(name, inner)
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=inner)
                try:
                    if os.fstat(fd).st_mode & 0o7777 != mode:
                        os.fchmod(fd, mode)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(name, path.name, src_dir_fd=inner, dst_dir_fd=parent)
            finally:
                for left in os.listdir(inner):  # what a failed write left (a library's own temporary)
                    with contextlib.suppress(OSError):
                        os.unlink(left, dir_fd=inner)
                os.close(inner)
                os.rmdir(temporary.name, dir_fd=parent)
        except BaseException as err:
            full = isinstance(err, Exception) and _failed_for_space(err, path.parent)
            if full and not isinstance(err, DiskFullError):
                raise DiskFullError(path) from err
            raise
        with contextlib.suppress(OSError):  # not every platform can fsync a directory
            os.fsync(parent)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    return atomic_write(path, lambda fh: fh.write(text))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    return atomic_write(path, lambda fh: fh.write(data), binary=True)
