"""The CI helpers of ``.ci/``: the test-package check (issue 21) and the version pins."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_ci_{name}", REPO / ".ci" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load("check_test_packages")
pins = _load("pins")


#: sys.path without this repository (its own ``tests`` package would be found for a tree in tmp_path)
ELSEWHERE = [p for p in sys.path if p and not Path(p).resolve().is_relative_to(REPO)]


def _tree(root: Path, files: list[str]) -> Path:
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return root


def test_this_repository_has_no_test_module_outside_the_tests_package() -> None:
    assert check.problems(REPO) == []


def test_a_test_folder_named_like_an_installed_module_is_reported(tmp_path: Path) -> None:
    # tests/ without __init__.py: tests/json/ becomes the top-level 'json' and shadows the stdlib's
    repo = _tree(tmp_path, ["tests/json/__init__.py", "tests/json/test_a.py", "tests/test_b.py"])
    found = check.problems(repo, ELSEWHERE)
    assert any("'json'" in p and "shadows 'json' from the standard library" in p for p in found), found
    assert any("'test_b'" in p and "add tests/__init__.py" in p for p in found), found
    assert check.main([str(repo)]) == 1


def test_a_package_chain_broken_below_tests_is_reported(tmp_path: Path) -> None:
    repo = _tree(tmp_path, ["tests/__init__.py", "tests/bench/conftest.py", "tests/bench/test_x.py"])
    found = check.problems(repo, ELSEWHERE)
    assert len(found) == 2 and all("add tests/bench/__init__.py" in p for p in found), found


def test_a_complete_package_tree_passes(tmp_path: Path) -> None:
    repo = _tree(tmp_path, ["tests/__init__.py", "tests/kernels/__init__.py", "tests/kernels/test_a.py"])
    assert check.problems(repo, ELSEWHERE) == []
    assert check.top_level_name(repo / "tests/kernels/test_a.py") == "tests"


def test_the_pins_name_torch_2_13_0_without_a_local_label_and_parse() -> None:
    pinned = pins.pinned()
    assert pinned["torch"] == "2.13.0"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.!+-]*", v) for v in pinned.values()), pinned
    for name in ("lightning", "hydra-core", "transformers", "diffusers", "pytest", "ruff"):
        assert name in pinned, name
    assert "flashprobe" not in pinned


def test_installed_versions_drop_local_labels() -> None:
    have = pins.installed()
    assert "+" not in have["torch"] and have["torch"].startswith("2.")
    assert "flashprobe" not in have and "pip" not in have


@pytest.mark.parametrize("name", ["Hydra_Core", "hydra.core", "hydra-core"])
def test_names_are_compared_in_canonical_form(name: str) -> None:
    assert pins.canonical(name) == "hydra-core"


def test_the_pins_cli_prints_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert pins.main(["versions", "torch", "no-such-package"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("versions: torch 2.") and "no-such-package not installed" in out
    assert pins.main([]) == 2
