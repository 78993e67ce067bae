"""torch SDPA pinned to one backend: ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``.

Each runs :func:`torch.nn.functional.scaled_dot_product_attention` inside
:func:`torch.nn.attention.sdpa_kernel` with exactly one backend enabled, so a backend that cannot
serve the inputs fails loudly instead of falling back. The efficient and cuDNN backends need CUDA.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashprobe.kernels._inputs import check_inputs
from flashprobe.kernels.registry import (
    ANY_CAPABILITIES,
    KernelCapabilities,
    KernelUnavailableError,
    register_kernel,
)

__all__ = ["BACKENDS", "sdpa_attention"]

#: Kernel name → torch SDPA backend.
BACKENDS: dict[str, SDPBackend] = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
_CUDA_ONLY = {"sdpa_efficient", "sdpa_cudnn"}

#: What each backend declares; what torch decides per device and shape is left to torch's refusal.
CAPABILITIES: dict[str, KernelCapabilities] = {
    "sdpa_flash": KernelCapabilities(devices=frozenset({"cpu", "cuda"})),
    "sdpa_efficient": KernelCapabilities(
        devices=frozenset({"cuda"}), dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32})
    ),
    "sdpa_cudnn": KernelCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        min_cuda_capability=(8, 0),
    ),
    "sdpa_math": ANY_CAPABILITIES,
}


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str = "sdpa_flash",
) -> torch.Tensor:
    """torch SDPA restricted to ``backend`` (of :data:`BACKENDS`): ``q (B, H, N_q, D)``,
    ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` → ``(B, H, N_q, D_v)``.

    Raises:
        KernelUnavailableError: the backend cannot serve these inputs on this device, with
            torch's reasons.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel=backend, gqa=True)
    if backend in _CUDA_ONLY and q.device.type != "cuda":
        raise KernelUnavailableError(
            f"{backend}: torch's {BACKENDS[backend].name} backend needs a CUDA device, inputs are "
            f"on {q.device.type}; on CPU use sdpa_flash or sdpa_math"
        )
    gqa = q.shape[1] != k.shape[1]
    # torch explains why a backend was not used only through warnings: record them for the error.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(BACKENDS[backend]):
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
                )
        except RuntimeError as err:
            reasons = "; ".join(str(w.message) for w in caught) or str(err)
            raise KernelUnavailableError(
                f"{backend}: torch's {BACKENDS[backend].name} backend cannot run these inputs "
                f"(q {tuple(q.shape)} {q.dtype} on {q.device}, mask "
                f"{None if attn_mask is None else attn_mask.dtype}, causal={is_causal}): {reasons}"
            ) from None
    for w in caught:  # a successful call's warnings reach the caller's filters unchanged
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


def _check(backend: str, device: torch.device, dtype: torch.dtype) -> None:
    x = torch.zeros(1, 1, 8, 16, device=device, dtype=dtype)
    sdpa_attention(x, x, x, backend=backend)


def _make(name: str) -> None:
    def kernel(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        return sdpa_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, backend=name)

    kernel.__name__ = name
    kernel.__doc__ = f"torch SDPA with only the {BACKENDS[name].name} backend enabled."
    register_kernel(name, kernel, check=partial(_check, name), capabilities=CAPABILITIES[name])


for _name in BACKENDS:
    _make(_name)
