"""The reproducer file: failing attention calls as ``safetensors`` (never a pickle) plus a script.

The probe's (``repro/<site>.step<step>.safetensors``) and the fuzzer's (``repro_<case>_<hash>``)::

    NAME.safetensors   q, k, v, [attn_mask], [grad_out]; the metadata as JSON in its header
    NAME.py            python NAME.py [KERNEL_SPEC ...]: exits 1 while the failure reproduces,
                       0 once it passes, 2 when the kernel cannot be loaded

A permuted view is stored in memory order and given back as the same view (``layout``). A call of a
contract api (:mod:`flashprobe.kernels.contract`) is a :class:`ContractReproducer`; a sequence of
calls is written by :func:`save_sequence`. Old ``.pt`` reproducers are refused, never unpickled.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashprobe.errors import FlashprobeError

__all__ = [
    "REPRO_FORMAT",
    "ContractReproducer",
    "Reproducer",
    "ReproducerError",
    "is_contract_reproducer",
    "is_sequence_file",
    "kernel_module",
    "load_contract_reproducer",
    "load_reproducer",
    "load_sequence",
    "reproducer_stem",
    "save_reproducer",
    "save_sequence",
]

#: ``format`` in the metadata of every reproducer file.
REPRO_FORMAT = "flashprobe-repro-1"

#: The first bytes of a file ``torch.save`` wrote (a zip archive, or a legacy pickle).
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")


class ReproducerError(ValueError, FlashprobeError):
    """A reproducer file that cannot be read: not safetensors, not flashprobe's, or incomplete."""


@dataclass(frozen=True)
class Reproducer:
    """One saved attention call.

    Attributes:
        q: ``(B, H, N_q, D)``; k: ``(B, H_kv, N_k, D)``; v: ``(B, H_kv, N_k, D_v)``, in the call's
            layout (permuted views where the call had them).
        attn_mask: bool or additive mask broadcastable to ``(B, H, N_q, N_k)``, or None.
        grad_out: ``(B, H, N_q, D_v)`` output gradient (probe calls with a backward), or None.
        is_causal, scale: the call's arguments.
        meta: the rest of the metadata: ``primary`` (the kernel that failed), ``kernel_module`` (the
            user module that registered it), ``baseline``, ``reason``, ``dtype``, ``device``,
            versions; the probe's ``site``, ``direction``, ``step``; the fuzzer's ``fuzz``.
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

    def save(self, path: str | Path) -> Path:
        """Write this call to ``path`` (``.safetensors``) and its script (:func:`save_reproducer`)."""
        fields = ("q", "k", "v", "attn_mask", "grad_out", "is_causal", "scale", "meta")
        return save_reproducer(path, **{name: getattr(self, name) for name in fields})


def reproducer_stem(site: str, step: int) -> str:
    """A probe reproducer's file stem: ``<site>.step<step>``, the site reduced to ``[A-Za-z0-9._-]``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", site).strip(".") or "attention"
    return f"{safe}.step{step:07d}"


def kernel_module(kernel: Any) -> str | None:
    """The module of a user's kernel function, which a reproducer's script imports first; ``None``
    for a built-in kernel or ``__main__``."""
    module = getattr(getattr(kernel, "fn", None), "__module__", None)
    if not module or module.startswith("flashprobe.") or module == "__main__":
        return None
    return module


