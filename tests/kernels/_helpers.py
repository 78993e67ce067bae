"""Helpers shared by the kernel tests: masks and the flash-attention noise-floor rule."""

from __future__ import annotations

import torch

__all__ = ["make_mask", "noise_floor_ok", "rounding_floor"]


def make_mask(
    kind: str, n_q: int, n_k: int, *, h: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0
):
    """A mask of ``kind`` for ``(1, h, n_q, n_k)`` scores, with fully masked query rows 0 and 7.

    Returns ``(attn_mask, is_causal)``: ``"none"`` → ``(None, False)``, ``"causal"`` →
    ``(None, True)``, ``"bool"`` → a ``(n_q, n_k)`` keep-mask broadcast over batch and heads,
    ``"additive"`` → a ``(1, h, n_q, n_k)`` finite bias with ``-inf`` at masked positions.
    """
    if kind == "none":
        return None, False
    if kind == "causal":
        return None, True
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(n_q, n_k, generator=gen) < 0.7
    keep[[0, 7]] = False
    if kind == "bool":
        return keep, False
    bias = 2.0 * torch.randn(1, h, n_q, n_k, generator=gen, dtype=torch.float64)
    return bias.masked_fill(~keep, float("-inf")).to(dtype), False


def rounding_floor(golden: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attention's absolute floor: the rounding error of outputs of this size in ``dtype``."""
    g = golden.to(dtype)
    return (g + 0.3 - 0.3 - g).abs().max().item()


def noise_floor_ok(out: torch.Tensor, baseline: torch.Tensor, golden: torch.Tensor) -> tuple[bool, str]:
    """flash-attention's rule: ``max|out − golden| ≤ 2·max|baseline − golden| + rounding floor``.

    Returns ``(passed, description)``; NaN anywhere fails.
    """
    err = (out.double() - golden).abs().max().item()
    base = (baseline.double() - golden).abs().max().item()
    floor = rounding_floor(golden, out.dtype)
    bound = 2 * base + floor
    return err <= bound, f"max err {err:.3g} vs bound {bound:.3g} (baseline {base:.3g}, floor {floor:.3g})"
