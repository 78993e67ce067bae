"""flash-attn's varlen and packed entry points called directly inside a model: each call is a site, the
model gets the library's own output and gradients, and the shadow compares them with the references of
the call read from its arguments (each packed sequence on its own, bottom-right causal within it).
flash-attn needs CUDA: the library here is a stand-in with its signatures and semantics, written with
torch ops per sequence."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from flashprobe.probing import probe
from flashprobe.probing.call import ORIGINAL_SDPA


def _library(cross_sequence_bug: bool = False) -> types.ModuleType:
    sdpa = ORIGINAL_SDPA

    def attend(q, k, v, scale, causal):  # (N, H, D) each, bottom-right causal
        n_q, n_k = q.shape[0], k.shape[0]
        mask = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q) if causal else None
        out = sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
                   enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
        return out.transpose(0, 1)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
        return torch.stack([attend(q[i], k[i], v[i], softmax_scale, causal) for i in range(q.shape[0])])

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
    ):
        if cross_sequence_bug:  # the bug: every query attends to every packed key
            return attend(q, k, v, softmax_scale, False)
        outs = []
        for i in range(len(cu_seqlens_q) - 1):
            sq, sk = slice(cu_seqlens_q[i], cu_seqlens_q[i + 1]), slice(cu_seqlens_k[i], cu_seqlens_k[i + 1])
            outs.append(attend(q[sq], k[sk], v[sk], softmax_scale, causal))
        return torch.cat(outs)

    def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False):
        return flash_attn_func(*qkv.unbind(2), softmax_scale=softmax_scale, causal=causal)

    def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False):
        return flash_attn_func(q, *kv.unbind(2), softmax_scale=softmax_scale, causal=causal)

    library = types.ModuleType("flash_attn")
    for fn in (flash_attn_func, flash_attn_varlen_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func):
        setattr(library, fn.__name__, fn)
    return library


class Packed(nn.Module):
    """Three packed sequences (lengths 3, 5, 2; keys 4, 5, 3 with ``kv_extra``) through the varlen
    call, then the qkv- and kv-packed calls on a (2, 5) batch; 4 query and 2 key/value heads, D 8."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(8, 64)

    def forward(self, x: torch.Tensor, kv_extra: torch.Tensor) -> torch.Tensor:
        fa = sys.modules["flash_attn"]
        qkv = self.qkv(x)  # (10, 64)
        q = qkv[:, :32].reshape(10, 4, 8)
        k = self.qkv(kv_extra)[:, 32:48].reshape(12, 2, 8)
        v = self.qkv(kv_extra)[:, 48:].reshape(12, 2, 8)
        cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
        cu_k = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
        out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, softmax_scale=0.3, causal=self.causal)
        b = out.reshape(2, 5, 32)
        packed = torch.stack(
            [b.reshape(2, 5, 4, 8), b.reshape(2, 5, 4, 8).flip(1), b.reshape(2, 5, 4, 8)], dim=2
        )
        out2 = fa.flash_attn_qkvpacked_func(packed, causal=self.causal)  # (B, N, 3, H, D)
        kv = torch.stack(
            [k[:10].reshape(2, 5, 2, 8), v[:10].reshape(2, 5, 2, 8)], dim=2
        )  # (B, N, 2, H_kv, D)
        out3 = fa.flash_attn_kvpacked_func(out2, kv, softmax_scale=0.5, causal=self.causal)
        return out3.reshape(10, 32)


def _run(model: nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, extra = torch.randn(10, 8, generator=gen), torch.randn(12, 8, generator=gen)
    out = model(x, extra)
    out.square().mean().backward()
    return [out.detach(), *(p.grad.clone() for p in model.parameters())]


@pytest.fixture
def library(monkeypatch: pytest.MonkeyPatch):
    def install(**bugs: bool) -> None:
        monkeypatch.setitem(sys.modules, "flash_attn", _library(**bugs))

    return install


@pytest.mark.parametrize("causal", [False, True], ids=["full", "bottom_right_causal"])
def test_varlen_and_packed_calls_are_sites_with_unchanged_training(library, causal: bool) -> None:
    library()
    torch.manual_seed(0)
    plain = Packed(causal)
    torch.manual_seed(0)
    model = Packed(causal)
    want = _run(plain)
    with probe(model, backward=True) as p:
        got = _run(model)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 3 and entry["backward"]["calls"] == 3  # every call a site
    assert entry["verdict"] == "pass", entry["verdict_reason"]
    assert sys.modules["flash_attn"].flash_attn_varlen_func.__name__ == "flash_attn_varlen_func"


def test_a_varlen_library_attending_across_sequences_fails(library) -> None:
    library(cross_sequence_bug=True)
    model = Packed(causal=False)
    with probe(model) as p, torch.no_grad():
        model(torch.randn(10, 8), torch.randn(12, 8))
    assert p.stats()["<root>"]["verdict"] == "fail"


def test_flash_attention_3_signature_gets_its_own_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa = ORIGINAL_SDPA

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None):  # FlashAttention-3: no dropout_p
        assert qv is None and (softmax_scale is None or softmax_scale > 0)
        out = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2)

    fa3 = types.ModuleType("flash_attn_interface")
    fa3.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3)

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, N, H, D)
            return sys.modules["flash_attn_interface"].flash_attn_func(x, x, x, causal=True)

    x = torch.randn(2, 6, 2, 8)
    want = flash_attn_func(x, x, x, causal=True)
    model = Block()
    with probe(model) as p, torch.no_grad():
        got = model(x)
    assert torch.equal(got, want)
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 1 and entry["verdict"] == "pass", entry["verdict_reason"]
