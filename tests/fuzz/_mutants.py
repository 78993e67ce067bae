"""The mutation suite: attention kernels that each carry one bug of a class real kernels have shipped.

Every mutant is the same plain attention with an explicit backward (:class:`_Attention`, the flash
form: ``D = rowsum(dO ∘ O)``, ``dS = P ∘ (dP − D)``), computed in opmath (fp32, fp64 for fp64
inputs), with exactly one bug switched on; ``explicit`` is the same kernel with none, the control
that must pass. Each :class:`Mutant` names its bug class, the catalogue case of the default profile
that must catch it, the dtype it is checked at and the failure kind expected there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashprobe import math_attention

__all__ = ["MUTANTS", "Mutant", "explicit_attention"]

TILE = 128  # the key tile of the kernels whose bugs are mimicked
GRID_LIMIT = 1024  # the launch-grid limit of the large-grid bug


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _valid(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, bug: str
) -> torch.Tensor:
    """``(B, H, N_q, N_k)`` bool: where a query may attend to a key (with the mask bugs)."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[2]
    valid = torch.ones(b, h, n_q, n_k, dtype=torch.bool, device=q.device)
    if causal:
        shift = n_k - n_q if bug == "causal_bottom_right" else 0  # flash-attn's convention
        valid = valid & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(shift)
    if mask is not None:
        if mask.dim() == 4 and mask.shape[0] > 1 and bug == "mask_batch_broadcast":
            mask = mask[:1]  # the first batch entry's mask for every entry
        if mask.dtype == torch.bool:
            valid = valid & mask
        elif bug != "additive_mask_ignored":
            valid = valid & (mask > float("-inf"))
    return valid


def _bias(mask: torch.Tensor | None, bug: str, dtype: torch.dtype) -> torch.Tensor | float:
    if mask is None or mask.dtype == torch.bool or bug == "additive_mask_ignored":
        return 0.0
    return torch.where(mask > float("-inf"), mask.to(dtype), 0.0)


def _scores(q, k, mask, causal, scale, bug):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale + _bias(mask, bug, q.dtype)
    valid = _valid(q, k, mask, causal, bug)
    return s.masked_fill(~valid, float("-inf")), valid


def _softmax(s: torch.Tensor, bug: str) -> torch.Tensor:
    """Row softmax with torch's safe convention (a row that sees no key gives 0)."""
    if bug == "fully_masked_nan":
        return torch.softmax(s, dim=-1)  # NaN for a row of -inf
    if bug == "no_max_subtraction":
        e = torch.exp(s)
        return e / e.sum(-1, keepdim=True)
    if bug == "no_rescale":  # each key tile uses its own max, never rescaled to the row's
        tiles = []
        for j in range(0, s.shape[-1], TILE):
            part = s[..., j : j + TILE]
            m = part.amax(-1, keepdim=True)
            tiles.append(torch.where(torch.isfinite(m), torch.exp(part - m), 0.0))
        e = torch.cat(tiles, dim=-1)
        total = e.sum(-1, keepdim=True)
        return torch.where(total > 0, e / total, 0.0)
    m = s.amax(-1, keepdim=True)
    e = torch.where(torch.isfinite(m), torch.exp(s - m), 0.0)
    total = e.sum(-1, keepdim=True)
    return torch.where(total > 0, e / total.clamp_min(torch.finfo(s.dtype).tiny), 0.0)


