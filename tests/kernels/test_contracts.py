"""Kernels registered with the contract they really have (flashprobe.kernels.contract): the adapters,
the refusals, and the correct stand-ins of lab/contracts.py judged against the golden.

The stand-ins compute differently from the golden (online softmax over key tiles, exp2, split-KV
with a merge, FlashInfer's base-2 merge); over many seeds in bf16, fp16 and fp32 they must pass the
one rule (:func:`flashprobe.fuzz.rule.check_output`, floored by the golden's rounding as
flash-attention's tests floor theirs) and give the golden's LSE. Planted bugs of the classes the
contracts exist for (a base-2 LSE merged as natural, a symmetric window, an LSE in the wrong base)
must fail, so the adapters' conversions are tested both ways.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.fuzz.rule import check_output, rounding_floor
from flashprobe.kernels import (
    KernelCapabilities,
    KernelInputError,
    KernelSpecError,
    KernelUnsupportedError,
    get_kernel,
    list_kernels,
    register_kernel,
    unregister_kernel,
)
from flashprobe.kernels.call import AttentionCall
from flashprobe.kernels.contract import call_from_arguments, logical_outputs
from flashprobe.kernels.math import baseline_call, golden_call
from lab import contracts
from tests.kernels._oracle import random_sequences
from tests.kernels.test_call import dense_call

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SEEDS = range(20)


@pytest.fixture(scope="module", autouse=True)
def controls():
    names = contracts.register_controls()
    yield names
    for name in names:
        unregister_kernel(name)


def _random_call(api: str, seed: int, dtype: torch.dtype) -> AttentionCall:
    """A call with features drawn from ``seed``: GQA, causal, windows, softcap, ALiBi, ragged lengths
    with empty sequences for the packed and cached apis, in the storage ``api`` takes."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda n: int(torch.randint(n, (1,), generator=gen))  # noqa: E731
    h_kv = (1, 2, 4)[pick(3)]
    b = 3
    if api == "flash_attn_func":
        n_q, n_k = 1 + pick(20), 1 + pick(30)
        q_lens, k_lens = [n_q] * b, [n_k] * b
    elif api == "flash_attn_with_kvcache":
        n_q = 1 + pick(4)
        q_lens, k_lens = [n_q] * b, [n_q + pick(20) for _ in range(b)]
    else:
        q_lens, k_lens = [pick(12) for _ in range(b)], [pick(24) for _ in range(b)]
        q_lens[0], k_lens[1] = 0, 0  # an empty query sequence and one without keys, in a batch
    seqs = random_sequences(q_lens, k_lens, 4, h_kv, 16, 16, seed=seed, dtype=dtype, scale=1.5)
    features = {"align": "bottom_right", "return_lse": True, "causal": bool(pick(2))}
    if pick(2):
        features["window"] = (pick(6), 0 if features["causal"] else pick(6) - 1)
    if pick(3) == 0:
        features["softcap"] = 1.0 + pick(4)
    if pick(3) == 0 and api != "merge_state":
        features["alibi_slopes"] = torch.rand(b, 4, generator=gen) * 0.3
    call = dense_call(seqs, **features)
    if api == "flash_attn_func":
        return call.replace(q_lens=None, k_lens=None).with_layout("bnhd")
    if api == "flash_attn_varlen_func":
        if seed % 2:
            return call.paged(1 + pick(8), kv_layout="NHD", generator=gen, fill=float("nan"))
        return call.packed()
    if api == "flash_attn_with_kvcache":
        return call.replace(q_lens=None).cached(
            new=pick(n_q + 1), page_size=(None, 3)[seed % 2], fill=float("nan")
        )
    return call.replace(split_k=pick(26), lse_base=2)


def _check(out, golden, baseline, dtype, what):
    verdict = check_output(out.out, baseline.out, golden.out, floor=rounding_floor(golden.out, dtype))
    assert verdict.passed, f"{what}: {verdict.reason}"
    if golden.lse is not None:
        assert out.lse is not None and out.lse.shape == golden.lse.shape
        empty = torch.isinf(golden.lse)
        assert torch.equal(torch.isinf(out.lse), empty) and (out.lse[empty] == golden.lse[empty]).all(), what
        torch.testing.assert_close(
            out.lse[~empty].double(), golden.lse[~empty], rtol=1e-5, atol=1e-4, msg=what
        )


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    "api", ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_state"]
)
def test_correct_stand_ins_pass_against_the_golden_over_many_seeds(api, dtype):
    kernel = get_kernel(f"control_{api}")
    assert kernel.api == api
    for seed in SEEDS:
        call = _random_call(api, seed, dtype)
        golden, baseline = golden_call(call), baseline_call(call)
        _check(kernel.run(call), golden, baseline, dtype, f"{api} seed {seed}")


