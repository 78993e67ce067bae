"""Reproducers replayed and shrunk: the one path of the probe, ``flashprobe fuzz``, ``fuzz --from``
and ``flashprobe replay``.

A reproducer (:mod:`flashprobe.formats.reproducer`) is a call the probe saved in training or a case the
fuzzer saved. :func:`replay` judges it again for any kernel spec with the judge that found it (a call
through a :class:`~flashprobe.probing.ShadowAttention`: :func:`replay_call`; a case with the judge its
caller passes); :func:`shrink_reproducer` cuts either to the smallest call that still fails the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from flashprobe.formats.reproducer import (
    REPRO_FORMAT,
    Reproducer,
    ReproducerError,
    load_reproducer,
    reproducer_stem,
    save_reproducer,
)
from flashprobe.kernels import KernelSpecError, get_kernel
from flashprobe.probing.shadow import ShadowAttention
from flashprobe.probing.stats import site_directions

__all__ = [
    "REPRO_FORMAT",
    "Judge",
    "Reproducer",
    "ReproducerError",
    "load_reproducer",
    "replay",
    "replay_baseline",
    "replay_call",
    "replay_kernels",
    "reproducer_stem",
    "save_reproducer",
    "shrink_reproducer",
]

#: ``judge(call, spec, baseline) -> result``: one kernel spec's verdict on a saved call, in the form
#: :func:`replay` returns per spec
Judge = Callable[[Reproducer, str, str], dict[str, Any]]


def replay(
    call: Reproducer, kernels: Sequence[str], *, baseline: str | None = None, judge: Judge | None = None
) -> dict[str, dict[str, Any]]:
    """Run the saved call through each kernel spec and judge it with the judge that found it: a call
    saved in training with :func:`replay_call` (forward, and backward when the file holds an output
    gradient), a fuzz case with ``judge`` (the fuzzer's :func:`flashprobe.fuzz.reproducer.replay_case`).

    Returns:
        ``{spec: {"verdict": "pass"|"fail"|"undetermined"|"error", "reasons": [...], "failure": the
        kind of failure (a probe call's first failing direction, a case's kind) or None,
        "directions": {dir: verdict}, "limit_ratio": {dir: ...}, "l2_error_ratio": {dir: ...}}}``.

    Raises:
        ReproducerError: a fuzz case without ``judge``, or a recorded baseline that is not a kernel
            here (:func:`replay_baseline`).
    """
    if judge is None:
        if call.meta.get("fuzz") is not None:
            raise ReproducerError(
                "the file is a case flashprobe fuzz saved: judge it as the fuzzer does, "
                "replay(..., judge=flashprobe.fuzz.reproducer.replay_case)"
            )
        judge = replay_call
    base = replay_baseline(call, baseline)
    return {spec: judge(call, spec, base) for spec in kernels}


def replay_baseline(call: Reproducer, baseline: str | None = None) -> str:
    """The baseline a replay of ``call`` judges with: ``baseline``, else the recorded one, else ``math``.

    Raises:
        ReproducerError: the recorded baseline is not a kernel here.
    """
    if baseline:
        return baseline
    recorded = call.meta.get("baseline") or "math"
    try:
        get_kernel(recorded)
    except KernelSpecError as err:
        module = call.meta.get("kernel_module")
        also = f", or --import {module} if it registers {recorded!r}" if module else ""
        raise ReproducerError(
            f"the call's recorded baseline {recorded!r} cannot be used here ({err}); name the baseline to "
            f"judge against with --baseline SPEC, e.g. --baseline math{also}"
        ) from None
    return recorded


def replay_kernels(
    call: Reproducer, kernels: Sequence[str] | None, baseline: str | None = None
) -> tuple[list[str], str]:
    """The kernel specs (``kernels``, else the recorded primary) and the baseline
    (:func:`replay_baseline`) a replay of ``call`` runs with, checked before any kernel runs.

    Raises:
        ReproducerError: no kernel given and none recorded, or a spec that is not a kernel here.
    """
    specs = list(kernels or ([call.meta["primary"]] if call.meta.get("primary") else []))
    if not specs:
        raise ReproducerError(
            "the call was made with torch's own scaled_dot_product_attention (no primary recorded); "
            "name the kernels to replay with --kernel, e.g. --kernel sdpa_flash --kernel sdpa_math"
        )
    module = call.meta.get("kernel_module")
    hint = f"the call recorded --import {module}" if module else "pass --import MODULE"
    given = [("--kernel", k) for k in specs] + ([("--baseline", baseline)] if baseline else [])
    for flag, spec in given:
        try:
            get_kernel(spec)
        except KernelSpecError as err:
            raise ReproducerError(
                f"{flag} {spec!r}: {err} ({hint} for a kernel registered in your code)"
            ) from None
    return [k.strip() for k in specs], replay_baseline(call, baseline and baseline.strip())


def replay_call(call: Reproducer, spec: str, baseline: str) -> dict[str, Any]:
    """A call saved in training, judged with ``spec`` as the probe judges it (the default :data:`Judge`)."""
    backward, site = call.grad_out is not None, call.meta.get("site") or "attention"
    try:
        shadow = ShadowAttention(
            primary=spec, baseline=baseline, backward=backward, name=site, on_failure="ignore"
        )
        # clone() keeps the saved layout: a permuted view keeps its strides
        q, k, v = (t.detach().clone().requires_grad_(backward) for t in (call.q, call.k, call.v))
        with torch.enable_grad():
            arguments = {"attn_mask": call.attn_mask, "is_causal": call.is_causal, "scale": call.scale}
            out = shadow(q, k, v, **arguments, enable_gqa=q.shape[1] > k.shape[1])
            if call.grad_out is not None:
                out.backward(call.grad_out.to(out.dtype))
        entry = shadow.stats()[site]
    except Exception as err:  # a kernel that raises on the call is a result, not a crash
        reasons = [f"{type(err).__name__}: {err}"]
        return {"verdict": "error", "reasons": reasons, "failure": None, "directions": {}} | {
            "limit_ratio": {},
            "l2_error_ratio": {},
        }
    directions = site_directions(entry) if backward else {"out": entry["forward"]["out"]}
    verdicts = {d: e["verdict"] for d, e in directions.items() if e["verdict"] is not None}
    reasons = [
        f"{d}: {e['first_failure']['reason']}" for d, e in directions.items() if e.get("first_failure")
    ]
    if entry.get("shadow_errors"):
        reasons.append(f"{entry['shadow_errors']} reference computation(s) failed")
    verdict = next(
        (v for v in ("fail", "pass") if v in verdicts.values()), "undetermined" if verdicts else "error"
    )
    return {
        "verdict": verdict,
        "reasons": reasons,
        "failure": next((d for d, v in verdicts.items() if v == "fail"), None),
        "directions": verdicts,
        "limit_ratio": {d: e["limit_ratio"] for d, e in directions.items()},
        "l2_error_ratio": {d: e["l2_error_ratio"] for d, e in directions.items()},
    }


#: per axis of :func:`_cut`, the dimension it cuts in q, k, v, grad_out and the 4-D mask (None: not cut)
_CUT_DIMS = {
    "batch": (0, 0, 0, 0, 0),
    "heads": (1, 1, 1, 1, 1),
    "n_q": (2, None, None, 2, 2),
    "n_k": (None, 2, 2, None, 3),
    "head_dim": (3, 3, None, None, None),
    "head_dim_v": (None, None, 3, 3, None),
}


def _cut(call: Reproducer, axis: str, start: int, stop: int) -> Reproducer:
    """The call cut to ``[start, stop)`` along ``axis`` (of :data:`_CUT_DIMS`, or ``n``: rows and keys
    together); ``heads`` are query heads, whole GQA groups, cut with their key/value heads."""
    rep = call.q.shape[1] // max(call.k.shape[1], 1)
    tensors = [call.q, call.k, call.v, call.grad_out, call.attn_mask]
    if call.attn_mask is not None:  # broadcastable to (B, H, N_q, N_k): as a 4-D view
        tensors[4] = call.attn_mask.reshape((1,) * (4 - call.attn_mask.dim()) + tuple(call.attn_mask.shape))
    for name in ("n_q", "n_k") if axis == "n" else (axis,):
        for i, (t, dim) in enumerate(zip(tensors, _CUT_DIMS[name], strict=True)):
            if dim is None or t is None or (i == 4 and t.shape[dim] == 1):  # a broadcast mask dim
                continue
            kv = name == "heads" and i in (1, 2)  # key/value heads: one per group of query heads
            index = [slice(None)] * dim + [slice(start // rep, stop // rep) if kv else slice(start, stop)]
            tensors[i] = t[tuple(index)]
    q, k, v, grad_out, mask = tensors
    return replace(call, q=q, k=k, v=v, grad_out=grad_out, attn_mask=mask)


def _simplified(call: Reproducer) -> Iterator[Reproducer]:
    """The call made plainer, one way at a time: contiguous and unpoisoned, then GQA heads repeated."""
    fuzz = call.meta.get("fuzz") or {}
    strided = not all(t.is_contiguous() for t in (call.q, call.k, call.v))
    if strided or fuzz.get("layout", "contiguous") != "contiguous" or fuzz.get("poison"):
        meta = {**call.meta, "fuzz": {**fuzz, "layout": "contiguous", "poison": ""}} if fuzz else call.meta
        q, k, v = (t.contiguous() for t in (call.q, call.k, call.v))
        yield replace(call, q=q, k=k, v=v, meta=meta)
    rep = call.q.shape[1] // max(call.k.shape[1], 1)
    if rep > 1:
        k, v = (t.repeat_interleave(rep, dim=1) for t in (call.k, call.v))
        yield replace(call, k=k, v=v, meta={**call.meta, "gqa_rep": 1})


def _smaller(call: Reproducer, axis: str) -> Iterator[Reproducer]:
    """Cuts along ``axis``: each half, all but the last step, all but the first (heads: a GQA group)."""
    rep = call.q.shape[1] // max(call.k.shape[1], 1)
    dims = zip((call.q, call.k, call.v), _CUT_DIMS["n_q" if axis == "n" else axis], strict=False)
    n = next(t.shape[dim] for t, dim in dims if dim is not None)  # the axis's size, in q, else k or v
    step = rep if axis == "heads" else 1
    half = (n // 2) // step * step
    windows = [(0, half), (n - half, n), (0, n - step), (step, n)]
    for start, stop in dict.fromkeys(windows):
        if 0 < stop - start < n:
            yield _cut(call, axis, start, stop)


def _has_fully_masked_row(call: Reproducer) -> bool:
    """Whether some query row of ``call`` sees no key (SDPA's top-left causal mask leaves each key 0)."""
    mask = call.attn_mask
    if mask is None or call.k.shape[2] == 0:
        return call.k.shape[2] == 0 and call.q.shape[2] > 0
    sees = mask if mask.dtype == torch.bool else mask > float("-inf")
    return not bool(sees.any(-1).all())


def shrink_reproducer(
    call: Reproducer,
    kernel: str,
    *,
    baseline: str | None = None,
    max_tries: int = 120,
    judge: Judge | None = None,
) -> tuple[Reproducer, int]:
    """The smallest cut of the call on which ``kernel`` still fails :func:`replay` with the same
    ``failure``.

    Greedy: along each axis in turn (query rows and keys, together for a square causal call; batch;
    whole GQA head groups; head dims) a half, else all but one step, while one still fails; then the
    plain layout and heads; repeated while anything shrank. Cuts outside the kernel's declared limits,
    and cuts leaving a query row that sees no key (a convention case) unless the call had one, are not
    tried. The shrunk call's ``reason`` is the failure on it.

    Returns:
        The shrunk call and the number of replays tried (at most ``max_tries``).

    Raises:
        ValueError: the call does not fail with ``kernel`` to begin with.
        ReproducerError: as :func:`replay`.
    """
    first = replay(call, [kernel], baseline=baseline, judge=judge)[kernel]
    if first["verdict"] != "fail":
        raise ValueError(f"the saved call does not fail with {kernel!r}: nothing to shrink")
    caps = get_kernel(kernel).capabilities
    square = call.is_causal and call.q.shape[2] == call.k.shape[2]
    axes = (*(("n",) if square else ("n_q", "n_k")), "batch", "heads", "head_dim", "head_dim_v")
    best, tries = call, 1
    masked = _has_fully_masked_row(call)

    def fails(candidate: Reproducer) -> bool:
        nonlocal best, tries
        if tries >= max_tries or caps.call_problem(
            candidate.q, candidate.k, candidate.v, candidate.attn_mask, candidate.is_causal
        ):
            return False
        if not masked and _has_fully_masked_row(candidate):  # a convention case, not the failure
            return False
        tries += 1
        result = replay(candidate, [kernel], baseline=baseline, judge=judge)[kernel]
        if result["verdict"] != "fail" or result["failure"] != first["failure"]:
            return False
        best = replace(candidate, meta={**candidate.meta, "reason": "; ".join(result["reasons"])})
        return True

    changed = True
    while changed and tries < max_tries:
        changed = False
        for axis in axes:
            while any(fails(c) for c in _smaller(best, axis)):
                changed = True
        changed |= any(fails(c) for c in _simplified(best))
    return best, tries
