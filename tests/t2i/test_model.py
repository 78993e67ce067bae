"""The tiny text-to-image DiT: shapes, presets, and every attention call through torch SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashprobe.t2i import DIT_MODELS, TextToImageDiT, dit_small, dit_tiny
from flashprobe.t2i.model import Attention, timestep_embedding


def _randomize(model: torch.nn.Module) -> None:
    """Replace the zero adaLN-Zero init so the output depends on every input."""
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)


def _inputs(batch: int, size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    tokens = torch.randint(0, 22, (batch, 12), generator=g)
    return x, t, tokens


@pytest.mark.parametrize("name", sorted(DIT_MODELS))
def test_presets_predict_noise_of_image_shape(name: str) -> None:
    model = DIT_MODELS[name]()
    x, t, tokens = _inputs(2, model.config.image_size)
    out = model(x, t, tokens)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.count_nonzero(out) == 0  # adaLN-Zero: the untrained model predicts zero noise


def test_preset_sizes_and_overrides() -> None:
    n_tiny = sum(p.numel() for p in dit_tiny().parameters())
    n_small = sum(p.numel() for p in dit_small().parameters())
    assert n_tiny < 100_000 < 300_000 < n_small < 1_000_000
    model = dit_tiny(image_size=16, patch_size=2)
    assert model.config.num_patches == 64
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        dit_tiny(image_size=15)
    with pytest.raises(ValueError, match="not divisible by heads"):
        TextToImageDiT(dim=30, heads=4)
    with pytest.raises(ValueError, match=r"images must be \(B, 3, 16, 16\)"):
        dit_tiny()(*_inputs(1, 32))
    with pytest.raises(ValueError, match=r"caption tokens must be \(B, 12\)"):
        dit_tiny()(torch.zeros(1, 3, 16, 16), torch.zeros(1), torch.zeros(1, 5, dtype=torch.long))


def test_every_attention_call_goes_through_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    model = dit_tiny(depth=3, text_depth=2)
    _randomize(model)
    x, t, tokens = _inputs(2, 16)
    expected = model(x, t, tokens)
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    original = F.scaled_dot_product_attention

    def counting(q, k, v, *args, **kwargs):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    out = model(x, t, tokens)
    assert torch.equal(out, expected)
    text, image = (2, 2, 12, 16), (2, 2, 64, 16)  # (B, H, N, D): 12 caption tokens, 64 patches
    text_encoder_calls = [(text, text)] * 2  # self-attention over the caption
    dit_calls = [(image, image), (image, text)] * 3  # self-attention, then cross-attention
    assert calls == text_encoder_calls + dit_calls


def test_attention_matches_softmax_reference() -> None:
    torch.manual_seed(0)
    attn = Attention(dim=24, heads=3).double()
    x, ctx = torch.randn(2, 7, 24, dtype=torch.float64), torch.randn(2, 5, 24, dtype=torch.float64)
    for context in (None, ctx):
        src = x if context is None else context
        q = attn.q(x).view(2, 7, 3, 8).transpose(1, 2)
        k, v = attn.kv(src).view(2, -1, 2, 3, 8).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        ref = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v  # (B, H, N, D)
        ref = attn.proj(ref.transpose(1, 2).reshape(2, 7, 24))
        torch.testing.assert_close(attn(x, context), ref, rtol=1e-12, atol=1e-12)


def test_output_depends_on_caption_timestep_and_image() -> None:
    model = dit_tiny()
    _randomize(model)
    x, t, tokens = _inputs(2, 16)
    base = model(x, t, tokens)
    other_tokens = tokens.roll(1, dims=1)
    assert not torch.allclose(model(x, t, other_tokens), base)
    assert not torch.allclose(model(x, t + 100, tokens), base)
    assert not torch.allclose(model(x + 0.1, t, tokens), base)
    # samples in a batch are independent
    torch.testing.assert_close(model(x[:1], t[:1], tokens[:1]), base[:1])


def test_unpatchify_inverts_patch_order() -> None:
    """The final per-patch outputs land on their patches, checked against ``F.fold``."""
    model = dit_tiny(image_size=16, patch_size=4)
    h = torch.randn(2, 16, 4 * 4 * 3)  # (B, N, p·p·C) in (py, px, C) order
    channel_major = h.view(2, 16, 4, 4, 3).permute(0, 4, 2, 3, 1).reshape(2, 3 * 16, 16)  # (B, C·p·p, N)
    expected = F.fold(channel_major, output_size=16, kernel_size=4, stride=4)
    assert torch.equal(model._unpatchify(h), expected)


def test_timestep_embedding_values() -> None:
    emb = timestep_embedding(torch.tensor([0.0, 3.0]), 8)
    assert emb.shape == (2, 8)
    torch.testing.assert_close(emb[0], torch.tensor([1.0] * 4 + [0.0] * 4))
    freqs = torch.tensor([10_000 ** (-i / 4) for i in range(4)])
    torch.testing.assert_close(emb[1], torch.cat([torch.cos(3 * freqs), torch.sin(3 * freqs)]))
