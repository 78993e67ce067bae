"""The autouse fixture of the probe's and the integration tests (their ``conftest.py`` import it): one
intra-op thread (tiny tensors; avoids OpenMP barrier stalls on a loaded machine), and a check that no
test leaves a probe or route attached (torch's SDPA restored)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from flashprobe.probing.intercept import active_handles

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
