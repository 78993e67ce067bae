"""Attention libraries called directly inside a model (flash-attn's ``flash_attn_func``, as transformers'
``flash_attention_2`` does): each call is a site, the model gets the library's own output, the shadow
compares it with the references of the call it read (bottom-right causal when ``N_q != N_k``, native
grouped heads, the library's scale, its window), forward and backward. flash-attn needs CUDA, so the
library here is a stand-in with flash-attn's signature and semantics, written on torch's SDPA."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.probing import probe
from flashprobe.probing.call import ORIGINAL_SDPA


def _flash_attn_func(scale_bug: bool = False):
    sdpa = ORIGINAL_SDPA  # bound here: the probe swaps module globals that hold SDPA while attached

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
        """flash-attn's API: (B, N, H, D) tensors, bottom-right causal, grouped k/v heads."""
        n_q, n_k = q.shape[1], k.shape[1]
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q) if causal else None
        scale = None if scale_bug else softmax_scale  # the bug: an explicit scale ignored
        out = sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
            enable_gqa=k.shape[2] != q.shape[2],
        )  # fmt: skip
        return out.transpose(1, 2)

    return flash_attn_func


@pytest.fixture
def flash_attn(monkeypatch: pytest.MonkeyPatch):
    """A ``flash_attn`` module and a model module that did ``from flash_attn import flash_attn_func``."""

    def install(scale_bug: bool = False):
        library = types.ModuleType("flash_attn")
        library.flash_attn_func = _flash_attn_func(scale_bug)
        monkeypatch.setitem(sys.modules, "flash_attn", library)
        models = types.ModuleType("fake_flash_model")
        exec(_MODEL_CODE, models.__dict__)
        monkeypatch.setitem(sys.modules, "fake_flash_model", models)
        return models

    return install


_MODEL_CODE = '''
import torch
from torch import nn
from flash_attn import flash_attn_func


class Block(nn.Module):
    """Cross-attention of N_q queries to N_k keys with 4 query and 2 key/value heads."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = nn.Linear(16, 32), nn.Linear(16, 32)

    def forward(self, x, memory, causal):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 8)
        k, v = self.kv(memory).view(b, memory.shape[1], 2, 2, 8).unbind(2)
        return flash_attn_func(q, k, v, softmax_scale=0.2, causal=causal).reshape(b, n, 32)
'''


def _train(model: nn.Module, causal: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x, memory = torch.randn(2, 6, 16, generator=gen), torch.randn(2, 9, 16, generator=gen)
    out = model(x, memory, causal)
    out.square().mean().backward()
    return [out.detach()], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "bottom_right_causal"])
def test_direct_flash_attn_calls_are_sites_with_unchanged_training(flash_attn, causal: bool) -> None:
    models = flash_attn()
    torch.manual_seed(0)
    plain = models.Block()
    torch.manual_seed(0)
    model = models.Block()
    want = _train(plain, causal)
    with probe(model, backward=True) as p:
        got = _train(model, causal)
    for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)  # the library's own output and gradients, untouched
    assert p.sites == ["<root>"]
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 1 and entry["backward"]["calls"] == 1
    assert entry["verdict"] == "pass", entry["verdict_reason"]  # bottom-right causal, scale 0.2, GQA
    assert models.flash_attn_func.__name__ == "flash_attn_func"  # restored: the library's own
    assert models.flash_attn_func is sys.modules["flash_attn"].flash_attn_func


def test_a_buggy_direct_library_fails_the_verdict(flash_attn) -> None:
    models = flash_attn(scale_bug=True)
    model = models.Block()
    with probe(model, backward=True, on_failure="ignore") as p:
        _train(model, causal=False)
    assert p.summary().verdict == "fail"
    assert p.failures[0].direction == "out"


def test_a_window_is_compared_and_a_library_that_ignores_it_fails(flash_attn) -> None:
    """A call with ``window_size`` is compared like any other (it once ran unchanged, with a warning):
    this stand-in ignores the window, so the verdict fails."""
    flash_attn()

    class Windowed(nn.Module):
        def forward(self, q):
            return sys.modules["flash_attn"].flash_attn_func(q, q, q, window_size=(4, 0))

    model = Windowed()
    q = torch.randn(1, 8, 2, 8)
    with probe(model, on_failure="ignore") as p:
        out = model(q)
    assert torch.equal(out, _flash_attn_func()(q, q, q, window_size=(4, 0)))  # the library's own output
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 1 and entry["verdict"] == "fail"
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
