"""use_kernel routes a model's attention; the probe catches a silent kernel bug and names the site."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.probing import probe, use_kernel


class VeryNegativeLogits(nn.Module):
    """Attention whose valid logits all lie near -1e5 (below FlashInfer's -5e4 sentinel)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q, k, v)


class _Attend(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        bias = torch.full((q.shape[-2], k.shape[-2]), -1e5)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))


def test_route_shows_the_sentinel_and_detach_restores() -> None:
    model, (q, k, v) = VeryNegativeLogits(), _inputs()
    want = model(q, k, v)
    # Softmax is shift-invariant: a constant -1e5 bias changes nothing but fp32 rounding.
    assert torch.allclose(want, F.scaled_dot_product_attention(q, k, v), atol=0.05)
    with use_kernel(model, "tiled:mask_value=-5e4") as route:
        assert torch.equal(model(q, k, v), torch.zeros_like(want))  # the silent bug
        again = use_kernel(model, "math")  # re-route: the newest route applies
        assert torch.allclose(model(q, k, v), want, atol=1e-6)
        again.detach()
        assert torch.equal(model(q, k, v), torch.zeros_like(want))
        with probe(model) as p:  # primary=None: the routed kernel stays primary
            assert torch.equal(model(q, k, v), torch.zeros_like(want))
        assert torch.equal(model(q, k, v), torch.zeros_like(want))  # routing restored
    assert not route.attached
    assert torch.equal(model(q, k, v), want)
    summary = p.summary()
    assert summary.max_error_ratio_site == "attn"
    assert summary.max_error_ratio > 100  # zeros vs outputs ~0.3; the fp32 baseline is ~1e-3 off


def test_probe_with_explicit_primary_catches_the_bug() -> None:
    model, (q, k, v) = VeryNegativeLogits(), _inputs()
    with probe(model, primary="tiled:mask_value=-5e4") as p:
        out = model(q, k, v)
    assert torch.equal(out, torch.zeros_like(out))
    fwd = p.stats()["attn"]["forward"]["out"]
    assert fwd["primary_golden"]["max_abs"] > 0.1
    assert fwd["baseline_golden"]["max_abs"] < 0.01  # fp32 rounding of -1e5 + logits
    assert fwd["error_ratio"] > 100
    with probe(model, primary="tiled") as p:  # the fixed kernel (true -inf): max error ratio <= 2
        model(q, k, v)
    assert p.summary().max_error_ratio <= 2
