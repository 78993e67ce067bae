"""Output directories and file-name parts are checked before any work."""

from __future__ import annotations

import os

import pytest

from flashprobe.formats import OutputPathError, prepare_output_dir, safe_name


def test_prepare_output_dir_creates_nested_directories(tmp_path):
    out = prepare_output_dir(tmp_path / "a" / "b")
    assert out.is_dir() and list(out.iterdir()) == []


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_a_file_in_the_way_is_refused(tmp_path, where):
    (tmp_path / "f").write_text("x")
    path = tmp_path / "f" if where == "file" else tmp_path / "f" / "out"
    with pytest.raises(OutputPathError, match=r"--out .*(is a file|lies under .*f, which is a file)"):
        prepare_output_dir(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_an_unwritable_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OutputPathError, match="not writable"):
        prepare_output_dir(locked / "out", flag="--out")


def test_a_write_refused_by_the_system_is_reported(tmp_path, monkeypatch):
    # What a read-only mount or missing permission does (root ignores chmod, so simulate the OS error).
    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(tmp_path), "touch", refuse)
    with pytest.raises(OutputPathError, match=r"--out .* is not writable \(Permission denied\)"):
        prepare_output_dir(tmp_path / "out")


@pytest.mark.parametrize("name", ["", "../x", "a/b", "..", ".hidden", "-flag", "a b", "x\\y"])
def test_unsafe_names_are_refused(name):
    with pytest.raises(OutputPathError, match="cannot be used in a file name"):
        safe_name(name, what="--pair name")


def test_safe_names_pass_through():
    assert safe_name("flash_vs_baseline") == "flash_vs_baseline"
    assert safe_name("seed1_vs_seed0.v2") == "seed1_vs_seed0.v2"
