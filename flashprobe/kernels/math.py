"""The baseline: plain ``softmax(q kᵀ · scale) v``, every step in one dtype.

Computed in float64 from the same inputs it is the **golden** value every deviation is measured
against. It materialises the ``(B, H, N_q, N_k)`` score matrix, as unfused attention does.
"""

from __future__ import annotations

import torch

from flashprobe.kernels._inputs import check_inputs, default_scale, to_dtype
from flashprobe.kernels.reference import reference_attention
from flashprobe.kernels.registry import register_kernel

__all__ = ["golden_attention", "math_attention"]


def _validate(dtype: str | torch.dtype | None = None) -> None:
    to_dtype(dtype)


@register_kernel("math", validate=_validate)
def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dtype: str | torch.dtype | None = None,
) -> torch.Tensor:
    """Baseline attention ``softmax(q kᵀ · scale + mask) v`` (fully masked rows give 0).

    Args:
        q: ``(B, H, N_q, D)`` queries.
        k: ``(B, H, N_k, D)`` keys.
        v: ``(B, H, N_k, D_v)`` values.
        attn_mask: bool (``True`` = attend) or additive mask, broadcastable to
            ``(B, H, N_q, N_k)``.
        is_causal: apply the top-left aligned causal mask.
        scale: softmax scale, default ``1/sqrt(D)``.
        dtype: compute every step in this dtype instead of the inputs' dtype; the result is cast
            back to the inputs' dtype.

    Returns:
        ``(B, H, N_q, D_v)`` in the inputs' dtype.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="math")
    out_dtype = q.dtype
    compute = to_dtype(dtype) or q.dtype
    q, k, v = q.to(compute), k.to(compute), v.to(compute)  # (no copies when already there)
    s = default_scale(q.shape[-1], scale)
    # In place on fresh intermediates: the matmul and the scaling save their inputs, not outputs.
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(s)  # (B, H, N_q, N_k)
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        above = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu_(1)  # (N_q, N_k)
        scores = scores.masked_fill_(above, float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill_(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(compute)
    # Safe softmax, as torch SDPA: a row with every key masked (all -inf) gives 0, not NaN, in the
    # output and in the gradients. Only a mask can mask a whole row (a top-left causal row i keeps
    # key 0 whenever there are keys; with no keys at all the empty product below gives zeros), so
    # unmasked and causal calls skip this. Such a row is found with one row-max reduction (no
    # (N_q, N_k) bool temporary) and given finite scores before the softmax, so autograd never
    # sees inf - inf.
    fully_masked = None
    if attn_mask is not None and not is_causal and scores.shape[-1]:
        fully_masked = scores.detach().amax(dim=-1, keepdim=True) == float("-inf")  # (B, H, N_q, 1)
        scores = scores.masked_fill_(fully_masked, 0.0)
    probs = torch.softmax(scores, dim=-1)
    if fully_masked is not None:
        probs = probs.masked_fill(fully_masked, 0.0)  # (not in place: the softmax saved its output)
    return torch.matmul(probs, v).to(out_dtype)  # (B, H, N_q, D_v)


def golden_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    budget: int | None = None,
) -> torch.Tensor:
    """The golden value: the baseline computed in float64 from the same inputs, in bounded memory.

    Shapes as :func:`math_attention`; returns a float64 ``(B, H, N_q, D_v)`` tensor. Computed in
    blocks of at most ``budget`` bytes (:func:`flashprobe.kernels.reference.reference_attention`:
    default a quarter of the device's free memory), causal calls in row blocks against only the keys
    they see; each row's value is that of the whole score matrix up to float64 rounding of
    differently shaped sums.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="golden")
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    return reference_attention(
        math_attention,
        q,
        k,
        v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        dtype=torch.float64,
        budget=budget,
    )
