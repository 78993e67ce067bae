"""Shared fixtures: random attention inputs from a private generator (no global RNG state)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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
