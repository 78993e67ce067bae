"""flashprobe's callbacks in your own Lightning ``Trainer``: a plain LightningModule, no flashprobe model.

The model is a stock ``nn.TransformerEncoder`` (its attention calls torch SDPA in training mode).
``AttentionProbe`` compares its attention with the baseline and the FP64 golden value at every
call and writes ``probe.jsonl``; ``WeightSnapshot`` saves the weights for ``flashprobe compare``.

Run: ``python examples/lightning_callbacks.py --out out/example`` (about a minute on a CPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flashprobe.callbacks import AttentionProbe, WeightSnapshot


class SequenceRegressor(L.LightningModule):
    """Predict the running mean of a random sequence with a 2-layer transformer encoder."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        # dropout=0.0: no kernel implements attention dropout, so with dropout a named primary
        # (AttentionProbe(primary="tiled")) is refused rather than silently replaced by torch's SDPA
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, N, dim)`` → ``(B, N)``."""
        return self.head(self.encoder(x)).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_data(n: int = 256, length: int = 24, dim: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, length, dim, generator=g)
    y = x.mean(-1).cumsum(-1) / torch.arange(1, length + 1)
    return TensorDataset(x, y)


def main(out: Path, steps: int = 20) -> list[dict]:
    """Train with both callbacks; returns the ``probe.jsonl`` records."""
    L.seed_everything(0, workers=True)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(out, name="csv"),
        callbacks=[
            AttentionProbe(baseline="math", golden=True, backward=True, dirpath=out),
            WeightSnapshot(out, every_n_steps=10),
        ],
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(SequenceRegressor(), DataLoader(make_data(), batch_size=32, shuffle=True))
    return [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("out/example"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    for record in main(args.out, args.steps):
        s = record["summary"]
        print(
            f"step {record['step']:>3}: {s['sites']} sites, {s['forward_calls']} calls, "
            f"verdict {s['verdict']}, error / limit {s['limit_ratio']:.3f} (> 1 fails), "
            f"non-finite {s['nonfinite']}"
        )
    print(f"snapshots in {args.out / 'snapshots'}; compare two runs with `flashprobe compare RUN_A RUN_B`")
