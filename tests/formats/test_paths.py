"""Output directories and file-name parts are checked before any work."""

from __future__ import annotations

import os

import pytest

from flashprobe.formats import OutputPathError, prepare_output_dir, safe_name
from flashprobe.formats.paths import check_output_dir


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


@pytest.mark.parametrize("target", ["/", "/usr", "/etc", "/usr/share/flashprobe-out", "/tmp"])
def test_an_output_directory_that_resolves_to_a_system_directory_is_refused(tmp_path, target):
    link = tmp_path / "out"
    link.symlink_to(target)
    for check in (check_output_dir, prepare_output_dir):
        expected = rf"--out {link} \(which is {target}\) is .*give a new directory"
        with pytest.raises(OutputPathError, match=expected):
            check(link)
        with pytest.raises(OutputPathError, match=r"system|shared by the whole machine"):
            check(target)


def test_the_home_directory_and_above_it_are_refused(tmp_path, monkeypatch):
    home = tmp_path / "home" / "me"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(OutputPathError, match="is your home directory"):
        check_output_dir(home)
    with pytest.raises(OutputPathError, match="is above your home directory"):
        prepare_output_dir(tmp_path / "home")
    assert check_output_dir(home / "out") == home / "out"


def test_a_directory_of_other_files_is_refused_where_the_command_names_its_own(tmp_path):
    owned = ("study.json", "runs")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("mine")
    with pytest.raises(OutputPathError, match=r"holds files flashprobe did not write there \(thesis\.tex\)"):
        prepare_output_dir(theirs, owned=owned)
    assert (theirs / "thesis.tex").read_text() == "mine" and len(list(theirs.iterdir())) == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "study.json").write_text("{}")
    for fine in ("empty", "ours", "new"):
        assert prepare_output_dir(tmp_path / fine, owned=owned) == tmp_path / fine
    assert check_output_dir(theirs) == theirs  # a command that does not name its files: any directory


@pytest.mark.parametrize("target", ["/", "/etc", "/proc/x", "/usr/local/out"])
def test_the_one_check_names_the_key_and_file_that_named_a_system_directory(target):
    """Nothing is written: the check only reads (the end-to-end refusals use sandboxed directories)."""
    from flashprobe.formats.paths import check_write_dir

    named_by = "hydra.run.dir (set in mycfg/experiment/root.yaml)"
    with pytest.raises(
        OutputPathError, match=rf"^hydra\.run\.dir \(set in mycfg/experiment/root\.yaml\) {target}"
    ):
        check_write_dir(target, named_by)


def test_the_one_check_refuses_a_foreign_directory_and_a_path_outside_the_run(tmp_path):
    from flashprobe.formats.paths import check_write_dir

    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep")
    with pytest.raises(
        OutputPathError, match=r"^output_root \(set in c\.yaml\) .*theirs holds files .*notes\.txt"
    ):
        check_write_dir(tmp_path / "theirs", "output_root (set in c.yaml)", owned=("run.json",))
    run = tmp_path / "run"
    with pytest.raises(OutputPathError, match=r"logger\.csv\.save_dir .* lies outside the run directory"):
        check_write_dir(tmp_path / "elsewhere", "logger.csv.save_dir", inside=run)
    assert check_write_dir(run / "csv", "logger.csv.save_dir", inside=run) == run / "csv"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs"]  # nothing created


def test_text_read_from_a_file_prints_without_acting_on_the_terminal():
    from flashprobe.formats.paths import printable

    assert printable("a\x1b[2J\x07b\rc\td\n\x9b") == "a\\x1b[2J\\x07b\\x0dc\td\n\\x9b"
    assert printable(os.fsdecode(b"run\xff")) == "run\\xff"
