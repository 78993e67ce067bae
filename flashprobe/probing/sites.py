"""The attached models and the site finder: which attached module made an attention call.

Handles attached to a model are bound here (:func:`bind`, :func:`unbind`, under :data:`lock`). At call
time :func:`find_caller` walks up the Python stack to the innermost ``nn.Module.__call__`` frame of an
attached model; that module's path (``blocks.3.attn``) is the **site**. Nothing is stored on the
modules. A probe's own computations run inside :func:`passthrough`, straight to the original functions.
"""

from __future__ import annotations

import re
import threading
import types
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "GRAPH_BREAK_REASON",
    "ROOT_SITE",
    "ProbeWarning",
    "Resolution",
    "active_handles",
    "bind",
    "find_caller",
    "handle_sdpa",
    "in_passthrough",
    "lock",
    "passthrough",
    "probing_caller",
    "resolution_of",
    "roots",
    "unbind",
]

#: Site name of an attention call made by the attached model's root module itself.
ROOT_SITE = "<root>"

#: Why a stand-in runs a call at a graph break under ``torch.compile``: Dynamo prints this when it
#: skips the call (and in the error that ``torch.compile(..., fullgraph=True)`` raises).
GRAPH_BREAK_REASON = (
    "flashprobe: an attached probe or use_kernel route runs each attention call eagerly at a graph "
    "break (the shadow computation needs real tensors and the module stack); compile without "
    "fullgraph=True while it is attached, or detach it"
)

# Prefixes that wrappers (FSDP1, activation checkpointing, torch.compile) insert into module paths.
_WRAPPER_PREFIX = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.?")


class ProbeWarning(UserWarning):
    """An attention call inside an attached model that flashprobe cannot route or compare."""


class Resolution(NamedTuple):
    """Who handles the attention calls of one module of an attached model.

    Attributes:
        module: the module.
        probe: the :class:`~flashprobe.probing.Probe` comparing its calls, or None.
        site: the module's path in the probe's model.
        route: the :class:`~flashprobe.probing.KernelRoute` its calls run, or None.
        route_site: the module's path in the route's model.
    """

    module: nn.Module
    probe: Any
    site: str
    route: Any
    route_site: str


# --- Passthrough: a probe's own attention calls ---


class _Busy(threading.local):
    busy = False


_busy = _Busy()


class passthrough:  # noqa: N801  (a context manager used like a function)
    """Inside the block, attention calls on this thread bypass every probe and route."""

    __slots__ = ("_previous",)

    def __enter__(self) -> None:
        self._previous = _busy.busy
        _busy.busy = True

    def __exit__(self, *exc: object) -> None:
        _busy.busy = self._previous


def in_passthrough() -> bool:
    """Whether this thread is inside :func:`passthrough` (a probe's own computation)."""
    return _busy.busy


# --- The registry of attached models ---

#: Held while handles are bound or unbound (and the sources' names swapped to match).
lock = threading.RLock()
_bindings: list[Any] = []  # attached handles, oldest first
_index: dict[int, Resolution] = {}


def active_handles(model: nn.Module | None = None) -> list[Any]:
    """Attached handles (of ``model`` only, if given), oldest first."""
    return [b for b in _bindings if model is None or b.model is model]


def bind(handle: Any) -> None:
    """Register an attached handle (it has ``model`` and ``kind``: ``"probe"`` or ``"route"``); call
    under :data:`lock`."""
    _bindings.append(handle)
    _rebuild()


def unbind(handle: Any) -> None:
    """Forget a handle; call under :data:`lock`."""
    _bindings[:] = [b for b in _bindings if b is not handle]
    _rebuild()


def roots() -> list[nn.Module]:
    """The attached models, each once, oldest first."""
    return list({id(b.model): b.model for b in _bindings}.values())


def _site_name(path: str) -> str:
    return _WRAPPER_PREFIX.sub("", path) or ROOT_SITE


def _rebuild() -> None:
    """Recompute the module → handle index after a bind/unbind."""
    global _index
    models = roots()
    members = {id(r): {id(m): (m, name) for name, m in r.named_modules()} for r in models}
    # Innermost first: a root contained in more of the other roots is deeper.
    depth = {id(r): sum(id(r) in members[id(o)] for o in models if o is not r) for r in models}
    ordered = sorted(models, key=lambda r: -depth[id(r)])
    top: dict[tuple[int, str], Any] = {}
    for b in _bindings:
        top[(id(b.model), b.kind)] = b  # the most recently attached of each kind wins
    index: dict[int, Resolution] = {}
    for module_id in {mid for r in models for mid in members[id(r)]}:
        module, probe, site, route, route_site = None, None, "", None, ""
        for r in ordered:
            entry = members[id(r)].get(module_id)
            if entry is None:
                continue
            module = entry[0]
            if probe is None and (id(r), "probe") in top:
                probe, site = top[(id(r), "probe")], _site_name(entry[1])
            if route is None and (id(r), "route") in top:
                route, route_site = top[(id(r), "route")], _site_name(entry[1])
        assert module is not None
        index[module_id] = Resolution(module, probe, site, route, route_site)
    _index = index


# --- The site finder ---

_CALL_IMPL_CODE = nn.Module._call_impl.__code__


def _is_call_impl(code: types.CodeType) -> bool:
    """``nn.Module._call_impl``'s code, or the copy Dynamo runs when it compiled that frame
    (``model.compile()``): same name and file, new bytecode."""
    return code is _CALL_IMPL_CODE or (
        code.co_name == _CALL_IMPL_CODE.co_name and code.co_filename == _CALL_IMPL_CODE.co_filename
    )


def resolution_of(module: Any) -> Resolution | None:
    """Who handles ``module``'s calls, or None when it is in no attached model."""
    res = _index.get(id(module))
    return res if res is not None and res.module is module else None


def find_caller(frame: FrameType | None) -> Resolution | None:
    """The innermost attached module whose ``__call__`` is on the stack at or above ``frame``; None
    when there is none or inside :func:`passthrough` (the call then runs unchanged)."""
    if _busy.busy:
        return None
    index = _index
    while frame is not None:
        if _is_call_impl(frame.f_code):
            module = frame.f_locals.get("self")
            res = index.get(id(module))
            if res is not None and res.module is module:
                return res
        frame = frame.f_back
    return None


def probing_caller(frame: FrameType | None) -> Resolution | None:
    """:func:`find_caller` for a call to compare: None also while Dynamo traces (no module frames to
    walk) and where no probe (only a route) handles the module."""
    if torch.compiler.is_compiling():
        return None
    res = find_caller(frame)
    return None if res is None or res.probe is None else res


def handle_sdpa(res: Resolution, call: Any, route: Any = None) -> Any:
    """Run one :class:`~flashprobe.probing.call.SdpaCall` of the module ``res`` names, inside
    :func:`passthrough`: through its probe (with ``route``, default the module's), else its route."""
    route = res.route if route is None else route
    with passthrough():
        if res.probe is not None:
            return res.probe.handle(res.site, call, route)
        assert route is not None
        return route.run(call)
