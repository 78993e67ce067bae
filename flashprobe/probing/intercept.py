"""Interception: every attention call made inside an attached model reaches its handle.

A handle (:class:`~flashprobe.probing.KernelRoute` from :func:`~flashprobe.probing.use_kernel`, or a
:class:`~flashprobe.probing.Probe`) derives from :class:`AttentionRoute`; attaching registers its
model (:mod:`flashprobe.probing.sites`), and every attention call made inside a registered model reaches
the handle together with its **site**, the path of the innermost attached module that made it.

The calls come from the **sources** in :data:`SOURCES`, one module each, whose names are swapped while
at least one handle is attached (:mod:`flashprobe.probing.patching`):

* :mod:`~flashprobe.probing.sdpa`: ``F.scaled_dot_product_attention``, eager and under ``torch.compile``
  (one opaque op per call, :mod:`~flashprobe.probing.opaque`, or a graph break);
* :mod:`~flashprobe.probing.fastpath`: torch's fused fast paths and ``nn.MultiheadAttention`` with
  ``need_weights=True``, which never reach SDPA: reported once per site;
* :mod:`~flashprobe.probing.flex`: ``flex_attention``, compared with references that apply its own
  ``score_mod`` and ``block_mask``; :mod:`~flashprobe.probing.hf_flex`: transformers' compiled wrapper
  of it;
* :mod:`~flashprobe.probing.flashattn`: flash-attn 2's and FlashAttention-3's entry points;
  :mod:`~flashprobe.probing.flashinfer`: FlashInfer's functions, batch wrappers and merges;
  :mod:`~flashprobe.probing.varlen`: PyTorch's ``varlen_attn`` (each through
  :mod:`~flashprobe.probing.direct`: arguments bound by the library's own signature and read as a call
  of the kernels layer, whose golden and baseline the shadow computes; the model gets the library's
  output).

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
    :class:`~flashprobe.probing.Probe`).

    Attaching never touches the model's modules; it registers the model so that attention calls made
    inside it reach this handle. Use as a context manager or call :meth:`detach`.
    """

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
