"""Paths handed in are data: an --out that resolves to a system directory or to someone else's files is
refused, a snapshot that links out of its run is refused, and any bytes in a path are handled."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flashprobe.report.cli import compare_main, report_main
from tests.app._study import TINY
from tests.weights._helpers import write_run

WEIGHTS = {0: {"w": torch.zeros(4)}, 2: {"w": torch.ones(4)}}
OTHER = {0: {"w": torch.zeros(4)}, 2: {"w": torch.full((4,), 3.0)}}


def test_a_study_out_that_is_a_link_to_a_system_directory_is_refused(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A stand-in system directory (were the check to fail, the study would write there, not into /;
    tests/formats/test_paths.py checks / itself)."""
    from flashprobe.app.study import main
    from flashprobe.formats import paths

    system = tmp_path / "system"
    system.mkdir()
    monkeypatch.setattr(paths, "SYSTEM_ROOTS", (*paths.SYSTEM_ROOTS, str(system)))
    link = tmp_path / "out"
    link.symlink_to(system)
    assert main(["--out", str(link), "--runs", "flash,baseline", *TINY]) == 2
    err = capsys.readouterr().err
    assert f"--out {link} (which is {system}) is a system directory ({system})" in err
    assert list(system.iterdir()) == []


def test_compare_refuses_an_out_of_someone_elses_files(tmp_path: Path, capsys) -> None:
    runs = [write_run(tmp_path / name, WEIGHTS, seed=seed) for name, seed in (("a", 0), ("b", 1))]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert compare_main([*map(str, runs), "--out", str(tmp_path / "mine")]) == 2
    assert "holds files flashprobe did not write there (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_compare_refuses_a_snapshot_that_links_into_another_run(tmp_path: Path, capsys) -> None:
    """Linked to the other run's file, the pair would measure a run against itself: distance 0."""
    a = write_run(tmp_path / "a", WEIGHTS, seed=0)
    b = write_run(tmp_path / "b", OTHER, seed=1)
    linked = b / "snapshots" / "step_0000002.safetensors"
    linked.unlink()
    linked.symlink_to(a / "snapshots" / "step_0000002.safetensors")
    assert compare_main([str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"is a link to {a.resolve() / 'snapshots' / 'step_0000002.safetensors'}, outside" in err
    assert not (tmp_path / "out" / "study.json").exists()
    (b / "snapshots").rename(tmp_path / "elsewhere")
    (b / "snapshots").symlink_to(tmp_path / "elsewhere")  # the whole directory linked out of the run
    assert compare_main([str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    assert "snapshots directory" in capsys.readouterr().err


def test_compare_and_report_handle_any_bytes_in_a_path(tmp_path: Path, capsys) -> None:
    a = write_run(tmp_path / os.fsdecode(b"run\xff"), WEIGHTS, seed=0)
    b = write_run(tmp_path / "b", OTHER, seed=1)
    out = tmp_path / os.fsdecode(b"out\xfe")
    # a seed pair alone carries no verdict: UNDETERMINED, exit code 4, as `flashprobe study` gives it
    assert compare_main([str(a), str(b), "--out", str(out)]) == 4, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "2.000e+00  2.000e+00" in printed  # |3 - 1| at step 2, both distances: read, not called corrupt
    assert report_main([str(out)]) == 4, capsys.readouterr().err
    assert b"run\xff" in (out / "report.md").read_bytes()  # the path's bytes, as they are


def test_compare_refuses_a_run_against_itself_and_leaves_no_empty_out(tmp_path: Path, capsys) -> None:
    """``compare a a`` reported distance 0 as a result; a pair refused while measuring (no step in
    common) left an empty --out behind (issue 42's table). Both leave nothing."""
    a = write_run(tmp_path / "a", WEIGHTS, seed=0)
    assert compare_main([str(a), str(tmp_path / "." / "a"), "--out", str(tmp_path / "out")]) == 2
    assert "are the same run directory, and a run against itself is at distance 0" in capsys.readouterr().err
    b = write_run(tmp_path / "b", {1: {"w": torch.zeros(4)}, 3: {"w": torch.ones(4)}}, seed=1)
    assert compare_main([str(a), str(b), "--out", str(tmp_path / "out")]) == 2
    assert "have no snapshot step in common" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
