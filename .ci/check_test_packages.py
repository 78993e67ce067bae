"""CI check: no test module is importable under a top-level name other than ``tests``.

pytest imports a test file under the name its package path gives it: it walks up from the file's
folder while the folder holds an ``__init__.py`` and puts the folder above the top-most package on
``sys.path``. A test folder without ``__init__.py`` (or a package chain that stops below ``tests/``)
therefore becomes a top-level module of its own — ``tests/kernels/`` became ``kernels`` and shadowed
the Hugging Face ``kernels`` package that transformers imports. This check fails when

* a test module's top-level name is anything but ``tests`` (fix: add the missing ``__init__.py``), or
* ``tests`` itself is also a module installed outside this repository, or a standard-library module.

Usage: ``python .ci/check_test_packages.py [REPO]`` (exit 1 with one line per problem).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import sys
from pathlib import Path

PACKAGE = "tests"


def top_level_name(path: Path) -> str:
    """The top-level module name pytest's default import mode gives the file ``path``."""
    name, folder = path.stem, path.parent
    while (folder / "__init__.py").is_file():
        name, folder = folder.name, folder.parent
    return name


def installed_elsewhere(name: str, repo: Path, search_path: list[str] | None = None) -> str | None:
    """Where ``name`` is importable from outside ``repo`` (a distribution, the standard library,
    or a folder of ``search_path``, default ``sys.path``), or None."""
    if name in sys.stdlib_module_names:
        return "the standard library"
    dists = importlib.metadata.packages_distributions().get(name)
    if dists:
        return "the installed distribution " + ", ".join(sorted(set(dists)))
    repo = repo.resolve()
    outside = [
        p
        for p in (sys.path if search_path is None else search_path)
        if p and not Path(p).resolve().is_relative_to(repo)
    ]
    spec = importlib.machinery.PathFinder.find_spec(name, outside)
    if spec is not None and (spec.origin or spec.submodule_search_locations):
        return str(spec.origin or next(iter(spec.submodule_search_locations or []), "?"))
    return None


def problems(repo: Path, search_path: list[str] | None = None) -> list[str]:
    """Every reason the test tree of ``repo`` could shadow an installed module (empty: none); modules
    are looked up in ``search_path`` (default ``sys.path``) outside ``repo``."""
    outside: dict[str, list[Path]] = {}
    for path in sorted((repo / PACKAGE).rglob("*.py")):
        name = top_level_name(path)
        if name != PACKAGE:
            outside.setdefault(name, []).append(path)
    found = []
    for name, paths in outside.items():
        first = paths[0]
        missing = next(f for f in (first.parent, *first.parents) if not (f / "__init__.py").is_file())
        where = installed_elsewhere(name, repo, search_path)
        clash = f"; it shadows {name!r} from {where}" if where else ""
        found.append(
            f"{len(paths)} file(s) such as {first.relative_to(repo)} are imported as the top-level module "
            f"{name!r}{clash}: add {(missing / '__init__.py').relative_to(repo)}"
        )
    where = installed_elsewhere(PACKAGE, repo, search_path)
    if where is not None:
        found.append(f"the test package {PACKAGE!r} is also importable from {where}; rename one of them")
    return found


def main(argv: list[str]) -> int:
    repo = Path(argv[0] if argv else Path(__file__).resolve().parent.parent)
    found = problems(repo)
    for line in found:
        print(f"check_test_packages: {line}", file=sys.stderr)
    if not found:
        print(f"check_test_packages: every test module is inside the {PACKAGE!r} package")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
