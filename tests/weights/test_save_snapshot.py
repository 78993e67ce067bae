"""``save_snapshot`` writes what the Lightning callback writes, and ``compare_runs(run_a, run_b)`` of
two seeds gives the distances scipy and a hand-computed max |W_a − W_b| give."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from safetensors import safe_open
from scipy.stats import wasserstein_distance as scipy_wasserstein
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flashprobe import compare_runs, save_snapshot
from flashprobe.callbacks.weight_snapshot import WeightSnapshot
from flashprobe.weights import PairComparison, SnapshotStore
from tests.weights._helpers import TinyBlocks

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*(does not have many workers|is smaller than the logging interval).*",
    "ignore:.*isinstance.treespec, LeafSpec.*",
)


def _manifest(run_dir: Path) -> dict:
    manifest = json.loads((run_dir / "snapshots" / "manifest.json").read_text())
    for entry in manifest["snapshots"]:
        entry.pop("saved_at")  # the time of the write
    return manifest


def _contents(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A snapshot file's tensors and metadata (safetensors orders the metadata as it likes)."""
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()  # noqa: SIM118 (not a dict)


def test_save_snapshot_writes_what_the_lightning_callback_writes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyBlocks()
    initial = copy.deepcopy(model)  # the weights the callback saves as step 0
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    callback = WeightSnapshot(tmp_path / "lightning" / "run", save_last=False, seed=7, config={"lr": 1e-2})
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(model, DataLoader(data, batch_size=8))

    by_hand = tmp_path / "by_hand" / "run"  # the same directory name: the same default run_id
    path = save_snapshot(initial, by_hand, 0, seed=7, attention="math", config={"lr": 1e-2}, epoch=0)

    assert path == by_hand / "snapshots" / "step_0000000.safetensors"
    lightning = tmp_path / "lightning" / "run" / "snapshots"
    assert sorted(p.name for p in lightning.iterdir()) == sorted(p.name for p in path.parent.iterdir())
    by_callback, ours = _contents(lightning / path.name), _contents(path)
    assert ours[1] == by_callback[1] == {"format": "flashprobe.snapshots/1", "step": "0", "run_id": "run"}
    assert ours[0].keys() == by_callback[0].keys() == dict(initial.named_parameters()).keys()
    assert all(torch.equal(ours[0][n], by_callback[0][n]) for n in ours[0])
    assert _manifest(by_hand) == _manifest(tmp_path / "lightning" / "run")  # every field, "32-true" too


def test_save_snapshot_defaults_and_refusals(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 2)).to(torch.bfloat16)
    save_snapshot(model, tmp_path / "run", 5)
    save_snapshot(model, tmp_path / "run", 9)
    store = SnapshotStore(tmp_path / "run")
    assert store.steps == [5, 9] and store.run_id == "run" and store.seed is None
    assert (store.attention, store.precision) == ("own attention on cpu", "bf16-true")
    assert torch.equal(store.tensor(9, "0.weight"), model[0].weight.detach())
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_snapshot(model, tmp_path / "run", -1)
    with pytest.raises(ValueError, match="no tensors to save"):
        save_snapshot(model.requires_grad_(False), tmp_path / "run", 10, trainable_only=True)


def _seed_run(run_dir: Path, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """A hand-written training loop of seed ``seed`` saving steps 0 and 3; the weights it saved."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 4, generator=torch.Generator().manual_seed(99)), torch.ones(32, 1)
    saved = {}
    for step in range(4):
        if step in (0, 3):
            save_snapshot(model, run_dir, step, seed=seed)
            saved[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return saved


def test_compare_runs_of_two_seeds_matches_scipy_and_max_abs_by_hand(tmp_path: Path) -> None:
    a, b = _seed_run(tmp_path / "seed0", 0), _seed_run(tmp_path / "seed1", 1)

    pair = compare_runs(tmp_path / "seed0", tmp_path / "seed1")

    assert isinstance(pair, PairComparison) and pair.steps == [0, 3]
    assert pair.differs == {"seed": [0, 1]} and pair.like_for_like
    for i, step in enumerate(pair.steps):
        flat_a = np.concatenate([t.double().flatten().numpy() for t in a[step].values()])
        flat_b = np.concatenate([t.double().flatten().numpy() for t in b[step].values()])
        assert pair.model[i].wasserstein == pytest.approx(scipy_wasserstein(flat_a, flat_b), rel=1e-12)
        assert pair.model[i].max_abs == float(np.abs(flat_a - flat_b).max())
        weight = "0.weight"
        expected = scipy_wasserstein(a[step][weight].flatten().numpy(), b[step][weight].flatten().numpy())
        assert pair.tensors[weight][i].wasserstein == pytest.approx(expected, rel=1e-6)
    assert pair.model[0].wasserstein > 0  # two seeds start apart


def test_compare_runs_keeps_named_pairs_and_refuses_one_run(tmp_path: Path) -> None:
    _seed_run(tmp_path / "seed0", 0)
    _seed_run(tmp_path / "seed1", 1)
    named = compare_runs({"seed": (tmp_path / "seed0", tmp_path / "seed1")})
    pair = compare_runs(str(tmp_path / "seed0"), str(tmp_path / "seed1"))
    assert named.pairs["seed"].curve() == pair.curve()
    with pytest.raises(ValueError, match=r"needs a second run directory: compare_runs\(run_a, run_b\)"):
        compare_runs(tmp_path / "seed0")
