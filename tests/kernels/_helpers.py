"""Helpers shared by the kernel tests: masks.

Accuracy is judged by the one rule (:mod:`flashprobe.judge`) through
:func:`flashprobe.fuzz.rule.check_output`, its reported 2x tolerance floored as flash-attention's tests
floor theirs, by :func:`flashprobe.fuzz.rule.rounding_floor` (the rounding error of the golden output
in the dtype), tighter than the fuzzer's ``eps(dtype) · max|v|``.
"""

from __future__ import annotations

import torch

__all__ = ["make_mask"]


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
