"""torch SDPA pinned to one backend, and the Dao-AILab flash-attn adapter."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from flashprobe.fuzz.rule import check_output, rounding_floor
from flashprobe.kernels import KernelUnavailableError, get_kernel, golden_attention, math_attention
from flashprobe.kernels.flash_attn import _import_flash_attn


@pytest.mark.parametrize(
    ("spec", "op"),
    [
        ("sdpa_flash", "aten::_scaled_dot_product_flash_attention_for_cpu"),
        ("sdpa_math", "aten::_scaled_dot_product_attention_math"),
    ],
)
def test_sdpa_kernel_runs_exactly_its_backend(spec, op, make_qkv):
    q, k, v = make_qkv(16, 24, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        get_kernel(spec)(q, k, v, is_causal=True)
    ran = {e.key for e in prof.events() if e.key.startswith("aten::_scaled_dot_product")}
    assert ran == {op}


@pytest.mark.parametrize(("spec", "backend"), [("sdpa_efficient", "EFFICIENT"), ("sdpa_cudnn", "CUDNN")])
def test_cuda_only_sdpa_backends_refuse_cpu(spec, backend, make_qkv):
    q, k, v = make_qkv(4, 4, 8)
    message = rf"{spec}: runs on CUDA devices only, not CPU; move the model there"
    with pytest.raises(KernelUnavailableError, match=message):
        get_kernel(spec)(q, k, v)
    with pytest.raises(KernelUnavailableError, match=message):
        get_kernel(spec).check("cpu", torch.float32)


def test_sdpa_flash_does_not_fall_back(make_qkv):
    q, k, v = make_qkv(4, 6, 8, 5)  # the CPU flash kernel needs D_v == D
    with pytest.raises(KernelUnavailableError, match=r"sdpa_flash: .*FLASH_ATTENTION.*Value.size\(-1\): 5"):
        get_kernel("sdpa_flash")(q, k, v)
    assert get_kernel("sdpa_math")(q, k, v).shape == (1, 2, 4, 5)


def test_flash_attn_on_cpu_names_the_cuda_extra(make_qkv):
    q, k, v = make_qkv(4, 4, 8, dtype=torch.float16)
    for call in (
        lambda: get_kernel("flash_attn")(q, k, v),
        lambda: get_kernel("flash_attn").check("cpu", q.dtype),
    ):
        with pytest.raises(
            KernelUnavailableError, match=r"CUDA devices only.*pip install 'flashprobe\[cuda\]'"
        ):
            call()


def test_flash_attn_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    with pytest.raises(
        KernelUnavailableError, match=r"flash-attn package is not installed.*flashprobe\[cuda\]"
    ):
        _import_flash_attn()


def test_flash_attn_is_imported_lazily():
    import flashprobe.kernels  # noqa: F401

    assert sys.modules.get("flash_attn") is None


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "spec",
    ["flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "tiled:stats_dtype=fp32,acc_dtype=fp32"],
)
@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
def test_cuda_kernels_within_noise_floor(spec, dtype, causal):
    if spec == "flash_attn":
        pytest.importorskip("flash_attn")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 203, 64, generator=gen, device="cuda", dtype=dtype) for _ in range(3))
    kernel = get_kernel(spec)
    try:
        kernel.check("cuda", dtype)
    except KernelUnavailableError as err:  # e.g. no cuDNN attention on this GPU
        pytest.skip(str(err))
    out = kernel(q, k, v, is_causal=causal)
    golden = golden_attention(q, k, v, is_causal=causal)
    verdict = check_output(
        out, math_attention(q, k, v, is_causal=causal), golden, floor=rounding_floor(golden, dtype)
    )
    assert verdict.passed, f"{spec}: {verdict.reason}"
