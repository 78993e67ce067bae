"""One writer per directory: an advisory :func:`fcntl.flock` on ``DIR/.flashprobe.lock``.

A second process is refused at once (:class:`DirectoryLockedError`, naming the holder). The kernel
releases the lock when its process ends (``kill -9`` included), so a stale file is simply taken over;
the file is removed when its holder lets go. Locks are re-entrant within a process. The lock file is
never opened through a link, and while it is held every write below the directory follows no link
(:func:`flashprobe.formats.nofollow.writing_into`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from flashprobe.errors import FlashprobeError
from flashprobe.formats.jsonio import utc_now
from flashprobe.formats.nofollow import LinkError, writing_into

__all__ = ["LOCK_NAME", "DirectoryLockedError", "directory_lock", "lock_holder"]

#: The lock file inside a locked directory.
LOCK_NAME = ".flashprobe.lock"

#: The directories this process holds: resolved path → (open lock file, how many holders).
_HELD: dict[Path, list] = {}


class DirectoryLockedError(RuntimeError, FlashprobeError):
    """Another process is writing into the directory."""


def lock_holder(directory: str | os.PathLike[str]) -> str:
    """Who holds (or last held) the lock of ``directory``, as written in its lock file."""
    from flashprobe.formats.paths import printable

    try:
        with open(Path(directory) / LOCK_NAME, "rb", opener=_no_follow) as fh:
            text = fh.read(1000).decode("utf-8", errors="replace").strip()
    except OSError:
        return "an unknown process"
    return printable(text) or "an unknown process"


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike[str], *, what: str = "directory") -> Iterator[Path]:
    """Hold the lock of ``directory`` (created if needed) for the ``with`` block; yields the lock file.

    ``what`` says what the directory is, for the error message (``run directory``).

    Raises:
        DirectoryLockedError: another process holds the lock; nothing was written.
    """
    path = Path(directory).resolve()
    held = _HELD.get(path)
    if held is not None:
        held[1] += 1
        try:
            yield path / LOCK_NAME
        finally:
            held[1] -= 1
        return
    path.mkdir(parents=True, exist_ok=True)
    lock_file = path / LOCK_NAME
    directory_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = _acquire(directory_fd, what, path)
    except BaseException:
        os.close(directory_fd)
        raise
    command = " ".join(["flashprobe", *sys.argv[1:]])[:300]
    os.ftruncate(fd, 0)
    line = f"pid {os.getpid()} on {socket.gethostname()} since {utc_now()}: {command}\n"
    os.write(fd, line.encode("utf-8", "surrogateescape"))
    _HELD[path] = [fd, 1]
    try:
        with writing_into(path):
            yield lock_file
    finally:
        _HELD[path][1] -= 1
        if _HELD[path][1] == 0:
            del _HELD[path]
            with contextlib.suppress(OSError):  # while still locked: a waiter then finds it gone, retries
                os.unlink(LOCK_NAME, dir_fd=directory_fd)
            os.close(fd)
            os.close(directory_fd)


def _acquire(directory_fd: int, what: str, directory: Path) -> int:
    """Open (never through a link) and ``flock`` the lock file in ``directory_fd``; returns its
    descriptor once locked and still the file there (a holder may remove it as it lets go).

    Raises:
        DirectoryLockedError: another process holds it.
        LinkError: the lock file is a link or not a regular file of its own.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    for _ in range(100):
        try:
            fd = os.open(LOCK_NAME, flags, 0o644, dir_fd=directory_fd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise LinkError(directory / LOCK_NAME, directory) from None
            raise
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            kind = "a hard link to another file" if stat.S_ISREG(info.st_mode) else "not a regular file"
            raise LinkError(directory / LOCK_NAME, directory, kind)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryLockedError(
                f"{what} {directory} is in use by another flashprobe process ({lock_holder(directory)}); "
                "one process writes into a directory at a time: wait for it to end (or stop it), or choose "
                "another directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(LOCK_NAME, dir_fd=directory_fd, follow_symlinks=False).st_ino == info.st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # locked a file its holder removed as it let go: lock the new one
    raise DirectoryLockedError(f"{what} {directory}: could not take its lock {LOCK_NAME}; try again")
