"""One writer per directory: an advisory lock on ``DIR/.flashprobe.lock``.

``flashprobe train`` takes the lock of its run directory and ``flashprobe study`` the lock of its
``--out`` directory before writing anything there, and hold it until they end. A second process
that wants the same directory is refused at once with :class:`DirectoryLockedError`, whose message names
the process holding it (pid, host, command, since when), instead of both writing the same files.

The lock is :func:`fcntl.flock` on an open file: the kernel releases it when its process ends, however
it ends (``kill -9`` included), so a lock file left by a dead process is stale by construction and the
next process simply takes it over; the pid written in the file is only there to name the holder. The
file is removed when its holder lets go (so a finished run's directory holds no trace of it); a
process that locked a file just removed by its holder sees that the path no longer names the file it
locked and tries again, so two processes never both hold a directory. Locks
are re-entrant within a process (a study's runs, ``flashprobe train`` locking before Hydra starts
and again in ``train()``): the second request of a directory the process holds already is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from flashprobe.formats.jsonio import utc_now

__all__ = ["LOCK_NAME", "DirectoryLockedError", "directory_lock", "lock_holder"]

#: The lock file inside a locked directory.
LOCK_NAME = ".flashprobe.lock"

#: The directories this process holds: resolved path → (open lock file, how many holders).
_HELD: dict[Path, list] = {}


class DirectoryLockedError(RuntimeError):
    """Another process is writing into the directory."""


def lock_holder(directory: str | os.PathLike[str]) -> str:
    """Who holds (or last held) the lock of ``directory``, as written in its lock file."""
    try:
        text = (Path(directory) / LOCK_NAME).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return "an unknown process"
    return text or "an unknown process"


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike[str], *, what: str = "directory") -> Iterator[Path]:
    """Hold the lock of ``directory`` (created if needed) for the ``with`` block.

    Args:
        directory: the run or study directory.
        what: what the directory is, for the error message (``run directory``, ``study --out``).

    Yields:
        The lock file.

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
    fd = _acquire(lock_file, what, path)
    command = " ".join(["flashprobe", *sys.argv[1:]])[:300]
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {utc_now()}: {command}\n".encode())
    _HELD[path] = [fd, 1]
    try:
        yield lock_file
    finally:
        _HELD[path][1] -= 1
        if _HELD[path][1] == 0:
            del _HELD[path]
            with contextlib.suppress(OSError):
                lock_file.unlink()  # while still locked: a waiter then finds the path gone and retries
            os.close(fd)


def _acquire(lock_file: Path, what: str, directory: Path) -> int:
    """Open and ``flock`` ``lock_file``; the open descriptor once it is locked and still the file there.

    Raises:
        DirectoryLockedError: another process holds it.
    """
    for _ in range(100):
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
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
            same = os.stat(lock_file).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # locked a file its holder removed as it let go: lock the new one
    raise DirectoryLockedError(f"{what} {directory}: could not take its lock {lock_file}; try again")
