"""Kernels for the fuzz axes of issue 38: a shape-limited blockwise kernel, and one bug per new axis.

:func:`blockwise_attention` is a kernel written the way Triton attention kernels are: key blocks of
128, an online softmax in fp32, causal or key-padding masks only; registered with the limits such
kernels declare (:data:`TRITON_LIKE`: ``N_q = N_k``, lengths multiples of 128, head dims 32/64/128,
a backward only when causal). With ``first_block_nan`` it has the bug the issue found in a real one:
no guard for a key block in which every key is masked, so a row whose first block is fully masked
gets ``exp(-inf - (-inf)) = NaN``.

Each :class:`AxisMutant` is one bug of a class the new axes exist for, with the case that must catch
it. They follow plain attention (:func:`flashprobe.math_attention` semantics) except for their bug.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashprobe import math_attention
from flashprobe.kernels import KernelCapabilities

__all__ = ["AXIS_MUTANTS", "TRITON_LIKE", "AxisMutant", "axis_mutant", "blockwise_attention"]

BLOCK = 128

#: the limits of a typical hand-written Triton attention kernel (issue 38's floor)
TRITON_LIKE = KernelCapabilities(
    masks=frozenset({"causal", "key_padding"}),
    seq_multiple=BLOCK,
    same_length=True,
    backward_masks=frozenset({"causal"}),
    head_dims=frozenset({32, 64, 128}),
)


def _valid(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """``(B, 1|H, N_q, N_k)`` bool: where a query may attend to a key."""
    n_q, n_k = q.shape[2], k.shape[2]
    valid = torch.ones(1, 1, n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        valid = valid & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        valid = valid & (mask if mask.dtype == torch.bool else mask > float("-inf"))
    return valid


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    first_block_nan: bool = False,
) -> torch.Tensor:
    """Online-softmax attention over key blocks of 128 in fp32 (differentiable by autograd).

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H_kv, N_k, D)``; v: ``(B, H_kv, N_k, D_v)``.
        attn_mask: a bool key-padding mask ``(B, 1, 1, N_k)``, or None.
        is_causal: top-left causal mask.
        scale: the softmax scale (``1/sqrt(D)`` when None).
        first_block_nan: the bug: no guard for a running max that is still ``-inf``.

    Returns:
        ``(B, H, N_q, D_v)`` in q's dtype; 0 for rows that see no key.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    valid = _valid(q, k, attn_mask, is_causal)
    q32, k32, v32 = q.float(), k.float(), v.float()
    shape = (*q.shape[:3], 1)
    m = q32.new_full(shape, float("-inf"))
    l = q32.new_zeros(shape)  # noqa: E741
    acc = q32.new_zeros(*q.shape[:3], v.shape[-1])
    for j in range(0, k.shape[2], BLOCK):
        s = torch.matmul(q32, k32[:, :, j : j + BLOCK].transpose(-2, -1)) * scale
        s = s.masked_fill(~valid[..., j : j + BLOCK], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        if not first_block_nan:  # a block whose keys are all masked so far: subtract 0, not -inf
            m_new = torch.where(torch.isneginf(m_new), 0.0, m_new)
        p = torch.exp(s - m_new)
        alpha = torch.exp(m - m_new)
        l = l * alpha + p.sum(-1, keepdim=True)  # noqa: E741
        acc = acc * alpha + torch.matmul(p, v32[:, :, j : j + BLOCK])
        m = m_new
    out = acc / torch.where(l == 0, 1.0, l)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# one bug per new axis


def _raw_sentinel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Masks with −5e4 and starts the running max at −5e4 on the *unscaled* scores q·kᵀ."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    raw = torch.matmul(q.float(), k.float().transpose(-2, -1))
    raw = raw.masked_fill(~_valid(q, k, attn_mask, is_causal), -5e4)
    m = raw.amax(-1, keepdim=True).clamp_min(-5e4)
    p = torch.exp((raw - m) * scale)
    p = torch.where(raw <= -5e4, 0.0, p)
    out = torch.matmul(p, v.float()) / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return out.to(q.dtype)


def _tail_reader(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Loads whole key tiles past N_k (unmasked loads) and zeroes their probabilities: 0 × NaN."""
    n_k = k.shape[2]
    full = -(-n_k // BLOCK) * BLOCK
    k_tile = k.as_strided((*k.shape[:2], full, k.shape[3]), k.stride(), k.storage_offset())
    v_tile = v.as_strided((*v.shape[:2], full, v.shape[3]), v.stride(), v.storage_offset())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k_tile.float().transpose(-2, -1)) * scale
    valid = torch.zeros(*s.shape[:2], 1, full, dtype=torch.bool)
    valid[..., :n_k] = True
    if attn_mask is not None:
        pad = attn_mask.new_zeros(*attn_mask.shape[:-1], full - n_k)
        valid = valid & torch.cat([attn_mask, pad], dim=-1)
    s = s.masked_fill(~valid, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v_tile.float()).to(q.dtype)  # p = 0 past N_k, v there is the poison


def _nan_swallowed(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """A fully-masked-row guard that also catches NaN rows: NaN becomes 0."""
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return torch.nan_to_num(out, nan=0.0)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class _ScratchAttention(torch.autograd.Function):
    """Plain attention in fp32 with an explicit backward that has one of two output-gradient bugs."""

    @staticmethod
    def forward(ctx: Any, q, k, v, scale, causal, bug):  # type: ignore[override]
        s = torch.matmul(q, k.transpose(-2, -1)) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        p = torch.softmax(s, dim=-1)
        out = torch.matmul(p, v)
        ctx.save_for_backward(q, k, v, p, out)
        ctx.scale, ctx.bug = scale, bug
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor):  # type: ignore[override]
        q, k, v, p, out = ctx.saved_tensors
        if ctx.bug == "contiguous_do":  # reads dO's memory as if it were contiguous (B, H, N, D)
            d_out = d_out.as_strided(d_out.shape, _contiguous_strides(d_out.shape), d_out.storage_offset())
        d_out = d_out.float()
        dp = torch.matmul(d_out, v.transpose(-2, -1))
        ds = p * (dp - (d_out * out).sum(-1, keepdim=True))
        if ctx.bug == "fp16_scratch":  # dP and dS kept in fp16's range: overflow to Inf, flush to 0
            dp_big = dp.abs() > torch.finfo(torch.float16).max
            ds = torch.where(ds.abs() < torch.finfo(torch.float16).tiny * 2**-10, 0.0, ds)
            ds = torch.where(dp_big, float("inf"), ds)
        dv = torch.matmul(p.transpose(-2, -1), d_out)
        dq = torch.matmul(ds, k) * ctx.scale
        dk = torch.matmul(ds.transpose(-2, -1), q) * ctx.scale
        return dq, dk, dv, None, None, None


def _scratch(bug: str):
    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        if attn_mask is not None:
            raise NotImplementedError("the output-gradient mutants take no attn_mask")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = _ScratchAttention.apply(q.float(), k.float(), v.float(), scale, is_causal, bug)
        return out.to(q.dtype)

    return kernel


def _float_offsets(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Gathers k through element offsets computed in fp32: wrong past 2^24 elements."""
    index = torch.arange(k.numel(), dtype=torch.float32).long().clamp_max(k.numel() - 1)  # 2^24+1 → 2^24
    k = k.contiguous().reshape(-1)[index].view(k.shape)
    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


@dataclass(frozen=True)
class AxisMutant:
    """One bug of a new fuzz axis.

    Attributes:
        name: the registered kernel's name.
        text: the class of real bug it stands for.
        case: the catalogue case that must catch it.
        dtype: the dtype it is checked at.
        failure: the expected failure kind, or its prefix.
    """

    name: str
    text: str
    case: str
    dtype: str
    failure: str


def axis_mutant(name: str) -> Any:
    """The kernel function of mutant ``name``."""
    return _KERNELS[name]


_KERNELS = {
    "first_block_nan": lambda q, k, v, **kw: blockwise_attention(q, k, v, first_block_nan=True, **kw),
    "raw_sentinel": _raw_sentinel,
    "tail_reader": _tail_reader,
    "nan_swallowed": _nan_swallowed,
    "contiguous_do": _scratch("contiguous_do"),
    "fp16_scratch": _scratch("fp16_scratch"),
    "float_offsets": _float_offsets,
}

#: One mutant per new axis, with the case that catches it.
AXIS_MUTANTS: tuple[AxisMutant, ...] = (
    AxisMutant("first_block_nan", "NaN if a first key block is masked", "left_padding", "fp32", "nonfinite"),
    AxisMutant("raw_sentinel", "−5e4 sentinel on unscaled q·kᵀ", "raw_sentinel_5e4", "fp32", "zeros"),
    AxisMutant("tail_reader", "unmasked loads of a tail tile: 0 × NaN", "poisoned_nan", "fp32", "nonfinite"),
    AxisMutant("nan_swallowed", "a NaN row returned as 0", "nan_inputs", "fp32", "nan_hidden"),
    AxisMutant("contiguous_do", "dO read as contiguous", "grad_out_transposed", "fp32", "d"),
    AxisMutant("fp16_scratch", "dS flushed below fp16's subnormals", "grad_out_tiny", "fp32", "d"),
    AxisMutant("fp16_scratch", "dP overflows fp16's range", "grad_out_huge", "fp32", "d"),
    AxisMutant("float_offsets", "element offsets in fp32", "offsets_2e24", "fp32", "values"),
)  # fmt: skip
