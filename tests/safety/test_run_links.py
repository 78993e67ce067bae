"""Links planted in a run directory never make ``resume=`` write outside it, and a recorded setting
cannot send the run's files elsewhere: each is refused before any work (exit 2, one message naming the
link or the setting and where it came from), and the file or directory it points to keeps its bytes.
The run, the links and their targets all lie in the test's own directory."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from flashprobe.app.train import cli_main
from tests.safety._runs import SHORT, fingerprint


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run of ``flashprobe train`` (so it records its overrides as the CLI does)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert cli_main([*SHORT, f"hydra.run.dir={run}"]) == 0
    finally:  # Hydra points the root logger at the run's log and the console: the other tests' own
        root.handlers[:], root.level = handlers, level
    return run


def _plant(run: Path, name: str, target: Path, kind: str) -> None:
    path = run / name
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    if kind == "hard":
        os.link(target, path)
    else:
        path.symlink_to(target, target_is_directory=target.is_dir())


@pytest.mark.parametrize(
    ("name", "target", "kind"),
    [
        (".flashprobe.lock", "file", "symbolic"),
        (".flashprobe.lock", "file", "hard"),
        (".hydra/config.yaml", "file", "symbolic"),
        ("train.log", "file", "symbolic"),
        ("train.log", "file", "hard"),
        (".hydra", "directory", "symbolic"),
        ("csv", "directory", "symbolic"),
        ("probe.jsonl", "other run", "symbolic"),
        ("probe.jsonl", "other run", "hard"),
        ("snapshots", "directory", "symbolic"),
        ("checkpoints", "directory", "symbolic"),
    ],
)
def test_a_link_in_the_run_is_refused_before_resume_writes(
    finished: Path, tmp_path: Path, cli, name: str, target: str, kind: str
) -> None:
    run = Path(shutil.copytree(finished, tmp_path / "run", symlinks=True))
    outside = tmp_path / "outside"
    shutil.copytree(finished / name if target == "directory" else finished / ".hydra", outside)
    (outside / "victim.txt").write_text("the user's own file\n")
    other = tmp_path / "other_run" / "probe.jsonl"
    other.parent.mkdir()
    other.write_text((finished / "probe.jsonl").read_text())
    pointed = {"file": outside / "victim.txt", "directory": outside, "other run": other}[target]
    _plant(run, name, pointed, kind)
    before, theirs = fingerprint(run), fingerprint(tmp_path, skip=("run",))
    result = cli("train", f"resume={run}", "trainer.max_steps=3", cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert f"{run / name} is a" in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert fingerprint(tmp_path, skip=("run",)) == theirs  # nothing outside the run written
    assert fingerprint(run) == before  # nor inside: refused before any work


@pytest.mark.parametrize(
    ("setting", "phrase"),
    [
        ("logger.csv.save_dir={outside}", "logger.csv.save_dir (recorded in {run}/.hydra/overrides.yaml)"),
        ("+trainer.default_root_dir={outside}", "trainer.default_root_dir (recorded in {run}/.hydra/"),
        ("logger.csv.name=../../escaped", "logger.csv.name='../../escaped' (recorded in {run}/.hydra/"),
        ("callbacks.weight_snapshot.dirpath={outside}", "callbacks.weight_snapshot.dirpath (recorded in"),
    ],
)
def test_a_recorded_setting_cannot_send_the_runs_files_outside_it(
    finished: Path, tmp_path: Path, cli, setting: str, phrase: str
) -> None:
    run = Path(shutil.copytree(finished, tmp_path / "run"))
    outside = tmp_path / "outside"
    outside.mkdir()
    with (run / ".hydra" / "overrides.yaml").open("a") as fh:
        fh.write(f"- {setting.format(outside=outside)}\n")
    before = fingerprint(tmp_path)
    result = cli("train", f"resume={run}", "trainer.max_steps=3", cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert phrase.format(run=run) in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert fingerprint(tmp_path) == before


def test_a_run_on_a_read_only_disk_is_one_line_for_report_and_resume(
    finished: Path, tmp_path: Path, cli
) -> None:
    import subprocess

    from tests._disk import tiny_disk

    with tiny_disk(tmp_path / "disk", 16 * 1024) as disk:
        run = Path(shutil.copytree(finished, disk / "run"))
        (run / "probe.png").unlink()
        assert subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True).returncode == 0
        for args, flag in (
            (["report", str(run)], "DIR"),
            (["train", f"resume={run}", "trainer.max_steps=3"], "resume"),
        ):
            result = cli(*args, cwd=tmp_path)
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
            assert f"{flag} {run} is not writable (Read-only file system)" in result.stderr, result.stderr[
                -3000:
            ]
