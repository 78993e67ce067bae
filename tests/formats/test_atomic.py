"""The one atomic writer: content, replacement, crash safety and permissions."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashprobe.formats import atomic_write, atomic_write_bytes, atomic_write_file, atomic_write_text


@pytest.fixture
def umask_022() -> Iterator[int]:
    """Run the test under umask 022, so new files are 0644."""
    old = os.umask(0o022)
    yield 0o644
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_text_and_bytes_create_parents_and_replace(tmp_path):
    target = tmp_path / "a" / "b" / "out.txt"
    assert atomic_write_text(target, "first\n") == target
    assert target.read_text() == "first\n"
    atomic_write_text(target, "second\n")
    assert target.read_text() == "second\n"
    atomic_write_bytes(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert _leftovers(target.parent) == []


def test_a_crash_mid_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    atomic_write_text(target, '{"ok": true}\n')

    def broken(fh):
        fh.write('{"half')
        raise KeyboardInterrupt  # a kill arrives mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, broken)
    assert target.read_text() == '{"ok": true}\n'
    assert _leftovers(tmp_path) == []


def test_files_get_the_umask_permissions(tmp_path, umask_022):
    atomic_write_text(tmp_path / "t.txt", "x")
    assert _mode(tmp_path / "t.txt") == umask_022


def test_library_writers_get_the_umask_permissions_not_their_own(tmp_path, umask_022):
    # safetensors' save_file makes its files 0600 (checked here, so the test cannot pass vacuously).
    save_file({"w": torch.zeros(2)}, tmp_path / "direct.safetensors")
    assert _mode(tmp_path / "direct.safetensors") == 0o600
    target = tmp_path / "snap.safetensors"
    atomic_write_file(target, lambda tmp: save_file({"w": torch.arange(3.0)}, tmp))
    assert _mode(target) == umask_022
    assert torch.equal(load_file(target)["w"], torch.arange(3.0))
    assert _leftovers(tmp_path) == []


def test_library_writer_failure_removes_its_temporary(tmp_path):
    def fails(tmp: Path) -> None:
        tmp.write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_file(tmp_path / "x.pt", fails)
    assert list(tmp_path.iterdir()) == []
