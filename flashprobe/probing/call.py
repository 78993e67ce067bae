"""One ``scaled_dot_product_attention`` call, adapted to the kernels' convention.

:class:`SdpaCall` holds one call's arguments by name; :func:`prepare` brings them to ``(B, H, N, D)``
tensors in one dtype (:class:`Prepared`); :func:`run_kernel` runs a kernel with SDPA's semantics and
layout. :data:`ORIGINAL_SDPA` is torch's own SDPA, saved before anything replaces it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from flashprobe.kernels import ANY_CAPABILITIES, Kernel, KernelOutputError, mask_kind, output_problem
from flashprobe.kernels.reference import expand_kv

__all__ = [
    "ORIGINAL_SDPA",
    "Prepared",
    "SdpaCall",
    "autocast_dtype",
    "autocast_off",
    "expand_kv",
    "prepare",
    "run_kernel",
]

#: torch's SDPA as it was when flashprobe was imported (restored after every detach).
ORIGINAL_SDPA: Callable[..., torch.Tensor] = F.scaled_dot_product_attention


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """The arguments of one ``scaled_dot_product_attention`` call, in SDPA's order, so
    ``SdpaCall(*args, **kwargs)`` binds them: ``query (..., N_q, D)``, ``key (..., N_k, D)``,
    ``value (..., N_k, D_v)`` (with ``enable_gqa`` key/value may have fewer heads)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    def replace(self, **changes: Any) -> SdpaCall:
        return dataclasses.replace(self, **changes)

    def detached(self) -> SdpaCall:
        """The same call on detached tensors (no autograd history; same storage)."""
        mask = self.attn_mask.detach() if isinstance(self.attn_mask, torch.Tensor) else self.attn_mask
        return self.replace(
            query=self.query.detach(), key=self.key.detach(), value=self.value.detach(), attn_mask=mask
        )

    def original(self) -> torch.Tensor:
        """Run torch's own SDPA with exactly these arguments (what the model would have got)."""
        return ORIGINAL_SDPA(
            self.query,
            self.key,
            self.value,
            attn_mask=self.attn_mask,
            dropout_p=self.dropout_p,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
        )


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in for input ``t`` under torch's autocast rule (float64 is not cast)."""
    if _autocast_on(t.device.type) and t.is_floating_point() and t.dtype != torch.float64:
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast support
        return False


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Disable autocast for ``device_type`` inside the block (no-op when it is off)."""
    on = _autocast_on(device_type)
    return torch.autocast(device_type, enabled=False) if on else contextlib.nullcontext()


def _to_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x
    if x.dim() < 4:
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    return x.reshape(-1, *x.shape[-3:])


class Prepared(NamedTuple):
    """A call brought to the references' convention (:func:`prepare`,
    :func:`flashprobe.probing.direct.prepare_call`).

    Attributes:
        q: ``(B, H, N_q, D)`` in the compute dtype (the autocast dtype under autocast).
        k: ``(B, H_kv, N_k, D)``; ``H_kv = H / rep`` under grouped-query attention.
        v: ``(B, H_kv, N_k, D_v)``.
        attn_mask: bool or additive mask broadcastable to ``(B, H, N_q, N_k)``, 4-D, or None.
        is_causal: top-left causal mask.
        scale: softmax scale or None.
        rep: query heads per key/value head (1 without GQA).
        dtype: the dtype the verdict's limits are taken at (an FP8 or merged call's tensors are wider).
        terms: the logical :class:`~flashprobe.kernels.AttentionCall` whose terms beyond SDPA's each
            reference block gets, or None for an SDPA call.
        lse_base: the base of the LSE the primary returned (``"e"`` or 2), or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    rep: int
    dtype: torch.dtype
    terms: Any = None
    lse_base: str | int | None = None

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """Shape of the 4-D output, ``(B, H, N_q, D_v)``."""
        return (self.q.shape[0], self.q.shape[1], self.q.shape[2], self.v.shape[3])


def prepare(call: SdpaCall, dtype: torch.dtype | None = None) -> Prepared:
    """Cast to the compute dtype (default :func:`autocast_dtype`) and reshape to 4-D, differentiably.

    Raises:
        ValueError: ``enable_gqa`` with query heads that are no multiple of the key/value heads.
    """
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    dtype = dtype or autocast_dtype(q)
    if q.dim() > 4 and mask is not None:
        mask = mask.expand(*q.shape[:-2], q.shape[-2], k.shape[-2])
        mask = mask.reshape(-1, q.shape[-3], q.shape[-2], k.shape[-2])
    q4, k4, v4 = (_to_4d(t).to(dtype) for t in (q, k, v))
    if mask is not None:
        mask = _to_4d(mask)
        if mask.is_floating_point():
            mask = mask.to(dtype)
    rep = 1
    if call.enable_gqa and k4.shape[1] != q4.shape[1]:
        if not k4.shape[1] or q4.shape[1] % k4.shape[1]:  # (else no head would be compared at all)
            raise ValueError(
                f"enable_gqa=True with {q4.shape[1]} query heads and {k4.shape[1]} key/value heads: the "
                "query heads must be a multiple of the key/value heads"
            )
        rep = q4.shape[1] // k4.shape[1]
    return Prepared(q4, k4, v4, mask, bool(call.is_causal), call.scale, rep, dtype)


def run_kernel(kernel: Kernel, call: SdpaCall) -> torch.Tensor:
    """Run ``kernel`` with SDPA's semantics (autocast, any leading dims, GQA, mask, scale; no dropout),
    adapted to its declared contract as the fuzzer does (native GQA, a bool mask as additive).

    Returns:
        The output in SDPA's layout: ``query.shape[:-1] + (D_v,)``.
    """
    p = prepare(call)
    caps = kernel.capabilities
    native = caps is not ANY_CAPABILITIES and caps.gqa == "native"
    k, v = (p.k, p.v) if native else expand_kv(p.k, p.v, p.rep)
    mask = p.attn_mask
    additive_only = "float" in caps.masks and "bool" not in caps.masks
    if mask is not None and mask.dtype == torch.bool and additive_only:
        padding = mask_kind(mask) == "key_padding" and "key_padding" in caps.masks
        mask = mask if padding else torch.where(mask, 0.0, float("-inf")).to(p.dtype)
    with autocast_off(p.q.device.type):
        out = kernel(p.q, k, v, attn_mask=mask, is_causal=p.is_causal, scale=p.scale)
    problem = output_problem(out, p.q, v, kernel.spec)
    if problem is not None:
        raise KernelOutputError(f"flashprobe: {problem}")
    return out.reshape(*call.query.shape[:-1], call.value.shape[-1])
