"""Lightning checkpoints written by flashprobe's one atomic writer.

Lightning's own ``TorchCheckpointIO`` writes the checkpoint file in place, so a process killed
mid-save leaves a truncated ``last.ckpt`` that no resume can load. :class:`AtomicCheckpointIO`
writes it through :func:`flashprobe.formats.atomic.atomic_write_file` (temporary file, fsync,
rename): a checkpoint on disk is always complete. Pass it to any Trainer:
``Trainer(plugins=[AtomicCheckpointIO()])``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from flashprobe.formats.atomic import atomic_write_file

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic (reads are Lightning's own)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        atomic_write_file(path, lambda tmp: torch.save(checkpoint, tmp))
