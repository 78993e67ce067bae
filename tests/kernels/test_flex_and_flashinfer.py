"""The `flex` kernel (torch FlexAttention behind the SDPA signature) against FP64 math: causal,
bool and additive masks (fully masked rows give 0), scale, grouped-query heads; its CPU backward is
refused with the reason, before any work. The ``flashinfer`` adapter: refused without CUDA naming
the install; on CUDA (``gpu``) against FP64 math."""

from __future__ import annotations

import pytest
import torch

from flashprobe.kernels import KernelUnavailableError, get_kernel, golden_attention

EAGER = get_kernel("flex:compile=false")


def _inputs(h_kv: int = 4):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=gen)
    k, v = (torch.randn(2, h_kv, 40, 16, generator=gen) for _ in range(2))
    keep = torch.rand(2, 1, 40, 40, generator=gen) > 0.3
    keep[:, :, 3] = False  # a fully masked row
    bias = torch.randn(1, 4, 40, 40, generator=gen).masked_fill(~keep[:1], float("-inf"))
    return q, k, v, keep, bias


@pytest.mark.parametrize(
    "case", ["plain", "causal", "bool_mask", "additive_mask", "scale", "gqa", "causal_gqa"]
)
def test_eager_flex_matches_fp64_math(case: str) -> None:
    q, k, v, keep, bias = _inputs(h_kv=2 if "gqa" in case else 4)
    kwargs = {
        "plain": {},
        "causal": {"is_causal": True},
        "bool_mask": {"attn_mask": keep},
        "additive_mask": {"attn_mask": bias},
        "scale": {"scale": 0.37},
        "gqa": {},
        "causal_gqa": {"is_causal": True},
    }[case]
    rep = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    golden = golden_attention(q, kx, vx, **kwargs)
    out = EAGER(q, k, v, **kwargs)
    assert out.dtype == torch.float32 and out.shape == (2, 4, 40, 16)
    assert (out.double() - golden).abs().max() < 2e-6
    if "attn_mask" in kwargs:
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))  # the fully masked row


def test_cpu_backward_is_refused_with_the_reason() -> None:
    q, k, v, _, _ = _inputs()
    with pytest.raises(KernelUnavailableError, match="inputs require grad, but it has no backward on CPU"):
        EAGER(q.requires_grad_(), k, v)
    with pytest.raises(KernelUnavailableError, match="not fp64"):
        get_kernel("flex").check("cpu", torch.float64)
    EAGER.check("cpu", torch.float64)  # eager FlexAttention runs fp64
    with pytest.raises(ValueError, match="compile"):
        get_kernel("flex:compile=maybe")


def test_compiled_flex_is_the_fused_kernel_and_close() -> None:
    q, k, v, keep, _ = _inputs()
    with torch.no_grad():
        out = get_kernel("flex")(q, k, v, attn_mask=keep)  # compiles (tens of seconds the first time)
    assert (out.double() - golden_attention(q, k, v, attn_mask=keep)).abs().max() < 1e-5


@pytest.mark.slow
def test_compiled_flex_compiles_once_for_every_length_and_never_runs_eager(monkeypatch) -> None:
    """Lengths are dynamic: a second length reuses the compile (torch's ``recompile_limit`` of 8 was
    reached by a fuzz run of 8 shapes, past which torch ran the unfused eager code in silence); a
    variant past the kernel's own limit is an error, not eager code."""
    import flashprobe.kernels.flex as flex_module

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters["stats"]
    flex = get_kernel("flex")
    gen = torch.Generator().manual_seed(1)
    graphs = []
    for n_q, n_k in ((40, 56), (24, 100)):  # one key block each: a second block count is a variant
        q = torch.randn(2, 2, n_q, 16, generator=gen)
        k, v = (torch.randn(2, 2, n_k, 16, generator=gen) for _ in range(2))
        with torch.no_grad():
            out = flex(q, k, v, is_causal=True)
        graphs.append(counters["unique_graphs"])
        assert (out.double() - golden_attention(q, k, v, is_causal=True)).abs().max() < 1e-5
    assert graphs[0] >= 1 and graphs[1] == graphs[0]  # the second length compiled nothing
    monkeypatch.setattr(flex_module, "RECOMPILE_LIMIT", 1)
    with torch.no_grad(), pytest.raises(RuntimeError, match="reached 1 compiled variants"):
        flex(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)  # a new dtype is a new variant
    torch._dynamo.reset()


def test_flashinfer_says_what_it_needs_here() -> None:
    """On a machine without CUDA the spec is refused at the check, naming the device and the install."""
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without CUDA")
    with pytest.raises(
        KernelUnavailableError,
        match=r"flashinfer: runs on CUDA devices only, not CPU.*pip install flashinfer",
    ):
        get_kernel("flashinfer").check("cpu", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
def test_flashinfer_matches_sdpa_on_cuda() -> (
    None
):  # run by scripts/gpu_check.sh where flashinfer is installed
    pytest.importorskip("flashinfer")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 100, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 120, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    keep = torch.rand(2, 1, 100, 120, device="cuda", generator=gen) > 0.2
    kernel = get_kernel("flashinfer")
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": keep}):
        golden = golden_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), **kwargs)
        assert (kernel(q, k, v, **kwargs).double() - golden).abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
def test_flash_attn_takes_key_padding_through_varlen_on_cuda() -> None:  # run by scripts/gpu_check.sh
    pytest.importorskip("flash_attn")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 64, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 80, 64, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    keep = torch.ones(2, 1, 1, 80, dtype=torch.bool, device="cuda")
    keep[1, ..., 50:] = False  # the second entry has 50 real keys
    kx, vx = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    out = get_kernel("flash_attn")(q, k, v, attn_mask=keep)
    assert (out.double() - golden_attention(q, kx, vx, attn_mask=keep)).abs().max() < 2e-2


def test_flash_attn_refuses_what_it_cannot_take_before_any_work() -> None:
    q = torch.randn(1, 2, 8, 16)
    from flashprobe.kernels.flash_attn import _key_padding

    with pytest.raises(KernelUnavailableError, match="only key-padding masks"):
        _key_padding(torch.rand(1, 1, 8, 8) > 0.5, 1, 8, 8)
    with pytest.raises(KernelUnavailableError, match="additive float mask"):
        _key_padding(torch.zeros(1, 1, 8, 8), 1, 8, 8)
    keys = _key_padding(torch.tensor([True] * 6 + [False] * 2).view(1, 1, 1, 8), 1, 8, 8)
    assert keys.tolist() == [[True] * 6 + [False] * 2]
    with pytest.raises(KernelUnavailableError, match="CUDA"):
        get_kernel("flash_attn")(q, q, q)
