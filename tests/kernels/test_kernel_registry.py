"""Spec strings, the registry, user kernels and ``Kernel.check``."""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.cli import main as cli_main
from flashprobe.kernels import (
    Kernel,
    KernelSpecError,
    KernelUnavailableError,
    available_kernels,
    get_kernel,
    golden_attention,
    kernel_availability,
    list_kernels,
    math_attention,
    parse_spec,
    register_kernel,
    unregister_kernel,
)

BUILTINS = [
    "flash_attn",
    "flashinfer",
    "flex",
    "math",
    "sdpa_cudnn",
    "sdpa_efficient",
    "sdpa_flash",
    "sdpa_math",
    "tiled",
]
CPU_OK = ["math", "tiled", "sdpa_flash", "sdpa_math"]
CUDA_ONLY = ["sdpa_efficient", "sdpa_cudnn", "flash_attn", "flashinfer"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.fixture
def user_kernel_name():
    """A registry name for a user kernel, removed again after the test."""
    name = "user_test_kernel"
    yield name
    if name in available_kernels():
        unregister_kernel(name)


def test_parse_spec_values():
    name, options = parse_spec(
        " tiled : block_q=32, block_k = 128,dtype=bfloat16,swap_blocks=true,square=False,"
        "mask_value=-5e4,sram=none"
    )
    assert name == "tiled"
    assert options == {
        "block_q": 32,
        "block_k": 128,
        "dtype": "bfloat16",
        "swap_blocks": True,
        "square": False,
        "mask_value": -50000.0,
        "sram": None,
    }
    assert isinstance(options["block_q"], int) and isinstance(options["mask_value"], float)
    assert parse_spec("tiled:mask_value=-inf")[1]["mask_value"] == -math.inf
    assert parse_spec("math") == ("math", {})
    assert parse_spec("tiled:") == ("tiled", {})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "non-empty string"),
        ("tiled:block_k", "option 'block_k' must look like key=value"),
        ("tiled:=3", "must look like key=value"),
        ("tiled:block_k=8,block_k=16", "option 'block_k' is given twice"),
    ],
)
def test_parse_spec_errors(spec, message):
    with pytest.raises(KernelSpecError, match=message):
        parse_spec(spec)


def test_unknown_kernel_lists_the_available_ones():
    with pytest.raises(KernelSpecError) as err:
        get_kernel("flashinferr:block_k=64")
    text = str(err.value)
    assert "unknown kernel 'flashinferr'" in text
    assert all(name in text for name in BUILTINS)
    assert "register_kernel" in text


def test_unknown_option_lists_the_allowed_ones():
    with pytest.raises(KernelSpecError) as err:
        get_kernel("tiled:blocksize=64")
    text = str(err.value)
    assert "no option 'blocksize'" in text
    for option in (
        "block_q",
        "block_k",
        "sram",
        "swap_blocks",
        "square",
        "loop",
        "preset",
        "order",
        "order_seed",
        "update",
        "score_dtype",
        "mask_value",
        "stats_dtype",
    ):
        assert option in text
    with pytest.raises(KernelSpecError, match=r"its options: \(none\)"):
        get_kernel("sdpa_flash:block_k=64")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tiled:dtype=fp8", r"unknown dtype 'fp8'; use one of: .*bf16"),
        ("tiled:stats_dtype=int8", "unknown dtype 'int8'"),
        ("math:dtype=half_precision", "unknown dtype 'half_precision'"),
        ("tiled:loop=z", "loop='z' must be 'kv' or 'q'"),
        ("tiled:preset=fa3", "preset='fa3' must be 'fa2', 'paper' or 'fa3_fp8'"),
        ("tiled:update=fa3", "update='fa3' must be 'fa2' or 'fa1'"),
        ("tiled:order=backwards", "order='backwards' must be 'forward', 'reverse' or 'shuffle'"),
        ("tiled:order_seed=-1", "order_seed=-1 must be an integer ≥ 0"),
        ("tiled:score_dtype=int8", r"score_dtype='int8': unknown dtype 'int8'; use one of: .*, or opmath"),
        ("tiled:acc_dtype=wide", r"acc_dtype='wide': unknown dtype"),
        ("tiled:block_k=0", "block_k=0 must be a positive integer"),
        ("tiled:sram=4096,block_q=8", "either sram=M or block_q/block_k"),
        ("tiled:swap_blocks=maybe", "swap_blocks='maybe' must be true or false"),
        ("tiled:mask_value=inf", "mask_value=inf must be -inf or a finite number"),
        ("tiled:mask_value=low", "mask_value='low' must be -inf or a finite number"),
    ],
)
def test_bad_option_values_fail_when_the_spec_is_parsed(spec, message):
    with pytest.raises(KernelSpecError, match=message):
        get_kernel(spec)


