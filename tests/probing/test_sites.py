"""Interception: which calls are caught, how sites are named, sampling and unprobed paths."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.probing import ROOT_SITE, ProbeWarning, probe, use_kernel

from ._models import GQAAttention, ImportedNameAttention, TinyTransformer

_ORIGINAL = F.scaled_dot_product_attention


def _qkv(b: int = 1, h: int = 2, n: int = 5, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen) for _ in range(3))


class Pair(nn.Module):
    """Two sub-models, one called twice per forward (one site, two calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GQAAttention(8, 2, 1), GQAAttention(8, 2, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](self.layers[0](x)))


class Direct(nn.Module):
    """Calls SDPA from the root module itself."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


def test_sites_are_module_paths_and_repeats_aggregate() -> None:
    model = Pair()
    with probe(model) as p:
        model(torch.randn(2, 5, 8))
    assert p.sites == ["layers.0", "layers.1"]
    assert p.calls == {"layers.0": 2, "layers.1": 1}
    stats = p.stats()
    assert stats["layers.0"]["forward"]["calls"] == 2
    assert stats["layers.0"]["forward"]["out"]["primary_baseline"]["numel"] == 2 * (2 * 2 * 5 * 4)


def test_stock_encoder_root_calls_and_imported_names() -> None:
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2)
    with probe(enc) as p:
        enc(torch.randn(1, 4, 8))
    assert p.sites == ["layers.0.self_attn", "layers.1.self_attn"]

    direct = Direct()
    with probe(direct) as p:
        direct(*_qkv())
    assert p.sites == [ROOT_SITE]

    imported = ImportedNameAttention()
    with probe(imported) as p:
        imported(*_qkv())
    assert p.sites == [ROOT_SITE]


def test_calls_outside_the_model_and_after_detach_pass_through() -> None:
    model, other = Direct(), Direct()
    p = probe(model)
    q, k, v = _qkv()
    assert torch.equal(F.scaled_dot_product_attention(q, k, v), _ORIGINAL(q, k, v))  # outside any model
    other(q, k, v)  # a different, unprobed model
    assert p.calls == {}
    p.detach()
    model(q, k, v)
    assert p.calls == {}
    assert F.scaled_dot_product_attention is _ORIGINAL  # everything restored
    assert torch.nn.modules.activation.F.multi_head_attention_forward.__module__ == "torch.nn.functional"


def test_nested_and_multiple_models() -> None:
    outer = Pair()
    inner = outer.layers[1]
    with probe(outer) as p_outer, probe(inner) as p_inner:
        outer(torch.randn(1, 5, 8))
    # The innermost probed model wins its calls, named relative to itself.
    assert p_inner.calls == {ROOT_SITE: 1}
    assert p_outer.calls == {"layers.0": 2}


def test_model_state_is_untouched() -> None:
    model = TinyTransformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with probe(model, backward=True), use_kernel(model, "math"):
        model(torch.randn(2, 6, 4)).sum().backward()
        clone = copy.deepcopy(model)
        pickle.dumps(model)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in clone.state_dict().items())


def test_sampling_every_n_calls_steps_and_site_patterns() -> None:
    model = Pair()
    x = torch.randn(1, 5, 8)
    with probe(model, every_n_calls=2) as p:
        for _ in range(3):
            model(x)
    # layers.0: 6 calls → calls 0, 2, 4 compared; layers.1: 3 calls → calls 0, 2.
    assert p.calls == {"layers.0": 6, "layers.1": 3}
    assert {s: e["forward"]["calls"] for s, e in p.stats().items()} == {"layers.0": 3, "layers.1": 2}

    with probe(model, every_n_steps=3) as p:
        for _ in range(7):
            model(x)
            p.next_step()
    assert p.step == 7
    assert p.stats()["layers.1"]["forward"]["calls"] == 3  # steps 0, 3, 6

    with probe(model, sites=["layers.*", "!layers.0"]) as p:
        model(x)
    assert p.sites == ["layers.1"]
    p.reset()
    assert p.stats()["layers.1"]["forward"]["calls"] == 0


def test_fused_eval_fast_path_is_reported_by_module_name() -> None:
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
    ).eval()
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 4, 8)
    with torch.no_grad(), probe(enc) as p, pytest.warns(ProbeWarning) as caught:
        enc(x)
    messages = sorted(str(w.message) for w in caught)
    for i, message in enumerate(messages):
        # Named by the site the probe would use (the layer's self_attn), not the layer itself.
        layer = f"(torch.nn.modules.transformer.TransformerEncoderLayer at 'layers.{i}')"
        assert f"site 'layers.{i}.self_attn' {layer}" in message
        assert "torch._transformer_encoder_layer_fwd" in message and "set_fastpath_enabled(False)" in message
    assert len(messages) == 2 and p.sites == []
    with (
        torch.no_grad(),
        probe(mha),
        pytest.warns(ProbeWarning, match=r"'<root>'.*_native_multi_head_attention"),
    ):
        mha(x, x, x, need_weights=False)
    with probe(mha.train()), pytest.warns(ProbeWarning, match="need_weights=True"):
        mha(x, x, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe(mha) as p:
            mha(x, x, x, need_weights=False)
        assert p.sites == [ROOT_SITE]
