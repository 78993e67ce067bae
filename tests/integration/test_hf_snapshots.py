"""flashprobe.integrations.hf_snapshots: weight snapshots of a real ``transformers.Trainer`` run (a tiny
random-init Llama, 3 steps) in the Lightning callback's format, compared by ``flashprobe compare``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flashprobe.cli import main as cli_main
from flashprobe.weights import SnapshotStore

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("flashprobe.integrations.hf")  # exports the snapshot callback too
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers.Trainer needs accelerate"
)

VOCAB, TOKENS, STEPS = 64, 8, 3


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(1, VOCAB, (2 * STEPS, TOKENS), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(out: Path, seed: int) -> hf.WeightSnapshotCallback:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        report_to=[], use_cpu=True, dataloader_num_workers=0, seed=seed, disable_tqdm=True,
        save_strategy="no",
    )  # fmt: skip
    callback = hf.WeightSnapshotCallback(every_n_steps=2)
    trainer = transformers.Trainer(
        model=transformers.LlamaForCausalLM(config), args=args, train_dataset=_Tokens(), callbacks=[callback]
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
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "seed (0 vs 1)" in printed and "not like for like" not in printed
    pair = next(iter(json.loads((out / "study.json").read_text())["pairs"].values()))
    assert pair["differs"] == {"seed": [0, 1]} and pair["unrecorded"] == []
    assert pair["steps"] == [0, 2, 3]
    distances = torch.tensor([pair["model"]["wasserstein"], pair["model"]["max_abs"]])
    assert distances.isfinite().all() and (distances > 0).all()  # other seeds: other initial weights
