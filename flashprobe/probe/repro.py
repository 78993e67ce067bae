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

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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

#: ``format`` in the metadata of every reproducer file.
REPRO_FORMAT = "flashprobe-repro-1"

_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16)
}


class ReproducerError(ValueError):
    """A reproducer file that cannot be read: not safetensors, not flashprobe's, or incomplete."""


@dataclass(frozen=True)
class Reproducer:
    """One saved attention call.

    Attributes:
        q: ``(B, H, N_q, D)``; k: ``(B, H_kv, N_k, D)``; v: ``(B, H_kv, N_k, D_v)``, in the call's
            layout (permuted views where the call had them).
        attn_mask: bool or additive mask broadcastable to ``(B, H, N_q, N_k)``, or None.
        grad_out: ``(B, H, N_q, D_v)`` output gradient (backward failures), or None.
        is_causal, scale: the call's arguments.
        meta: the rest of the metadata (``site``, ``direction``, ``step``, ``reason``, ``primary``,
            ``baseline``, ``dtype``, ``device``, versions).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    grad_out: torch.Tensor | None
    is_causal: bool
    scale: float | None
    meta: dict[str, Any]

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype


def reproducer_stem(site: str, step: int) -> str:
    """The file name (without suffix) of a reproducer: ``<site>.step<step>``, the site with every
    character but letters, digits, ``.``, ``_`` and ``-`` replaced by ``_``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", site).strip(".") or "attention"
    return f"{safe}.step{step:07d}"


def _memory_order(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``(stored, perm)``: ``t`` as a contiguous tensor in its memory order and the permutation with
    ``stored.permute(perm)`` equal to ``t`` (the identity for a contiguous ``t``)."""
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))
    stored = t.permute(order).contiguous()
    perm = [order.index(i) for i in range(t.dim())]
    return stored, perm


def save_reproducer(
    path: str | Path,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    grad_out: torch.Tensor | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write one call as a reproducer (``path`` ending in ``.safetensors``) and its script (``.py``).

    Both files are written atomically. Returns the ``.safetensors`` path.
    """
    from safetensors.torch import save_file

    from flashprobe import __version__
    from flashprobe.formats.atomic import atomic_write_file, atomic_write_text

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, list[int]] = {}
    named = {"q": q, "k": k, "v": v, "attn_mask": attn_mask, "grad_out": grad_out}
    for name, t in named.items():
        if t is None:
            continue
        stored, perm = _memory_order(t.detach())
        tensors[name] = stored.cpu()
        layout[name] = perm
    info = {
        **(meta or {}),
        "format": REPRO_FORMAT,
        "is_causal": bool(is_causal),
        "scale": scale,
        "dtype": str(q.dtype).removeprefix("torch."),
        "device": str(q.device),
        "layout": layout,
        "torch": torch.__version__,
        "flashprobe": __version__,
    }
    metadata = {"flashprobe": json.dumps(info, sort_keys=True)}
    atomic_write_file(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    atomic_write_text(path.with_suffix(".py"), _script(path.name, info))
    return path


def _script(name: str, info: dict[str, Any]) -> str:
    kernel = info.get("primary") or "sdpa_flash"
    return (
        f'"""Reproducer of a failing attention call: site {info.get("site")!r}, {info.get("direction")}, '
        f"step {info.get('step')}.\n\n{info.get('reason', '')}\n\n"
        f"Run: python {Path(name).with_suffix('.py').name} [KERNEL_SPEC ...]\n"
        f"(or: flashprobe replay {name} --kernel KERNEL_SPEC)\n"
        '"""\n\n'
        "import sys\nfrom pathlib import Path\n\n"
        "from flashprobe.probe.repro import load_reproducer, replay\n\n"
        f"call = load_reproducer(Path(__file__).with_name({name!r}))\n"
        f"kernels = sys.argv[1:] or [{kernel!r}]\n"
        "results = replay(call, kernels)\n"
        "for spec, result in results.items():\n"
        "    print(spec, result['verdict'], '; '.join(result['reasons']))\n"
        "sys.exit(1 if any(r['verdict'] == 'fail' for r in results.values()) else 0)\n"
    )


def load_reproducer(path: str | Path, device: torch.device | str | None = None) -> Reproducer:
    """Read a reproducer written by :func:`save_reproducer` (safetensors only; nothing unpickled).

    Args:
        path: the ``.safetensors`` file.
        device: where to put the tensors (default: the recorded device if it exists here, else CPU).

    Raises:
        ReproducerError: the file is missing, not safetensors, or not a flashprobe reproducer.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ReproducerError(f"{path}: no such file (a reproducer is a .safetensors file in repro/)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open API)
    except (SafetensorError, OSError, ValueError) as err:
        raise ReproducerError(f"{path}: not a safetensors file ({err})") from None
    try:
        info = json.loads(meta["flashprobe"])
        assert isinstance(info, dict), f"its metadata is a JSON {type(info).__name__}, not an object"
        assert info["format"] == REPRO_FORMAT
        missing = [n for n in ("q", "k", "v") if n not in tensors]
        assert not missing, f"missing tensors {missing}"
    except (KeyError, AssertionError, json.JSONDecodeError, TypeError) as err:
        raise ReproducerError(f"{path}: not a flashprobe reproducer ({err or 'no metadata'})") from None
    problem = _metadata_problem(info, tensors)
    if problem:
        raise ReproducerError(f"{path}: not a valid flashprobe reproducer: {problem}")
    if device is None:
        recorded = torch.device(info.get("device", "cpu"))
        usable = recorded.type == "cpu" or (recorded.type == "cuda" and torch.cuda.is_available())
        device = recorded if usable else torch.device("cpu")
    layout = info.get("layout", {})
    views = {n: t.to(device).permute(layout.get(n, list(range(t.dim())))) for n, t in tensors.items()}
    return Reproducer(
        q=views["q"],
        k=views["k"],
        v=views["v"],
        attn_mask=views.get("attn_mask"),
        grad_out=views.get("grad_out"),
        is_causal=bool(info.get("is_causal", False)),
        scale=info.get("scale"),
        meta=info,
    )


def _metadata_problem(info: Any, tensors: dict[str, torch.Tensor]) -> str | None:
    """What is wrong with a reproducer's metadata and tensors, in words, or ``None``: read as data,
    every field is checked for its type before it is used (``"is_causal": "no"`` is not True)."""
    if not isinstance(info.get("is_causal", False), bool):
        return f"is_causal is {info['is_causal']!r}, not true or false"
    scale = info.get("scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        return f"scale is {scale!r}, not a number or null"
    for key in ("device", "baseline"):
        if key in info and info[key] is not None and not isinstance(info[key], str):
            return f"{key} is {info[key]!r}, not a string"
    try:
        torch.device(info.get("device") or "cpu")
    except (RuntimeError, ValueError):
        return f"device {info['device']!r} is not a torch device"
    layout = info.get("layout", {})
    if not isinstance(layout, dict):
        return f"layout is {layout!r}, not an object of permutations"
    for name, t in tensors.items():
        order = layout.get(name, list(range(t.dim())))
        if not (isinstance(order, list) and sorted(order) == list(range(t.dim()))):
            return f"layout of {name} is {order!r}, not a permutation of its {t.dim()} dimensions"
    dtypes = {n: t.dtype for n, t in tensors.items() if n != "attn_mask" and t.is_floating_point()}
    if len(set(dtypes.values())) > 1:
        found = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for n, d in dtypes.items())
        return f"its tensors mix dtypes ({found}); a saved call has one compute dtype"
    return None


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
    from flashprobe.probe.shadow import ShadowAttention

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