class _Attention(torch.autograd.Function):
    """Attention on equal head counts with an explicit flash-form backward, in opmath."""

    @staticmethod
    def forward(ctx: Any, q, k, v, mask, causal, scale, bug):  # type: ignore[override]
        s, _ = _scores(q, k, mask, causal, scale, bug)
        p = _softmax(s, bug)
        out = torch.matmul(p, v)
        ctx.save_for_backward(q, k, v, out, p, mask)
        ctx.causal, ctx.scale, ctx.bug = causal, scale, bug
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, p, mask = ctx.saved_tensors
        bug, scale = ctx.bug, ctx.scale
        if bug == "backward_mask_ignored":  # P recomputed from unmasked scores
            p = _softmax(torch.matmul(q, k.transpose(-2, -1)) * scale, "")
        if bug == "fully_masked_backward_nan":  # P recomputed as exp(s − lse): NaN where lse = −inf
            s, _ = _scores(q, k, mask, ctx.causal, scale, "")
            p = torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))
        dv = torch.matmul(p.transpose(-2, -1), d_out)
        dp = torch.matmul(d_out, v.transpose(-2, -1))
        d = (d_out * out).sum(-1, keepdim=True)
        ds = p * (dp - d)
        if bug == "ds_bf16":
            ds = ds.to(torch.bfloat16).to(ds.dtype)
        dq = torch.matmul(ds, k) * (1.0 if bug == "dq_no_scale" else scale)
        dk = torch.matmul(ds.transpose(-2, -1), q) * scale
        n_k = k.shape[2]
        if bug == "dk_partial_tile_zero" and n_k % TILE:
            dk[:, :, n_k - n_k % TILE :] = 0.0
        if bug == "dq_nan_nk_mod_128_64" and n_k % TILE == 64:
            dq[..., -1, :] = float("nan")
        if bug == "dv_unnormalised":
            dv = torch.matmul((p * p.shape[-1]).transpose(-2, -1), d_out)
        return dq, dk, dv, None, None, None, None


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _read(x: torch.Tensor, bug: str) -> torch.Tensor:
    """How a buggy kernel reads an input: as contiguous memory, or from the start of the storage."""
    if bug == "strided_read":
        return x.as_strided(x.shape, _contiguous_strides(x.shape), x.storage_offset())
    if bug == "storage_offset_ignored":
        return x.as_strided(x.shape, x.stride(), 0)
    return x


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    bug: str = "",
) -> torch.Tensor:
    """Attention with an explicit backward and (``bug``) one planted bug; GQA-capable.

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H_kv, N_k, D)``; v: ``(B, H_kv, N_k, D_v)``.
        attn_mask: bool or additive, broadcastable to ``(B, H, N_q, N_k)``.
        is_causal: top-left aligned causal mask.
        scale: softmax scale (default ``1/sqrt(D)``).
        bug: one of :data:`MUTANTS`' bugs, or ``""`` for the correct kernel.

    Returns:
        ``(B, H, N_q, D_v)`` in the inputs' dtype.
    """
    dtype = q.dtype
    if bug == "qk_unscaled_fp16":  # forms q·kᵀ in the inputs' dtype, then scales
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    if bug == "falsy_scale":
        scale = scale or None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = _read(q, bug), _read(k, bug), _read(v, bug)
    if bug == "head_dim_truncated" and q.shape[-1] > TILE:
        q, k = q[..., :TILE], k[..., :TILE]  # only the first 128 channels enter q·kᵀ
    if bug == "keys_beyond_4096_ignored" and k.shape[2] > 4096:
        k, v = k[:, :, :4096], v[:, :, :4096]
        if attn_mask is not None and attn_mask.shape[-1] > 1:
            attn_mask = attn_mask[..., :4096]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        if bug == "gqa_head_mapping":  # query head h reads k/v head h % H_kv instead of h // rep
            index = torch.arange(q.shape[1], device=q.device) % k.shape[1]
            k, v = k[:, index], v[:, index]
        elif bug == "gqa_dk_not_summed":  # the gradient reaches only each group's first query head
            k = torch.cat([k[:, i : i + 1].expand(-1, rep, -1, -1) for i in range(k.shape[1])], dim=1)
            k = k.detach() + (k - k.detach()) * (torch.arange(q.shape[1]) % rep == 0).view(1, -1, 1, 1)
            v = v.repeat_interleave(rep, dim=1)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    op = _opmath(dtype)
    out = _Attention.apply(q.to(op), k.to(op), v.to(op), attn_mask, is_causal, scale, bug)
    if bug == "masked_mean":
        dead = ~_valid(q, k, attn_mask, is_causal, "").any(-1, keepdim=True)
        out = torch.where(dead, v.to(op).mean(-2, keepdim=True), out)
    if bug == "large_grid_head_mixup" and q.shape[0] * q.shape[1] > GRID_LIMIT:
        b, h = q.shape[:2]
        flat = out.reshape(b * h, *out.shape[2:])  # heads past the limit get an earlier head's output
        index = torch.arange(b * h, device=out.device)
        index = torch.where(index >= GRID_LIMIT, index - GRID_LIMIT, index)
        out = flat[index].reshape(out.shape)
    return out.to(dtype)


