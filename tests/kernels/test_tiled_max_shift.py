"""``tiled:max_shift=repeated``: the paper's row-max shift where the max repeats (Qiu & Yao)."""

from __future__ import annotations

import pytest
import torch

from flashprobe.kernels import KernelSpecError, get_kernel
from flashprobe.kernels.math import golden_attention
from flashprobe.kernels.tiled import _tile_max, tiled_attention
from tests.kernels._helpers import make_mask


def test_tile_max_shifts_only_rows_whose_max_repeats():
    scores = torch.tensor(
        [
            [3.0, 3.0 - 5e-4, 1.0],  # repeats, positive: 2·m
            [-2.0, -2.0, -7.0],  # repeats, negative: 0
            [3.0, 2.0, 1.0],  # single max: unchanged
            [0.0, 0.0, -1.0],  # repeats at 0: unchanged (2·0 = 0)
            [float("-inf")] * 3,  # every key masked: unchanged
        ]
    )
    got = _tile_max(scores, float("-inf"), shift_repeated=True).flatten().tolist()
    assert got == [6.0, 0.0, 3.0, 0.0, float("-inf")]
    assert _tile_max(scores, float("-inf"), shift_repeated=False).flatten().tolist()[:3] == [3.0, -2.0, 3.0]
    sentinel = torch.full((1, 3), -5e4)
    assert _tile_max(sentinel, -5e4, shift_repeated=True).item() == -5e4  # a sentinel row stays dead


def test_off_is_the_default_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).bfloat16() for _ in range(3))
    assert torch.equal(
        tiled_attention(q, k, v, block_k=16), tiled_attention(q, k, v, block_k=16, max_shift="off")
    )


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("preset", ["fa2", "paper"])
def test_the_shift_cancels_in_float64(mask, preset):
    """With exact arithmetic the shift changes nothing: fp64 results match the golden value,
    fully masked rows included, on inputs whose maxima repeat in every tile."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 40, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 40, 16, generator=gen, dtype=torch.float64).round()  # many ties
    k[:, :, 1::2] = k[:, :, 0::2]  # every key twice: every tile's max repeats
    v = torch.randn(1, 2, 40, 16, generator=gen, dtype=torch.float64)
    attn_mask, causal = make_mask(mask, 40, 40, dtype=torch.float64)
    got = tiled_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, block_k=8, preset=preset,
                          max_shift="repeated")  # fmt: skip
    want = golden_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_probability_is_exactly_one_where_the_max_repeats():
    """bf16 ties: without the shift P = 1 for the tied keys, with it P = exp(-m) < 1 (both give the
    same attention up to rounding)."""
    q = torch.tensor([[[[2.0, 0.0]]]])
    k = torch.tensor([[[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]]])  # two keys tie at s = 2/√2
    m = _tile_max(q @ k.transpose(-2, -1) / 2**0.5, float("-inf"), shift_repeated=True)
    assert torch.exp(q @ k.transpose(-2, -1) / 2**0.5 - m).max() < 1
    v = torch.randn(1, 1, 3, 2)
    torch.testing.assert_close(
        tiled_attention(q, k, v, max_shift="repeated"), tiled_attention(q, k, v), rtol=1e-6, atol=1e-6
    )


def test_bad_value_is_refused_when_the_spec_is_parsed():
    with pytest.raises(KernelSpecError, match="max_shift='always' must be 'off' or 'repeated'"):
        get_kernel("tiled:max_shift=always")
    assert get_kernel("tiled:max_shift=repeated").options == {"max_shift": "repeated"}


def test_the_shift_costs_range_in_fp16():
    """A repeated max of 20: the shifted probabilities exp(s - 40) <= exp(-20) underflow fp16 (smallest
    subnormal 6e-8), so the row outputs 0; in bf16 (fp32's exponent range) they do not."""
    q = torch.zeros(1, 1, 4, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 8, 16)
    k[0, 0, :3, 0] = torch.tensor([80.0, 80.0, 10.0])  # scores 80/√16 = 20, twice
    v = torch.randn(1, 1, 8, 16, generator=torch.Generator().manual_seed(0))
    for dtype, lost in ((torch.float16, True), (torch.bfloat16, False)):
        args = [t.to(dtype) for t in (q, k, v)]
        golden = golden_attention(*args)
        shifted = tiled_attention(*args, max_shift="repeated").double()
        assert torch.equal(shifted, torch.zeros_like(shifted)) == lost
        plain_error = (tiled_attention(*args).double() - golden).abs().max()
        assert plain_error < 4e-3  # without the shift both dtypes are fine
