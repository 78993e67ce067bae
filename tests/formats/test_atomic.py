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


def test_a_write_that_runs_out_of_space_says_so_in_one_line(tmp_path, monkeypatch):
    """torch's zip writer says only "unexpected pos" when the disk is full: read with the free space."""
    import errno

    from flashprobe.formats import atomic
    from flashprobe.formats.atomic import DiskFullError

    target = tmp_path / "out.bin"

    def zip_writer(tmp: Path) -> None:
        Path(tmp).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 312000 vs 311892")

    monkeypatch.setattr(atomic, "free_space", lambda directory: 4096)
    with pytest.raises(DiskFullError) as raised:
        atomic_write_file(target, zip_writer)
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC and "\n" not in message
    assert f"the disk holding {tmp_path} is full (0.0 MiB free) writing out.bin; no out.bin written" in (
        message
    )
    assert _leftovers(tmp_path) == [] and not target.exists()

    def no_space(fh) -> None:
        fh.write("x")
        raise OSError(errno.ENOSPC, "No space left on device")

    atomic_write_bytes(target, b"good")
    monkeypatch.undo()  # the errno alone says it, whatever the free space
    with pytest.raises(DiskFullError, match=r"the earlier out\.bin is kept"):
        atomic_write(target, no_space)
    assert target.read_bytes() == b"good" and _leftovers(tmp_path) == []


def test_an_error_with_space_left_is_not_called_a_full_disk(tmp_path):
    def broken(tmp: Path) -> None:
        raise RuntimeError("unexpected pos")

    with pytest.raises(RuntimeError, match=r"^unexpected pos$"):
        atomic_write_file(tmp_path / "out.bin", broken)
    assert _leftovers(tmp_path) == []


def test_a_real_full_disk_keeps_the_earlier_file(tmp_path):
    from flashprobe.formats.atomic import DiskFullError
    from tests._disk import fill, tiny_disk

    with tiny_disk(tmp_path / "disk", 512) as disk:
        target = disk / "weights.pt"
        atomic_write_file(target, lambda tmp: torch.save({"w": torch.zeros(4)}, tmp))
        before = target.read_bytes()
        fill(disk, 64)
        expected = (
            r"the disk holding .*disk is full \(0\.\d MiB free\) writing weights\.pt; "
            r"the earlier weights\.pt is kept"
        )
        with pytest.raises(DiskFullError, match=expected):
            atomic_write_file(target, lambda tmp: torch.save({"w": torch.zeros(100_000)}, tmp))
        assert target.read_bytes() == before
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "weights.pt"]
        big = {"w": torch.zeros(100_000)}
        with pytest.raises(DiskFullError, match=r"no big\.safetensors written"):
            atomic_write_file(disk / "big.safetensors", lambda tmp: save_file(big, tmp))
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "weights.pt"]