@dataclass(frozen=True)
class Mutant:
    """One planted bug.

    Attributes:
        bug: the bug's name (the ``bug`` of :func:`explicit_attention`), or a kernel spec.
        text: the class of real bug it stands for.
        case: the default-profile catalogue case that must catch it.
        dtype: the dtype it is checked at.
        failure: the expected failure kind (``dq:values``, ``zeros``, ...), or its prefix ``dq:``.
    """

    bug: str
    text: str
    case: str
    dtype: str
    failure: str


#: Every mutant, forward and backward, one real bug class each.
MUTANTS: tuple[Mutant, ...] = (
    Mutant("tiled:mask_value=-5e4", "FlashInfer's −5e4 sentinel (PR 4401)", "sentinel_5e4", "fp32", "zeros"),
    Mutant("falsy_scale", "`scale or 1/sqrt(d)`: 0.0 ignored", "scale_zero", "fp32", "values"),
    Mutant("fully_masked_nan", "NaN for fully masked rows", "fully_masked_rows", "fp32", "nonfinite"),
    Mutant("masked_mean", "masked rows get mean(v)", "fully_masked_rows", "fp32", "masked_nonzero"),
    Mutant("causal_bottom_right", "causal mask aligned bottom-right", "causal_nq_lt_nk", "fp32", "values"),
    Mutant("no_max_subtraction", "exp() without the row max", "large_logits", "fp32", "nonfinite"),
    Mutant("no_rescale", "online softmax without rescaling", "rising_max", "fp32", "values"),
    Mutant("qk_unscaled_fp16", "q·kᵀ formed in fp16 before the scale", "qk_overflow", "fp16", "nonfinite"),
    Mutant(
        "additive_mask_ignored", "additive mask dropped", "fully_masked_additive", "fp32", "masked_nonzero"
    ),
    Mutant("mask_batch_broadcast", "batch 0's mask used for every entry", "padding_mask", "fp32", "zeros"),
    Mutant("strided_read", "inputs read as contiguous (B, H, N, D)", "layout_bnhd", "fp32", "values"),
    Mutant("storage_offset_ignored", "a view's storage offset ignored", "layout_offset", "fp32", "values"),
    Mutant("head_dim_truncated", "only the first 128 channels used", "head_dim_160", "fp32", "values"),
    Mutant("keys_beyond_4096_ignored", "keys past 4096 ignored", "long_context_8k", "fp32", "values"),
    Mutant("large_grid_head_mixup", "heads past grid limit mixed", "large_grid", "fp32", "values"),
    Mutant("gqa_head_mapping", "head h reads kv head h % H_kv", "gqa_broadcast", "fp32", "values"),
    Mutant("dq_no_scale", "dq without the softmax scale", "odd_shapes", "fp32", "dq:values"),
    Mutant("dk_partial_tile_zero", "dk zero for a partial last key tile", "odd_shapes", "fp32", "dk:"),
    Mutant("dq_nan_nk_mod_128_64", "NaN dq if N_k % 128 == 64", "keys_mod128_64", "fp32", "dq:nonfinite"),
    Mutant("ds_bf16", "dS rounded to bf16", "odd_shapes", "fp32", "dq:values"),
    Mutant("backward_mask_ignored", "backward without the mask", "padding_mask", "fp32", "dq:masked"),
    Mutant(
        "fully_masked_backward_nan", "NaN grads of masked rows", "fully_masked_rows", "fp32", "dq:nonfinite"
    ),
    Mutant("gqa_dk_not_summed", "GQA dk not summed over the group", "gqa_broadcast", "fp32", "dk:values"),
    Mutant("dv_unnormalised", "dv from unnormalised probabilities", "odd_shapes", "fp32", "dv:values"),
)  # fmt: skip
