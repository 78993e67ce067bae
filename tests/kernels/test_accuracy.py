"""Every CPU kernel against the FP64 golden value, judged by the 2x noise-floor rule of the fuzzer.

Awkward sizes as in flash-attention's tests: head dims 40/59/111, lengths 113/203, N_q != N_k,
causal, boolean and additive masks with fully masked rows, D_v != D. Each case runs every kernel
on the same inputs so the golden value and the baseline are computed once per case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import softmax

from flashprobe.deviation import deviation
from flashprobe.fuzz.rule import check_output, rounding_floor
from flashprobe.kernels import KernelUnavailableError, get_kernel, golden_attention, math_attention

from ._helpers import make_mask

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (dtype, d, d_v, n_q, n_k, mask kind)
CASES = [
    (FP32, 40, None, 113, 203, "none"),
    (FP32, 59, None, 203, 113, "causal"),
    (FP32, 111, None, 113, 113, "bool"),
    (FP32, 40, 24, 113, 203, "additive"),
    (BF16, 59, None, 113, 203, "causal"),
    (BF16, 40, None, 203, 113, "bool"),
    (BF16, 111, None, 113, 113, "additive"),
    (BF16, 40, 59, 203, 113, "none"),
    (FP16, 40, None, 113, 203, "none"),
    (FP16, 59, None, 203, 113, "bool"),
    (FP16, 111, 40, 113, 203, "causal"),
    (FP16, 40, None, 113, 113, "additive"),
]

TILED_KNOBS = [
    "",
    "loop=q,block_q=32",
    "swap_blocks=true",
    "square=true,block_q=48,block_k=32",
    "sram=4096",
    "block_k=16",
]


def _specs(dtype: torch.dtype) -> list[str]:
    # Plain tiled is the fa2 preset: scores, softmax statistics and output accumulator in fp32
    # whatever the input dtype, as real kernels; the paper preset (every step in the compute dtype)
    # is the lossier setting, tested below.
    tiled = [f"tiled:{knob}".rstrip(":") for knob in TILED_KNOBS]
    return ["sdpa_flash", "sdpa_math", *tiled, "tiled:update=fa1,order=forward"]


def _case_id(case: tuple) -> str:
    dtype, d, d_v, n_q, n_k, mask = case
    dv = f"-dv{d_v}" if d_v else ""
    return f"{str(dtype).removeprefix('torch.')}-d{d}{dv}-q{n_q}k{n_k}-{mask}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernels_within_noise_floor_of_golden(case, make_qkv):
    dtype, d, d_v, n_q, n_k, kind = case
    q, k, v = make_qkv(n_q, n_k, d, d_v, dtype=dtype, seed=d + n_q)
    attn_mask, causal = make_mask(kind, n_q, n_k, dtype=dtype, seed=d)
    kw = {"attn_mask": attn_mask, "is_causal": causal}
    golden = golden_attention(q, k, v, **kw)
    baseline = math_attention(q, k, v, **kw)
    assert baseline.dtype == dtype and golden.dtype == torch.float64
    failures = []
    for spec in _specs(dtype):
        kernel = get_kernel(spec)
        if spec == "sdpa_flash" and d_v is not None:
            with pytest.raises(KernelUnavailableError, match=r"FLASH_ATTENTION.*same last dimension"):
                kernel(q, k, v, **kw)
            continue
        out = kernel(q, k, v, **kw)
        assert out.shape == (1, 2, n_q, d_v or d) and out.dtype == dtype, spec
        verdict = check_output(out, baseline, golden, floor=rounding_floor(golden, dtype))
        if not verdict.passed:
            failures.append(f"{spec}: {verdict.reason}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_low_precision_statistics_add_deviation(dtype, make_qkv):
    """With many key tiles, the paper preset (bf16/fp16 statistics and accumulator) deviates more
    than the fa2 preset (fp32 ones, paper Fig 4), which stays within the noise floor.

    The mean error is compared: the max is dominated by the final rounding of the output.
    """
    q, k, v = make_qkv(113, 203, 40, dtype=dtype, seed=3)
    golden = golden_attention(q, k, v)
    baseline = math_attention(q, k, v)
    lossy = get_kernel("tiled:preset=paper,block_k=8")(q, k, v)
    faithful = get_kernel("tiled:block_k=8")(q, k, v)
    assert deviation(lossy, golden).mean_abs > 1.4 * deviation(faithful, golden).mean_abs
    verdict = check_output(faithful, baseline, golden, floor=rounding_floor(golden, dtype))
    assert verdict.passed, verdict.reason


def _numpy_attention(q, k, v, keep, bias, scale):
    """Independent oracle: scipy softmax over numpy float64 scores; fully masked rows give 0."""
    scores = q @ np.swapaxes(k, -1, -2) * scale + bias
    scores = np.where(keep, scores, -np.inf)
    dead = ~keep.any(axis=-1, keepdims=True) | np.isneginf(scores).all(axis=-1, keepdims=True)
    probs = softmax(np.where(dead, 0.0, scores), axis=-1)
    return np.where(dead, 0.0, probs @ v)


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive"])
def test_golden_matches_numpy_reference(kind, make_qkv):
    q, k, v = make_qkv(13, 21, 8, 5, dtype=torch.float64, seed=1)
    attn_mask, causal = make_mask(kind, 13, 21, dtype=torch.float64, seed=1)
    keep = np.ones((13, 21), dtype=bool)
    bias = np.zeros((1, 1, 13, 21))
    if causal:
        keep = np.tril(keep)
    elif kind == "bool":
        keep = attn_mask.numpy()
    elif kind == "additive":
        bias = np.where(np.isneginf(attn_mask.numpy()), 0.0, attn_mask.numpy())
        keep = ~np.isneginf(attn_mask.numpy())
    # golden upcasts fp32 inputs: the oracle sees the same fp32-rounded values, in float64
    q, k, v = q.float(), k.float(), v.float()
    got = golden_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
    expected = _numpy_attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), keep, bias, 8**-0.5
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-13)
    if kind in ("bool", "additive"):
        assert (got[..., [0, 7], :] == 0).all()


def test_math_dtype_option_computes_in_that_dtype(make_qkv):
    q, k, v = make_qkv(37, 53, 16, dtype=torch.bfloat16)
    golden = golden_attention(q, k, v, is_causal=True)
    out = get_kernel("math:dtype=fp64")(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, golden.to(torch.bfloat16), rtol=0, atol=0)
    plain = get_kernel("math")(q, k, v, is_causal=True)
    assert (plain.double() - golden).abs().max() > (out.double() - golden).abs().max()
