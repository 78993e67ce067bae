"""The shrinker keeps a failure's point: a NaN in rows that see keys is never shrunk to a call whose
only failure is a fully masked row (a convention case: torch returns 0 there, other kernels NaN)."""

from __future__ import annotations

import torch

from flashprobe import register_kernel
from flashprobe.formats.reproducer import Reproducer
from flashprobe.probing.repro import replay, shrink_reproducer

BLOCK = 4


def _first_block_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Online softmax over key blocks of 4 with the classic bug: the running max starts at -inf and a
    fully masked first block makes ``exp(-inf - -inf)`` NaN, for every row whose first block is masked."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    m = torch.full(s.shape[:-1], float("-inf"))
    den = torch.zeros(s.shape[:-1])
    acc = torch.zeros(*s.shape[:-1], v.shape[-1])
    for j in range(0, s.shape[-1], BLOCK):
        sb = s[..., j : j + BLOCK]
        m_new = torch.maximum(m, sb.amax(-1))
        alpha = torch.exp(m - m_new)  # the bug: NaN while m and m_new are both -inf
        p = torch.exp(sb - m_new[..., None])
        den = den * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[..., j : j + BLOCK, :].float()
        m = m_new
    return (acc / den[..., None]).to(q.dtype)


def _left_padded_call() -> Reproducer:
    """Batch entry 1's first 4 keys are padding; every row still sees 12 keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, 16, generator=g)
    k, v = (torch.randn(2, 2, 16, 16, generator=g) for _ in range(2))
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[1, ..., :BLOCK] = False
    return Reproducer(q, k, v, mask, None, False, None, {"dtype": "float32"})


def test_a_first_block_nan_is_not_shrunk_to_a_fully_masked_row() -> None:
    register_kernel("first_block_nan", _first_block_nan)  # unregistered by tests/conftest.py
    call = _left_padded_call()
    assert replay(call, ["first_block_nan"])["first_block_nan"]["verdict"] == "fail"
    small, tries = shrink_reproducer(call, "first_block_nan")
    assert tries > 1 and small.q.numel() < call.q.numel()
    mask = small.attn_mask.expand(*small.q.shape[:-1], small.k.shape[2])
    assert mask.any(-1).all(), "shrunk to a call with a fully masked row"
    # the shrunk call still shows the bug: NaN in a row that sees keys; the torch reference does not
    out = _first_block_nan(small.q, small.k, small.v, attn_mask=small.attn_mask)
    assert out.isnan().any() and replay(small, ["sdpa_math"])["sdpa_math"]["verdict"] == "pass"
