"""The baseline: plain ``softmax(q kᵀ · scale) v``, every step in one dtype; in float64, the golden.

``math:fp8=e4m3`` (or ``e5m2``) is the baseline of FP8 kernels: q, k, v rounded to the format with
one amax scale per tensor, then every step in float32; ``fp8_draw=<r>`` is another, equally valid
realisation of that rounding (:func:`flashprobe.kernels.fp8.realisation_shifts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from flashprobe.kernels import fp8 as fp8_numerics
from flashprobe.kernels._inputs import check_inputs, default_scale, to_dtype
from flashprobe.kernels.call import AttentionCall, CallOutput, convert_lse
from flashprobe.kernels.reference import reference_attention, reference_input_gradients
from flashprobe.kernels.registry import ANY_CAPABILITIES, KernelCapabilities, register_kernel

__all__ = [
    "baseline_call",
    "call_gradients",
    "call_reference",
    "golden_attention",
    "golden_call",
    "math_attention",
    "plain_attention",
    "reference_arguments",
]


#: What ``math:fp8=<format>`` supports: forward only (the FP8 rounding has no gradient).
_FP8_CAPABILITIES = {
    fmt: KernelCapabilities(backward_devices=frozenset(), fp8=fmt) for fmt in fp8_numerics.FP8_FORMATS
}


def _validate(dtype: str | torch.dtype | None = None, fp8: str = fp8_numerics.OFF, fp8_draw: int = 0) -> None:
    to_dtype(dtype)
    if fp8 not in (*fp8_numerics.FP8_FORMATS, fp8_numerics.OFF):
        allowed = ", ".join(repr(f) for f in (*fp8_numerics.FP8_FORMATS, fp8_numerics.OFF))
        raise ValueError(f"math: fp8={fp8!r} must be one of {allowed}")
    if fp8 != fp8_numerics.OFF and dtype is not None:
        raise ValueError("math: fp8 computes in float32 after the FP8 rounding; leave dtype out")
    if isinstance(fp8_draw, bool) or not isinstance(fp8_draw, int) or fp8_draw < 0:
        raise ValueError(f"math: fp8_draw={fp8_draw!r} must be an integer ≥ 0 (0: the amax scales)")
    if fp8_draw and fp8 == fp8_numerics.OFF:
        raise ValueError(
            "math: fp8_draw picks a realisation of the FP8 rounding; give fp8=e4m3 or fp8=e5m2 too"
        )


def _capabilities(options: Mapping[str, Any]) -> KernelCapabilities:
    """Everything, except with ``fp8`` on: forward only, declaring its FP8 format."""
    return _FP8_CAPABILITIES.get(options.get("fp8", fp8_numerics.OFF), ANY_CAPABILITIES)


@register_kernel("math", validate=_validate, capabilities=_capabilities)
def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dtype: str | torch.dtype | None = None,
    fp8: str = fp8_numerics.OFF,
    fp8_draw: int = 0,
) -> torch.Tensor:
    """Baseline attention ``softmax(q kᵀ · scale + mask) v`` (fully masked rows give 0).

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H, N_k, D)``; v: ``(B, H, N_k, D_v)``; the mask, causal flag
            and scale as SDPA's.
        dtype: compute every step in this dtype; the result is cast back to the inputs' dtype.
        fp8: ``"e4m3"`` or ``"e5m2"``: the FP8 baseline (module docstring); ``"off"``: no.
        fp8_draw: with ``fp8``, the realisation of its rounding (0: the amax scales).

    Returns:
        ``(B, H, N_q, D_v)`` in the inputs' dtype.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="math")
    out_dtype = q.dtype
    compute = to_dtype(dtype) or q.dtype
    if fp8 != fp8_numerics.OFF:
        compute = torch.float32
        per_tensor = {"scaling": "tensor", "scale": fp8_numerics.AMAX, "block": 1}
        shifts = fp8_numerics.realisation_shifts(fp8_draw)  # (q, k, v)
        q, k, v = (
            fp8_numerics.dequantize(x, fp8, **per_tensor, shift=c)
            for x, c in zip((q, k, v), shifts, strict=True)
        )
    q, k, v = q.to(compute), k.to(compute), v.to(compute)  # (no copies when already there)
    out = plain_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return out.to(out_dtype)  # (B, H, N_q, D_v)