def test_spec_round_trip_and_passthrough(make_qkv):
    kernel = get_kernel("tiled:block_k=16,dtype=fp64,mask_value=-5e4")
    assert kernel.name == "tiled" and kernel.spec == "tiled:block_k=16,dtype=fp64,mask_value=-50000.0"
    assert str(kernel) == kernel.spec
    again = get_kernel(kernel.spec)
    assert again == kernel and get_kernel(kernel) is kernel
    q, k, v = make_qkv(9, 11, 4)
    assert torch.equal(again(q, k, v), kernel(q, k, v))
    assert get_kernel("tiled:mask_value=-inf").spec == "tiled:mask_value=-inf"


def test_available_kernels_lists_every_builtin_with_a_description():
    kernels = available_kernels()
    assert set(BUILTINS) <= set(kernels)
    assert all(kernels[name] for name in BUILTINS)


def test_register_user_kernel_and_use_it_by_spec(user_kernel_name, make_qkv):
    seen = []

    def check(device, dtype, temperature=1.0):
        seen.append((device, dtype, temperature))
        if dtype == torch.float16:
            raise KernelUnavailableError("user kernel: no fp16")

    @register_kernel(user_kernel_name, description="attention at a softmax temperature", check=check)
    def tempered(q, k, v, *, attn_mask=None, is_causal=False, scale=None, temperature=1.0):
        s = (q.shape[-1] ** -0.5 if scale is None else scale) / temperature
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=s)

    assert available_kernels()[user_kernel_name] == "attention at a softmax temperature"
    kernel = get_kernel(f"{user_kernel_name}:temperature=2")
    q, k, v = make_qkv(7, 9, 16, dtype=torch.float64)
    expected = golden_attention(q, k, v, is_causal=True, scale=0.125)
    torch.testing.assert_close(kernel(q, k, v, is_causal=True), expected, rtol=0, atol=1e-15)
    kernel.check("cpu", torch.float32)
    assert seen == [(torch.device("cpu"), torch.float32, 2)]
    with pytest.raises(KernelUnavailableError, match=r"no fp16"):
        kernel.check("cpu", torch.float16)
    with pytest.raises(KernelSpecError, match=r"no option 'temp'.*its options: temperature"):
        get_kernel(f"{user_kernel_name}:temp=2")


def test_register_kernel_rejects_bad_and_taken_names(user_kernel_name):
    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    with pytest.raises(KernelSpecError, match=r"must be letters, digits and '_'"):
        register_kernel("my-kernel", kernel)
    with pytest.raises(KernelSpecError, match=r"'tiled' is already registered; pass overwrite=True"):
        register_kernel("tiled", kernel)
    register_kernel(user_kernel_name, kernel)
    register_kernel(user_kernel_name, kernel, description="replaced", overwrite=True)
    assert available_kernels()[user_kernel_name] == "replaced"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_check_agrees_with_running_on_cpu(dtype, make_qkv):
    q, k, v = make_qkv(8, 12, 16, dtype=dtype)
    for name in CPU_OK:
        get_kernel(name).check("cpu", dtype)
        assert get_kernel(name)(q, k, v).shape == (1, 2, 8, 16)
    for name in CUDA_ONLY:
        kernel = get_kernel(name)
        with pytest.raises(KernelUnavailableError, match=f"{name}:"):
            kernel.check("cpu", dtype)
        with pytest.raises(KernelUnavailableError, match=f"{name}:"):
            kernel(q, k, v)


def test_kernel_built_directly_still_validates_at_call(make_qkv):
    q, k, v = make_qkv(4, 4, 8)
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'"):
        Kernel("tiled", {"dtype": "fp8"})(q, k, v)
    with pytest.raises(KernelUnavailableError, match=r"unknown dtype 'fp8'"):
        Kernel("tiled", {"dtype": "fp8"}).check("cpu", torch.float32)


