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
