"""The baseline and the golden follow torch SDPA's gradient convention for fully masked rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashprobe.kernels import golden_attention, math_attention


def _mask(kind: str, n_q: int, n_k: int) -> torch.Tensor:
    keep = torch.rand(n_q, n_k, generator=torch.Generator().manual_seed(0)) < 0.6
    keep[[1, 4]] = False  # two fully masked rows
    if kind == "bool":
        return keep
    return torch.zeros(n_q, n_k, dtype=torch.float64).masked_fill(~keep, float("-inf"))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("kernel", [math_attention, golden_attention], ids=["math", "golden"])
def test_fully_masked_rows_give_zero_gradients_like_sdpa(kind, kernel, make_qkv):
    q, k, v = (t.requires_grad_() for t in make_qkv(6, 9, 8, dtype=torch.float64, seed=3))
    mask = _mask(kind, 6, 9)
    g = torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours = torch.autograd.grad(kernel(q, k, v, attn_mask=mask), (q, k, v), g)
    sdpa = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), g)
    for name, a, b in zip("qkv", ours, sdpa, strict=True):
        assert torch.isfinite(a).all(), f"d{name} has NaN/inf"
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"d{name}")
    assert (ours[0][:, :, [1, 4]] == 0).all()  # the masked rows' queries get no gradient


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize(("n_q", "n_k"), [(7, 7), (5, 11), (11, 5)])
def test_values_and_gradients_match_sdpa_for_every_mask(kind, n_q, n_k, make_qkv):
    """Unmasked and causal calls skip the safe-softmax handling (no row can be fully masked there);
    every mask kind still matches torch SDPA, outputs and gradients, in float64."""
    q, k, v = make_qkv(n_q, n_k, 8, dtype=torch.float64, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = None if kind in ("none", "causal") else _mask(kind, n_q, n_k)
    causal = kind == "causal"
    g = torch.randn(1, 2, n_q, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ours = math_attention(q, k, v, attn_mask=mask, is_causal=causal)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    torch.testing.assert_close(ours, sdpa, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(
        "qkv",
        torch.autograd.grad(ours, (q, k, v), g),
        torch.autograd.grad(sdpa, (q, k, v), g),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"d{name}")


@pytest.mark.parametrize("kind", ["causal", "bool", "additive"])
def test_inputs_and_mask_are_left_unchanged(kind, make_qkv):
    """The kernel works in place on its own intermediates only, never on q, k, v or the mask."""
    q, k, v = make_qkv(6, 9, 8, dtype=torch.float32, seed=4)
    mask = None if kind == "causal" else _mask(kind, 6, 9)
    mask = mask.float() if kind == "additive" else mask
    before = [t.clone() for t in (q, k, v)] + ([] if mask is None else [mask.clone()])
    math_attention(q, k, v, attn_mask=mask, is_causal=kind == "causal")
    after = [q, k, v] + ([] if mask is None else [mask])
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)
