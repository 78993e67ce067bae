"""Merges of two attention states with FlashInfer's ``merge_state`` signature: two controls and the LSE
bugs of split-KV merging.

Signature and conventions (FlashInfer ``flashinfer/cascade.py`` and ``include/flashinfer/attention/
cascade.cuh``): ``merge_state(v_a, s_a, v_b, s_b) -> (V, S)`` with ``v_a, v_b (seq_len, num_heads,
head_dim)`` the attention outputs of two KV segments and ``s_a, s_b (seq_len, num_heads)`` float32 their
log-sum-exps **in base 2**; ``V`` has ``v_a``'s dtype and ``S`` is float32, base 2. An empty segment is
``(0, -inf)``: merging it leaves the other state unchanged, and merging two empty states gives ``(0, -inf)``
(the kernel's ``max(·, -inf)`` drops the NaN of ``-inf − -inf`` and its ``d_sum > 0`` guard keeps 0/0 out).
"""

from __future__ import annotations

import math

import torch

from lab.heldout._online import LN2
from lab.heldout._table import Contract, HeldOut


def _check(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor) -> None:
    """Reject states that cannot be merged.

    Raises:
        ValueError: v_a and v_b of different shapes, v not 3-d, or s not ``v.shape[:-1]``.
    """
    if v_a.dim() != 3 or v_a.shape != v_b.shape:
        raise ValueError(
            f"v_a, v_b must be (seq_len, num_heads, head_dim) of one shape; got "
            f"{tuple(v_a.shape)}, {tuple(v_b.shape)}"
        )
    if s_a.shape != v_a.shape[:-1] or s_b.shape != v_a.shape[:-1]:
        raise ValueError(
            f"s_a, s_b must be (seq_len, num_heads) = {tuple(v_a.shape[:-1])}; got "
            f"{tuple(s_a.shape)}, {tuple(s_b.shape)}"
        )


def _weights_base2(s_a: torch.Tensor, s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Guarded base-2 weights ``(w_a, w_b)`` summing to 1 (0 for two empty states) and the merged LSE."""
    s_max = torch.maximum(s_a, s_b)
    shift = torch.where(s_max == -math.inf, torch.zeros_like(s_max), s_max)
    e_a, e_b = torch.exp2(s_a - shift), torch.exp2(s_b - shift)
    d = e_a + e_b
    d_safe = torch.where(d > 0, d, torch.ones_like(d))
    s = torch.where(d > 0, torch.log2(d_safe) + shift, torch.full_like(d, -math.inf))
    return e_a / d_safe, e_b / d_safe, s


def _combine(v_a: torch.Tensor, w_a: torch.Tensor, v_b: torch.Tensor, w_b: torch.Tensor) -> torch.Tensor:
    return (w_a[..., None] * v_a.float() + w_b[..., None] * v_b.float()).to(v_a.dtype)


def fi_merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct ``merge_state``: base-2 weights against the larger LSE, guarded for empty states.

    Args:
        v_a: ``(seq_len, num_heads, head_dim)`` output of segment A.
        s_a: ``(seq_len, num_heads)`` its LSE, base 2 (-inf: empty).
        v_b: ``(seq_len, num_heads, head_dim)`` output of segment B.
        s_b: ``(seq_len, num_heads)`` its LSE, base 2.

    Returns:
        ``(V (seq_len, num_heads, head_dim) in v_a's dtype, S (seq_len, num_heads) fp32 base 2)``.
    """
    _check(v_a, s_a, v_b, s_b)
    w_a, w_b, s = _weights_base2(s_a.float(), s_b.float())
    return _combine(v_a, w_a, v_b, w_b), s


def fi_merge_state_logaddexp(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Correct ``merge_state`` computed in natural log: ``S·ln 2``, ``logaddexp``, weights
    ``exp(s − S)``, back to base 2; two empty states give ``(0, -inf)``. Shapes as ``fi_merge_state``."""
    _check(v_a, s_a, v_b, s_b)
    a, b = s_a.float() * LN2, s_b.float() * LN2
    s = torch.logaddexp(a, b)
    empty = s == -math.inf
    s_safe = torch.where(empty, torch.zeros_like(s), s)
    w_a = torch.where(empty, torch.zeros_like(s), torch.exp(a - s_safe))
    w_b = torch.where(empty, torch.zeros_like(s), torch.exp(b - s_safe))
    return _combine(v_a, w_a, v_b, w_b), s / LN2


def merge_state_natural_log(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_state`` that treats the base-2 LSEs as natural logs: weights ``exp(s − max)`` and
    ``S = log(d) + max`` (sglang issue 40903).

    Trigger: both states non-empty. V is wrong when ``s_a != s_b`` (the weights are ``e^Δ`` instead of
    ``2^Δ``), S whenever both are finite. Right when either state is empty.
    """
    _check(v_a, s_a, v_b, s_b)
    a, b = s_a.float(), s_b.float()
    s_max = torch.maximum(a, b)
    shift = torch.where(s_max == -math.inf, torch.zeros_like(s_max), s_max)
    e_a, e_b = torch.exp(a - shift), torch.exp(b - shift)
    d = e_a + e_b
    d_safe = torch.where(d > 0, d, torch.ones_like(d))
    s = torch.where(d > 0, torch.log(d_safe) + shift, torch.full_like(d, -math.inf))
    return _combine(v_a, e_a / d_safe, v_b, e_b / d_safe), s


def merge_state_lse_converted_twice(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_state`` that merges in natural log and converts the merged LSE back to base 2 twice
    (``/ ln 2`` two times): V is right, S is off by a factor ``1 / ln 2`` (flashinfer issue 4663, "silent
    wrong LSE").

    Trigger: a merged LSE other than 0 or -inf — visible only to a check of S.
    """
    v, s = fi_merge_state_logaddexp(v_a, s_a, v_b, s_b)
    return v, s / LN2


def merge_state_empty_nan(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_state`` without the empty-state guards: ``exp2(s − max(s_a, s_b))`` is NaN when both LSEs
    are -inf, and the NaN reaches V and S (vllm issue 27491, flashinfer issue 4051).

    Trigger: a row where both states are empty (``s_a = s_b = -inf``, e.g. a query that sees no key in
    either chunk). Right when at most one is empty.
    """
    _check(v_a, s_a, v_b, s_b)
    a, b = s_a.float(), s_b.float()
    s_max = torch.maximum(a, b)
    e_a, e_b = torch.exp2(a - s_max), torch.exp2(b - s_max)
    d = e_a + e_b
    return _combine(v_a, e_a / d, v_b, e_b / d), torch.log2(d) + s_max


HELDOUT: dict[str, HeldOut] = {
    "fi_merge_state": HeldOut(fi_merge_state, "merge_state", "control", "base-2 max shift, guarded"),
    "fi_merge_state_logaddexp": HeldOut(
        fi_merge_state_logaddexp, "merge_state", "control", "natural-log logaddexp, converted back to base 2"
    ),
    "merge_state_natural_log": HeldOut(
        merge_state_natural_log, "merge_state", "bug", "both states non-empty (V: s_a != s_b)"
    ),
    "merge_state_lse_converted_twice": HeldOut(
        merge_state_lse_converted_twice, "merge_state", "bug", "merged LSE not 0 or -inf (S only)"
    ),
    "merge_state_empty_nan": HeldOut(
        merge_state_empty_nan, "merge_state", "bug", "s_a = s_b = -inf on a row"
    ),
}

CONTRACTS: dict[str, Contract] = {
    name: Contract("FlashInfer", lse_base=2.0, empty_row_lse=-math.inf, backward=None) for name in HELDOUT
}
