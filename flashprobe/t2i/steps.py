"""Randomness as a function of (seed, batch index): what makes a resumed run the run it resumes.

Every random choice of a training batch (its images, dropped captions, timesteps, noise) comes from
a generator seeded with ``(seed, batch index, rank)``, never from torch's global RNG, so batch ``i``
is the same however the run got there, and a checkpoint needs no RNG state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["StepLoader", "StepSampler", "batch_generator", "derived_seed"]

#: Distinguishes the streams drawn from one seed (order vs per-batch noise).
_ORDER, _BATCH = 1, 2


def derived_seed(*parts: int) -> int:
    """A 63-bit seed that depends on every part (order matters), e.g. ``(seed, stream, index)``."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31 ^ int(state[1])) & (2**63 - 1)


def batch_generator(
    seed: int, batch_index: int, rank: int = 0, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The generator of training batch ``batch_index`` (counted over the whole run) on ``rank``."""
    return torch.Generator(device).manual_seed(derived_seed(seed, _BATCH, batch_index, rank))


class StepSampler(Sampler[int]):
    """The training order as a function of (seed, batch index), resumable at any batch.

    Args:
        num_samples: images in the training set, ``N``.
        batch_size: images per batch on each rank, ``B``.
        seed: the order's seed.
        next_batch: returns the index (over the whole run) of the next batch the run will train on;
            read when an epoch's iteration starts.
        rank: this process's rank.
        world_size: the number of ranks ``W``; a global batch is ``B · W`` images.

    Epoch ``e`` is a permutation drawn from ``(seed, e)``, each rank taking its slice of every
    global batch; ``len(sampler)`` is ``B · ⌊N / (B·W)⌋`` (an incomplete last batch is dropped).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        next_batch: Callable[[], int] = lambda: 0,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.next_batch = next_batch
        self.rank = rank
        self.world_size = world_size
        self.batches_per_epoch = num_samples // (batch_size * world_size)
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"{num_samples} training images do not fill one batch of {batch_size} on each of "
                f"{world_size} rank(s); use a smaller batch_size or more images"
            )

    def __len__(self) -> int:
        return self.batches_per_epoch * self.batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order of the ``N`` images in ``epoch``, ``(N,)`` int64."""
        gen = torch.Generator().manual_seed(derived_seed(self.seed, _ORDER, epoch))
        return torch.randperm(self.num_samples, generator=gen)

    def __iter__(self) -> Iterator[int]:
        epoch, first = divmod(self.next_batch(), self.batches_per_epoch)
        order = self.permutation(epoch)
        b, global_batch = self.batch_size, self.batch_size * self.world_size
        for batch in range(first, self.batches_per_epoch):
            start = batch * global_batch + self.rank * b
            yield from order[start : start + b].tolist()


class StepLoader(DataLoader):
    """A DataLoader over a :class:`StepSampler` whose checkpoint state is what the order depends on,
    so a resume with another order fails at once (the position is the Trainer's batch index)."""

    sampler: StepSampler

    def state_dict(self) -> dict[str, Any]:
        """What the order depends on."""
        s = self.sampler
        return {
            "order": "flashprobe.t2i.steps/1",
            "seed": s.seed,
            "num_samples": s.num_samples,
            "batch_size": s.batch_size,
            "world_size": s.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that a resumed run has the order it was checkpointed with.

        Raises:
            ValueError: naming what changed (seed, data size, batch size or number of ranks).
        """
        changed = {k: (v, self.state_dict()[k]) for k, v in state.items() if self.state_dict().get(k) != v}
        if changed:
            what = ", ".join(f"{k} {old} → {new}" for k, (old, new) in changed.items())
            raise ValueError(
                f"the checkpoint was trained with another data order ({what}); resume with the run's "
                "own settings (flashprobe train resume=RUN_DIR reuses them)"
            )
