"""Integration tests against third-party model classes (the ``integration`` extra): small random-init
configs, no downloads (``HF_HUB_OFFLINE=1``), one intra-op thread, and no probe left attached."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from flashprobe.probing.intercept import active_handles

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

_SDPA = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _one_thread_and_no_leaks() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    leaked = active_handles()
    for handle in leaked:
        handle.detach()
    assert not leaked, f"handles left attached: {leaked}"
    assert F.scaled_dot_product_attention is _SDPA
