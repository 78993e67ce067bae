"""The probe package's layering, read from its source with ``ast``: no import cycle among
``flashprobe/probing`` modules, and no module that imports or reads another module's ``_`` names.

Every import counts as an edge, a function-level one too (an import moved into a function to dodge a
circle is still a circle); imports under ``if TYPE_CHECKING:`` do not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import flashprobe

PACKAGE_ROOT = Path(flashprobe.__file__).parent
PROBE = "flashprobe.probing"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(under: Path) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(under.rglob("*.py"))}


ALL = _modules(PACKAGE_ROOT)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if not is_package:
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


class _Imports:
    """The flashprobe modules one module imports (``edges``), and the ``_`` names it takes from other
    flashprobe modules (``private``: ``(module, name, line)`` for ``from m import _x`` and ``m._x``)."""

    def __init__(self, module: str, text: str | None = None) -> None:
        self.edges: set[str] = set()
        self.private: list[tuple[str, str, int]] = []
        aliases: dict[str, str] = {}
        path = ALL.get(module)
        is_package = path is not None and path.name == "__init__.py"
        tree = ast.parse(path.read_text() if text is None else text)
        nodes = list(_runtime_nodes(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in ALL:
                        self.edges.add(alias.name)
                        if alias.asname:
                            aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, is_package, node)
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    bound = alias.asname or alias.name
                    if target in ALL:  # a submodule
                        self.edges.add(target)
                        aliases[bound] = target
                    elif source in ALL:
                        self.edges.add(source)
                        if _private(alias.name) and source != module:
                            self.private.append((source, alias.name, node.lineno))
        for node in nodes:
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = _dotted(node.value, aliases)
                if target in ALL and target != module:
                    self.private.append((target, node.attr, node.lineno))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The module an expression names (``intercept``, ``flashprobe.probing.intercept``), or None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value, aliases)
        if head is None and isinstance(node.value, ast.Name):
            head = node.value.id
        return None if head is None else f"{head}.{node.attr}"
    return None


def _probe_graph() -> dict[str, set[str]]:
    probe = {m for m in ALL if m == PROBE or m.startswith(PROBE + ".")}
    return {m: _Imports(m).edges & probe - {m} for m in probe}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    found, state, path = [], dict.fromkeys(graph, 0), []

    def visit(node: str) -> None:
        state[node], _ = 1, path.append(node)
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif state[nxt] == 0:
                visit(nxt)
        state[node], _ = 2, path.pop()

    for node in sorted(graph):
        if state[node] == 0:
            visit(node)
    return found


def test_the_probe_package_has_no_import_cycle() -> None:
    graph = {m: edges - {PROBE} for m, edges in _probe_graph().items() if m != PROBE}
    cycles = _cycles(graph)
    assert not cycles, "import cycles among flashprobe/probing modules:\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def _in_probe(module: str) -> bool:
    return module == PROBE or module.startswith(PROBE + ".")


def test_no_module_reaches_into_a_probe_module_s_private_names() -> None:
    """The probe's modules, and every other flashprobe module reading the probe's, use public names."""
    reaches = [
        f"{module} line {line}: {target}.{name}"
        for module in ALL
        for target, name, line in _Imports(module).private
        if _in_probe(module) or _in_probe(target)
    ]
    assert not reaches, "private names used across modules:\n" + "\n".join(reaches)


def test_the_checker_sees_cycles_and_private_reaches() -> None:
    """The cycle finder on hand-made graphs; the import reader on the patterns it must catch and the
    ones it must not (``TYPE_CHECKING`` imports, dunder names, public names)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    source = (
        "from typing import TYPE_CHECKING\n"
        "from flashprobe import __version__\n"
        "from flashprobe.probing import routing\n"
        "from . import call as c\n"
        "from flashprobe.probing.config import _hidden, ProbeConfig\n"
        "if TYPE_CHECKING:\n    from flashprobe.probing.shadow import _typing_only\n"
        "def f():\n    from flashprobe.probing import stats\n"
        "    return routing._secret, c._other, routing.use_kernel\n"
    )
    imports = _Imports("flashprobe.probing.example", source)
    assert imports.edges == {
        "flashprobe",
        "flashprobe.probing.routing",
        "flashprobe.probing.call",
        "flashprobe.probing.config",
        "flashprobe.probing.stats",
    }
    assert sorted(imports.private) == [
        ("flashprobe.probing.call", "_other", 10),
        ("flashprobe.probing.config", "_hidden", 5),
        ("flashprobe.probing.routing", "_secret", 10),
    ]
