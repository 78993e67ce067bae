"""Helpers for the weights tests: real tiny training runs and hand-made snapshot directories."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flashprobe.callbacks.weight_snapshot import WeightSnapshot
from flashprobe.weights.store import SnapshotWriter, TensorSpec

__all__ = ["TinyBlocks", "train_run", "write_run"]


class TinyBlocks(pl.LightningModule):
    """Two residual MLP blocks, a head and a root-level parameter: groups ``blocks.0``, ``blocks.1``,
    ``head`` and ``scale`` at depth 2."""

    def __init__(self, width: int = 16, attention: str = "math") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)) for _ in range(2)
        )
        self.head = nn.Linear(width, 1)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.scale * self.head(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def train_run(run_dir: Path, *, seed: int, max_steps: int = 4, every_n_steps: int = 2) -> Path:
    """Train :class:`TinyBlocks` from ``seed`` on fixed data, snapshotting into ``run_dir``."""
    pl.seed_everything(seed, verbose=False)
    model = TinyBlocks()
    gen = torch.Generator().manual_seed(1234)  # the data do not depend on the seed
    data = TensorDataset(torch.randn(64, 4, generator=gen), torch.randn(64, 1, generator=gen))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[WeightSnapshot(run_dir, every_n_steps=every_n_steps)],
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    return run_dir


def write_run(run_dir: Path, snapshots: Mapping[int, Mapping[str, torch.Tensor]], **header) -> Path:
    """A run directory with the given ``{step: {name: tensor}}`` snapshots, written by SnapshotWriter."""
    writer = SnapshotWriter(run_dir, {"run_id": run_dir.name, **header})
    for step, tensors in snapshots.items():
        specs: Sequence[TensorSpec] = [TensorSpec.of(n, t) for n, t in tensors.items()]
        writer.write(step, {n: t.contiguous() for n, t in tensors.items()}, specs)
    return run_dir
