"""The package's layers: what may import what.

* The library layers import without the application: the probe, the kernels, the weights and the
  deviation statistics pull in neither Lightning, Hydra, W&B nor transformers, nor the app's modules
  (checked in a fresh interpreter, so nothing imported by other tests hides a leak).
* The import graph between the package's files and folders, read from the source with ``ast`` (every
  import that runs: at module level or inside a function; ``if TYPE_CHECKING:`` blocks aside), goes
  downward only — kernels, deviation and judge at the bottom; probing, fuzz and weights above them;
  app, bench and the commands on top (:data:`LAYERS`) — with at most one import from a lower layer to
  a higher one (:data:`UPWARD`, each with its reason), and has no circle: none between folders, none
  between files through module-level imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HEAVY = ("lightning", "hydra", "wandb", "transformers", "diffusers", "flashprobe.t2i", "flashprobe.app")
LIBRARY = (
    "flashprobe",
    "flashprobe.deviation",
    "flashprobe.kernels",
    "flashprobe.probing",
    "flashprobe.weights",
)

PACKAGE = Path(__file__).resolve().parents[1] / "flashprobe"

#: Each folder or top-level file of the package (a unit) and its layer; a module may import from its
#: own layer and the ones below. ``cli`` is every command module (``cli.py``, ``*/cli.py``,
#: ``*_cli.py``): the commands sit on top, whatever folder holds them. ``__init__`` is the package's
#: face, whose names are imported on first use (no import at module level).
LAYERS: dict[str, int] = {
    **dict.fromkeys(("errors", "kernels", "deviation", "judge", "bias", "formats", "__init__"), 0),
    **dict.fromkeys(("probing", "fuzz", "weights"), 1),
    **dict.fromkeys(("callbacks", "integrations", "report", "t2i", "conf"), 2),
    **dict.fromkeys(("app", "bench", "cli"), 3),
}

#: The imports allowed to run from a lower layer to a higher one (at most one), with the reason: none.
UPWARD: dict[tuple[str, str], str] = {}


def test_library_layers_do_not_import_the_app() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {LIBRARY!r}:\n"
        "    importlib.import_module(name)\n"
        f"    leaked = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    if leaked:\n"
        "        sys.exit(f'importing {name} imported {leaked}')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module of ``package`` (a package by its ``__init__.py``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import that runs, with whether it is at module level (not inside a function or class body
    that runs later); ``if TYPE_CHECKING:`` blocks are left out."""

    def walk(nodes: list[ast.stmt], top: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, top
                continue
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.orelse, top)
                continue
            inner = top and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for field in ("body", "orelse", "finalbody"):
                yield from walk(getattr(node, field, None) or [], inner)
            for block in (*(getattr(node, "handlers", None) or []), *(getattr(node, "cases", None) or [])):
                yield from walk(block.body, inner)

    yield from walk(tree.body, True)


def import_graph(package: Path) -> dict[tuple[str, str], bool]:
    """``(importer, imported) → at module level`` for every import between two modules of ``package``
    (``from a import b`` names module ``a.b`` when it is one, else ``a``)."""
    modules = _modules(package)
    edges: dict[tuple[str, str], bool] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, top in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name, target] = edges.get((name, target), False) or top
    return edges


def unit(module: str) -> str:
    """The folder or top-level file a module belongs to (``cli`` for a command module)."""
    parts = module.split(".")
    if parts[-1] == "cli" or parts[-1].endswith("_cli"):
        return "cli"
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle(nodes: set[str], edges: set[tuple[str, str]]) -> list[str]:
    """One cycle of the directed graph, as its nodes in order, or ``[]``."""
    following: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        following[a].append(b)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for m in sorted(following[n]):
            if state.get(m) == 1:
                return [*path[path.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return []

    for n in sorted(nodes):
        if n not in state and (found := visit(n)):
            return found
    return []


def violations(package: Path = PACKAGE, upward: dict[tuple[str, str], str] = UPWARD) -> list[str]:
    """Every import against :data:`LAYERS` (beyond the declared ``upward`` ones), a unit missing from
    it, a circle between units, or one between files through module-level imports; one line each."""
    edges = import_graph(package)
    found = [f"{u}: not placed in LAYERS" for u in sorted({unit(m) for m in _modules(package)} - set(LAYERS))]
    for (a, b), top in sorted(edges.items()):
        low, high = LAYERS.get(unit(a), -1), LAYERS.get(unit(b), -1)
        if low < high and (a, b) not in upward:
            where = "module level" if top else "in a function"
            found.append(f"{a} (layer {low}) imports {b} (layer {high}) {where}")
    # the allowed upward import closes a circle with the downward ones it crosses: it is the exception
    units = {(unit(a), unit(b)) for a, b in edges if unit(a) != unit(b) and (a, b) not in upward}
    if circle := _cycle({u for pair in units for u in pair}, units):
        found.append("the folders import each other in a circle: " + " -> ".join(circle))
    top_edges = {pair for pair, top in edges.items() if top}
    if circle := _cycle({m for pair in top_edges for m in pair}, top_edges):
        found.append("the files import each other in a circle at module level: " + " -> ".join(circle))
    return found


def test_imports_run_down_the_layers_and_in_no_circle() -> None:
    assert len(UPWARD) <= 1
    assert violations() == []


def test_the_allowed_upward_import_still_exists() -> None:
    """An entry of :data:`UPWARD` whose import is gone must go too (the floor stays at its count)."""
    edges = import_graph(PACKAGE)
    assert [pair for pair in UPWARD if pair not in edges] == []


def test_the_checker_finds_an_upward_import_and_a_circle(tmp_path: Path) -> None:
    """The check itself, on a made-up package: a kernel importing the probe (at module level), the
    probe importing the fuzzer inside a function while the fuzzer imports the probe."""
    package = tmp_path / "flashprobe"
    for folder in ("kernels", "probing", "fuzz"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    face = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import flashprobe.fuzz\n"
    (package / "__init__.py").write_text(face)  # the face's typing-only import is no edge
    (package / "kernels" / "math.py").write_text("from flashprobe.probing.shadow import x\n")
    (package / "probing" / "shadow.py").write_text("x = 1\ndef f():\n    from flashprobe.fuzz import run\n")
    (package / "fuzz" / "run.py").write_text("from ..probing import shadow\n")
    found = violations(package)
    assert found == [
        "flashprobe.kernels.math (layer 0) imports flashprobe.probing.shadow (layer 1) module level",
        "the folders import each other in a circle: fuzz -> probing -> fuzz",
    ], found
    declared = {("flashprobe.kernels.math", "flashprobe.probing.shadow"): "a reason"}
    assert violations(package, upward=declared) == [found[1]]  # a declared upward import is let through


@pytest.mark.parametrize(
    ("module", "expected"),
    [("flashprobe.cli", "cli"), ("flashprobe.probing.replay_cli", "cli"), ("flashprobe.fuzz.run", "fuzz")],
)
def test_units(module: str, expected: str) -> None:
    assert unit(module) == expected
