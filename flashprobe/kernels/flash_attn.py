"""Adapter for Dao-AILab's ``flash-attn`` package (CUDA only, optional ``cuda`` extra).

flash-attn takes ``(B, N, H, D)`` fp16/bf16 tensors; this adapter keeps flashprobe's ``(B, H, N, D)``.
Grouped heads pass natively; a bool key-padding mask takes the varlen path
(``flash_attn_varlen_func`` on each entry's real keys); other masks, causal with ``N_q != N_k``
(flash-attn aligns it bottom-right) and head dims flash-attn lacks are refused. The package is
imported at the first call.
"""

from __future__ import annotations

from typing import Any

import torch

from flashprobe.kernels._inputs import check_inputs
from flashprobe.kernels.registry import Kernel, KernelCapabilities, KernelUnavailableError, register_kernel

__all__ = ["flash_attn_attention"]

_INSTALL = (
    "install the CUDA extra on a machine with a CUDA toolchain: "
    "pip install 'flashprobe[cuda]' (builds Dao-AILab flash-attn)"
)


def _import_flash_attn(varlen: bool = False) -> Any:
    """flash-attn's ``flash_attn_func`` (``flash_attn_varlen_func`` with ``varlen``), or a refusal."""
    try:
        if varlen:
            from flash_attn import flash_attn_varlen_func as fn
        else:
            from flash_attn import flash_attn_func as fn
    except ImportError as err:
        raise KernelUnavailableError(
            f"flash_attn: the flash-attn package is not installed ({err}); {_INSTALL}"
        ) from None
    return fn


def _key_padding(mask: torch.Tensor, b: int, n_q: int, n_k: int) -> torch.Tensor:
    """The ``(B, N_k)`` bool real-key mask of a key-padding ``attn_mask``, or a refusal."""
    if mask.dtype != torch.bool:
        raise KernelUnavailableError(
            "flash_attn: an additive float mask has no flash-attn equivalent; pass a bool key-padding "
            "mask, or use sdpa_flash, sdpa_efficient or tiled"
        )
    full = mask.expand(b, -1, n_q, n_k) if mask.dim() == 4 else mask.expand(b, 1, n_q, n_k)
    keys = full[:, 0, 0, :]
    if not bool((full == keys[:, None, None, :]).all()):
        raise KernelUnavailableError(
            "flash_attn: only key-padding masks (the same keys masked for every head and query) map to "
            "flash-attn's varlen path; use sdpa_flash, sdpa_efficient or tiled for other masks"
        )
    return keys


def _varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """``flash_attn_varlen_func`` over each batch entry's real keys (queries all kept)."""
    flash_attn_varlen_func = _import_flash_attn(varlen=True)
    b, h, n_q, d = q.shape
    lengths_k = keys.sum(dim=1, dtype=torch.int32)
    cu_k = torch.nn.functional.pad(lengths_k.cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = torch.arange(0, (b + 1) * n_q, n_q, dtype=torch.int32, device=q.device)
    q_packed = q.transpose(1, 2).reshape(b * n_q, h, d)
    k_packed = k.transpose(1, 2)[keys]  # (total real keys, H_kv, D)
    v_packed = v.transpose(1, 2)[keys]
    out = flash_attn_varlen_func(
        q_packed, k_packed, v_packed, cu_q, cu_k, n_q, int(lengths_k.max()), softmax_scale=scale
    )
    return out.view(b, n_q, h, v.shape[-1]).transpose(1, 2)


def _installed(device: torch.device, dtype: torch.dtype) -> None:
    """The registered check: the package is installed."""
    _import_flash_attn()


#: flash-attn 2's limits (its README): sm80+, fp16/bf16, head dims up to 256 (multiples of 8 here),
#: D_v == D, native GQA, causal bottom-right, key padding through the varlen path; with a backward.
FLASH_ATTN_CAPABILITIES = KernelCapabilities(
    masks=frozenset({"causal", "key_padding"}),
    causal_cross=False,
    gqa="native",
    max_head_dim=256,
    head_dim_multiple=8,
    value_head_dim=False,
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    devices=frozenset({"cuda"}),
    min_cuda_capability=(8, 0),
    install=_INSTALL,
)


@register_kernel("flash_attn", check=_installed, capabilities=FLASH_ATTN_CAPABILITIES)
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

    ``q (B, H, N_q, D)``, ``k``, ``v`` ``(B, H_kv, N_k, D)`` → ``(B, H, N_q, D)``; ``attn_mask`` None
    or a bool key-padding mask.

    Raises:
        KernelUnavailableError: what flash-attn cannot run (module docstring), or the package missing.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="flash_attn", gqa=True)
    Kernel("flash_attn").check(q.device, q.dtype)  # the raw function may be called without a Kernel
    d = q.shape[-1]
    if d > 256 or d % 8:
        raise KernelUnavailableError(
            f"flash_attn: flash-attn supports head dims up to 256 that are multiples of 8, not {d}"
        )
    keys = None
    if attn_mask is not None:
        keys = _key_padding(attn_mask, q.shape[0], q.shape[-2], k.shape[-2])
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
    if keys is not None:
        return _varlen(q, k, v, keys, scale)
    flash_attn_func = _import_flash_attn()
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, N, H, D)
    return flash_attn_func(q, k, v, softmax_scale=scale, causal=is_causal).transpose(1, 2)  # (B, H, N_q, D)
