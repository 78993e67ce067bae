"""flashprobe.integrations.hf_snapshots: weight snapshots of a real ``transformers.Trainer`` run (a tiny
random-init Llama, 3 steps) in the Lightning callback's format, compared by ``flashprobe compare``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flashprobe.bench import tiny_models as tiny
from flashprobe.cli import main as cli_main
from flashprobe.weights import SnapshotStore

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("flashprobe.integrations.hf")  # exports the snapshot callback too
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers.Trainer needs accelerate"
)

STEPS = 3


def _train(out: Path, seed: int) -> hf.WeightSnapshotCallback:
    model = tiny.llama(seed=seed)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        report_to=[], use_cpu=True, dataloader_num_workers=0, seed=seed, disable_tqdm=True,
        save_strategy="no",
    )  # fmt: skip
    callback = hf.WeightSnapshotCallback(every_n_steps=2)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=tiny.TokenDataset(2 * STEPS), callbacks=[callback]
    )
    trainer.train()
    final = SnapshotStore(out).load(STEPS)
    for name, p in trainer.model.named_parameters():  # the last snapshot is the trained weights
        assert torch.equal(final[name], p.detach()), name
    return callback


def test_hf_snapshots_compare_like_the_lightning_callbacks(tmp_path: Path, capsys) -> None:
    for seed in (0, 1):
        callback = _train(tmp_path / f"seed{seed}", seed)
        assert callback.saved_steps == [0, 2, 3]  # initial, every 2nd step, the last
    store = SnapshotStore(tmp_path / "seed1")
    assert store.steps == [0, 2, 3] and store.seed == 1 and store.precision == "32-true"
    assert store.attention == "own sdpa on cpu"  # the model's own attention, resolved when recorded
    assert "model.layers.0.self_attn.q_proj.weight" in store.names()

    out = tmp_path / "cmp"
    argv = ["compare", str(tmp_path / "seed0"), str(tmp_path / "seed1"), "--out", str(out), "--no-figures"]
    assert cli_main(argv) == 4  # a seed pair alone: no kernel pair, no verdict (UNDETERMINED)
    printed = capsys.readouterr().out
    assert "seed (0 vs 1)" in printed and "not like for like" not in printed
    pair = next(iter(json.loads((out / "study.json").read_text())["pairs"].values()))
    assert pair["differs"] == {"seed": [0, 1]} and pair["unrecorded"] == []
    assert pair["steps"] == [0, 2, 3]
    distances = torch.tensor([pair["model"]["wasserstein"], pair["model"]["max_abs"]])
    assert distances.isfinite().all() and (distances > 0).all()  # other seeds: other initial weights