def _store(named: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The tensors among ``named`` as stored (contiguous in memory order, on the CPU, own memory)
    and ``layout``: per tensor the permutation giving back the original view."""
    tensors: dict[str, torch.Tensor] = {}
    layout: dict[str, list[int]] = {}
    for name, t in named.items():
        if isinstance(t, torch.Tensor):
            t = t.detach()
            order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))
            tensors[name] = t.permute(order).contiguous().to("cpu", copy=True)  # q, k, v may share memory
            layout[name] = [order.index(i) for i in range(t.dim())]
    return tensors, layout


def _write(path: str | Path, tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> Path:
    """Write ``tensors`` with ``info`` (plus format and versions) and the script beside it, both
    atomically; returns the ``.safetensors`` path."""
    from safetensors.torch import save_file

    from flashprobe import __version__
    from flashprobe.formats.atomic import atomic_write_file, atomic_write_text

    path = Path(path)
    info = {**info, "format": REPRO_FORMAT, "torch": torch.__version__, "flashprobe": __version__}
    metadata = {"flashprobe": json.dumps(info, sort_keys=True)}
    atomic_write_file(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    atomic_write_text(path.with_suffix(".py"), _script(path.name, info))
    return path


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
    """Write one call to ``path`` (``.safetensors``) and its script (``.py``), both atomically.

    Returns:
        The ``.safetensors`` path.
    """
    tensors, layout = _store({"q": q, "k": k, "v": v, "attn_mask": attn_mask, "grad_out": grad_out})
    info = {
        **(meta or {}),
        "is_causal": bool(is_causal),
        "scale": scale,
        "dtype": str(q.dtype).removeprefix("torch."),
        "device": str(q.device),
        "layout": layout,
    }
    return _write(path, tensors, info)


def _script(name: str, info: dict[str, Any]) -> str:
    """The script beside ``name``, running ``flashprobe replay`` of it (texts written as ``repr``)."""
    return f'''"""Reproducer saved by flashprobe: a failing attention call (the constants below).

Run it with `python` (`flashprobe replay` of the .safetensors file beside it), optionally with kernel
specs: it judges the call with each kernel (default: KERNEL) and exits 1 while one still fails, 0
once every one passes, and 2 when a kernel cannot be loaded (its module does not import): that says
nothing about the bug.
"""

import importlib
import sys
from pathlib import Path

from flashprobe.probing.replay_cli import main

KERNEL = {info.get("primary") or "sdpa_flash"!r}
KERNEL_MODULE = {info.get("kernel_module")!r}  # imported first: it registers KERNEL (None: built in)
CASE = {(info.get("fuzz") or {}).get("case")!r}  # the fuzz case (None: a call saved in training)
SITE = {info.get("site")!r}
REASON = {info.get("reason")!r}  # the failure when the reproducer was saved

try:
    if KERNEL_MODULE:
        importlib.import_module(KERNEL_MODULE)
except Exception as err:  # exit 2, not 1: a kernel that cannot be loaded says nothing about the bug
    print(f"cannot load the kernel {{KERNEL}}: {{type(err).__name__}}: {{err}}", file=sys.stderr)
    sys.exit(2)
kernels = [arg for spec in sys.argv[1:] or [KERNEL] for arg in ("--kernel", spec)]
sys.exit(main([str(Path(__file__).with_name({name!r})), *kernels]))
'''


def _read(path: str | Path, *, tensors: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file's header metadata and (with ``tensors``) its tensors by name; any bytes in
    the path. Raises what safetensors raises."""
    from safetensors import safe_open

    from flashprobe.formats.paths import library_path

    with library_path(path) as name, safe_open(name, framework="pt") as f:
        found = {n: f.get_tensor(n) for n in f.keys()} if tensors else {}  # noqa: SIM118 (safe_open API)
        return f.metadata() or {}, found


def load_reproducer(path: str | Path, device: torch.device | str | None = None) -> Reproducer:
    """Read a reproducer written by :func:`save_reproducer` (safetensors only; nothing unpickled).

    Args:
        path: the ``.safetensors`` file.
        device: where to put the tensors (default: the recorded device if it exists here, else CPU).

    Raises:
        ReproducerError: the file is missing, not safetensors (an old ``.pt`` one: saying so), not
            flashprobe's, of another format version, or not one valid attention call (the field
            named); all before any kernel runs.
    """
    from safetensors import SafetensorError

    path = Path(path)
    if not path.is_file():
        raise ReproducerError(f"{path}: no such file (a reproducer is a .safetensors file)")
    try:
        meta, tensors = _read(path)
    except (SafetensorError, OSError, ValueError) as err:
        with path.open("rb") as file:
            pickled = file.read(4).startswith(_PICKLE_MAGIC)
        if pickled or path.suffix == ".pt":
            raise ReproducerError(
                f"{path}: a reproducer in the old .pt format (a torch pickle, written by an older "
                "flashprobe fuzz); flashprobe does not unpickle files it is handed. Run the same "
                "`flashprobe fuzz` again (same --kernel, --case, --seed) to save it as .safetensors"
            ) from None
        raise ReproducerError(f"{path}: not a safetensors file ({err})") from None
    try:
        info = json.loads(meta["flashprobe"])
        assert isinstance(info, dict), f"its metadata is a JSON {type(info).__name__}, not an object"
        if SEQUENCE in info:
            raise ReproducerError(f"{path}: {_SEQUENCE_FIX}")
        missing = [n for n in ("q", "k", "v") if n not in tensors]
        assert not missing, f"missing tensors {missing}"
    except (KeyError, AssertionError, json.JSONDecodeError, TypeError) as err:
        raise ReproducerError(f"{path}: not a flashprobe reproducer ({err or 'no metadata'})") from None
    info = _printable_text(info)  # shown on a terminal: no escape sequence of the file's acts on it
    if info.get("format") != REPRO_FORMAT:
        raise ReproducerError(f"{path}: {_format_problem(info)}")
    problem = _metadata_problem(info, tensors)
    if not problem:
        layout = info.get("layout", {})
        views = {n: t.permute(layout.get(n, list(range(t.dim())))) for n, t in tensors.items()}
        problem = _call_problem(views, is_causal=info.get("is_causal", False))
    if problem:
        raise ReproducerError(
            f"{path}: not a valid flashprobe reproducer: {problem}. flashprobe never writes such a file, "
            "so it was changed or written by something else; save the call again (the probe saves it in "
            "training, `flashprobe fuzz` a failing case)"
        )
    if device is None:
        recorded = torch.device(info.get("device", "cpu"))
        usable = recorded.type == "cpu" or (recorded.type == "cuda" and torch.cuda.is_available())
        device = recorded if usable else torch.device("cpu")
    views = {n: t.to(device) for n, t in views.items()}
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


def _printable_text(value: Any) -> Any:
    """``value`` with every string in it :func:`~flashprobe.formats.paths.printable`."""
    from flashprobe.formats.paths import printable

    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(k): _printable_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_text(v) for v in value]
    return value


