"""Writing into a directory flashprobe owns without following links.

While a process holds a directory (:func:`writing_into`), every file below it is reached from the
directory's descriptor one component at a time with ``O_NOFOLLOW``, so a planted link is refused
(:class:`LinkError`) and cannot be swapped in between a check and the write.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from flashprobe.formats.paths import OutputPathError

__all__ = ["LinkError", "held_root", "open_append", "open_new", "parent_directory", "writing_into"]

#: The directories this process writes into without following links: resolved path → holders.
_ROOTS: dict[Path, int] = {}

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class LinkError(OutputPathError):
    """A link (or another file in the way) inside a directory flashprobe writes into: refused."""

    def __init__(
        self, path: str | os.PathLike[str], root: str | os.PathLike[str] | None, kind: str = ""
    ) -> None:
        path = Path(path)
        target = Path(os.path.realpath(path))
        outside = root is not None and not target.is_relative_to(os.path.realpath(root))
        if not kind:
            kind = "in the way (not a directory)"
            if path.is_symlink():
                kind = f"a link to {target}"
        where = f" inside {root}, which flashprobe writes into" if root is not None else ""
        if outside and path.is_symlink():
            where = f", outside the run or study directory {root}"
        super().__init__(
            f"{path} is {kind}{where}; flashprobe never writes through a link (it could send its files "
            "anywhere): remove it, or replace it by a copy of what it points to (cp -L)"
        )


@contextlib.contextmanager
def writing_into(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """While the block runs, everything written below ``directory`` is opened without following links.

    Yields:
        ``directory`` resolved.
    """
    root = Path(os.path.realpath(directory))
    _ROOTS[root] = _ROOTS.get(root, 0) + 1
    try:
        yield root
    finally:
        _ROOTS[root] -= 1
        if not _ROOTS[root]:
            del _ROOTS[root]


def held_root(path: str | os.PathLike[str]) -> tuple[Path, tuple[str, ...]] | None:
    """The held directory ``path`` lies in (its shortest leading part that resolves to one) and the
    components below it, or ``None``."""
    if not _ROOTS:
        return None
    path = Path(os.path.abspath(path))
    parts = path.parts
    for n in range(1, len(parts) + 1):
        if Path(os.path.realpath(Path(*parts[:n]))) in _ROOTS:
            return Path(os.path.realpath(Path(*parts[:n]))), parts[n:]
    return None


@contextlib.contextmanager
def parent_directory(path: str | os.PathLike[str]) -> Iterator[int]:
    """An open descriptor of the directory of ``path``, created with its parents if need be (below a
    held directory, each component opened with ``O_NOFOLLOW``).

    Raises:
        LinkError: a component below the held directory is a link, or not a directory.
    """
    path = Path(path)
    found = held_root(path.parent)
    if found is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.parent, _DIRECTORY)
    else:
        root, parts = found
        fd = os.open(root, _DIRECTORY)
        for n, part in enumerate(parts):  # (each step closes the descriptor it is given)
            fd = _step(fd, part, root, root.joinpath(*parts[: n + 1]))
    try:
        yield fd
    finally:
        os.close(fd)


def _step(fd: int, name: str, root: Path, shown: Path) -> int:
    """Open (creating) the directory ``name`` in ``fd``, not through a link; closes ``fd``."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o777, dir_fd=fd)
        return os.open(name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LinkError(shown, root) from None
        raise
    finally:
        os.close(fd)


def _refused(err: OSError, path: Path) -> OSError:
    if err.errno == errno.ELOOP:
        found = held_root(path)
        return LinkError(path, found[0] if found else path.parent)
    return err


def open_new(name: str, parent: int, path: Path) -> int:
    """Create the file ``name`` (``O_EXCL``, never through a link) in ``parent``; returns its read-write
    descriptor. ``path`` is its full path, for messages."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, 0o666, dir_fd=parent)
    except OSError as err:
        raise _refused(err, path) from None


@contextlib.contextmanager
def open_append(path: str | os.PathLike[str], mode: int = 0o666) -> Iterator[int]:
    """An open descriptor appending to ``path`` (created if need be), never through a symbolic link,
    and only to a regular file with one link.

    Raises:
        LinkError: ``path`` or a directory below a held directory is a link, or ``path`` is not a
            regular file of its own.
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    with parent_directory(path) as parent:
        try:
            fd = os.open(path.name, flags, mode, dir_fd=parent)
        except OSError as err:
            raise _refused(err, path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            found = held_root(path)
            kind = "not a regular file" if not stat.S_ISREG(info.st_mode) else "a hard link to another file"
            raise LinkError(path, found[0] if found else None, kind)
        yield fd
    finally:
        os.close(fd)
