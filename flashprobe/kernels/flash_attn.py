"""Adapter for Dao-AILab's ``flash-attn`` package (CUDA only, optional ``cuda`` extra).

flash-attn takes ``(B, N, H, D)`` tensors in fp16/bf16 and aligns its causal mask to the
bottom-right when ``N_q != N_k``. This adapter keeps flashprobe's ``(B, H, N, D)`` layout; since
flash-attn's dense API takes no mask, causal calls with ``N_q != N_k`` (where the two conventions
differ) are rejected with an explanation. The package is imported lazily, at the first call.
"""

from __future__ import annotations

from typing import Any

import torch

from flashprobe.kernels._inputs import check_inputs
from flashprobe.kernels.registry import KernelUnavailableError, register_kernel

__all__ = ["flash_attn_attention"]

_INSTALL = (
    "install the CUDA extra on a machine with a CUDA toolchain: "
    "pip install 'flashprobe[cuda]' (builds Dao-AILab flash-attn)"
)


def _import_flash_attn() -> Any:
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise KernelUnavailableError(
            f"flash_attn: the flash-attn package is not installed ({err}); {_INSTALL}"
        ) from None
    return flash_attn_func


def _check(device: torch.device, dtype: torch.dtype) -> None:
    if device.type != "cuda":
        raise KernelUnavailableError(
            f"flash_attn: Dao-AILab flash-attn runs only on CUDA devices, not {device.type}; "
            "on CPU use sdpa_flash (torch's fused flash kernel) or tiled; on a CUDA machine "
            "install the CUDA extra: pip install 'flashprobe[cuda]'"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        raise KernelUnavailableError(
            f"flash_attn: flash-attn supports only fp16 and bf16, not {dtype}; "
            "run the model in autocast or cast q, k, v"
        )
    _import_flash_attn()


@register_kernel("flash_attn", check=_check)
def flash_attn_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Dao-AILab flash-attn (``flash_attn_func``), CUDA fp16/bf16 only.

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H, N_k, D)``; v: ``(B, H, N_k, D)``.
        attn_mask: not supported by flash-attn's dense API: must be None.
        is_causal: causal mask; with ``N_q != N_k`` flash-attn aligns it bottom-right, unlike
            torch SDPA, so that case is rejected.
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(B, H, N_q, D)`` in the inputs' dtype.

    Raises:
        KernelUnavailableError: not on CUDA, wrong dtype, package missing, a mask was given,
            D_v != D, or causal with N_q != N_k.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="flash_attn")
    _check(q.device, q.dtype)
    if attn_mask is not None:
        raise KernelUnavailableError(
            "flash_attn: flash-attn's dense API takes no attn_mask; use is_causal, or a kernel "
            "with mask support (sdpa_flash, sdpa_efficient, tiled)"
        )
    if v.shape[-1] != q.shape[-1]:
        raise KernelUnavailableError(
            f"flash_attn: flash-attn needs v's head dim ({v.shape[-1]}) to equal q's ({q.shape[-1]}); "
            "use sdpa_math or tiled for D_v != D"
        )
    if is_causal and q.shape[-2] != k.shape[-2]:
        raise KernelUnavailableError(
            "flash_attn: causal with N_q != N_k is aligned bottom-right by flash-attn but "
            "top-left by torch SDPA; compare such shapes with sdpa kernels instead"
        )
    flash_attn_func = _import_flash_attn()
    out = flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),  # (B, N, H, D)
        softmax_scale=scale,
        causal=is_causal,
    )
    return out.transpose(1, 2)  # (B, H, N_q, D)
