"""FlexAttention calls under the probe: a module calling ``flex_attention`` with a soft-capping
``score_mod`` and a sliding-window (or document) ``block_mask`` is a site, its output is bit-identical
with and without the probe, and the references apply the same mods (primary vs golden at rounding
level; without the mods they would differ by the mods' effect, checked)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from flashprobe.probing import probe

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def softcap(score, b, h, q_idx, kv_idx):
    return 5.0 * torch.tanh(score / 5.0)


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 16)


DOCUMENT = torch.tensor([0] * 17 + [1] * 23)  # two packed documents of 17 and 23 tokens


def same_document(b, h, q_idx, kv_idx):
    return DOCUMENT[q_idx] == DOCUMENT[kv_idx]


class FlexBlock(nn.Module):
    def __init__(self, mask_mod, kv_heads: int = 2) -> None:
        super().__init__()
        self.mask_mod, self.kv_heads = mask_mod, kv_heads
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 2 * 8 * kv_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, 8).permute(2, 0, 3, 1, 4)
        mask = flex.create_block_mask(self.mask_mod, None, None, n, n, device=x.device)
        with warnings.catch_warnings():  # eager FlexAttention (no compile) warns that it is unfused
            warnings.simplefilter("ignore")
            y = flex.flex_attention(
                q, k, v, score_mod=softcap, block_mask=mask, enable_gqa=self.kv_heads != 4
            )
        return y.transpose(1, 2).reshape(b, n, 32)


@pytest.mark.parametrize("mask_mod", [window, same_document], ids=["sliding_window", "documents"])
def test_flex_calls_are_sites_compared_with_their_own_mods(mask_mod) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(FlexBlock(mask_mod), FlexBlock(mask_mod, kv_heads=4))
    x = 3 * torch.randn(2, 40, 32)
    with torch.no_grad():
        plain = model(x)
        with probe(model) as p:
            probed = model(x)
    assert torch.equal(plain, probed)  # the model gets the call's own output
    assert p.sites == ["0", "1"]
    for entry in p.stats().values():
        out = entry["forward"]["out"]
        assert entry["forward"]["calls"] == 1 and entry["shadow_errors"] == 0
        assert out["verdict"] == "pass" and out["primary_golden"]["max_abs"] < 1e-5
    # The references really apply the mods: without the soft-cap and the mask they are far off.
    block = model[0]
    b, n = 2, 40
    with torch.no_grad():  # (torch has no FlexAttention backward on the CPU)
        q = block.q(x).view(b, n, 4, 8).transpose(1, 2)
        k, v = block.kv(x).view(b, n, 2, 2, 8).permute(2, 0, 3, 1, 4)
        plain_attention = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mask = flex.create_block_mask(mask_mod, None, None, n, n, "cpu")
            flexed = flex.flex_attention(q, k, v, score_mod=softcap, block_mask=mask, enable_gqa=True)
    assert (plain_attention - flexed).abs().max() > 1e-2


def test_flex_calls_outside_a_probed_model_and_after_detach_are_untouched() -> None:
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    model = nn.Sequential(FlexBlock(window))
    with probe(model) as p, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex.flex_attention(q, k, v)  # not inside the model: not a site
    assert p.sites == []
    from flashprobe.kernels.flex import FLEX_ORIGINAL

    assert flex.flex_attention is FLEX_ORIGINAL  # restored after detaching
