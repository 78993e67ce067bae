"""Input validation and dtype names shared by every kernel.

Kernels follow torch SDPA's conventions: ``q (B, H, N_q, D)``, ``k (B, H, N_k, D)``,
``v (B, H, N_k, D_v)``; a bool ``attn_mask`` is True where a query may attend, a floating one is
added to the scaled scores, either broadcast to ``(B, H, N_q, N_k)``; ``is_causal`` is top-left
aligned; ``scale`` defaults to ``1 / sqrt(D)``; a fully masked row outputs zeros, never NaN.
"""

from __future__ import annotations

import math

import torch

from flashprobe.errors import FlashprobeError

__all__ = [
    "DTYPE_NAMES",
    "KernelInputError",
    "KernelOutputError",
    "causal_mask",
    "check_inputs",
    "default_scale",
    "dtype_name",
    "output_problem",
    "to_dtype",
]

#: Accepted spellings of the floating dtypes flashprobe works with.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}


class KernelInputError(ValueError, FlashprobeError):
    """Raised when the inputs of an attention kernel are malformed."""


class KernelOutputError(RuntimeError, FlashprobeError):
    """Raised when an attention kernel returns something other than a ``(B, H, N_q, D_v)`` tensor in
    its inputs' dtype and device."""


def output_problem(out: object, q: torch.Tensor, v: torch.Tensor, kernel: str) -> str | None:
    """Why ``out``, what ``kernel`` returned for ``q (B, H, N_q, D)`` and ``v (B, H_kv, N_k, D_v)``,
    is not a ``(B, H, N_q, D_v)`` tensor of ``q``'s dtype and device (None when it is)."""
    expected = (*q.shape[:-1], v.shape[-1])
    if not isinstance(out, torch.Tensor):
        return f"kernel {kernel!r} returned {type(out).__name__}, not a tensor; return the attention output"
    if tuple(out.shape) != expected:
        return (
            f"kernel {kernel!r} returned shape {tuple(out.shape)}, expected (B, H, N_q, D_v) = {expected} "
            "(the queries' shape with the values' head dim); check its output layout"
        )
    if out.dtype != q.dtype:
        return (
            f"kernel {kernel!r} returned {dtype_name(out.dtype)} for {dtype_name(q.dtype)} inputs; "
            "cast its output back to the inputs' dtype"
        )
    if out.device != q.device:
        return f"kernel {kernel!r} returned a tensor on {out.device} for inputs on {q.device}"
    return None


def to_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Turn a dtype name (``"bf16"``, ``"float32"``, ...) or a ``torch.dtype`` into a dtype.

    Raises:
        ValueError: the name is not a floating dtype flashprobe supports.
    """
    if value is None or isinstance(value, torch.dtype):
        if value is not None and not value.is_floating_point:
            raise ValueError(f"dtype {value} is not a floating dtype; use one of bf16, fp16, fp32, fp64")
        return value
    key = str(value).lower().removeprefix("torch.")
    if key not in DTYPE_NAMES:
        allowed = ", ".join(sorted(DTYPE_NAMES))
        raise ValueError(f"unknown dtype {value!r}; use one of: {allowed}")
    return DTYPE_NAMES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype: ``torch.bfloat16`` → ``"bf16"``."""
    return {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.float64: "fp64",
    }.get(dtype, str(dtype).removeprefix("torch."))


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: ``scale`` if given, else ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    *,
    kernel: str = "attention",
    gqa: bool = False,
) -> None:
    """Validate the shapes, dtypes and mask of an SDPA call (module docstring), naming ``kernel``;
    with ``gqa``, k and v may have ``H_kv`` heads dividing ``H``.

    Raises:
        KernelInputError: naming the problem and how to fix it.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KernelInputError(f"{kernel}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise KernelInputError(
                f"{kernel}: {name} must have shape (B, H, N, D), got {tuple(t.shape)} "
                f"({t.dim()} dims); reshape with .view(B, N, H, D).transpose(1, 2)"
            )
        if not t.is_floating_point():
            raise KernelInputError(f"{kernel}: {name} must be floating point, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise KernelInputError(
            f"{kernel}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
            "cast them with .to(dtype)"
        )
    if not (q.device == k.device == v.device):
        raise KernelInputError(
            f"{kernel}: q, k, v are on different devices: {q.device}, {k.device}, {v.device}"
        )
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise KernelInputError(
            f"{kernel}: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}"
        )
    grouped = gqa and k.shape[1] == v.shape[1] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
    if (q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]) and not grouped:
        raise KernelInputError(
            f"{kernel}: head counts differ: q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]}; "
            "repeat k/v heads for grouped-query attention (k.repeat_interleave(g, dim=1))"
        )
    if q.shape[-1] != k.shape[-1]:
        raise KernelInputError(
            f"{kernel}: head dims of q ({q.shape[-1]}) and k ({k.shape[-1]}) differ; they must match"
        )
    if k.shape[2] != v.shape[2]:
        raise KernelInputError(
            f"{kernel}: k has {k.shape[2]} keys but v has {v.shape[2]} values; they must match"
        )
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise KernelInputError(f"{kernel}: attn_mask must be a tensor or None")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise KernelInputError(
                f"{kernel}: attn_mask must be bool (True = attend) or floating (added to scores), "
                f"got {attn_mask.dtype}"
            )
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise KernelInputError(
                f"{kernel}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"(B, H, N_q, N_k) = {target}; use size 1 (or omit leading dims) to broadcast"
            )
        if attn_mask.device != q.device:
            raise KernelInputError(
                f"{kernel}: attn_mask is on {attn_mask.device} but q, k, v are on {q.device}; "
                "move it with attn_mask.to(q.device)"
            )
        if is_causal:
            raise KernelInputError(
                f"{kernel}: pass either attn_mask or is_causal=True, not both (as torch SDPA); "
                "fold the causal mask into attn_mask instead"
            )


def causal_mask(
    n_q: int,
    n_k: int,
    device: torch.device | str,
    q_start: int = 0,
    k_start: int = 0,
    q_len: int | None = None,
    k_len: int | None = None,
) -> torch.Tensor:
    """Top-left causal mask ``(q_len, k_len)`` (True where key index ≤ query index) of the block of
    the score matrix at ``(q_start, k_start)``; the lengths default to the rest of ``n_q``, ``n_k``."""
    q_len = n_q - q_start if q_len is None else q_len
    k_len = n_k - k_start if k_len is None else k_len
    qi = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(-1)
    ki = torch.arange(k_start, k_start + k_len, device=device).unsqueeze(0)
    return ki <= qi
