"""Lightning checkpoints: written atomically, read without running any code.

:class:`AtomicCheckpointIO` (``Trainer(plugins=[AtomicCheckpointIO()])``) writes complete checkpoints
of finite weights only; every checkpoint flashprobe opens is read by :func:`load_checkpoint` with
``torch.load(weights_only=True)``, anything else refused with :class:`CheckpointError`.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from flashprobe.errors import FlashprobeError
from flashprobe.formats.atomic import atomic_write_file

__all__ = ["AtomicCheckpointIO", "CheckpointError", "load_checkpoint", "nonfinite_weights"]

log = logging.getLogger(__name__)


class CheckpointError(ValueError, FlashprobeError):
    """A checkpoint file that flashprobe will not load (unsafe, truncated or not a checkpoint)."""


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> dict[str, Any]:
    """Load a Lightning checkpoint with ``torch.load(weights_only=True)``; nothing in it is executed.

    Returns:
        The checkpoint dictionary (it has a ``global_step``); tensors at ``map_location``.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file needs code to be unpickled (refused: it could run anything), is
            truncated or corrupt, or is not a Lightning checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found (or not a file)")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        if not any("GLOBAL" in line or "Unsupported global" in line for line in lines):
            detail = next(
                (line for line in lines if line.startswith("Unsupported")), lines[-1] if lines else ""
            )
            raise CheckpointError(
                f"checkpoint {path} is refused: torch.load(weights_only=True) cannot read it "
                f"({detail[:120]}), so it is corrupt or a pickle that is not a checkpoint of tensors and "
                "plain values (one that could run code is never loaded); give a .ckpt written by flashprobe "
                "train or a Lightning Trainer"
            ) from None
        reason = str(err).strip().splitlines()
        detail = next((line for line in reason if "GLOBAL" in line or "Unsupported" in line), reason[-1:])
        raise CheckpointError(
            f"checkpoint {path} is refused: loading it would run code or build objects other than tensors "
            f"and plain values ({str(detail).strip()[:200]}); flashprobe loads checkpoints with "
            "torch.load(weights_only=True) only. Use a checkpoint written by flashprobe train, or one "
            "from a source you trust converted to plain tensors"
        ) from None
    except (RuntimeError, EOFError, KeyError, OSError, ValueError, IndexError) as err:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:160]}): "
            "the file is truncated, corrupt or not a PyTorch checkpoint; resume from another checkpoint "
            "of the run (checkpoints/*.ckpt) or start the run again with overwrite=true"
        ) from None
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(
            f"checkpoint {path} is not a Lightning checkpoint (no non-negative integer 'global_step'); "
            "give a .ckpt file written by flashprobe train or a Lightning Trainer"
        )
    return checkpoint


def nonfinite_weights(state_dict: Any) -> tuple[int, str | None]:
    """How many NaN/±inf values the floating-point tensors of ``state_dict`` hold, and the first
    tensor holding one (one host synchronisation per tensor)."""
    count, first = 0, None
    for name, value in (state_dict or {}).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            count, first = count + bad, first if first is not None or not bad else str(name)
    return count, first


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic, whose loads run no code (:func:`load_checkpoint`),
    and which writes no checkpoint of non-finite weights (it logs why and keeps the earlier files)."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options")
        count, first = nonfinite_weights(checkpoint.get("state_dict"))
        if count:
            log.error(
                "not writing checkpoint %s (step %s): %d weights are NaN or infinite (first in %s); the "
                "earlier checkpoints hold the last finite weights",
                path,
                checkpoint.get("global_step"),
                count,
                first,
            )
            return
        atomic_write_file(path, lambda tmp: torch.save(checkpoint, tmp))

    @override
    def load_checkpoint(
        self,
        path: Any,
        map_location: Any | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load with ``weights_only=True`` whatever the caller asks for (``weights_only`` is ignored)."""
        return load_checkpoint(path, map_location=map_location)
