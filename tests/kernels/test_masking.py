"""Masking semantics: fully masked rows, very negative logits, and the −5e4 sentinel bug.

torch SDPA on CPU (torch 2.13) is the convention: a fully masked row outputs 0, not NaN, and a
row whose valid logits are all very negative (−1e5) still gets the exact softmax. FlashInfer's
sentinel bug (flashinfer PR 4401) is reproduced by ``tiled:mask_value=-5e4``: every row whose
valid logits all lie below −5e4 silently outputs zeros.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import softmax

from flashprobe.kernels import get_kernel, golden_attention

from ._helpers import make_mask

CPU_KERNELS = [
    "math",
    "tiled",
    "tiled:loop=q,block_q=16,block_k=32",
    "tiled:mask_value=-5e4",
    "sdpa_flash",
    "sdpa_math",
]


def _hand_built(row0_logits: np.ndarray, dtype: torch.dtype, seed: int = 0):
    """q, k, v whose scores at ``scale=1`` are ``row0_logits`` for query 0 and N(0, 1) for query 1.

    Returns ``(q (1, 1, 2, 4), k (1, 1, N, 4), v (1, 1, N, 4), expected (2, 4) float64)``: the
    expected output is the softmax computed by scipy on the exact logits.
    """
    n = len(row0_logits)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, 4))
    k[:, 0] = row0_logits
    v = rng.standard_normal((n, 4))
    q = np.zeros((2, 4))
    q[0, 0] = q[1, 1] = 1.0
    expected = softmax(q @ k.T, axis=-1) @ v
    as_t = lambda a: torch.from_numpy(a).to(dtype)[None, None]  # noqa: E731
    return as_t(q), as_t(k), as_t(v), expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sentinel_reproduces_flashinfer_zero_rows(dtype):
    # Valid logits near −2.45e5 (the raw logits of the bf16 model in the FlashInfer report), and
    # logits only just below −5e4 whose exponentials do not underflow: both rows come out zero.
    for base in (-2.45e5, -5.0001e4):
        logits = base - 0.25 * np.arange(37)
        q, k, v, expected = _hand_built(logits, dtype)
        sentinel = get_kernel("tiled:mask_value=-5e4,block_k=8")(q, k, v, scale=1.0)
        assert (sentinel[0, 0, 0] == 0).all(), "the sentinel kernel must silently return zeros"
        assert np.abs(sentinel[0, 0, 1].double().numpy() - expected[1]).max() <= 1e-5
        exact = get_kernel("tiled:block_k=8")(q, k, v, scale=1.0)
        below_all = get_kernel("tiled:mask_value=-1e6,block_k=8")(q, k, v, scale=1.0)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for out in (exact, below_all):
            assert np.abs(out[0, 0].double().numpy() - expected).max() <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "spec", [s for s in CPU_KERNELS if "-5e4" not in s] + ["tiled:mask_value=-1e6,block_k=8"]
)
def test_very_negative_logits_give_exact_softmax(spec, dtype):
    logits = -1e5 - 0.25 * np.arange(29)  # exact in fp32
    q, k, v, expected = _hand_built(logits, dtype, seed=1)
    out = get_kernel(spec)(q, k, v, scale=1.0)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    assert np.abs(out[0, 0].double().numpy() - expected).max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows_are_zero_for_every_kernel(kind, dtype, make_qkv):
    q, k, v = make_qkv(23, 31, 16, dtype=dtype, seed=7)
    attn_mask, _ = make_mask(kind, 23, 31, dtype=dtype, seed=7)  # rows 0 and 7 fully masked
    for spec in CPU_KERNELS:
        out = get_kernel(spec)(q, k, v, attn_mask=attn_mask)
        assert torch.isfinite(out).all(), spec
        assert (out[..., [0, 7], :] == 0).all(), spec
        assert (out[..., 1:7, :] != 0).any(), spec


@pytest.mark.parametrize("kind", ["bool", "additive", "causal"])
def test_sentinel_kernel_is_exact_on_ordinary_logits(kind, make_qkv):
    q, k, v = make_qkv(50, 70, 16, dtype=torch.float64, seed=8)
    attn_mask, causal = make_mask(kind, 50, 70, dtype=torch.float64, seed=8)
    out = get_kernel("tiled:mask_value=-5e4,block_k=16")(q, k, v, attn_mask=attn_mask, is_causal=causal)
    golden = golden_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
    assert (out - golden).abs().max().item() <= 1e-12


def test_sentinel_kernel_treats_bool_and_additive_masks_alike(make_qkv):
    q, k, v = make_qkv(19, 33, 8, seed=9)
    keep, _ = make_mask("bool", 19, 33, seed=9)
    additive = torch.zeros(19, 33).masked_fill(~keep, float("-inf"))
    kernel = get_kernel("tiled:mask_value=-5e4,block_k=8")
    assert torch.equal(kernel(q, k, v, attn_mask=keep), kernel(q, k, v, attn_mask=additive))


@pytest.mark.parametrize("spec", ["math", "tiled"])
def test_no_keys_gives_zeros_like_torch(spec):
    """N_k = 0: every row is fully masked; torch SDPA returns zeros of shape (B, H, N_q, D_v)."""
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    k, v = torch.randn(1, 2, 0, 4, dtype=torch.float64), torch.randn(1, 2, 0, 5, dtype=torch.float64)
    out = get_kernel(spec)(q, k, v)
    assert out.shape == (1, 2, 3, 5)
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert torch.equal(out, torch.zeros_like(out))
