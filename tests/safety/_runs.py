"""What the safety tests share: a small finished run to copy, crafted files, and directory fingerprints."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

#: 2 steps; a checkpoint, a snapshot and a probe record every step: a run to resume in seconds.
SHORT = [
    "experiment=smoke",
    "trainer.max_steps=2",
    "trainer.val_check_interval=1",
    "trainer.log_every_n_steps=1",
    "callbacks.weight_snapshot.every_n_steps=1",
    "logger=csv",
]


class CreatesFile:
    """Unpickling this object creates ``path`` (it names ``builtins.open`` as its constructor)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (str(self.path), "w"))


def write_crafted_checkpoint(path: Path, marker: Path) -> Path:
    """A ``.ckpt`` that looks like a Lightning checkpoint and creates ``marker`` when unpickled."""
    torch.save({"global_step": 1, "epoch": 0, "state_dict": {}, "payload": CreatesFile(marker)}, path)
    return path


def write_crafted_pickle(path: Path, marker: Path) -> Path:
    """A plain pickle (not torch's zip format) that creates ``marker`` when unpickled."""
    path.write_bytes(pickle.dumps({"global_step": 1, "payload": CreatesFile(marker)}))
    return path


def fingerprint(directory: Path, *, skip: tuple[str, ...] = ()) -> dict[str, bytes | None]:
    """Every path under ``directory`` (hidden ones included) → its bytes (``None`` for a directory),
    leaving out the top-level names in ``skip``."""
    found: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(directory):
        if Path(root) == directory:
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), directory)] = None
        for name in files:
            path = Path(root) / name
            found[os.path.relpath(path, directory)] = path.read_bytes()
    return found
