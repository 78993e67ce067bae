"""The reproducer file: one attention call saved as ``safetensors`` (no pickle) plus a Python script.

The format is described in :mod:`flashprobe.probe.repro`, which also replays and shrinks the calls;
this module only writes and reads the files (the probe saves them from
:class:`~flashprobe.probe.ShadowAttention`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "REPRO_FORMAT",
    "Reproducer",
    "ReproducerError",
    "load_reproducer",
    "reproducer_stem",
    "save_reproducer",
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
