"""Links planted in a directory flashprobe writes into never send a write elsewhere.

While a process holds a directory's lock, every file it writes below it is reached without following
links: a linked sub-directory, a linked file appended to, a linked or hard-linked lock file are refused
(:class:`~flashprobe.formats.nofollow.LinkError`) and the file they point to keeps its bytes. Everything
here happens inside the test's own temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save_file

from flashprobe.formats import OutputPathError, atomic_write_file, atomic_write_text
from flashprobe.formats.lock import LOCK_NAME, directory_lock
from flashprobe.formats.probe_log import ProbeLogWriter

KEEP = "the user's own file\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the run directory that must keep its bytes."""
    path = tmp_path / "outside" / "victim.txt"
    path.parent.mkdir()
    path.write_text(KEEP)
    return path


def test_a_linked_directory_inside_a_locked_run_is_refused(tmp_path: Path, victim: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "csv").symlink_to(victim.parent)
    with directory_lock(run), pytest.raises(OutputPathError, match=r"csv is a link to .*outside"):
        atomic_write_text(run / "csv" / "victim.txt", "overwritten")
    assert victim.read_text() == KEEP and sorted(p.name for p in victim.parent.iterdir()) == ["victim.txt"]


def test_a_linked_file_is_replaced_not_written_through(tmp_path: Path, victim: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").symlink_to(victim)
    with directory_lock(run):
        atomic_write_text(run / "run.json", "{}")
    assert victim.read_text() == KEEP
    assert not (run / "run.json").is_symlink() and (run / "run.json").read_text() == "{}"


def test_the_run_directory_itself_may_be_reached_through_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    with directory_lock(tmp_path / "alias"):
        atomic_write_text(tmp_path / "alias" / "checkpoints" / "a.txt", "x")
    assert (real / "checkpoints" / "a.txt").read_text() == "x"


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_an_append_never_goes_through_a_link(tmp_path: Path, victim: Path, kind: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    log = run / "probe.jsonl"
    log.symlink_to(victim) if kind == "symlink" else os.link(victim, log)
    writer = ProbeLogWriter(log)
    writer.opened = True  # as a resumed run does, keeping what the file holds
    with directory_lock(run), pytest.raises(OutputPathError, match=r"probe\.jsonl is a"):
        writer.append({"step": 1, "x": 2})
    assert victim.read_text() == KEEP


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_planted_lock_file_is_refused_never_truncated(tmp_path: Path, victim: Path, kind: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    lock = run / LOCK_NAME
    lock.symlink_to(victim) if kind == "symlink" else os.link(victim, lock)
    with pytest.raises(OutputPathError, match=r"\.flashprobe\.lock is a"), directory_lock(run):
        pass
    assert victim.read_text() == KEEP


def test_a_library_writer_in_a_directory_whose_name_is_not_utf8(tmp_path: Path) -> None:
    run = tmp_path / os.fsdecode(b"run\xff")
    with directory_lock(run):
        atomic_write_file(run / "w.safetensors", lambda tmp: save_file({"w": torch.arange(3.0)}, tmp))
    with open(run / "w.safetensors", "rb") as fh:
        assert torch.equal(load(fh.read())["w"], torch.arange(3.0))
    assert sorted(p.name for p in run.iterdir()) == ["w.safetensors"]
