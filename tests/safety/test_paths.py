"""Names and paths that reach the file system are refused up front (exit 2, one message, nothing
written): run names with separators, file-name options with ``..``, empty and quoted directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashprobe.weights.store import SnapshotWriter, TensorSpec
from tests.app._study import flashprobe_cli
from tests.safety._runs import fingerprint


def _refused(proc, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["run_name=../../../../x"], ["run_name '../../../../x' cannot be used in a file name"]),
        (["run_name=a/b"], ["run_name 'a/b' cannot be used"]),
        (["seed=../x"], ["seed='../x' must be a non-negative integer"]),
        (["hydra.run.dir="], ["hydra.run.dir is empty"]),
        (["hydra.run.dir=''"], ["hydra.run.dir is empty"]),
        (
            ["hydra.run.dir=run", "+callbacks.attention_probe.filename=../../../x.jsonl"],
            ["filename='../../../x.jsonl'"],
        ),
        (
            ["hydra.run.dir=run", "+callbacks.attention_probe.filename=/tmp/x.jsonl"],
            ["must be a file name inside"],
        ),
        (
            ["hydra.run.dir=run", "callbacks.checkpoint.dirpath=/tmp/elsewhere"],
            ["lies outside the run directory"],
        ),
        (["hydra.run.dir=run", "callbacks.weight_snapshot.dirpath=.."], ["lies outside the run directory"]),
    ],
)
def test_train_refuses_paths_that_leave_the_run_before_any_write(
    tmp_path: Path, cli, args: list[str], needles: list[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    proc = cli("train", "experiment=smoke", *args, cwd=work)
    _refused(proc, *needles)
    assert fingerprint(tmp_path) == {"work": None}  # not even Hydra's outputs/ or the run directory


def test_a_quoted_run_dir_is_read_as_hydra_reads_it(tmp_path: Path, cli) -> None:
    """``"hydra.run.dir='/path'"`` is the directory /path: its checks apply and no quoted name appears."""
    work, run = tmp_path / "work", tmp_path / "run dir"
    work.mkdir()
    run.mkdir()
    (run / "run.json").write_text("{}")  # holds a run: the early refusal must see it
    proc = cli("train", "experiment=smoke", f"hydra.run.dir='{run}'", cwd=work)
    _refused(proc, "already holds a run (run.json)")
    assert list(work.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["run dir", "work"]


@pytest.mark.parametrize(
    "command",
    [
        ["study", "--out", ""],
        ["compare", "a", "b", "--out", ""],
        ["fuzz", "--kernel", "math", "--out", ""],
        ["report", ""],
        ["bench", "bias", "--out", ""],
    ],
)
def test_an_empty_out_is_refused_not_taken_as_the_working_directory(
    tmp_path: Path, cli, command: list[str]
) -> None:
    proc = cli(*command, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "empty" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_study_refuses_a_run_name_outside_its_out(tmp_path: Path, cli) -> None:
    proc = cli("study", "--out", str(tmp_path / "study"), "run_name=../../escaped", cwd=tmp_path)
    _refused(proc, "run_name '../../escaped' cannot be used in a file name")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_compare_names_pairs_of_awkward_directories_safely(tmp_path: Path, cli) -> None:
    """``compare 'run a' 'run b'``: the automatic pair name is made a safe file name, not a late failure."""
    spec = [TensorSpec.of("w", torch.zeros(3))]
    for name, value in (("run a", 0.0), ("run b", 1.0)):
        writer = SnapshotWriter(tmp_path / name, {"run_id": name})
        for step in (0, 1):
            writer.write(step, {"w": torch.full((3,), value + step)}, spec)
    proc = cli("compare", "run a", "run b", "--out", "cmp", "--no-figures", cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr[-2000:]  # nothing recorded they differ in: UNDETERMINED
    assert "run_a_vs_run_b" in proc.stdout and (tmp_path / "cmp" / "study.json").is_file()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run_name=../../../../x"], "run_name '../../../../x' cannot be used in a file name"),
        (["+callbacks.attention_probe.filename=../../../x.jsonl"], "filename='../../../x.jsonl'"),
    ],
)
def test_the_console_script_refuses_them_without_a_traceback(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    """The same refusals through a real ``flashprobe`` process: exit 2, one message, nothing written."""
    work = tmp_path / "a" / "b" / "c" / "work"
    work.mkdir(parents=True)
    _refused(flashprobe_cli("train", "experiment=smoke", *args, cwd=work), needle)
    assert fingerprint(tmp_path) == {"a": None, "a/b": None, "a/b/c": None, "a/b/c/work": None}