def test_list_and_unregister_kernels(user_kernel_name):
    infos = {info.name: info for info in list_kernels()}
    assert sorted(n for n, i in infos.items() if i.builtin) == BUILTINS
    assert infos["tiled"].options[:2] == ("block_q", "block_k")

    @register_kernel(user_kernel_name, description="mine")
    def mine(q, k, v, *, attn_mask=None, is_causal=False, scale=None, block=64):
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    info = next(i for i in list_kernels() if i.name == user_kernel_name)
    assert (info.description, info.options, info.builtin) == ("mine", ("block",), False)
    unregister_kernel(user_kernel_name)
    assert user_kernel_name not in available_kernels()
    with pytest.raises(KernelSpecError, match="no kernel"):
        unregister_kernel(user_kernel_name)
    with pytest.raises(KernelSpecError, match="built into flashprobe"):
        unregister_kernel("math")
    assert "math" in available_kernels()


def test_availability_on_cpu_says_why_not():
    for name in CPU_OK:
        found = kernel_availability(name, "cpu")
        assert found.available and found.dtypes == ("bf16", "fp16", "fp32", "fp64") and found.reason == ""
    for name in CUDA_ONLY:
        found = kernel_availability(name, "cpu")
        assert not found.available and found.dtypes == ()
        assert found.reason.startswith(f"{name}: ") and "CUDA" in found.reason  # one reason, said once
        assert set(found.reasons) == {"bf16", "fp16", "fp32", "fp64"}


def test_availability_of_a_user_kernel_comes_from_its_check_and_a_tiny_call(user_kernel_name):
    def check(device, dtype):
        if dtype == torch.float16:
            raise KernelUnavailableError(f"{user_kernel_name}: no fp16 here")

    @register_kernel(user_kernel_name, check=check)
    def fragile(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        if q.dtype == torch.float64:
            raise RuntimeError("fp64 kernel not compiled")
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    found = kernel_availability(user_kernel_name, "cpu")
    assert found.available and found.dtypes == ("bf16", "fp32")
    assert found.reasons == {
        "fp16": f"{user_kernel_name}: no fp16 here",
        "fp64": "RuntimeError: fp64 kernel not compiled",
    }
    expected = f"fp16: {user_kernel_name}: no fp16 here; fp64: RuntimeError: fp64 kernel not compiled"
    assert found.reason == expected
    with pytest.raises(KernelSpecError, match="unknown kernel"):
        kernel_availability("no_such_kernel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only listing")
def test_flashprobe_kernels_marks_what_runs_here(capsys):
    assert cli_main(["kernels"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in BUILTINS:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{name} "))
        status = lines[start + 2].strip()
        if name in CPU_OK:
            assert status == "runs on cpu: bf16, fp16, fp32, fp64", (name, status)
        elif name == "flex":  # compiled on its first call: only its check, which refuses fp64 on the CPU
            expected = "declared to run on cpu: bf16, fp16, fp32 (not fp64: flex: compiled"
            assert status.startswith(expected), status
            assert lines[start + 3].strip().startswith("not called: compiled on its first call; --try")
        else:
            assert status.startswith(f"NOT on cpu: {name}: ") and "CUDA" in status, (name, status)
    assert lines[-1] == (
        "on cpu: 5 of 9 kernels run (flex by the declared check only); "
        "not: flash_attn, flashinfer, sdpa_cudnn, sdpa_efficient"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only listing")
def test_flashprobe_kernels_calls_a_compiled_kernel_only_with_try(user_kernel_name, capsys):
    calls: list[torch.dtype] = []

    @register_kernel(user_kernel_name)
    def compiled(q, k, v, *, attn_mask=None, is_causal=False, scale=None, compile=True):
        calls.append(q.dtype)
        if compile and q.dtype == torch.float16:
            raise RuntimeError("no fp16 compiler here")
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    def status() -> list[str]:
        lines = capsys.readouterr().out.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{user_kernel_name} "))
        return [line.strip() for line in lines[start + 2 : start + 4]]

    assert cli_main(["kernels"]) == 0
    assert calls == []  # its first call would compile: the default listing only asks its check
    assert status() == [
        "declared to run on cpu: bf16, fp16, fp32, fp64",
        "not called: compiled on its first call; --try makes one tiny call",
    ]
    assert cli_main(["kernels", "--try"]) == 0
    assert calls == DTYPES
    assert status()[0] == "runs on cpu: bf16, fp32, fp64 (not fp16: RuntimeError: no fp16 compiler here)"


def test_import_of_the_kernels_does_not_import_dynamo():
    """``flashprobe kernels`` pays for torch only: the probe's torch._dynamo is imported on use."""
    import subprocess
    import sys

    code = "import sys, flashprobe.kernels, flashprobe.cli; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