def _format_problem(info: dict[str, Any]) -> str:
    """Why a file whose metadata is not of :data:`REPRO_FORMAT` is refused, naming both formats."""
    found = info.get("format")
    if not isinstance(found, str) or not found.startswith("flashprobe-repro-"):
        return (
            f"not a flashprobe reproducer (its metadata's format is {found!r}, not {REPRO_FORMAT!r}); "
            "give a .safetensors file the probe or `flashprobe fuzz` saved"
        )
    from flashprobe import __version__

    writer = info.get("flashprobe")
    by = f", written by flashprobe {writer}" if isinstance(writer, str) else ""
    return (
        f"a reproducer of format {found!r}{by}; this flashprobe ({__version__}) reads format "
        f"{REPRO_FORMAT!r} only. Replay it with the flashprobe that wrote it, or save the call again "
        "with this one"
    )


def _call_problem(views: dict[str, torch.Tensor], *, is_causal: bool) -> str | None:
    """Why the saved tensors are not one attention call (:func:`~flashprobe.kernels.check_inputs`,
    GQA allowed; ``grad_out`` of shape ``(B, H, N_q, D_v)``), or ``None``."""
    from flashprobe.kernels import KernelInputError, check_inputs

    q, k, v, mask = views["q"], views["k"], views["v"], views.get("attn_mask")
    try:
        check_inputs(q, k, v, mask, is_causal, kernel="the saved call", gqa=True)
    except KernelInputError as err:
        problem = str(err).removeprefix("the saved call: ").split("; ")[0]  # (not a caller's fix)
        return f"its tensors are not one attention call ({problem})"
    grad_out = views.get("grad_out")
    expected = (*q.shape[:3], v.shape[3])
    if grad_out is not None and tuple(grad_out.shape) != expected:
        return f"grad_out has shape {tuple(grad_out.shape)}, not the output's (B, H, N_q, D_v) {expected}"
    return None


