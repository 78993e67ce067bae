"""A snapshot manifest can name only plain files inside its directory: no entry makes flashprobe read
or delete anything else, and a resume refuses a malformed manifest, run record or snapshot up front."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flashprobe.app.train import compose, train
from flashprobe.weights.store import SnapshotError, SnapshotStore, SnapshotWriter, TensorSpec
from tests.safety._runs import SHORT, fingerprint

#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("safety/test_manifest")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run trained to step 2 of 3 (checkpoints and snapshots at steps 0, 1, 2): resumable."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    train(compose([*SHORT, "trainer.max_steps=2"], run_dir=run))
    return run


def _resume(run: Path) -> None:
    train(compose([*SHORT, "trainer.max_steps=3", f"resume={run}"], run_dir=run))


def _add_entry(run: Path, entry: dict) -> None:
    path = run / "snapshots" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["snapshots"].append(entry)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["absolute", "../../victim.txt", "sub/../../victim.txt", ".hidden", ""])
def test_a_resume_never_deletes_a_file_a_manifest_entry_points_outside(
    stopped: Path, tmp_path: Path, name: str
) -> None:
    run = Path(shutil.copytree(stopped, tmp_path / "a" / "run"))
    victim = tmp_path / "a" / "victim.txt"
    victim.write_text("the user's file")
    _add_entry(run, {"step": 999, "file": str(victim) if name == "absolute" else name})
    before = fingerprint(run)
    with pytest.raises(SnapshotError, match=r"is not a plain file name inside .*no '/', no '\.\.'"):
        _resume(run)
    assert victim.read_text() == "the user's file"
    assert fingerprint(run) == before  # refused before any write: no session, no pruning


def test_the_writer_and_the_reader_refuse_such_an_entry(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("x")
    writer = SnapshotWriter(tmp_path / "run", {"run_id": "r"})
    spec = [TensorSpec.of("w", torch.zeros(2))]
    writer.write(0, {"w": torch.zeros(2)}, spec)
    _add_entry(tmp_path / "run", {"step": 5, "file": str(victim)})
    with pytest.raises(SnapshotError, match="not a plain file name"):
        SnapshotWriter(tmp_path / "run", {"run_id": "r"})
    with pytest.raises(SnapshotError, match="not a plain file name"):  # compare reads nothing outside either
        SnapshotStore(tmp_path / "run")
    writer.manifest["snapshots"].append({"step": 5, "file": "../victim.txt"})  # in memory, as if loaded
    with pytest.raises(SnapshotError, match="not a plain file name"):
        writer.prune_after(0)
    assert victim.exists()


def test_pruning_still_deletes_the_runs_own_abandoned_snapshots(tmp_path: Path) -> None:
    writer = SnapshotWriter(tmp_path / "run", {"run_id": "r"})
    spec = [TensorSpec.of("w", torch.zeros(2))]
    for step in (0, 1, 2):
        writer.write(step, {"w": torch.full((2,), float(step))}, spec)
    assert SnapshotWriter(tmp_path / "run", {"run_id": "r"}).prune_after(0) == [1, 2]
    assert sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir()) == [
        "manifest.json",
        "step_0000000.safetensors",
    ]


def damage_run(run: Path, damage: str) -> None:
    """Damage a stopped run's records as ``damage`` says (also the robustness table's setups): the
    manifest (``manifest``: torn, ``manifest_list``: a list, ``entry``: a bad entry), ``run.json``, or
    else the step-1 snapshot, truncated."""
    manifest = run / "snapshots" / "manifest.json"
    if damage == "manifest":
        manifest.write_text('{"format": "flashprobe.snap')
    elif damage == "manifest_list":
        manifest.write_text("[1, 2]")
    elif damage == "entry":
        _add_entry(run, {"step": "two", "file": "step_0000002.safetensors"})
    elif damage == "run.json":
        (run / "run.json").write_text("garbage")
    else:
        snapshot = run / "snapshots" / "step_0000001.safetensors"
        snapshot.write_bytes(snapshot.read_bytes()[:100])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("manifest", r"malformed snapshot manifest .*manifest\.json"),
        ("manifest_list", r"not an object with a 'snapshots' list"),
        ("entry", r"has no non-negative integer 'step'"),
        ("run.json", r"run\.json is not a flashprobe run record .*earlier sessions would be lost"),
        ("snapshot", r"step_0000001\.safetensors \(step 1\) cannot be read .*truncated or corrupt"),
    ],
)
def test_a_damaged_run_is_refused_before_the_resume_writes(
    stopped: Path, tmp_path: Path, damage: str, message: str
) -> None:
    run = Path(shutil.copytree(stopped, tmp_path / "run"))
    damage_run(run, damage)
    before = fingerprint(run)
    with pytest.raises(ValueError, match=message):
        _resume(run)
    assert fingerprint(run) == before


@pytest.mark.parametrize("linked", ["checkpoints/last.ckpt", "snapshots/manifest.json", "snapshots"])
def test_a_resume_refuses_a_checkpoint_or_manifest_linked_out_of_the_run(
    stopped: Path, tmp_path: Path, linked: str
) -> None:
    """Linked out of the run, the resume read (and would write through) someone else's files; it trained
    on (issue 42's table). Refused before any write, the link named."""
    run = Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))
    path, outside = run / linked, tmp_path / "elsewhere"
    path.rename(outside)
    path.symlink_to(outside)
    before = fingerprint(run)
    with pytest.raises(ValueError, match=rf"{linked} is a link to {outside}, outside the run .*cp -L"):
        _resume(run)
    assert fingerprint(run) == before
