"""Adapter for FlashInfer's prefill kernel (CUDA only; ``pip install flashinfer-python``).

``flashinfer`` runs ``flashinfer.single_prefill_with_kv_cache`` once per batch entry on ``(N, H, D)``
views, grouped heads natively. A causal call with ``N_q != N_k`` is given as a custom top-left mask
(FlashInfer aligns bottom-right); a bool mask shared by every head becomes ``custom_mask``; additive
or per-head masks are refused. fp16/bf16, forward only. The package is imported at the first check.
"""

from __future__ import annotations

from typing import Any

import torch

from flashprobe.kernels._inputs import default_scale
from flashprobe.kernels.registry import Kernel, KernelCapabilities, KernelUnavailableError, register_kernel

__all__ = ["flashinfer_attention"]

_INSTALL = "pip install flashinfer-python (on a CUDA machine; see https://docs.flashinfer.ai)"


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as err:
        raise KernelUnavailableError(
            f"flashinfer: the flashinfer package is not installed ({err}); {_INSTALL}"
        ) from None
    return flashinfer


def _installed(device: torch.device, dtype: torch.dtype) -> None:
    """The registered check: the package is installed."""
    _import_flashinfer()


#: FlashInfer's prefill: fp16/bf16 on CUDA (sm75+), head dims its prebuilt kernels dispatch, D_v == D,
#: native GQA, causal and bool custom masks, no backward.
FLASHINFER_CAPABILITIES = KernelCapabilities(
    masks=frozenset({"causal", "bool", "key_padding"}),
    gqa="native",
    head_dims=frozenset({64, 128, 256}),
    value_head_dim=False,
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    devices=frozenset({"cuda"}),
    backward_devices=frozenset(),
    min_cuda_capability=(7, 5),
    install=_INSTALL,
)


@register_kernel(
    "flashinfer",
    description="FlashInfer single prefill (CUDA fp16/bf16, forward only)",
    check=_installed,
    capabilities=FLASHINFER_CAPABILITIES,
)
def flashinfer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``q (B, H, N_q, D)``, ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` → ``(B, H, N_q, D_v)``.

    Raises:
        KernelUnavailableError: not CUDA, not fp16/bf16, inputs that require grad, or a mask FlashInfer
            cannot take (additive, or different per head).
    """
    Kernel("flashinfer").check(q.device, q.dtype)  # the raw function may be called without a Kernel
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise KernelUnavailableError("flashinfer: FlashInfer has no backward; compare it forward only")
    flashinfer = _import_flashinfer()
    b, _, n_q, d = q.shape
    n_k = k.shape[2]
    mask = attn_mask
    if mask is not None:
        if mask.dtype != torch.bool:
            raise KernelUnavailableError(
                "flashinfer: an additive float mask has no FlashInfer equivalent; pass a bool mask"
            )
        mask = mask.expand(b, -1, n_q, n_k)
        if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
            raise KernelUnavailableError(
                "flashinfer: FlashInfer's custom mask is per batch entry, not per head"
            )
        mask = mask[:, 0]
    causal = is_causal
    if is_causal and n_q != n_k:  # FlashInfer aligns causal bottom-right: give SDPA's top-left mask
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril().expand(b, n_q, n_k)
        causal = False
    outs = [
        flashinfer.single_prefill_with_kv_cache(
            q[i].transpose(0, 1), k[i].transpose(0, 1), v[i].transpose(0, 1),
            custom_mask=None if mask is None else mask[i], causal=causal, kv_layout="NHD",
            sm_scale=default_scale(d, scale),
        ).transpose(0, 1)
        for i in range(b)
    ]
    return torch.stack(outs)
