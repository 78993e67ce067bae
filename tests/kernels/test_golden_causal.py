"""The causal golden value in blocks of query rows equals the full float64 computation (a numpy
oracle with the whole score matrix), forward and gradients, for any shape of the causal mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashprobe.kernels import golden_attention
from flashprobe.kernels.reference import CAUSAL_BLOCK_ROWS as GOLDEN_CAUSAL_ROWS


def _np_causal(q, k, v, do, scale):
    """Top-left causal attention over the full score matrix, and its hand-derived gradients."""
    s = q @ np.swapaxes(k, -1, -2) * scale
    n_q, n_k = s.shape[-2:]
    s = np.where(np.triu(np.ones((n_q, n_k), dtype=bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = p @ v
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (do * out).sum(-1, keepdims=True))
    return out, (ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ do)


@pytest.mark.parametrize(
    ("n_q", "n_k"),
    [
        (2 * GOLDEN_CAUSAL_ROWS, 2 * GOLDEN_CAUSAL_ROWS),  # two full blocks
        (2 * GOLDEN_CAUSAL_ROWS + 37, 2 * GOLDEN_CAUSAL_ROWS + 37),  # a short last block
        (2 * GOLDEN_CAUSAL_ROWS + 5, 150),  # fewer keys than rows: later rows see every key
        (2 * GOLDEN_CAUSAL_ROWS, 3 * GOLDEN_CAUSAL_ROWS),  # more keys than rows
    ],
)
def test_causal_golden_in_blocks_matches_the_full_computation(n_q: int, n_k: int) -> None:
    gen = torch.Generator().manual_seed(n_q + n_k)
    q = torch.randn(1, 2, n_q, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, n_k, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, n_k, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    do = torch.randn(1, 2, n_q, 4, generator=gen, dtype=torch.float64)
    out = golden_attention(q, k, v, is_causal=True, scale=0.3)
    grads = torch.autograd.grad(out, (q, k, v), do)
    want, want_grads = _np_causal(*(t.detach().numpy() for t in (q, k, v, do)), 0.3)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-12, atol=1e-14)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-13)
