"""The versions CI installs: read, compare and refresh ``.ci/constraints.txt``.

``.ci/constraints.txt`` records every package (and version) of an environment in which the whole
suite passed; ``.ci/run`` installs with it (``pip install -c .ci/constraints.txt ...``), so a new
upstream release cannot change what CI tests. Commands::

    python .ci/pins.py versions torch lightning ...   # installed versions, one line
    python .ci/pins.py diff                           # installed vs pinned, the packages that differ
    python .ci/pins.py freeze                         # write the installed versions as the new pins

A local version label (``torch 2.13.0+cpu``) is written without the label (``torch==2.13.0``): PEP 440
lets ``==2.13.0`` match the CPU build here and a CUDA build elsewhere, while ``==2.13.0+cpu`` could
only be met from PyTorch's own index. The project itself and pip's own tools are left out.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parent / "constraints.txt"
_SKIP = {"flashprobe", "pip", "setuptools", "wheel"}
_HEADER = """\
# The versions the whole suite last passed with (.ci/run installs with `-c` this file).
# Refresh: in a new virtualenv, `bash .ci/run --latest --write-pins` (docs/README.md "Pinned versions").
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """Installed distributions, canonical name → version without a local label."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name and name not in _SKIP:
            found[name] = dist.version.split("+", 1)[0]
    return dict(sorted(found.items()))


def pinned(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version.strip()
    return pins


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    have = installed()
    if command == "versions":
        print("versions: " + ", ".join(f"{n} {have.get(canonical(n), 'not installed')}" for n in args))
        return 0
    if command == "freeze":
        text = _HEADER + "".join(f"{n}=={v}\n" for n, v in have.items())
        tmp = CONSTRAINTS.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(CONSTRAINTS)
        print(f"pins: wrote {len(have)} versions to {CONSTRAINTS}")
        return 0
    if command == "diff":
        pins = pinned()
        rows = [
            f"  {n}: pinned {pins.get(n, '-')}, installed {have.get(n, '-')}"
            for n in sorted(set(pins) | set(have))
            if pins.get(n) != have.get(n)
        ]
        print(f"pins: {len(rows)} package(s) differ from {CONSTRAINTS.name}" + (":" if rows else ""))
        print("\n".join(rows)) if rows else None
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
