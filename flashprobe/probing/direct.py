"""Attention libraries called directly inside an attached model: what their sources share.

transformers' ``flash_attention_2``, inference engines and training loops call fused kernels
(flash-attn, FlashInfer, PyTorch's ``varlen_attn``) that never reach SDPA. While a probe is attached,
each library's source swaps its entry points (:class:`DirectFunctions`) and each call made inside the
probed model becomes a site: its arguments are bound by the library's own signature, read as a
:class:`LibraryCall` (an :class:`~flashprobe.kernels.AttentionCall`, read before the library runs: a
KV-cache call appends in place), compared with the references of :func:`prepare_call` (output, LSE,
and gradients where the library has a backward), and the model gets the library's own return. A call
using what flashprobe cannot compare runs unchanged, with one warning per site (:func:`unexpressed`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from flashprobe.kernels import AttentionCall, CallOutput
from flashprobe.kernels.math import reference_arguments
from flashprobe.probing import patching
from flashprobe.probing.call import Prepared
from flashprobe.probing.sites import Resolution, probing_caller

__all__ = [
    "DirectFunctions",
    "LibraryCall",
    "Reader",
    "bind_arguments",
    "function_wrapper",
    "mark_original",
    "original_of",
    "prepare_call",
    "signature_of",
    "unexpressed",
]

#: a library's own tensors by name, replaced in a call run again (the shadow's tapped tensors)
Tensors = Mapping[str, torch.Tensor]


@dataclasses.dataclass
class LibraryCall:
    """One call of an attention library, read before the library ran.

    Attributes:
        what: the entry point, for messages (``"flash_attn.flash_attn_func"``).
        call: the call in the library's storage (dense, packed, paged, a cache) and LSE base.
        run: ``run(None, None)`` calls the library with the caller's own arguments (once: a cache
            call appends in place); ``run(tensors, dropout_p)`` with ``q``, ``k``, ``v`` replaced.
        outputs: the library's return in the logical form: ``out`` ``(B, H, n_q, D_v)`` and, with
            ``call.return_lse``, the LSE ``(B, H, n_q)`` in ``call.lse_base``.
        dropout_p: the call's attention dropout (compared dropout-free).
        reference: the logical call the references compute, where it is not ``call.logical()``.
        differentiable: the library has a backward for this call (gradients compared).
        dtype: the dtype the verdict's limits are taken at (default: q's).
        tensors: ``q``, ``k``, ``v`` as the library got them (default: the call's).
    """

    what: str
    call: AttentionCall
    run: Callable[[Tensors | None, float | None], Any]
    outputs: Callable[[Any], CallOutput]
    dropout_p: float = 0.0
    reference: AttentionCall | None = None
    differentiable: bool = False
    dtype: torch.dtype | None = None
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tensors:
            self.tensors = {"q": self.call.q, "k": self.call.k, "v": self.call.v}

    @property
    def storage_problem(self) -> str | None:
        """Why an explicit primary kernel cannot stand in for the library here, or None."""
        if self.call.return_lse:
            return "returns an LSE, which an explicit primary kernel's output does not carry"
        if self.call.storage not in ("dense", "packed") or self.reference is not None:
            return f"has {self.call.storage} storage, which an explicit primary kernel does not write"
        return None


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def prepare_call(lib: LibraryCall) -> Prepared:
    """The references' detached arguments of a library call, read before the library runs: its logical
    form in the compute dtype (float32 for FP8) with its terms beyond SDPA's
    (:func:`~flashprobe.kernels.math.reference_arguments`)."""
    source = lib.reference if lib.reference is not None else lib.call
    call = AttentionCall.unchecked(
        **{f.name: _detached(getattr(source, f.name)) for f in dataclasses.fields(source)}
    )
    compute = torch.float32 if call.fp8 else call.q.dtype
    with torch.no_grad():
        logical, q, k, v, mask, causal, terms = reference_arguments(call, compute)
    dtype = lib.dtype or lib.call.q.dtype  # FP8 inputs: judged at FP8's precision
    lse = lib.call.lse_base if lib.call.return_lse else None
    return Prepared(q, k, v, mask, causal, logical.scale, logical.group, dtype, terms, lse)


# --- Which arguments a reader leaves out ---


def unexpressed(
    named: Mapping[str, Any],
    read: Collection[str],
    harmless: Collection[str] = (),
    off: Mapping[str, tuple[Any, ...]] | None = None,
) -> str | None:
    """``"uses NAME, NAME, which flashprobe does not compare"`` for the arguments in ``named`` that are
    not ``read``, not ``harmless`` and not off (``off[name]``'s values, else None), or None."""
    bad = []
    for name, value in named.items():
        if name in read or name in harmless:
            continue
        allowed = (off or {}).get(name, (None,))
        try:
            fine = (
                not isinstance(value, torch.Tensor)
                and (tuple(value) if isinstance(value, list | tuple) else value) in allowed
            )
        except TypeError:
            fine = False
        if not fine:
            bad.append(name)
    return f"uses {', '.join(bad)}, which flashprobe does not compare" if bad else None


# --- Binding and swapping ---

#: A source's reader: ``read(named, library, own)`` → a :class:`LibraryCall`, a reason not to compare
#: (a string), or None (run unchanged); ``own()`` calls the library with the caller's arguments.
Reader = Callable[[dict[str, Any], Callable[..., Any], Callable[[], Any]], "LibraryCall | str | None"]


def signature_of(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def bind_arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The caller's arguments by parameter name (``**kwargs`` merged, extra positionals under
    ``*name``), or None when they do not bind."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            named.update(named.pop(param.name, {}))
        elif param.kind is param.VAR_POSITIONAL and named.pop(param.name, ()):
            named[f"*{param.name}"] = bound.arguments[param.name]
    return named


def _probe_call(
    res: Resolution,
    what: str,
    original: Callable[..., Any],
    signature: inspect.Signature,
    read: Reader,
    args: tuple,
    kwargs: dict,
) -> Any:
    """One direct call at ``res.site``: read and handed to the probe, or run unchanged."""

    def own() -> Any:  # the caller's arguments, exactly
        return original(*args, **kwargs)

    probe = res.probe
    if probe.shadow.primary is None and not probe.will_compare(res.site):
        probe.count_call(res.site)  # not sampled: not read, the library's own call
        return own()
    named = bind_arguments(signature, args, kwargs)
    if named is None:
        return own()
    try:
        found = read(named, lambda **kw: original(**kw), own)
    except Exception as err:  # arguments the reader cannot read: never break the model's call
        found = f"could not be read ({type(err).__name__}: {err})"
    if isinstance(found, LibraryCall) and probe.shadow.primary is not None:
        problem = found.storage_problem
        found = found if problem is None else f"{problem}; it runs the library"
    if found is None:
        return own()
    if isinstance(found, str):
        probe.warn_once(
            ("direct-unsupported", res.site, what),
            f"flashprobe: the {what} call at site {res.site!r} {found}; it runs unchanged and is not "
            "compared",
        )
        return own()
    found.what = what
    return probe.handle_library(res.site, found)


def mark_original(wrapper: Any, original: Any) -> Any:
    """``wrapper``, marked as the replacement of ``original`` (:func:`original_of`)."""
    wrapper.__flashprobe_original__ = original
    return wrapper


def original_of(fn: Any) -> Any:
    """The library's function behind a flashprobe replacement (``fn`` itself when it is none)."""
    return getattr(fn, "__flashprobe_original__", fn)


def function_wrapper(original: Callable[..., Any], read: Reader, what: str) -> Callable[..., Any]:
    """The probed replacement of one library entry point: a call inside a probed model is a site, any
    other runs the original; it keeps the original's name and signature (transformers inspects them)."""
    signature = signature_of(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        res = probing_caller(sys._getframe(1))
        if res is None or signature is None:
            return original(*args, **kwargs)
        return _probe_call(res, what, original, signature, read, args, kwargs)

    return mark_original(wrapper, original)


class DirectFunctions:
    """A library's direct entry points, swapped where their modules are imported.

    Args:
        entries: ``(module, function, read)``: ``module.function`` is swapped when ``module`` is in
            ``sys.modules``.
        callers: modules holding the library's functions in their globals (transformers' helper).
    """

    def __init__(self, entries: Sequence[tuple[str, str, Reader]], callers: Sequence[str] = ()) -> None:
        self.entries = tuple(entries)
        self.callers = tuple(callers)
        self._found: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, replacement)

    def install(self) -> None:
        """Swap the entry points of the imported modules."""
        self._found.clear()
        for module_name, function, read in self.entries:
            library = sys.modules.get(module_name)
            fn = original_of(getattr(library, function, None)) if library is not None else None
            if not callable(fn):
                continue
            found = self._found.get(id(fn))
            if found is None or found[0] is not fn:
                found = self._found[id(fn)] = (fn, function_wrapper(fn, read, f"{module_name}.{function}"))
            patching.patch(vars(library), function, found[1])
        for module_name in self.callers:
            caller = sys.modules.get(module_name)
            for name, value in list(vars(caller).items()) if caller is not None else ():
                found = self._found.get(id(value))
                if found is not None and found[0] is value:
                    patching.patch(vars(caller), name, found[1])

    def stand_ins(self) -> Mapping[int, tuple[Any, Any]]:
        """``id(original) -> (original, replacement)`` of the functions found at install."""
        return self._found
