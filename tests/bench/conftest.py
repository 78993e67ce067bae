"""Shared fixtures of the microbenchmark tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

#: Modules whose tensors are tiny: one intra-op thread avoids OpenMP hand-offs, which dominate on
#: a busy CPU (results are identical; the peak-memory child inherits the setting).
_ONE_THREAD = {"test_precision", "test_speed", "test_sweep", "test_sweeps"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.module.__name__.rpartition(".")[2] not in _ONE_THREAD:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