def test_fp8_inputs_with_descales():
    """FlashAttention-3's FP8 contract: float8_e4m3fn q, k, v with (B, H_kv) descales, bf16 out."""
    kernel = get_kernel("control_fa3_flash_attn_func")
    for seed in SEEDS:
        seqs = random_sequences(
            [9] * 2, [13] * 2, 4, 2, 16, 16, seed=seed, dtype=torch.float8_e4m3fn, scale=2.0
        )
        gen = torch.Generator().manual_seed(seed)
        descales = {
            n: torch.rand(2, 2, generator=gen) + 0.25 for n in ("q_descale", "k_descale", "v_descale")
        }
        call = dense_call(seqs, causal=bool(seed % 2), align="bottom_right", return_lse=True, **descales)
        call = call.replace(q_lens=None, k_lens=None)
        out = kernel.run(call)
        assert out.out.dtype == torch.bfloat16
        _check(out, golden_call(call), baseline_call(call), torch.bfloat16, f"fp8 seed {seed}")
    with pytest.raises(KernelUnsupportedError, match="FP8"):
        get_kernel("control_flash_attn_func").run(call)


def test_a_cache_call_appends_its_new_keys_in_place():
    seqs = random_sequences([2, 2], [5, 7], 2, 2, 8, 8, seed=0)
    call = dense_call(seqs).replace(q_lens=None).cached(new=2, fill=float("nan"))
    before = call.k.clone()
    get_kernel("control_flash_attn_with_kvcache").run(call)
    seqlens = call.cache_seqlens.tolist()
    for b, n in enumerate(seqlens):
        assert torch.equal(call.k[b, n : n + 2], call.k_new[b]) and torch.equal(call.k[b, :n], before[b, :n])


def test_a_merge_with_an_empty_partial_is_not_nan():
    seqs = random_sequences([4, 3], [6, 0], 2, 2, 8, 8, seed=1, dtype=torch.float16)
    for split in (0, 6, 100):
        call = dense_call(seqs, return_lse=True, lse_base=2, split_k=split)
        out = get_kernel("control_merge_state").run(call)
        _check(out, golden_call(call), baseline_call(call), torch.float16, f"split {split}")


def test_sdpa_kernels_take_calls_beyond_sdpa_as_masks():
    """The SDPA contract gets lengths, windows, bottom-right causal and ALiBi folded into attn_mask."""
    seqs = random_sequences([5, 3, 0], [7, 2, 4], 4, 2, 16, 16, seed=2, dtype=torch.bfloat16)
    slopes = torch.rand(4) * 0.4
    call = dense_call(seqs, causal=True, align="bottom_right", window=(3, 0), alibi_slopes=slopes)
    for spec in ("math", "sdpa_math", "tiled"):
        out = get_kernel(spec).run(call.packed())
        _check(out, golden_call(call), baseline_call(call), torch.bfloat16, spec)
    for field, value, what in (("softcap", 1.0, "softcap"), ("return_lse", True, "LSE"),
                               ("sinks", torch.zeros(4), "sinks")):  # fmt: skip
        with pytest.raises(KernelUnsupportedError, match=f"SDPA contract has no .*{what}"):
            get_kernel("math").run(call.replace(**{field: value}))


def test_a_flash_contract_kernel_is_callable_like_sdpa():
    """An SDPA call given to a bottom-right kernel: equal lengths pass, top-left causal with more
    queries than keys becomes a window, with fewer it has none and is refused."""
    kernel = get_kernel("control_flash_attn_func")
    gen = torch.Generator().manual_seed(0)
    for n_q, n_k in ((8, 8), (9, 4)):
        q, k, v = (torch.randn(2, 4, n, 16, generator=gen).to(torch.float16) for n in (n_q, n_k, n_k))
        out = kernel(q, k, v, is_causal=True)
        call = AttentionCall(q=q, k=k, v=v, causal=True)
        verdict = check_output(out, baseline_call(call).out, golden_call(call).out, floor=1e-3)
        assert out.shape == q.shape and verdict.passed, verdict.reason
    with pytest.raises(KernelUnsupportedError, match="no window of it is this mask"):
        kernel(q[:, :, :3], k, v, is_causal=True)


