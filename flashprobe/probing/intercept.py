"""Interception: every attention call made inside an attached model reaches its handle.

A handle (:class:`~flashprobe.probing.KernelRoute` or :class:`~flashprobe.probing.Probe`) derives from
:class:`AttentionRoute`; attaching registers its model (:mod:`flashprobe.probing.sites`), and every
attention call made inside it reaches the handle with its **site**. The calls come from the sources
in :data:`SOURCES` (``sdpa``, ``fastpath``, ``flex``, ``hf_flex``, ``flashattn``, ``flashinfer``,
``varlen``), whose names are swapped while a handle is attached (:mod:`flashprobe.probing.patching`).
To add a source, write its module and add its ``SOURCE`` to :data:`SOURCES`.
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

from torch import nn

from flashprobe.probing import fastpath, flashattn, flashinfer, flex, hf_flex, patching, sdpa, sites, varlen
from flashprobe.probing.compiled import check_compiled
from flashprobe.probing.sites import GRAPH_BREAK_REASON, ROOT_SITE, ProbeWarning, active_handles, passthrough

__all__ = [
    "GRAPH_BREAK_REASON",
    "ROOT_SITE",
    "SOURCES",
    "AttentionRoute",
    "ProbeWarning",
    "active_handles",
    "passthrough",
]

#: Every source of attention calls, installed in this order on the first attach.
SOURCES: tuple[patching.Source, ...] = (
    sdpa.SOURCE,
    fastpath.SOURCE,
    flex.SOURCE,
    hf_flex.SOURCE,
    flashattn.SOURCE,
    flashinfer.SOURCE,
    varlen.SOURCE,
)

_H = TypeVar("_H", bound="AttentionRoute")


class AttentionRoute:
    """Base of the handles that attach to a model (:class:`~flashprobe.probing.KernelRoute`,
    :class:`~flashprobe.probing.Probe`); a context manager, or call :meth:`detach`."""

    kind = "route"

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected an nn.Module to attach to, got {type(model).__name__}")
        self.model = model
        self._warned: set[Any] = set()

    @property
    def attached(self) -> bool:
        """Whether attention calls inside the model currently reach this handle."""
        return any(b is self for b in active_handles())

    def attach(self: _H) -> _H:
        """(Re-)attach to the model; a no-op when attached. Returns ``self``.

        Raises:
            ProbeCompileError: a module of the model is compiled with ``fullgraph=True``.
        """
        with sites.lock:
            if not self.attached:
                check_compiled(self.model, "probe" if self.kind == "probe" else "use_kernel")
                sites.bind(self)
                patching.install(SOURCES, sites.roots())
        return self

    def detach(self) -> None:
        """Stop routing this model's calls here; the previous routing (if any) applies again."""
        with sites.lock:
            if self.attached:
                sites.unbind(self)
                models = sites.roots()
                if models:
                    patching.install(SOURCES, models)
                else:
                    patching.uninstall()

    def __enter__(self: _H) -> _H:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def warn_once(self, key: Any, message: str) -> None:
        """Emit ``message`` as a :class:`ProbeWarning` the first time ``key`` is seen."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, ProbeWarning, stacklevel=3)
