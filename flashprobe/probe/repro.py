"""Reproducers: the exact attention call that failed in training, saved to disk and replayed.

When the probe's verdict finds a failing call (:func:`flashprobe.judge.decide`), it saves
what reproduces it as one ``safetensors`` file — no pickle — plus a short Python script next to
it::

    REPRO_DIR/<site>.step<step>.safetensors   q, k, v, [attn_mask], [grad_out]
    REPRO_DIR/<site>.step<step>.py            replays it (flashprobe replay FILE)

One file per failing call: every direction that failed at it (``directions`` in the metadata;
``direction`` the first of ``out``, ``dq``, ``dk``, ``dv``); the output gradient is saved whenever
the call had a backward.

The tensors are the call as the kernels saw it (the compute dtype, 4-D, ``k``/``v`` with their own
head count under grouped-query attention); a tensor that was a permuted view (e.g. the transpose of
a ``(B, N, H, D)`` projection) is stored in its memory order and given back as the same view, so a
kernel that mishandles strides fails again on replay (other layouts — slices of a fused ``qkv``
tensor, gaps between rows — are stored contiguous). The metadata (strings, read with
:func:`load_reproducer`) holds ``is_causal``, ``scale``, ``enable_gqa`` (the GQA ratio), the
kernels' dtype and device, the site, direction, step, why it failed, the primary and baseline
specs and the versions of torch and flashprobe.

:func:`replay` runs the call again through a :class:`~flashprobe.probe.ShadowAttention` — the
same judge as in training — for any kernel spec, forward and, when the file has an output
gradient, backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flashprobe.probe.repro_file import (
    REPRO_FORMAT,
    Reproducer,
    ReproducerError,
    load_reproducer,
    reproducer_stem,
    save_reproducer,
)
from flashprobe.probe.shadow import ShadowAttention

__all__ = [
    "REPRO_FORMAT",
    "Reproducer",
    "ReproducerError",
    "load_reproducer",
    "replay",
    "reproducer_stem",
    "save_reproducer",
    "shrink_reproducer",
]


def replay(
    call: Reproducer, kernels: Sequence[str], *, baseline: str | None = None
) -> dict[str, dict[str, Any]]:
    """Run the saved call through each kernel spec and judge it as the probe does in training.

    Forward always; backward with the saved output gradient when the file has one (the kernel must
    support autograd then). The judge is a :class:`~flashprobe.probe.ShadowAttention` with the
    kernel as primary (baseline: the recorded one, default ``math``; golden FP64).

    Returns:
        ``{spec: {"verdict": "pass"|"fail"|"undetermined"|"error", "reasons": [...], "directions":
        {dir: verdict}, "limit_ratio": {dir: the verdict's statistic}, "l2_error_ratio": {dir: ratio}}}``.
    """
    base = baseline or call.meta.get("baseline") or "math"
    backward = call.grad_out is not None
    results: dict[str, dict[str, Any]] = {}
    for spec in kernels:
        site = call.meta.get("site") or "attention"
        try:
            shadow = ShadowAttention(
                primary=spec, baseline=base, backward=backward, name=site, on_failure="ignore"
            )
            leaves = [t.detach().clone().requires_grad_(backward) for t in (call.q, call.k, call.v)]
            # The saved layout (a permuted view) is kept: clone() preserves strides.
            q, k, v = leaves
            rep = q.shape[1] // max(k.shape[1], 1)
            with torch.enable_grad():
                out = shadow(
                    q,
                    k,
                    v,
                    attn_mask=call.attn_mask,
                    is_causal=call.is_causal,
                    scale=call.scale,
                    enable_gqa=rep > 1,
                )
                if backward:
                    assert call.grad_out is not None
                    out.backward(call.grad_out.to(out.dtype))
            entry = shadow.stats()[site]
        except Exception as err:  # a kernel that raises on the call is a result, not a crash
            results[spec] = {
                "verdict": "error",
                "reasons": [f"{type(err).__name__}: {err}"],
                "directions": {},
                "limit_ratio": {},
                "l2_error_ratio": {},
            }
            continue
        directions = {"out": entry["forward"]["out"]}
        if backward:
            directions.update((d, entry["backward"][d]) for d in ("dq", "dk", "dv"))
        verdicts = {d: e["verdict"] for d, e in directions.items() if e["verdict"] is not None}
        reasons = [
            f"{d}: {e['first_failure']['reason']}" for d, e in directions.items() if e.get("first_failure")
        ]
        if entry.get("shadow_errors"):
            reasons.append(f"{entry['shadow_errors']} reference computation(s) failed")
        if "fail" in verdicts.values():
            verdict = "fail"
        elif "pass" in verdicts.values():
            verdict = "pass"
        else:
            verdict = "undetermined" if verdicts else "error"
        results[spec] = {
            "verdict": verdict,
            "reasons": reasons,
            "directions": verdicts,
            "limit_ratio": {d: e["limit_ratio"] for d, e in directions.items()},
            "l2_error_ratio": {d: e["l2_error_ratio"] for d, e in directions.items()},
        }
    return results


def _sliced(call: Reproducer, b: int, h: int, n_q: int, n_k: int) -> Reproducer:
    """The call cut to its first ``b`` batch entries, ``h`` query heads (and their key/value heads),
    ``n_q`` query rows and ``n_k`` keys (the mask and output gradient cut alike)."""
    rep = call.q.shape[1] // max(call.k.shape[1], 1)
    h_kv = max(1, h // rep)
    mask = call.attn_mask
    if mask is not None:
        mask = mask[
            : min(b, mask.shape[0]),
            : min(h, mask.shape[1]),
            : min(n_q, mask.shape[2]),
            : min(n_k, mask.shape[3]),
        ]
    grad = None if call.grad_out is None else call.grad_out[:b, :h, :n_q]
    return Reproducer(
        q=call.q[:b, :h, :n_q],
        k=call.k[:b, :h_kv, :n_k],
        v=call.v[:b, :h_kv, :n_k],
        attn_mask=mask,
        grad_out=grad,
        is_causal=call.is_causal,
        scale=call.scale,
        meta=dict(call.meta),
    )


def shrink_reproducer(
    call: Reproducer, kernel: str, *, baseline: str | None = None, max_tries: int = 200
) -> tuple[Reproducer, int]:
    """The smallest prefix of the call (batch entries, query heads, query rows, keys) on which
    ``kernel`` still fails the judge of :func:`replay`, by greedy halving then single steps.

    A causal call keeps ``N_q == N_k`` when it had it (SDPA's top-left causal mask depends on both);
    grouped heads shrink in whole groups. Returns the shrunk call and the number of replays tried.

    Raises:
        ValueError: the call does not fail with ``kernel`` to begin with.
    """
    tries = 1
    if replay(call, [kernel], baseline=baseline)[kernel]["verdict"] != "fail":
        raise ValueError(f"the saved call does not fail with {kernel!r}: nothing to shrink")
    rep = call.q.shape[1] // max(call.k.shape[1], 1)
    dims = {"b": call.q.shape[0], "h": call.q.shape[1], "n_q": call.q.shape[2], "n_k": call.k.shape[2]}
    square = call.is_causal and dims["n_q"] == dims["n_k"]
    best = call
    changed = True
    while changed and tries < max_tries:
        changed = False
        for name in ("b", "h", "n_q", "n_k"):
            if square and name == "n_k":
                continue
            step = rep if name == "h" else 1
            candidates = sorted(
                {max(step, (dims[name] // 2) // step * step), dims[name] - step}, reverse=False
            )
            for size in candidates:
                if size < step or size >= dims[name] or tries >= max_tries:
                    continue
                trial = {**dims, name: size}
                if square and name == "n_q":
                    trial["n_k"] = size
                candidate = _sliced(call, trial["b"], trial["h"], trial["n_q"], trial["n_k"])
                tries += 1
                if replay(candidate, [kernel], baseline=baseline)[kernel]["verdict"] == "fail":
                    dims, best, changed = trial, candidate, True
                    break
    return best, tries