@pytest.mark.parametrize(
    ("caps", "call_changes", "message"),
    [
        ({"window": False}, {"window": (2, 1)}, "does not declare windows"),
        ({"softcap": False}, {"softcap": 2.0}, "does not declare softcap"),
        ({"alibi": False}, {"alibi_slopes": torch.ones(4)}, "does not declare ALiBi"),
        ({"lse": False}, {"return_lse": True}, "does not declare an LSE"),
        ({}, {"out": torch.zeros(2, 6, 4, 8)}, "preallocated out="),
        ({"head_dims": frozenset({64})}, {}, "head dim 8"),
        ({"gqa": "none"}, {}, "grouped key/value heads"),
        ({"dtypes": frozenset({torch.float16})}, {}, "supports fp16 only"),
        ({"same_length": True}, {}, "N_q = N_k only"),
    ],
)
def test_a_kernel_refuses_what_it_does_not_declare(caps, call_changes, message):
    register_kernel("contract_probe", contracts.flash_attn_func, api="flash_attn_func",
                    capabilities=KernelCapabilities(**caps), overwrite=True)  # fmt: skip
    try:
        q = torch.randn(2, 6, 4, 8)
        k = v = torch.randn(2, 7, 2, 8)
        call = AttentionCall(q=q, k=k, v=v, layout="bnhd", align="bottom_right", **call_changes)
        with pytest.raises(KernelUnsupportedError, match=message):
            get_kernel("contract_probe").run(call)
    finally:
        unregister_kernel("contract_probe")


def test_storages_a_contract_cannot_take_are_refused_naming_the_one_that_can():
    seqs = random_sequences([3, 2], [4, 5], 2, 2, 8, 8, seed=0)
    ragged = dense_call(seqs)
    with pytest.raises(KernelUnsupportedError, match="give ragged calls to flash_attn_varlen_func"):
        get_kernel("control_flash_attn_func").run(ragged)
    with pytest.raises(KernelUnsupportedError, match="flash_attn_with_kvcache takes queries of one length"):
        get_kernel("control_flash_attn_with_kvcache").run(ragged.packed())
    register_kernel("contract_probe", contracts.flash_attn_varlen_func, api="flash_attn_varlen_func",
                    capabilities=KernelCapabilities(page_multiple=256), overwrite=True)  # fmt: skip
    try:
        with pytest.raises(KernelUnsupportedError, match="pages of 16 keys"):
            get_kernel("contract_probe").run(ragged.paged(16))
    finally:
        unregister_kernel("contract_probe")
    assert get_kernel("control_flash_attn_varlen_func").run(ragged).out.shape == (2, 2, 3, 8)


def test_registration_reads_the_apis_parameters_and_the_options():
    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
               causal=False, return_attn_probs=False, tile=16):  # fmt: skip
        return contracts.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale,
            causal=causal,
        )

    register_kernel("contract_probe", varlen, api="flash_attn_varlen_func", overwrite=True)
    try:
        info = {i.name: i for i in list_kernels()}["contract_probe"]
        assert info.api == "flash_attn_varlen_func" and info.options == ("tile",)
        assert get_kernel("contract_probe:tile=8").options == {"tile": 8}
    finally:
        unregister_kernel("contract_probe")
    with pytest.raises(KernelSpecError, match="api='flash_attn' must be one of"):
        register_kernel("contract_probe", varlen, api="flash_attn")
    assert get_kernel("math").api == "sdpa"


