"""Compiled models: the attach-time check for ``torch.compile(..., fullgraph=True)``.

A call the opaque op cannot express falls back to a graph break, which ``fullgraph=True`` forbids.
:func:`check_compiled` finds such modules when a handle attaches and raises :class:`ProbeCompileError`
naming them and the fix. A *function* compiled with ``fullgraph=True`` that calls the model is not
seen; Dynamo then raises with :data:`flashprobe.probing.sites.GRAPH_BREAK_REASON` in its message.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from flashprobe.errors import FlashprobeError

__all__ = ["ProbeCompileError", "check_compiled", "fullgraph_modules"]


class ProbeCompileError(RuntimeError, FlashprobeError):
    """The model is compiled in a way the probe cannot run in (``fullgraph=True``)."""


def _fullgraph(compiled: Any) -> bool:
    """Whether a ``torch.compile`` result (an ``OptimizedModule``'s context, or the function
    ``module.compile()`` stores) was compiled with ``fullgraph=True``."""
    context = getattr(compiled, "dynamo_ctx", None)
    if context is not None:
        return bool(getattr(context, "fullgraph", False))
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if getattr(value, "fullgraph", False) is True:
            return True
    return False


def fullgraph_modules(model: nn.Module) -> list[str]:
    """Paths (``""`` for ``model`` itself) of the modules in ``model`` compiled with ``fullgraph=True``."""
    found = []
    for name, module in model.named_modules():
        compiled_call = module.__dict__.get("_compiled_call_impl")
        if _fullgraph(module) or (compiled_call is not None and _fullgraph(compiled_call)):
            found.append(name)
    return found


def check_compiled(model: nn.Module, what: str) -> None:
    """Raise :class:`ProbeCompileError` if ``model`` holds modules compiled with ``fullgraph=True``.

    Args:
        what: the handle, for the message (``"probe"``, ``"use_kernel"``).

    Raises:
        ProbeCompileError: naming the modules and the fix.
    """
    found = fullgraph_modules(model)
    if found:
        names = ", ".join(f"module {n!r}" if n else f"the model ({type(model).__name__})" for n in found)
        raise ProbeCompileError(
            f"{what}: {names} {'is' if len(found) == 1 else 'are'} compiled with fullgraph=True, which "
            "forbids graph breaks; flashprobe runs every attention call of an attached model eagerly at a "
            "graph break, so the compiled forward would fail. Compile with torch.compile(model) "
            "(fullgraph=False, the default) while probing, or attach to the uncompiled model and compile "
            "after detaching"
        )