def _metadata_problem(info: Any, tensors: dict[str, torch.Tensor]) -> str | None:
    """What is wrong with a reproducer's metadata and tensors, or ``None`` (every field type-checked)."""
    if not isinstance(info.get("is_causal", False), bool):
        return f"is_causal is {info['is_causal']!r}, not true or false"
    scale = info.get("scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        return f"scale is {scale!r}, not a number or null"
    if scale is not None and not abs(scale) <= sys.float_info.max:  # (NaN compares false)
        return f"scale is {scale!r}, not a finite number or null"
    for key in ("device", "baseline", "primary", "kernel_module", "reason"):
        if key in info and info[key] is not None and not isinstance(info[key], str):
            return f"{key} is {info[key]!r}, not a string"
    fuzz = info.get("fuzz", {})
    if not isinstance(fuzz, dict):
        return f"fuzz is {fuzz!r}, not an object"
    for key, kind in (("case", str), ("layout", str), ("poison", str), ("backward", bool), ("bias", bool)):
        if key in fuzz and not isinstance(fuzz[key], kind):
            return f"fuzz.{key} is {fuzz[key]!r}, not a {'string' if kind is str else 'true or false'}"
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


# ---- sequences: several calls in one process, in order (flashprobe fuzz's seq_* checks) ----------

#: The metadata key of a sequence reproducer: its calls, in order (:mod:`flashprobe.fuzz.sequences`).
SEQUENCE = "sequence"
_SEQUENCE_FIX = (
    "a sequence of calls (flashprobe fuzz's seq_* checks), replayed call by call in one process: "
    "run flashprobe replay FILE"
)


def save_sequence(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write a sequence of calls (``meta["sequence"]``) and the tensors its steps name as one
    reproducer, with its script; both atomically."""
    stored = {n: t.detach().to("cpu").contiguous().clone() for n, t in tensors.items()}
    return _write(path, stored, meta)


def is_sequence_file(path: str | Path) -> bool:
    """Whether ``path`` is a readable sequence reproducer (:func:`save_sequence`)."""
    try:
        return SEQUENCE in load_sequence(path, tensors=False)[1]
    except ReproducerError:
        return False


def load_sequence(
    path: str | Path, *, tensors: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a sequence reproducer: its tensors by name (none with ``tensors=False``) and metadata.

    The steps are checked by their reader (:func:`flashprobe.fuzz.sequences.replay_sequence`).

    Raises:
        ReproducerError: not a safetensors file, not flashprobe's, of another format, or no sequence.
    """
    from safetensors import SafetensorError

    path = Path(path)
    try:
        meta, found = _read(path, tensors=tensors)
        info = json.loads(meta.get("flashprobe", "null"))
    except (SafetensorError, OSError, ValueError) as err:
        raise ReproducerError(f"{path}: not a safetensors reproducer ({err})") from None
    if not isinstance(info, dict) or info.get("format") != REPRO_FORMAT or SEQUENCE not in info:
        raise ReproducerError(f"{path}: not a sequence reproducer of format {REPRO_FORMAT!r}")
    return found, info


# ---- contract reproducers: a call of any api (flashprobe.kernels.AttentionCall), every tensor stored

#: The scalar fields of an :class:`~flashprobe.kernels.AttentionCall`, stored in ``contract.fields``.
_CONTRACT_SCALARS = (
    "layout", "max_seqlen_q", "max_seqlen_k", "kv_layout", "causal", "align", "window", "softcap", "scale",
    "return_lse", "lse_base", "split_k", "num_splits",
)  # fmt: skip


@dataclass(frozen=True)
class ContractReproducer:
    """One saved call of a contract api (``flash_attn_varlen_func``, paged, KV cache, ``merge_state``).

    Every tensor field of the call is stored under its name, the rest in the metadata's ``contract``.

    Attributes:
        call: the :class:`~flashprobe.kernels.AttentionCall`, its tensors as handed to the kernel
            (NaN in unused pages, a poisoned ``out=``).
        meta: ``primary``, ``kernel_module``, ``reason``, ``directions`` and ``fuzz``; ``contract``:
            ``api``, ``refuse`` (the call must be refused, why), ``backward``, ``property``.
    """

    call: Any
    meta: dict[str, Any]

    @property
    def q(self) -> torch.Tensor:
        return self.call.q

    @property
    def k(self) -> torch.Tensor:
        return self.call.k

    @property
    def v(self) -> torch.Tensor:
        return self.call.v

    @property
    def dtype(self) -> torch.dtype:
        return self.call.q.dtype

    def save(self, path: str | Path) -> Path:
        """Write the call to ``path`` (``.safetensors``) and its script, both atomically."""
        call = self.call
        tensors, layout = _store({name: getattr(call, name) for name in call.__dataclass_fields__})
        fields = {n: getattr(call, n) for n in _CONTRACT_SCALARS}
        fields["window"] = list(fields["window"])
        if not isinstance(call.cache_seqlens, torch.Tensor):
            fields["cache_seqlens"] = call.cache_seqlens
        info = {
            **self.meta,
            "contract": {**self.meta.get("contract", {}), "fields": fields},
            "format": REPRO_FORMAT,
            "is_causal": bool(call.causal),
            "scale": call.scale,
            "dtype": str(call.q.dtype).removeprefix("torch."),
            "device": str(call.q.device),
            "layout": layout,
        }
        return _write(path, tensors, info)


def is_contract_reproducer(path: str | Path) -> bool:
    """Whether ``path`` is a reproducer of a contract call (False for any other file)."""
    try:
        info = json.loads(_read(path, tensors=False)[0].get("flashprobe", "{}"))
    except Exception:
        return False
    return isinstance(info, dict) and isinstance(info.get("contract"), dict)


def load_contract_reproducer(
    path: str | Path, device: torch.device | str | None = None
) -> ContractReproducer:
    """Read a :class:`ContractReproducer` (safetensors only; nothing unpickled).

    Raises:
        ReproducerError: the file is not one, of another format version, or its fields are not those
            of a call (the field named).
    """
    from flashprobe.kernels import AttentionCall

    path = Path(path)
    try:
        meta, tensors = _read(path)
        info = json.loads(meta["flashprobe"])
    except Exception as err:
        raise ReproducerError(f"{path}: not a flashprobe reproducer ({type(err).__name__}: {err})") from None
    if info.get("format") != REPRO_FORMAT:
        raise ReproducerError(f"{path}: {_format_problem(info)}")
    contract = info.get("contract")
    fields = contract.get("fields") if isinstance(contract, dict) else None
    names = {f for f in AttentionCall.__dataclass_fields__}
    problem = None
    if not isinstance(fields, dict) or not isinstance(contract.get("api"), str):
        problem = "contract.fields or contract.api missing"
    elif unknown := sorted((set(fields) | set(tensors)) - names):
        problem = f"{unknown[0]!r} is not a field of an attention call"
    elif missing := [n for n in ("q", "k", "v") if n not in tensors]:
        problem = f"missing tensors {missing}"
    if problem:
        raise ReproducerError(f"{path}: not a valid contract reproducer: {problem}; save the call again")
    if device is None:
        recorded = torch.device(info.get("device", "cpu"))
        device = recorded if recorded.type == "cpu" or torch.cuda.is_available() else torch.device("cpu")
    layout = info.get("layout", {})
    values: dict[str, Any] = {
        n: t.permute(layout.get(n, list(range(t.dim())))).to(device) for n, t in tensors.items()
    }
    values.update({n: tuple(v) if n == "window" else v for n, v in fields.items()})
    try:
        call = AttentionCall.unchecked(**values)
    except TypeError as err:
        raise ReproducerError(f"{path}: not a valid contract reproducer: {err}") from None
    return ContractReproducer(call, info)
