"""A real full disk for tests: a tiny tmpfs mounted for the test (root only; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tiny_disk(where: Path, kib: int) -> Iterator[Path]:
    """Mount a ``kib`` KiB tmpfs at ``where`` for the duration of the block.

    Skips the test where mounting is not allowed (not root, no tmpfs, a container without the
    capability).
    """
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or 'mount failed'}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path, leave_kib: int) -> None:
    """Fill ``disk`` with a file so that about ``leave_kib`` KiB stay free."""
    import shutil

    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as fh:
        fh.write(b"\0" * max(0, free - leave_kib * 1024))
