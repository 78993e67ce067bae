"""``flex``: torch's FlexAttention behind the SDPA signature.

``flex`` runs :func:`torch.nn.attention.flex_attention.flex_attention` compiled with ``torch.compile``
(``flex:compile=false``: torch's eager, unfused implementation). ``is_causal`` becomes a causal
``mask_mod``, a bool ``attn_mask`` a ``mask_mod`` reading it, an additive mask a ``score_mod`` (its
``-inf`` entries also in the block mask), grouped heads ``enable_gqa``.

Lengths, batch and head counts compile dynamically; a bool or additive mask compiles per shape (torch
2.13's CPU template cannot compile a mod reading a dynamic-shape tensor). Past
:data:`RECOMPILE_LIMIT` variants a call is an error, never silent eager code. torch has no
FlexAttention backward on the CPU: such calls are refused.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from flashprobe.kernels.registry import KernelCapabilities, KernelUnavailableError, register_kernel

__all__ = ["FLEX_ORIGINAL", "flex_attention_kernel"]


def _flex_module() -> Any:
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:  # torch < 2.5
        raise KernelUnavailableError(
            f"flex: torch {torch.__version__} has no torch.nn.attention.flex_attention (needs torch >= 2.5)"
        ) from None
    return module


try:
    from torch.nn.attention.flex_attention import flex_attention as _torch_flex_attention

    #: ``flex_attention`` as torch defines it, captured at import (the probe swaps the name while it
    #: is attached); None on a torch without FlexAttention.
    FLEX_ORIGINAL: Any = _torch_flex_attention
except ImportError:  # torch < 2.5
    FLEX_ORIGINAL = None


def _original() -> Any:
    return FLEX_ORIGINAL if FLEX_ORIGINAL is not None else _flex_module().flex_attention


#: Compiled variants the one ``flex_attention`` frame may hold (torch's own limit, 8, would fall back
#: to eager code in silence; a fuzz run of the default catalogue needs over a hundred).
RECOMPILE_LIMIT = 512


@cache
def _compiled(dynamic: bool) -> Any:
    # fullgraph=True: a graph break, or RECOMPILE_LIMIT reached, is an error, never eager code.
    return torch.compile(_original(), dynamic=dynamic, fullgraph=True)


def _run_compiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any], *, reads_mask: bool
) -> torch.Tensor:
    """The compiled FlexAttention call: dynamic shapes unless a mod reads a mask tensor."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    try:
        limits = {"recompile_limit": RECOMPILE_LIMIT, "accumulated_recompile_limit": RECOMPILE_LIMIT}
        with torch._dynamo.config.patch(**limits):
            return _compiled(not reads_mask)(q, k, v, **kwargs)
    except FailOnRecompileLimitHit as error:
        raise RuntimeError(
            f"flex: torch.compile(flex_attention) reached {RECOMPILE_LIMIT} compiled variants in this "
            "process; past them torch would run eager code. Run fewer shapes, dtypes or masks per process, "
            "or flex:compile=false"
        ) from error


def _check(device: torch.device, dtype: torch.dtype, /, compile: bool = True) -> None:
    _flex_module()
    if device.type not in ("cpu", "cuda"):
        raise KernelUnavailableError(f"flex: FlexAttention runs on CPU and CUDA devices, not {device.type}")
    if compile and device.type == "cpu" and dtype == torch.float64:
        raise KernelUnavailableError(
            "flex: compiled FlexAttention on the CPU supports fp32, bf16 and fp16, not fp64 "
            "(flex:compile=false runs fp64 eagerly)"
        )


def _validate(compile: bool = True) -> None:
    if not isinstance(compile, bool):
        raise ValueError(f"flex: compile={compile!r} must be true or false")


def _mods(
    attn_mask: torch.Tensor | None, is_causal: bool, shape: tuple[int, int, int, int]
) -> tuple[Any, Any]:
    """``(score_mod, mask_mod)`` for SDPA's mask arguments on a ``(B, H, N_q, N_k)`` score grid."""
    b, h, n_q, n_k = shape
    keep = None
    score_mod = None
    if attn_mask is not None:
        mask = attn_mask.expand(b, h, n_q, n_k)  # broadcast views: indexed per (b, h, q, kv) below
        if mask.dtype == torch.bool:
            keep = mask
        else:
            bias = mask
            keep = bias > float("-inf")

            def score_mod(score, bb, hh, qi, ki):  # type: ignore[no-untyped-def]
                return score + bias[bb, hh, qi, ki].to(score.dtype)

    def mask_mod(bb, hh, qi, ki):  # type: ignore[no-untyped-def]
        allowed = qi >= ki if is_causal else qi >= 0
        if keep is not None:
            allowed = allowed & keep[bb, hh, qi, ki]
        return allowed

    return score_mod, (mask_mod if (is_causal or keep is not None) else None)


#: FlexAttention: CPU and CUDA, every mask, native GQA; no backward on the CPU.
FLEX_CAPABILITIES = KernelCapabilities(
    devices=frozenset({"cpu", "cuda"}), backward_devices=frozenset({"cuda"})
)


@register_kernel(
    "flex", capabilities=FLEX_CAPABILITIES, check=_check, validate=_validate,
    description="torch FlexAttention (compiled; compile=false: eager); forward only on the CPU",
)
def flex_attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    compile: bool = True,
) -> torch.Tensor:
    """FlexAttention on ``q (B, H, N_q, D)``, ``k (B, H_kv, N_k, D)``, ``v (B, H_kv, N_k, D_v)`` →
    ``(B, H, N_q, D_v)``; CPU tensors that require grad raise :class:`KernelUnavailableError`."""
    module = _flex_module()
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise KernelUnavailableError(
            f"flex: torch {torch.__version__} has no FlexAttention backward on the CPU; compare its forward "
            "(no_grad, or the fuzzer's --no-backward) or run it on a GPU"
        )
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    score_mod, mask_mod = _mods(attn_mask, is_causal, (b, h, n_q, n_k))
    block_mask = None
    if mask_mod is not None:
        block_mask = module.create_block_mask(mask_mod, b, h, n_q, n_k, device=q.device)
    kwargs = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale, "enable_gqa": k.shape[1] != h}
    if compile:
        return _run_compiled(q, k, v, kwargs, reads_mask=attn_mask is not None)
    import warnings

    with warnings.catch_warnings():  # the eager implementation is asked for: its warning is noise here
        warnings.filterwarnings("ignore", message=r".*flex_attention called without torch.compile")
        return _original()(q, k, v, **kwargs)
