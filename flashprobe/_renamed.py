"""Old import paths of moved packages, kept for one release with a :class:`DeprecationWarning`.

The probe's package was ``flashprobe.probe``; it is :mod:`flashprobe.probing` now, so that
``flashprobe.probe`` is the :func:`~flashprobe.probing.probe` function (``from flashprobe import probe``).
Until the next release, ``from flashprobe.probe import X`` and ``from flashprobe.probe.<module> import X``
still work: they warn and give the very module objects of the new path (one module, one class
``ProbeConfig``, one state), never a second copy. What cannot work is attribute access through the
old name (``import flashprobe.probe`` then ``flashprobe.probe.ProbeConfig``): that name is the function.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["MOVED", "install"]

#: old package name → its new name
MOVED: dict[str, str] = {"flashprobe.probe": "flashprobe.probing"}


def _new_name(name: str) -> str | None:
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name as the module of its new name (the same object, under both names)."""

    def find_spec(
        self, fullname: str, path: object = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = _new_name(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = _new_name(spec.name)
        assert new is not None  # find_spec made this spec
        warnings.warn(
            f"'{spec.name}' is deprecated and goes in the next release: import from '{new}' (the probe's "
            "package is flashprobe.probing; flashprobe.probe is the probe() function)",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import machinery sets the old spec on it: restored below
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # the module is already executed under its new name


class _Package(types.ModuleType):
    """The ``flashprobe`` module: importing an old package path does not rebind the new top-level names.

    Python's import sets each imported submodule as an attribute of its parent; for ``flashprobe.probe``
    that would hide the function :func:`flashprobe.probe` behind the old package.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and f"{self.__name__}.{name}" in MOVED:
            return
        super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
    """Make the old paths importable (before the path finders, so a stale ``flashprobe/probe/``
    folder of ``__pycache__`` is never read as a namespace package) and guard ``package``'s names."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())
    package.__class__ = _Package
