"""The README's install lines name the extras a user needs, with what they install."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_names_the_integration_extra_and_what_it_installs() -> None:
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"^integration = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    extra = re.findall(r'"([^"]+)"', line.group(1))  # tomllib is Python >= 3.11
    assert extra
    # torch first, in the same command, so pip keeps the CPU build
    assert "pip install torch==2.13.0 -e '.[integration]'" in readme
    paragraph = readme[readme.index("pip install torch==2.13.0 -e '.[integration]'") :].split("\n\n")[1]
    for requirement in extra:
        name, bound = re.fullmatch(r"([\w-]+)>=([\d.]+)", requirement).groups()
        assert f"{name} (≥ {bound}" in paragraph, (name, paragraph)
