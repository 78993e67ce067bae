"""Swapping names: the one place where flashprobe replaces a library's functions, and puts them back.

While at least one handle is attached, every :class:`Source` (listed in
:data:`flashprobe.probing.intercept.SOURCES`) swaps its entry points for stand-ins: on the first attach
in the libraries' modules (:func:`patch`, :func:`patch_attribute`), on every attach in the modules of
the attached models' classes that imported a function by name (looked up in ``stand_ins`` by the
original's identity). When the last handle detaches every name is restored, unless someone else
replaced it meanwhile (theirs stays, with a warning).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from flashprobe.probing.sites import ProbeWarning

__all__ = ["Source", "install", "installed", "patch", "patch_attribute", "stand_in_of", "uninstall"]


@dataclass(frozen=True)
class Source:
    """One source of attention calls and how its names are swapped.

    Attributes:
        name: what it is, for messages (``"sdpa"``, ``"flash-attn"``).
        install: swaps the library's own names where it is imported; run on the first attach.
        stand_ins: ``id(original) -> (original, stand-in)`` for the functions model code may have
            imported by name (read after ``install``).
        forget: run when the last handle detaches, or None.
    """

    name: str
    install: Callable[[], None]
    stand_ins: Callable[[], Mapping[int, tuple[Any, Any]]] = dict
    forget: Callable[[], None] | None = None


_UNSET = object()
_patches: list[tuple[dict[str, Any], str, Any, Any]] = []  # (namespace, name, original, replacement)
# (class, attribute, the class's own original or _UNSET when inherited, replacement)
_attr_patches: list[tuple[type, str, Any, Any]] = []
_installed: list[Source] = []
_stand_ins: dict[Any, Callable[..., Any]] = {}  # original -> its stand-in, built once (attach is per step)


def installed() -> bool:
    """Whether the sources' names are swapped now."""
    return bool(_installed)


def patch(namespace: dict[str, Any], name: str, replacement: Any) -> None:
    """Set ``namespace[name] = replacement`` until :func:`uninstall` (a no-op when the name is absent
    or already swapped)."""
    if any(ns is namespace and n == name for ns, n, _, _ in _patches):
        return
    original = namespace.get(name)
    if original is None:
        return
    _patches.append((namespace, name, original, replacement))
    namespace[name] = replacement


def patch_attribute(cls: type, attribute: str, replacement: Any) -> None:
    """Set a class attribute until :func:`uninstall` (a no-op when already swapped)."""
    if any(c is cls and a == attribute for c, a, _, _ in _attr_patches):
        return
    _attr_patches.append((cls, attribute, cls.__dict__.get(attribute, _UNSET), replacement))
    setattr(cls, attribute, replacement)


def stand_in_of(original: Callable[..., Any], build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """The stand-in of ``original``, built by ``build`` the first time it is asked for (kept for the
    process: the same object at every attach, so compiled graphs' guards on it hold)."""
    wrapper = _stand_ins.get(original)
    if wrapper is None:
        wrapper = _stand_ins[original] = build()
    return wrapper


def _freeze_dynamo_rules() -> None:
    """Build Dynamo's cached table of torch functions before any name is swapped, so it never lists
    our stand-ins as torch functions (best effort: a Dynamo internal)."""
    try:
        from torch._dynamo.trace_rules import get_torch_obj_rule_map

        get_torch_obj_rule_map()
    except Exception:  # a torch without this internal: nothing to freeze
        return


def install(sources: Sequence[Source], models: Sequence[nn.Module]) -> None:
    """Swap every source's names (first call after :func:`uninstall`), and the functions that the
    modules defining ``models``' classes imported by name."""
    if not _installed:
        _freeze_dynamo_rules()
        for source in sources:
            source.install()
            _installed.append(source)
    table: dict[int, tuple[Any, Any]] = {}
    for source in _installed:
        table.update(source.stand_ins())
    seen: set[str] = set()
    for model in models:
        for module in model.modules():
            for cls in type(module).__mro__:
                if cls.__module__ in seen or cls is object:
                    continue
                seen.add(cls.__module__)
                py_module: ModuleType | None = sys.modules.get(cls.__module__)
                if py_module is None or py_module.__name__ == "torch.nn.functional":
                    continue
                namespace = vars(py_module)
                for name, value in list(namespace.items()):
                    entry = table.get(id(value))
                    if entry is not None and entry[0] is value:
                        patch(namespace, name, entry[1])


def uninstall() -> None:
    """Restore every swapped name (those someone else replaced meanwhile stay theirs)."""
    while _attr_patches:
        cls, attribute, original, replacement = _attr_patches.pop()
        if cls.__dict__.get(attribute) is not replacement:
            continue  # replaced by someone else meanwhile: theirs stays
        if original is _UNSET:
            delattr(cls, attribute)
        else:
            setattr(cls, attribute, original)
    while _installed:
        source = _installed.pop()
        if source.forget is not None:
            source.forget()
    while _patches:
        namespace, name, original, replacement = _patches.pop()
        if namespace.get(name) is replacement:
            namespace[name] = original
        else:
            warnings.warn(
                f"flashprobe: {name} was replaced by someone else while a probe was attached; "
                "leaving their version in place",
                ProbeWarning,
                stacklevel=3,
            )
