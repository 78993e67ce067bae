"""SDPA-shaped calls whose reference outputs must keep their bits (the "one golden" floor).

:func:`sdpa_outputs` runs ``math_attention``, ``golden_attention``, ``reference_attention`` and
``reference_input_gradients`` over a fixed set of SDPA calls (masks, causal with N_q = N_k and
N_q != N_k, row-blocked causal, GQA, fp16/bf16/fp32, the ``dtype`` and ``fp8`` options, small budgets
that split a call into blocks). ``data/sdpa_bits.json`` holds the SHA-256 of the bytes each gave before
the references took calls beyond SDPA (:func:`digest`), recorded with torch 2.13 on an AVX512 CPU.
"""

from __future__ import annotations

import hashlib

import torch

from flashprobe.kernels import golden_attention, math_attention
from flashprobe.kernels.reference import CAUSAL_BLOCK_ROWS, reference_attention, reference_input_gradients

__all__ = ["digest", "sdpa_outputs"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: name → (B, H, H_kv, N_q, N_k, D, D_v, mask kind, causal, scale)
_CALLS = {
    "plain": (2, 4, 4, 33, 33, 16, 16, "none", False, None),
    "cross": (1, 2, 2, 17, 45, 24, 8, "none", False, 0.3),
    "causal": (2, 2, 2, 40, 40, 16, 16, "none", True, None),
    "causal_cross_wide": (1, 2, 2, 12, 37, 16, 16, "none", True, None),
    "causal_cross_tall": (1, 2, 2, 37, 12, 16, 16, "none", True, None),
    "causal_rows": (1, 2, 1, 300, 300, 8, 8, "none", True, None),
    "gqa": (2, 6, 2, 21, 29, 16, 16, "none", False, None),
    "gqa_causal": (1, 4, 1, 29, 29, 16, 16, "none", True, 0.7),
    "bool": (2, 2, 2, 19, 23, 16, 16, "bool", False, None),
    "key_padding": (2, 2, 1, 19, 23, 16, 16, "key_padding", False, None),
    "additive": (1, 2, 2, 19, 23, 16, 16, "additive", False, None),
    "fully_masked": (1, 2, 2, 9, 11, 8, 8, "fully_masked", False, None),
    "empty_keys": (1, 2, 2, 5, 0, 8, 8, "none", False, None),
}


#: a budget (bytes) that cuts the calls into several blocks of rows or heads
_SMALL = 60_000


def _inputs(name: str, dtype: torch.dtype, seed: int):
    b, h, h_kv, n_q, n_k, d, d_v, kind, causal, scale = _CALLS[name]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=gen).to(dtype)
    k = torch.randn(b, h_kv, n_k, d, generator=gen).to(dtype)
    v = torch.randn(b, h_kv, n_k, d_v, generator=gen).to(dtype)
    mask = None
    if kind in ("bool", "fully_masked"):
        mask = torch.rand(b, 1, n_q, n_k, generator=gen) < 0.6
        if kind == "fully_masked":
            mask[:, :, [0, 4]] = False
    elif kind == "key_padding":
        mask = torch.ones(b, 1, 1, n_k, dtype=torch.bool)
        mask[0, ..., 15:] = False
    elif kind == "additive":
        mask = (2 * torch.randn(1, h, n_q, n_k, generator=gen)).to(dtype)
        mask[..., 3, :] = float("-inf")
    return q, k, v, mask, causal, scale


def _expand(k: torch.Tensor, v: torch.Tensor, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    rep = h // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def sdpa_outputs() -> dict[str, torch.Tensor]:
    """Every output of the fixed SDPA calls, by a name saying which function, call and dtype."""
    found: dict[str, torch.Tensor] = {}
    for name in _CALLS:
        for dname, dtype in _DTYPES.items():
            q, k, v, mask, causal, scale = _inputs(name, dtype, seed=len(found))
            kw = {"attn_mask": mask, "is_causal": causal, "scale": scale}
            budget = _SMALL if q.shape[2] < CAUSAL_BLOCK_ROWS else None  # (long causal calls: row blocks)
            ke, ve = _expand(k, v, q.shape[1])
            found[f"math/{name}/{dname}"] = math_attention(q, ke, ve, **kw)
            found[f"math_fp32/{name}/{dname}"] = math_attention(q, ke, ve, dtype="fp32", **kw)
            found[f"golden/{name}/{dname}"] = golden_attention(q, ke, ve, **kw)
            found[f"golden_small_budget/{name}/{dname}"] = golden_attention(q, ke, ve, budget=budget, **kw)
            found[f"reference/{name}/{dname}"] = reference_attention(math_attention, q, k, v, **kw)
            g = torch.randn(*q.shape[:3], v.shape[-1], generator=torch.Generator().manual_seed(7)).to(dtype)
            for tag, rdtype in (("grads", None), ("grads_fp64", torch.float64)):
                parts = reference_input_gradients(
                    math_attention, q, k, v, g, dtype=rdtype, budget=budget, **kw
                )
                for part, t in zip(("out", "dq", "dk", "dv"), parts, strict=True):
                    found[f"{tag}_{part}/{name}/{dname}"] = t
        if not _CALLS[name][4]:
            continue  # (math:fp8 cannot take a call without keys: its amax scale has no values)
        q, k, v, mask, causal, scale = _inputs(name, torch.float32, seed=len(found))
        ke, ve = _expand(k, v, q.shape[1])
        kw = {"attn_mask": mask, "is_causal": causal, "scale": scale}
        found[f"math_e4m3/{name}/fp32"] = math_attention(q, ke, ve, fp8="e4m3", **kw)
    return {key: t.contiguous() for key, t in found.items()}


def digest(t: torch.Tensor) -> str:
    """SHA-256 of the tensor's dtype, shape and bytes: equal digests are equal bits."""
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()
