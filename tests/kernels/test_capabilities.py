"""Kernel capabilities: what each kernel declares is refused when it is chosen or before it runs,
naming the feature and the fix; what it supports runs and matches SDPA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.kernels import (
    KernelCapabilities,
    KernelUnsupportedError,
    get_kernel,
    list_kernels,
    register_kernel,
    unregister_kernel,
)
from flashprobe.kernels.flash_attn import FLASH_ATTN_CAPABILITIES
from flashprobe.kernels.flashinfer import FLASHINFER_CAPABILITIES
from flashprobe.probing import probe

#: flash-attn's capabilities without its device and dtype limits, so its call rules run on the CPU
_FA_HERE = replace(FLASH_ATTN_CAPABILITIES, devices=None, dtypes=None, min_cuda_capability=None)


@pytest.fixture
def limited():
    """``limited(caps)``: a kernel computing SDPA with ``caps``, and the list of calls that reached it."""
    calls: list[tuple[int, ...]] = []
    names: list[str] = []

    def make(caps: KernelCapabilities) -> tuple[str, list[tuple[int, ...]]]:
        def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
            calls.append(tuple(q.shape))
            gqa = k.shape[1] != q.shape[1]
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
            )

        name = f"user_limited_{len(names)}"
        register_kernel(name, kernel, capabilities=caps, overwrite=True)
        names.append(name)
        return name, calls

    yield make
    for name in names:
        unregister_kernel(name)


def _qkv(b=2, h=4, h_kv=4, n_q=8, n_k=8, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n_q, d, generator=g, dtype=dtype)
    k = torch.randn(b, h_kv, n_k, d, generator=g, dtype=dtype)
    v = torch.randn(b, h_kv, n_k, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    ("kwargs", "feature"),
    [
        ({"d": 264}, "head dim 264 (head dims up to 256 that are multiples of 8)"),
        ({"d": 20}, "head dim 20"),
        ({"n_q": 4, "causal": True}, "causal with N_q != N_k"),
        ({"mask": "float"}, "additive float masks"),
        ({"mask": "per_head"}, "bool masks only as key padding"),
        ({"dv": 8}, "v's head dim (8) to equal q's (16)"),
    ],
)
def test_flash_attn_rules_refuse_before_the_kernel_runs(limited, kwargs, feature):
    name, calls = limited(_FA_HERE)
    q, k, v = _qkv(n_q=kwargs.get("n_q", 8), d=kwargs.get("d", 16))
    if "dv" in kwargs:
        v = v[..., : kwargs["dv"]]
    mask = None
    if kwargs.get("mask") == "float":
        mask = torch.zeros(2, 1, 1, 8)
    elif kwargs.get("mask") == "per_head":
        mask = torch.ones(2, 4, 8, 8, dtype=torch.bool)
    with pytest.raises(KernelUnsupportedError, match=r"choose|compare") as err:
        get_kernel(name)(q, k, v, attn_mask=mask, is_causal=kwargs.get("causal", False))
    assert feature in str(err.value) and str(err.value).startswith(f"{name}: ")
    assert calls == []  # refused before any kernel work


def test_flash_attn_rules_accept_what_flash_attn_takes(limited):
    name, calls = limited(_FA_HERE)
    q, k, v = _qkv(h_kv=2, d=64)  # native GQA
    keys = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    keys[0, ..., 5:] = False
    for mask, causal in ((None, False), (None, True), (keys, False), (keys.expand(2, 1, 8, 8), False)):
        out = get_kernel(name)(q, k, v, attn_mask=mask, is_causal=causal)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert len(calls) == 4


def test_flashinfer_head_dims_and_no_backward():
    caps = replace(FLASHINFER_CAPABILITIES, devices=None, dtypes=None, min_cuda_capability=None)
    for d, ok in ((64, True), (128, True), (256, True), (96, False), (32, False)):
        q, k, v = _qkv(d=d)
        assert (caps.call_problem(q, k, v, None, False) is None) is ok, d
    q, k, v = (t.requires_grad_() for t in _qkv(d=64))
    assert "has no backward" in caps.call_problem(q, k, v, None, False)
    with torch.no_grad():
        assert caps.call_problem(q, k, v, None, False) is None
    assert not caps.has_backward("cuda") and FLASH_ATTN_CAPABILITIES.has_backward("cuda")


def test_attach_refuses_dtype_device_and_backward_naming_the_fix(limited):
    model = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    half_only, _ = limited(KernelCapabilities(dtypes=frozenset({torch.float16, torch.bfloat16})))
    with pytest.raises(
        KernelUnsupportedError, match=r"primary kernel .* supports bf16, fp16 only, not fp32.*autocast"
    ):
        probe(model, primary=half_only)
    probe(model, primary=half_only, dtype=torch.bfloat16).detach()  # the autocast dtype: accepted
    cuda_only, _ = limited(KernelCapabilities(devices=frozenset({"cuda"})))
    with pytest.raises(KernelUnsupportedError, match="runs on CUDA devices only, not CPU"):
        probe(model, primary=cuda_only)
    forward_only, _ = limited(KernelCapabilities(backward_devices=frozenset()))
    with pytest.raises(
        KernelUnsupportedError, match=r"has no backward; compare forward only \(backward=False"
    ):
        probe(model, primary=forward_only, backward=True)
    with probe(model, primary=forward_only) as p, torch.no_grad():  # forward only: accepted, and compared
        model(torch.randn(2, 5, 16))
    assert p.summary().sites == 1 and p.summary().forward_calls == 1


def test_flex_backward_on_cpu_is_refused_at_attach():
    model = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    with pytest.raises(KernelUnsupportedError, match="has no backward on CPU \\(only on CUDA\\)"):
        probe(model, primary="flex:compile=false", backward=True)


def test_shape_refusal_comes_at_the_first_call_not_inside_the_kernel(limited):
    model = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)  # head dim 8
    name, calls = limited(KernelCapabilities(head_dims=frozenset({64, 128})))
    with (
        probe(model, primary=name),
        torch.no_grad(),
        pytest.raises(KernelUnsupportedError, match="does not support head dim 8 \\(head dims 64, 128\\)"),
    ):
        model(torch.randn(2, 5, 16))
    assert calls == []


def test_every_builtin_declares_capabilities():
    infos = {i.name: i for i in list_kernels()}
    assert infos["flash_attn"].capabilities.describe() == (
        "masks: causal, key_padding; GQA native; head dims up to 256 that are multiples of 8; "
        "bf16/fp16; CUDA, sm80+; backward"
    )
    assert "no backward" in infos["flashinfer"].capabilities.describe()
    assert infos["flex"].capabilities.describe().endswith("backward on CUDA")
    assert infos["math"].capabilities == KernelCapabilities()


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="unknown kinds"):
        KernelCapabilities(masks=frozenset({"sliding"}))
    with pytest.raises(ValueError, match="gqa="):
        KernelCapabilities(gqa="maybe")


def test_backward_auto_follows_the_kernels_capabilities(limited):
    model = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    forward_only, _ = limited(KernelCapabilities(backward_devices=frozenset()))
    with probe(model, backward="auto") as p:  # torch SDPA and math: both have a backward
        assert p.shadow.backward is True
        model(torch.randn(2, 5, 16)).sum().backward()
    assert (p.summary().forward_calls, p.summary().backward_calls) == (1, 1)
    with probe(model, primary=forward_only, backward="auto") as p, torch.no_grad():  # accepted, forward only
        assert p.shadow.backward is False
        model(torch.randn(2, 5, 16))
    assert (p.summary().forward_calls, p.summary().backward_calls) == (1, 0)
    with probe(model, primary="flex:compile=false", backward="auto") as p:
        assert p.shadow.backward is False  # no FlexAttention backward on the CPU


#: the limits of a typical hand-written Triton attention kernel (the fuzz floor of issue 38)
_TRITON_LIKE = KernelCapabilities(
    masks=frozenset({"causal", "key_padding"}),
    seq_multiple=128,
    same_length=True,
    backward_masks=frozenset({"causal"}),
    head_dims=frozenset({32, 64, 128}),
)


@pytest.mark.parametrize(
    ("n_q", "n_k", "grad", "causal", "feature"),
    [
        (128, 256, False, False, "takes N_q = N_k only, not N_q=128, N_k=256"),
        (200, 200, False, False, "multiples of 128, not N_q=200, N_k=200"),
        (128, 128, True, False, "a backward only for causal calls, not for calls without a mask"),
    ],
)
def test_lengths_and_backward_masks_refuse_before_the_kernel_runs(limited, n_q, n_k, grad, causal, feature):
    name, calls = limited(_TRITON_LIKE)
    q, k, v = (t.requires_grad_(grad) for t in _qkv(b=1, h=1, h_kv=1, n_q=n_q, n_k=n_k, d=32))
    with pytest.raises(KernelUnsupportedError, match=r"choose|compare") as info:
        get_kernel(name)(q, k, v, is_causal=causal)
    assert feature in str(info.value) and not calls
    assert "aligns bottom-right" not in str(info.value)


def test_lengths_and_backward_masks_accept_what_the_kernel_takes(limited):
    name, calls = limited(_TRITON_LIKE)
    q, k, v = (t.requires_grad_(True) for t in _qkv(b=1, h=2, h_kv=2, n_q=256, n_k=256, d=64))
    out = get_kernel(name)(q, k, v, is_causal=True)
    out.sum().backward()  # causal: a backward
    mask = torch.ones(1, 1, 1, 256, dtype=torch.bool)
    with torch.no_grad():
        get_kernel(name)(q, k, v, attn_mask=mask)  # key padding, forward only
    assert len(calls) == 2
    text = _TRITON_LIKE.describe()
    assert "N_q = N_k only, lengths multiples of 128" in text and "backward for causal calls only" in text


def test_causal_cross_refusal_does_not_claim_an_alignment(limited):
    name, _ = limited(KernelCapabilities(causal_cross=False))
    q, k, v = _qkv(n_q=4, n_k=8)
    with pytest.raises(KernelUnsupportedError) as info:
        get_kernel(name)(q, k, v, is_causal=True)
    assert "N_q=4, N_k=8" in str(info.value) and "aligns bottom-right" not in str(info.value)


def test_bad_length_and_backward_declarations_are_refused():
    with pytest.raises(ValueError, match="seq_multiple=0"):
        KernelCapabilities(seq_multiple=0)
    with pytest.raises(ValueError, match="backward_masks: unknown kinds"):
        KernelCapabilities(backward_masks=frozenset({"sliding"}))


def test_a_kernel_declaring_no_page_sizes_is_said_to_take_no_paged_cache() -> None:
    """``page_sizes=frozenset()`` (no paged KV cache) is said so, not as "page sizes any"."""
    none = KernelCapabilities(page_sizes=frozenset())
    assert none.describe_pages() == "no paged KV cache"
    assert "does not take a paged KV cache" in none.page_problem(16)
    listed = KernelCapabilities(page_sizes=frozenset({16, 64}))
    assert listed.page_problem(16) is None and "16, 64" in listed.page_problem(32)
    assert KernelCapabilities().page_problem(7) is None