def test_a_call_read_from_a_real_functions_arguments():
    seqs = random_sequences([3, 2], [4, 5], 4, 2, 8, 8, seed=0)
    packed = dense_call(seqs, causal=True, align="bottom_right", window=(2, 0), softcap=3.0).packed()
    read = call_from_arguments(
        "flash_attn_varlen_func",
        packed.q,
        packed.k,
        packed.v,
        packed.cu_seqlens_q,
        packed.cu_seqlens_k,
        3,
        5,
        0.0,
        None,
        True,
        (2, 4),
        3.0,
    )  # (causal sets the window's right side to 0, as flash-attn does)
    assert read.storage == "packed" and read.window == (2, 0) and read.align == "bottom_right"
    assert torch.equal(golden_call(read).out, golden_call(packed).out)
    cache = dense_call(seqs).replace(q_lens=None).cached(new=1)
    read = call_from_arguments("flash_attn_with_kvcache", cache.q, cache.k, cache.v, cache.k_new, cache.v_new,
                               cache_seqlens=cache.cache_seqlens, causal=True, num_splits=3)  # fmt: skip
    assert read.storage == "cache" and read.causal and read.num_splits == 3
    assert torch.equal(golden_call(read).out, golden_call(read.replace(num_splits=None)).out)  # a hint only
    with pytest.raises(KernelInputError, match="num_splits"):
        read.replace(num_splits=-1)
    with pytest.raises(TypeError, match="rotary"):
        call_from_arguments("flash_attn_with_kvcache", cache.q, cache.k, cache.v, rotary_cos=torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_what_a_probe_reads_from_a_real_call_and_its_return(dtype):
    """A probe sees a library function's arguments and return: the call read from them and the return
    in the logical form (LSE layout, +inf for rows without keys) pass against the call's golden."""
    seqs = random_sequences([4, 0, 6], [7, 2, 3], 4, 1, 16, 16, seed=9, dtype=dtype)
    packed = dense_call(seqs).packed()
    args = (packed.q, packed.k, packed.v, packed.cu_seqlens_q, packed.cu_seqlens_k, 6, 7)
    kwargs = {"causal": True, "softcap": 2.0, "window_size": (2, 0), "return_attn_probs": True}
    returned = contracts.flash_attn_varlen_func(*args, **kwargs)
    call = call_from_arguments("flash_attn_varlen_func", *args, **kwargs)
    caps = KernelCapabilities(empty_lse=math.inf)
    found = logical_outputs("flash_attn_varlen_func", call, returned, caps)
    _check(found, golden_call(call), baseline_call(call), dtype, "varlen read by a probe")
    # 6 queries, 3 keys, bottom-right causal: rows 0..2 of the third sequence see no key (+inf from the
    # kernel, −inf in the logical form), rows 3..5 see keys
    assert (found.lse[2, :, :3] == float("-inf")).all() and torch.isfinite(found.lse[2, :, 3:]).all()
    assert (returned[1][:, 4:7] == float("inf")).all()  # (its tokens 4..6 of the packed queries)


# ---- planted bugs: the conversions matter ---------------------------------------------------------


def _natural_merge(v_a, s_a, v_b, s_b):
    """A merge that reads base-2 LSEs as natural logs (sglang 40903)."""
    s_max = torch.maximum(s_a, s_b)
    w_a, w_b = torch.exp(s_a - s_max), torch.exp(s_b - s_max)
    v = (w_a[..., None] * v_a.float() + w_b[..., None] * v_b.float()) / (w_a + w_b)[..., None]
    return v.to(v_a.dtype), torch.log(w_a + w_b) + s_max


def _symmetric_window(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):  # fmt: skip
    """A window applied as (left, left) where the API says (left, right) (vllm PR 49202)."""
    return contracts.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     window_size=(window_size[0], window_size[0]), softcap=softcap,
                                     return_attn_probs=return_attn_probs)  # fmt: skip


