"""Bad inputs get a KernelInputError (a ValueError) naming the problem, from every kernel."""

from __future__ import annotations

import pytest
import torch

from flashprobe.kernels import KernelInputError, check_inputs, get_kernel, to_dtype

KERNELS = ["math", "tiled", "sdpa_flash", "sdpa_math", "flash_attn"]


def _qkv(**shapes):
    base = {"q": (1, 2, 5, 8), "k": (1, 2, 7, 8), "v": (1, 2, 7, 8)}
    base.update(shapes)
    return [torch.zeros(base[n]) for n in "qkv"]


BAD_INPUTS = [
    ("rank", _qkv(q=(2, 5, 8)), {}, r"q must have shape \(B, H, N, D\), got \(2, 5, 8\) \(3 dims\)"),
    ("heads", _qkv(k=(1, 3, 7, 8), v=(1, 3, 7, 8)), {}, "head counts differ: q 2, k 3, v 3"),
    ("batch", _qkv(v=(2, 2, 7, 8)), {}, "batch sizes differ: q 1, k 1, v 2"),
    ("head_dim", _qkv(k=(1, 2, 7, 6)), {}, r"head dims of q \(8\) and k \(6\) differ"),
    ("kv_len", _qkv(v=(1, 2, 6, 8)), {}, "k has 7 keys but v has 6 values"),
    ("mask_shape", _qkv(), {"attn_mask": torch.ones(5, 6, dtype=torch.bool)}, r"attn_mask of shape \(5, 6\)"),
    (
        "mask_rank",
        _qkv(),
        {"attn_mask": torch.ones(3, 1, 1, 5, 7, dtype=torch.bool)},
        r"\(B, H, N_q, N_k\) = ",
    ),
    ("mask_dtype", _qkv(), {"attn_mask": torch.ones(5, 7, dtype=torch.int64)}, "attn_mask must be bool"),
    ("mask_causal", _qkv(), {"attn_mask": torch.ones(5, 7, dtype=torch.bool), "is_causal": True}, "not both"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    ("qkv", "kwargs", "message"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_inputs_are_named(kernel, qkv, kwargs, message):
    with pytest.raises(KernelInputError, match=message) as err:
        get_kernel(kernel)(*qkv, **kwargs)
    assert str(err.value).startswith(f"{kernel}: ")


@pytest.mark.parametrize("kernel", KERNELS)
def test_mixed_dtypes_and_integer_inputs(kernel):
    q, k, v = _qkv()
    with pytest.raises(KernelInputError, match=r"q, k, v must share one dtype.*cast them"):
        get_kernel(kernel)(q, k.double(), v)
    with pytest.raises(KernelInputError, match=r"k must be floating point, got torch.int64"):
        get_kernel(kernel)(q, k.long(), v)
    with pytest.raises(KernelInputError, match=r"v must be a torch.Tensor, got list"):
        get_kernel(kernel)(q, k, [0.0])
    assert issubclass(KernelInputError, ValueError)


def test_to_dtype_names_and_errors():
    assert to_dtype("bf16") is torch.bfloat16 and to_dtype("torch.float16") is torch.float16
    assert to_dtype("FP32") is torch.float32 and to_dtype(None) is None
    assert to_dtype(torch.float64) is torch.float64
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8'; use one of: .*bfloat16"):
        to_dtype("fp8")
    with pytest.raises(ValueError, match=r"torch.int32 is not a floating dtype"):
        to_dtype(torch.int32)


def test_tiled_rejects_bad_options_at_call():
    q, k, v = _qkv()
    tiled = get_kernel("tiled").fn
    with pytest.raises(ValueError, match=r"loop='x' must be 'kv' or 'q'"):
        tiled(q, k, v, loop="x")
    with pytest.raises(ValueError, match=r"sram=16 must be an integer ≥ 4·d = 32"):
        tiled(q, k, v, sram=16)
    with pytest.raises(ValueError, match=r"mask_value=nan must be -inf or a finite number"):
        tiled(q, k, v, mask_value=float("nan"))


def test_check_inputs_accepts_grouped_query_heads_only_when_asked():
    q, kv = torch.zeros(1, 6, 4, 8), torch.zeros(1, 2, 5, 8)
    check_inputs(q, kv, kv, gqa=True)  # 3 query heads per k/v head
    with pytest.raises(KernelInputError, match="head counts differ: q 6, k 2, v 2"):
        check_inputs(q, kv, kv)
    odd = torch.zeros(1, 4, 5, 8)
    with pytest.raises(KernelInputError, match="head counts differ: q 6, k 4, v 4"):
        check_inputs(q, odd, odd, gqa=True)  # 4 does not divide 6
