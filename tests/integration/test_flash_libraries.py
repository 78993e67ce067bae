"""flash-attn and FlashInfer called directly, as the libraries around them call them: transformers'
flash-attention helper keeps the functions in module globals of its own (swapped too; CPU, with the
stand-in library), and the real libraries on CUDA (``gpu``: flash-attn's ``flash_attn_func``,
``flash_attn_varlen_func`` and ``flash_attn_kvpacked_func`` in bf16 with gradients; FlashInfer's single
prefill, paged prefill and paged decode in fp16, forward): outputs unchanged, every call a site, the
verdict pass. ``scripts/gpu_check.sh`` runs the ``gpu`` tests where a GPU is present."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from flashprobe.probing import probe
from tests.probing._standins import flash_attn_2, install


def test_transformers_flash_attention_helper_globals_are_swapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' ``flash_attention_2`` calls ``_flash_varlen_fn`` / ``_flash_fn``, globals of
    ``transformers.modeling_flash_attention_utils`` that hold flash-attn's functions."""
    helper = pytest.importorskip("transformers.modeling_flash_attention_utils")
    library = flash_attn_2()
    install(monkeypatch, {"flash_attn": library})
    monkeypatch.setattr(helper, "_flash_varlen_fn", library.flash_attn_varlen_func, raising=False)

    class Attention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:  # (total, H, D), two sequences of 3 and 5
            cu = torch.tensor([0, 3, 8], dtype=torch.int32)
            fn = sys.modules["transformers.modeling_flash_attention_utils"]._flash_varlen_fn
            return fn(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5, causal=True)

    q = torch.randn(8, 2, 8, generator=torch.Generator().manual_seed(0))
    original = library.flash_attn_varlen_func
    with probe(Attention()) as p, torch.no_grad():
        assert helper._flash_varlen_fn is not original  # swapped while attached
        assert helper._flash_varlen_fn is library.flash_attn_varlen_func  # one stand-in per function
        out = p.model(q)
    assert helper._flash_varlen_fn is original and library.flash_attn_varlen_func is original  # restored
    assert torch.equal(out, Attention()(q))
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 1 and entry["verdict"] == "pass", entry["verdict_reason"]


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_real_flash_attn_direct_calls_on_cuda() -> None:
    _cuda()
    flash_attn = pytest.importorskip("flash_attn")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash-attn 2 needs sm80+")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(64, 128)  # q: 4 heads of 16; k, v: 2 heads of 16 each

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, N, 64)
            b, n, _ = x.shape
            h = self.qkv(x)
            q = h[..., :64].view(b, n, 4, 16)
            k, v = h[..., 64:96].view(b, n, 2, 16), h[..., 96:].view(b, n, 2, 16)
            out = flash_attn.flash_attn_func(q, k, v, causal=True)  # (B, N, H, D)
            cu = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=x.device)
            packed = (t.reshape(b * n, *t.shape[2:]) for t in (out, k, v))
            out = flash_attn.flash_attn_varlen_func(*packed, cu, cu, n, n, softmax_scale=0.2, causal=True)
            kv = torch.stack([k, v], dim=2)  # (B, N, 2, H_kv, D)
            queries = out.view(b, n, 4, 16)[:, n // 2 :]  # the last half of the queries: bottom-right causal
            return flash_attn.flash_attn_kvpacked_func(queries, kv, causal=True)

    torch.manual_seed(0)
    plain = Block().cuda()
    model = Block().cuda()
    model.load_state_dict(plain.state_dict())
    x = torch.randn(2, 64, 64, device="cuda")
    results = []
    for m, probed in ((plain, False), (model, True)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            handle = probe(m, dtype=torch.bfloat16) if probed else None
            out = m(x)
            out.float().square().mean().backward()
            if handle is not None:
                handle.detach()
        results.append((out.detach(), [w.grad for w in m.parameters()], handle))
    (out_a, grads_a, _), (out_b, grads_b, p) = results
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 3 and entry["backward"]["calls"] == 3
    assert entry["shadow_errors"] == 0 and entry["verdict"] == "pass", entry["verdict_reason"]


@pytest.mark.gpu
def test_real_flashinfer_direct_calls_on_cuda() -> None:
    _cuda()
    flashinfer = pytest.importorskip("flashinfer")
    dev, dtype = "cuda", torch.float16
    gen = torch.Generator(device=dev).manual_seed(0)
    qo = torch.tensor([0, 3, 11, 16], dtype=torch.int32, device=dev)
    indptr = torch.tensor([0, 2, 5, 6], dtype=torch.int32, device=dev)
    indices = torch.tensor([7, 1, 4, 0, 6, 2], dtype=torch.int32, device=dev)
    last = torch.tensor([5, 16, 9], dtype=torch.int32, device=dev)  # keys: 21, 48, 9
    cache = torch.randn(8, 2, 16, 2, 64, generator=gen, device=dev, dtype=dtype)  # NHD, page size 16
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    q = torch.randn(16, 4, 64, generator=gen, device=dev, dtype=dtype)
    k, v = (torch.randn(40, 2, 64, generator=gen, device=dev, dtype=dtype) for _ in range(2))

    class Serving(nn.Module):
        def forward(self) -> list[torch.Tensor]:
            prefill.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True)
            decode.plan(indptr, indices, last, 4, 2, 64, 16)
            return [
                flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True),  # append: 16 queries, 40 keys
                flashinfer.single_decode_with_kv_cache(q[0], k, v),
                prefill.run(q, cache),
                decode.run(q[:3], cache),
            ]

    want = Serving()()
    with probe(Serving()) as p:
        got = p.model()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 4 and entry["shadow_errors"] == 0
    assert entry["verdict"] == "pass", entry["verdict_reason"]