@pytest.mark.parametrize(
    ("fn", "api", "caps", "changes"),
    [
        (_natural_merge, "merge_state", {"lse_base": 2}, {"split_k": 5, "lse_base": 2}),
        (
            contracts.merge_state,
            "merge_state",
            {"lse_base": "e"},
            {"split_k": 5},
        ),  # declared in the wrong base
        (_symmetric_window, "flash_attn_func", {"empty_lse": math.inf}, {"window": (3, 0)}),
        (
            contracts.flash_attn_func,
            "flash_attn_func",
            {},
            {"causal": True},
        ),  # +inf for empty rows, undeclared
    ],
)
def test_planted_contract_bugs_fail(fn, api, caps, changes):
    register_kernel("contract_bug", fn, api=api, capabilities=KernelCapabilities(**caps), overwrite=True)
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 12, 2, 16, generator=gen)
        k, v = (torch.randn(2, 9, 2, 16, generator=gen) for _ in range(2))
        call = AttentionCall(q=q, k=k, v=v, layout="bnhd", align="bottom_right", return_lse=True, **changes)
        with pytest.raises(AssertionError):
            _check(
                get_kernel("contract_bug").run(call),
                golden_call(call),
                baseline_call(call),
                torch.float32,
                api,
            )
    finally:
        unregister_kernel("contract_bug")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_varlen_kernels_backward_flows_to_the_packed_inputs(dtype):
    """Gradients through the adapter reach the packed tensors; mapped to the logical form they pass
    the rule against the golden's (:func:`~flashprobe.kernels.math.call_gradients`)."""
    from flashprobe.kernels.math import call_gradients

    seqs = random_sequences([4, 0, 7], [9, 3, 5], 4, 2, 16, 16, seed=5, dtype=dtype)
    packed = dense_call(seqs, causal=True, align="bottom_right", softcap=4.0).packed()
    q, k, v = (t.clone().requires_grad_() for t in (packed.q, packed.k, packed.v))
    call = packed.replace(q=q, k=k, v=v)
    out = get_kernel("control_flash_attn_varlen_func").run(call).out
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    golden = call_gradients(packed, grad_out, dtype=torch.float64)
    base = call_gradients(packed, grad_out)
    for name, got, g, b in zip("qkv", (dq, dk, dv), golden, base, strict=True):
        got = packed.q_to_logical(got) if name == "q" else packed.kv_to_logical(got)
        verdict = check_output(got, b, g, floor=rounding_floor(g, dtype))
        assert verdict.passed, f"d{name}: {verdict.reason}"


def test_a_kernel_without_cache_leftpad_is_not_given_calls_with_it() -> None:
    """``KernelCapabilities(cache_leftpad=False)``: a KV-cache call with ``cache_leftpad`` is refused
    before the kernel runs, naming the feature; without leftpad, or for a kernel that declares it, the
    same call is posed."""
    from flashprobe.kernels import AttentionCall, KernelCapabilities
    from flashprobe.kernels.contract import contract_problem

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 16, generator=g) for _ in range(3))
    dense = AttentionCall(q=q[:, :1], k=k, v=v, layout="bnhd", causal=True, align="bottom_right")
    padded = dense.cached(new=1, leftpad=torch.tensor([3, 0], dtype=torch.int32))
    plain = dense.cached(new=1)
    without = KernelCapabilities(cache_leftpad=False)
    assert "cache_leftpad" in contract_problem("flash_attn_with_kvcache", padded, without)
    assert contract_problem("flash_attn_with_kvcache", plain, without) is None
    assert contract_problem("flash_attn_with_kvcache", padded, KernelCapabilities()) is None
    assert "no cache_leftpad" in without.describe_features()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("api", ["flash_attn_func", "flash_attn_varlen_func"])
def test_stand_ins_take_logits_near_the_dtypes_largest_value(api, dtype):
    """Valid logits of −0.75·finfo.max (every key the same: the output is the mean of the values): the
    exp2 stand-in converts to log2 units only after the row max is subtracted, so ``s · log2(e)`` never
    overflows to −inf and turns the rows into rows without keys (zeros)."""
    b, n_q, n_k, h, d = 2, 3, 5, 2, 4
    big = -0.75 * torch.finfo(dtype).max
    q = torch.zeros(b, h, n_q, d, dtype=dtype)
    q[..., 0] = 1.0
    k = torch.zeros(b, h, n_k, d, dtype=dtype)
    k[..., 0] = big  # q·kᵀ = big exactly, at scale 1
    v = torch.randn(b, h, n_k, d, generator=torch.Generator().manual_seed(0)).to(dtype)
    call = AttentionCall(q=q, k=k, v=v, scale=1.0, return_lse=True)
    call = call.with_layout("bnhd") if api == "flash_attn_func" else call.packed()
    found = get_kernel(f"control_{api}").run(call)
    golden = golden_call(call)
    torch.testing.assert_close(golden.out, v.double().mean(2, keepdim=True).expand(b, h, n_q, d))
    _check(found, golden, baseline_call(call), dtype, api)
