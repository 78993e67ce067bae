"""Memory layouts of a case's inputs: the same values, laid out as models hand them to kernels.

A kernel must give the same answer for every layout; one that reads its inputs as if they were
contiguous does not. ``fused_qkv`` fuses k and v alone where q's shape differs (v alone where its
head dim does); ``expanded_kv`` changes the values (every k/v head is the first; the golden follows).
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "LAYOUT_TEXT", "apply_layout"]

#: Every layout, in the order the catalogue and the random search use them.
LAYOUTS = ("contiguous", "bnhd", "fused_qkv", "expanded_kv", "offset", "kv_strides", "mixed")
#: What the kernel gets in each layout but ``contiguous`` (the catalogue's ``layout_*`` cases).
LAYOUT_TEXT = {
    "bnhd": "transposed views of (B, N, H, D) projections",
    "fused_qkv": "slices of one fused (B, N, 3, H, D) qkv projection",
    "expanded_kv": "k, v of one head expanded with stride 0 to every batch entry and head",
    "offset": "views at a non-zero storage offset",
    "kv_strides": "k contiguous, v a transposed (B, N, H, D) view: k and v with different strides",
    "mixed": "q a (B, N, H, D) view, k at a storage offset, v half of a fused k/v projection",
}
_OFFSET = 7  # elements before a view's first one in its buffer


def _bnhd(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, N, D)`` as a transposed view of a contiguous ``(B, N, H, D)`` copy."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _fused(*xs: torch.Tensor) -> list[torch.Tensor]:
    """Tensors of one ``(B, H, N, D)`` shape as slices of one ``(B, N, len(xs), H, D)`` buffer."""
    fused = torch.stack([x.transpose(1, 2) for x in xs], dim=2).contiguous()  # (B, N, n, H, D)
    return [fused[:, :, i].transpose(1, 2) for i in range(len(xs))]


def _offset(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous view starting ``_OFFSET`` elements into a larger buffer."""
    buffer = torch.zeros(x.numel() + 2 * _OFFSET, dtype=x.dtype, device=x.device)
    view = buffer[_OFFSET : _OFFSET + x.numel()].view(x.shape)
    view.copy_(x)
    return view


def apply_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k``, ``v`` laid out as ``layout`` (see the module docstring).

    Args:
        q, k, v: ``(B, H, N_q, D)``, ``(B, H_kv, N_k, D)``, ``(B, H_kv, N_k, D_v)``.
        layout: one of :data:`LAYOUTS`.

    Returns:
        Tensors of the same shapes and (except ``expanded_kv``, which repeats the first k/v head)
        the same values in the layout.

    Raises:
        ValueError: an unknown layout; the message lists them.
    """
    if layout == "contiguous":
        return q.contiguous(), k.contiguous(), v.contiguous()
    if layout == "bnhd":
        return _bnhd(q), _bnhd(k), _bnhd(v)
    if layout == "fused_qkv":
        if q.shape == k.shape == v.shape:
            q, k, v = _fused(q, k, v)
            return q, k, v
        if k.shape == v.shape:
            k, v = _fused(k, v)
            return _bnhd(q), k, v
        q_, k_ = _fused(q, k) if q.shape == k.shape else (_bnhd(q), _bnhd(k))
        return q_, k_, _bnhd(v)
    if layout == "expanded_kv":
        return q.contiguous(), k[:1, :1].expand(k.shape), v[:1, :1].expand(v.shape)  # batch 0's head 0
    if layout == "offset":
        return _offset(q), _offset(k), _offset(v)
    if layout == "kv_strides":
        return q.contiguous(), k.contiguous(), _bnhd(v)
    if layout == "mixed":
        return _bnhd(q), _offset(k), _fused(v, v)[1]
    raise ValueError(f"layout={layout!r} must be one of {', '.join(LAYOUTS)}")
