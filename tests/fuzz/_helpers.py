"""Helpers of the fuzz tests: catalogue inputs, logits recomputed independently, defective kernels."""

from __future__ import annotations

import math

import torch

from flashprobe import KernelUnavailableError, math_attention
from flashprobe.fuzz import CATALOGUE, CaseInputs

#: flashprobe's FlashAttention re-implementation with FlashInfer's old −5e4 sentinel.
SENTINEL_KERNEL = "tiled:mask_value=-5e4"


def case(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> CaseInputs:
    """The inputs of catalogue case ``name``."""
    return CATALOGUE[name].build(dtype, seed=seed)


def scale_of(inputs: CaseInputs) -> float:
    """The softmax scale the case passes (``1/sqrt(D)`` when ``None``)."""
    return 1 / math.sqrt(inputs.q.shape[-1]) if inputs.scale is None else inputs.scale


def logits64(inputs: CaseInputs) -> torch.Tensor:
    """Scaled logits ``(B, H, N_q, N_k)`` of the cast inputs in float64, computed apart from the fuzzer."""
    q, k = inputs.q.double(), inputs.reference_kv()[0].double()
    return torch.einsum("bhqd,bhkd->bhqk", q, k) * scale_of(inputs)


def naive_softmax(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """softmax without the fully-masked-row guard: NaN for rows that see no key."""
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def falsy_scale(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """The `scale or default` bug: scale=0.0 silently becomes 1/sqrt(d)."""
    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale or None)


def masked_mean(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Fully masked rows get the mean of v instead of 0."""
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    dead = (out == 0).all(-1, keepdim=True)
    return torch.where(dead, v.mean(-2, keepdim=True), out)


def unavailable(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Never runs here."""
    raise KernelUnavailableError("needs a TPU")


def crashes(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Raises an ordinary error."""
    raise RuntimeError("index out of range")


def in_place(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct output, but zeroes q."""
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    q.zero_()
    return out


def gqa_capable(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Repeats k/v heads itself: supports grouped-query attention."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
