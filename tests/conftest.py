"""Shared fixtures: random attention inputs from a private generator; a clean kernel registry per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from flashprobe.kernels import available_kernels, unregister_kernel

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True)
def _kernels_registered_by_a_test_stay_in_it() -> Iterator[None]:
    """Unregister every kernel a test registered, so no later test sees it (the registry is global)."""
    before = set(available_kernels())
    yield
    for name in set(available_kernels()) - before:
        unregister_kernel(name)


@pytest.fixture
def make_qkv() -> Callable[..., QKV]:
    """Factory ``make_qkv(n_q, n_k, d, d_v=None, *, b=1, h=2, dtype=fp32, seed=0) -> (q, k, v)``.

    Returns ``q (b, h, n_q, d)``, ``k (b, h, n_k, d)``, ``v (b, h, n_k, d_v)``, standard normal.
    """

    def make(
        n_q: int,
        n_k: int,
        d: int,
        d_v: int | None = None,
        *,
        b: int = 1,
        h: int = 2,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> QKV:
        gen = torch.Generator().manual_seed(seed)
        shapes = ((b, h, n_q, d), (b, h, n_k, d), (b, h, n_k, d_v or d))
        return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)  # type: ignore[return-value]

    return make
