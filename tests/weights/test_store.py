"""SnapshotWriter / SnapshotStore: layout, atomic writes, lazy reads, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flashprobe.weights.store as store_module
from flashprobe.weights import SnapshotError, SnapshotStore, TensorSpec
from flashprobe.weights.store import SnapshotWriter, snapshot_filename

from ._helpers import write_run


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(3, 5, generator=gen),
        "a.bias": torch.randn(3, generator=gen),
        "b.weight": torch.randn(2, 3, generator=gen).to(torch.bfloat16),
    }


def test_filename_and_layout(tmp_path: Path) -> None:
    assert snapshot_filename(100) == "step_0000100.safetensors"
    assert snapshot_filename(123_456_789) == "step_123456789.safetensors"
    with pytest.raises(ValueError, match=">= 0"):
        snapshot_filename(-1)
    write_run(tmp_path / "run", {0: _weights(0), 10: _weights(1)}, seed=3, precision="bf16-mixed")
    names = sorted(p.name for p in (tmp_path / "run" / "snapshots").iterdir())
    assert names == ["manifest.json", "step_0000000.safetensors", "step_0000010.safetensors"]


def test_round_trip_keeps_values_dtypes_and_manifest_facts(tmp_path: Path) -> None:
    w0, w10 = _weights(0), _weights(1)
    write_run(tmp_path / "run", {0: w0, 10: w10}, seed=3, attention="tiled", precision="bf16-mixed")
    store = SnapshotStore(tmp_path / "run")
    assert store.steps == [0, 10] and len(store) == 2 and 10 in store and 5 not in store
    assert (store.run_id, store.seed, store.attention, store.precision) == ("run", 3, "tiled", "bf16-mixed")
    assert store.specs["b.weight"] == TensorSpec("b.weight", (2, 3), "bfloat16", "parameter")
    assert store.specs["a.weight"].numel == 15
    for name, value in w10.items():
        got = store.tensor(10, name)
        assert got.dtype == value.dtype and torch.equal(got, value)
    assert store.metadata(10)["step"] == "10"
    assert list(store.load(0)) == ["a.weight", "a.bias", "b.weight"]
    assert SnapshotStore(tmp_path / "run" / "snapshots").steps == [0, 10]  # the snapshot dir itself


def test_iter_tensors_reads_one_tensor_at_a_time(tmp_path: Path, monkeypatch) -> None:
    write_run(tmp_path, {5: _weights(0)})
    reads: list[str] = []
    real_open = store_module.safe_open

    class CountingOpen:
        def __init__(self, *args, **kwargs) -> None:
            self._inner = real_open(*args, **kwargs)

        def __enter__(self):
            handle = self._inner.__enter__()
            outer = self

            class Handle:
                def keys(self):
                    return handle.keys()

                def get_tensor(self, name: str) -> torch.Tensor:
                    reads.append(name)
                    return handle.get_tensor(name)

            outer._handle = Handle()
            return outer._handle

        def __exit__(self, *exc) -> None:
            self._inner.__exit__(*exc)

    monkeypatch.setattr(store_module, "safe_open", CountingOpen)
    store = SnapshotStore(tmp_path)
    assert reads == []  # opening the store reads only the manifest
    it = store.iter_tensors(5)
    name, _ = next(it)
    assert (name, reads) == ("a.weight", ["a.weight"])
    next(it)
    assert reads == ["a.weight", "a.bias"]
    store.tensor(5, "b.weight")
    assert reads == ["a.weight", "a.bias", "b.weight"]


def test_writing_a_step_again_replaces_its_entry(tmp_path: Path) -> None:
    writer = SnapshotWriter(tmp_path, {"run_id": "r"})
    specs = [TensorSpec.of(n, t) for n, t in _weights(0).items()]
    writer.write(3, _weights(0), specs)
    writer.write(3, _weights(1), specs)
    manifest = json.loads((tmp_path / "snapshots" / "manifest.json").read_text())
    assert [e["step"] for e in manifest["snapshots"]] == [3]
    assert torch.equal(SnapshotStore(tmp_path).tensor(3, "a.bias"), _weights(1)["a.bias"])


def test_prune_after_unlists_and_deletes_later_steps(tmp_path: Path) -> None:
    write_run(tmp_path, {0: _weights(0), 2: _weights(1), 4: _weights(2)})
    writer = SnapshotWriter(tmp_path, {"run_id": "r"})
    assert writer.steps == [0, 2, 4]
    assert writer.prune_after(2) == [4]
    assert SnapshotStore(tmp_path).steps == [0, 2]
    assert not (tmp_path / "snapshots" / "step_0000004.safetensors").exists()


def test_failed_write_leaves_no_file_and_an_unchanged_manifest(tmp_path: Path, monkeypatch) -> None:
    write_run(tmp_path, {0: _weights(0)})
    manifest_before = (tmp_path / "snapshots" / "manifest.json").read_text()

    def partial_then_fail(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\x00" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(store_module, "save_file", partial_then_fail)
    writer = SnapshotWriter(tmp_path, {"run_id": "r"})
    with pytest.raises(OSError, match="disk full"):
        writer.write(1, _weights(1), [TensorSpec.of(n, t) for n, t in _weights(1).items()])
    assert (tmp_path / "snapshots" / "manifest.json").read_text() == manifest_before
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [
        "manifest.json",
        "step_0000000.safetensors",
    ]


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="WeightSnapshot callback"):
        SnapshotStore(tmp_path / "nothing")
    write_run(tmp_path / "run", {0: _weights(0), 1: _weights(1)})
    store = SnapshotStore(tmp_path / "run")
    with pytest.raises(KeyError, match=r"no snapshot at step 7; saved steps: \[0, 1\]"):
        store.tensor(7, "a.bias")
    with pytest.raises(KeyError, match=r"no tensor 'c\.weight'"):
        store.tensor(0, "c.weight")
    (tmp_path / "run" / "snapshots" / "step_0000001.safetensors").unlink()
    with pytest.raises(SnapshotError, match=r"lists step 1 but .*step_0000001.safetensors does not exist"):
        SnapshotStore(tmp_path / "run")
    manifest = tmp_path / "run" / "snapshots" / "manifest.json"
    manifest.write_text(json.dumps({"format": "other/9", "snapshots": [], "tensors": []}))
    with pytest.raises(SnapshotError, match="format 'other/9'"):
        SnapshotStore(tmp_path / "run")
    manifest.write_text("{not json")
    with pytest.raises(SnapshotError, match="malformed"):
        SnapshotStore(tmp_path / "run")


def test_snapshots_get_the_umask_permissions_like_every_other_output(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        run = write_run(tmp_path / "run", {0: {"w": torch.ones(3)}})
    finally:
        os.umask(old)
    for path in (run / "snapshots").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name  # not safetensors' own 0600


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_snapshot_is_named_with_the_fix(tmp_path: Path, damage: str) -> None:
    run = write_run(tmp_path / "run", {0: {"w": torch.ones(3)}, 2: {"w": torch.ones(3)}})
    path = run / "snapshots" / snapshot_filename(2)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * len(data))
    store = SnapshotStore(run)
    assert store.tensor(0, "w").sum() == 3  # the other snapshots still read
    for read in (lambda: store.tensor(2, "w"), lambda: store.load(2), lambda: store.metadata(2)):
        with pytest.raises(
            SnapshotError, match=r"step_0000002.safetensors \(step 2\) cannot be read .*truncated or corrupt"
        ):
            read()
