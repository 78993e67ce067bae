"""torch's intra-op CPU threads for a block of work (the fuzzer's and the benchmarks' ``--threads``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["torch_threads"]


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op CPU threads set to ``threads`` inside the block; the caller's setting after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