def plain_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    lse: bool = False,
) -> Any:
    """The baseline with every term of a call, in the inputs' dtype: the one implementation behind
    :func:`math_attention`, the golden and the references of calls.

    ``s = q kᵀ · scale``, softcapped, SDPA's ``is_causal`` / ``attn_mask``, ``−inf`` where ``valid``
    is False, ``+ bias``; ``sinks`` join the denominator; a row that sees nothing gives 0.

    Args:
        q: ``(B, H, N_q, D)``; k: ``(B, H, N_k, D)``; v: ``(B, H, N_k, D_v)`` (heads expanded).
        valid: bool broadcastable to ``(B, H, N_q, N_k)``: the scores the call keeps.
        bias: added to the scores after the masks (ALiBi), broadcastable likewise.
        sinks: ``(H,)`` one logit per head.
        lse: also return the natural-log LSE ``(B, H, N_q)`` in at least float32.

    Returns:
        ``(B, H, N_q, D_v)`` in the inputs' dtype, or ``(out, lse)`` with ``lse``.
    """
    s = default_scale(q.shape[-1], scale)
    # In place on fresh intermediates: the matmul and the scaling save their inputs, not outputs.
    scores = torch.matmul(q, k.transpose(-2, -1)).mul_(s)  # (B, H, N_q, N_k)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap  # (not in place: tanh saved its output)
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        above = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).triu_(1)  # (N_q, N_k)
        scores = scores.masked_fill_(above, float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill_(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(q.dtype)
    if valid is not None:
        scores = scores.masked_fill_(~valid, float("-inf"))
    if bias is not None:
        scores = scores + bias
    if sinks is not None:  # one more logit per row, in the denominator only
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, N_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    row_lse = None
    if lse:  # in at least float32, as kernels store it (before any fill below)
        row_lse = torch.logsumexp(scores.detach().to(torch.promote_types(q.dtype, torch.float32)), dim=-1)
    # Safe softmax, as torch SDPA: a row with every key masked gives 0, not NaN, in the output and the
    # gradients; only a mask (without a sink) can mask a whole row. Its scores are made finite before
    # the softmax, so autograd never sees inf - inf.
    fully_masked = None
    masks = (attn_mask is not None and not is_causal) or valid is not None
    if masks and sinks is None and scores.shape[-1]:
        fully_masked = scores.detach().amax(dim=-1, keepdim=True) == float("-inf")  # (B, H, N_q, 1)
        scores = scores.masked_fill_(fully_masked, 0.0)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    if fully_masked is not None:
        probs = probs.masked_fill(fully_masked, 0.0)  # (not in place: the softmax saved its output)
    out = torch.matmul(probs, v)
    return out if row_lse is None else (out, row_lse)


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
    """The golden value: the baseline in float64 from the same inputs (shapes as
    :func:`math_attention`), in blocks of at most ``budget`` bytes
    (:func:`~flashprobe.kernels.reference.reference_attention`); float64 ``(B, H, N_q, D_v)``."""
    check_inputs(q, k, v, attn_mask, is_causal, kernel="golden")
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.double()
    return reference_attention(
        math_attention, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dtype=torch.float64,
        budget=budget,
    )


def reference_arguments(call: AttentionCall, compute: torch.dtype) -> tuple[Any, ...]:
    """``(logical, q, k, v, attn_mask, is_causal, terms)``: the arguments of the blocked references
    (with :func:`plain_attention`) for ``call`` in ``compute``; a causal mask SDPA expresses stays
    SDPA's, the other terms go per block (``terms``: None for an SDPA-shaped call)."""
    logical = call.logical()
    q, k, v = logical.dequantized(compute)
    mask = logical.attn_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.to(compute)
    lengths = logical.q_lens is not None or logical.k_lens is not None
    sdpa_causal = logical.causal and mask is None and (
        logical.align == "top_left" or (not lengths and logical.n_q == logical.n_k)
    )
    terms = logical.replace(causal=False) if sdpa_causal else logical
    extra = terms.positional or terms.causal or terms.softcap or terms.sinks is not None
    return logical, q, k, v, mask, sdpa_causal, terms if extra else None


def call_reference(
    call: AttentionCall, *, dtype: torch.dtype | None = None, budget: int | None = None
) -> CallOutput:
    """Plain attention (:func:`plain_attention`) of any call through its logical form, in blocks of at
    most ``budget`` bytes; an SDPA-shaped call gives the bits of :func:`math_attention`.

    Args:
        call: the call, in any storage.
        dtype: compute every step in this dtype (default: the inputs'; float32 for FP8 inputs,
            multiplied by their descales first).

    Returns:
        The logical ``out`` ``(B, H, n_q, D_v)`` in ``dtype`` (None: the call's output dtype) and,
        with ``call.return_lse``, the LSE ``(B, H, n_q)`` in ``call.lse_base``, at least float32.
    """
    compute = dtype or (torch.float32 if call.fp8 else call.q.dtype)
    logical, q, k, v, mask, causal, terms = reference_arguments(call, compute)
    found = reference_attention(
        plain_attention, q, k, v, attn_mask=mask, is_causal=causal, scale=call.scale, dtype=compute,
        budget=budget, terms=terms, lse=call.return_lse,
    )  # fmt: skip
    out, lse = found if call.return_lse else (found, None)
    if logical.q_lens is not None and lse is not None:  # padding rows are no rows (a sink sees them)
        rows = torch.arange(logical.n_q, device=lse.device)[None, None, :]
        lse = lse.masked_fill(rows >= logical.q_lens.long()[:, None, None], float("-inf"))
    if dtype is None:
        out = out.to(call.out_dtype)
    if lse is not None:
        lse = convert_lse(lse, "e", call.lse_base)
    return CallOutput(out, lse, call.lse_base)


def call_gradients(
    call: AttentionCall,
    grad_out: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logical ``dq (B, H, n_q, D)``, ``dk (B, H_kv, n_k, D)``, ``dv (B, H_kv, n_k, D_v)`` of plain
    attention of ``call`` for the logical ``grad_out`` ``(B, H, n_q, D_v)``, in ``dtype`` (default:
    the inputs'), in bounded memory."""
    compute = dtype or call.q.dtype
    _, q, k, v, mask, causal, terms = reference_arguments(call, compute)
    _, dq, dk, dv = reference_input_gradients(
        plain_attention, q, k, v, grad_out, attn_mask=mask, is_causal=causal, scale=call.scale, dtype=compute,
        budget=budget, terms=terms,
    )  # fmt: skip
    return dq, dk, dv


def golden_call(call: AttentionCall, *, budget: int | None = None) -> CallOutput:
    """The golden value of any call: :func:`call_reference` in float64."""
    return call_reference(call, dtype=torch.float64, budget=budget)


def baseline_call(call: AttentionCall, *, budget: int | None = None) -> CallOutput:
    """The same-dtype baseline of any call: :func:`call_reference` in the inputs' dtype (float32 after
    the descales for FP8 inputs), its output in the call's output dtype."""
    return call_reference(call, budget=budget)
