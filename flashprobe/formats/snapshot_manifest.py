"""The snapshot directory's layout and its manifest: names, format, and a checked reader and writer.

A run directory holds its snapshots as::

    RUN_DIR/snapshots/manifest.json
    RUN_DIR/snapshots/step_0000100.safetensors      one file per saved step

``manifest.json`` (format ``flashprobe.snapshots/1``)::

    {"format": "flashprobe.snapshots/1", "run_id": "...", "seed": 0, "attention": "math",
     "precision": "32-true", "config": {...},
     "tensors": [{"name": "blocks.0.attn.qkv.weight", "shape": [96, 32], "dtype": "float32",
                  "kind": "parameter"}, ...],
     "snapshots": [{"step": 100, "file": "step_0000100.safetensors", "bytes": 123456,
                    "epoch": 0, "saved_at": "2025-01-01T00:00:00Z"}, ...]}

Plain JSON and paths, no tensors: the snapshot files themselves are written and read by
:mod:`flashprobe.weights.store` (``SnapshotWriter``, ``SnapshotStore``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashprobe.errors import FlashprobeError
from flashprobe.formats.jsonio import format_problem

__all__ = [
    "MANIFEST_NAME",
    "SNAPSHOT_DIRNAME",
    "SNAPSHOT_FORMAT",
    "SnapshotError",
    "dumps_manifest",
    "manifest_entry",
    "read_manifest",
    "resolved_inside",
    "snapshot_filename",
]

SNAPSHOT_FORMAT = "flashprobe.snapshots/1"
SNAPSHOT_DIRNAME = "snapshots"
MANIFEST_NAME = "manifest.json"


class SnapshotError(ValueError, FlashprobeError):
    """A snapshot directory or manifest is missing, malformed or inconsistent."""


def snapshot_filename(step: int) -> str:
    """File name of the snapshot at ``step``: ``step_0000100.safetensors`` (7 digits, more if needed)."""
    if step < 0:
        raise ValueError(f"snapshot step must be >= 0, got {step}")
    return f"step_{step:07d}.safetensors"


def manifest_entry(directory: Path, entry: Any, manifest: Path) -> tuple[int, Path]:
    """The step and file of one manifest entry; the file must be a plain name inside ``directory``.

    A manifest is read from run directories that may be anyone's, and a resume deletes the files of
    abandoned entries: an entry naming an absolute path, a ``..`` or a sub-directory is refused, so
    no manifest can make flashprobe read or delete a file outside its snapshot directory.

    Raises:
        SnapshotError: the entry is not ``{"step": int >= 0, "file": "NAME"}`` with a plain file name.
    """
    if not isinstance(entry, Mapping):
        raise SnapshotError(f"{manifest}: a snapshot entry is {entry!r}, not {{'step': N, 'file': NAME}}")
    step, name = entry.get("step"), entry.get("file")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SnapshotError(f"{manifest}: snapshot entry {dict(entry)!r} has no non-negative integer 'step'")
    plain = isinstance(name, str) and name not in ("", ".", "..") and not name.startswith(".")
    if not plain or os.sep in name or (os.altsep and os.altsep in name) or Path(name).name != name:
        raise SnapshotError(
            f"{manifest}: snapshot entry of step {step} names the file {name!r}, which is not a plain file "
            f"name inside {directory} (no '/', no '..'); flashprobe reads and deletes only files inside the "
            "snapshot directory: fix or remove that entry (snapshot files are named like "
            f"{snapshot_filename(step)})"
        )
    return step, resolved_inside(directory / name, directory, f"{manifest}: the snapshot of step {step}")


def resolved_inside(path: Path, root: Path, what: str) -> Path:
    """``path``, if it resolves (links followed) inside ``root``: a snapshot directory handed around must
    not make flashprobe read another run's files (a distance of 0) or anything outside the run.

    Raises:
        SnapshotError: naming ``what``, the path and where it leads.
    """
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise SnapshotError(
            f"{what} ({path}) is a link to {resolved}, outside {root}; flashprobe reads a run's snapshots "
            "only from inside the run: copy the files in (cp -L) instead of linking them"
        )
    return path


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a snapshot directory, checked: a JSON object whose every entry is valid.

    Args:
        directory: the snapshot directory (``RUN_DIR/snapshots``).

    Raises:
        FileNotFoundError: no manifest.
        SnapshotError: not valid JSON, not an object, no ``snapshots`` list, or an entry that is not
            ``{"step": N, "file": NAME}`` with a plain file name (see :func:`manifest_entry`).
    """
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no snapshot manifest at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SnapshotError(
            f"malformed snapshot manifest {path} ({err}); it is written by flashprobe's WeightSnapshot "
            "callback: restore it, or start the run again with overwrite=true"
        ) from None
    if isinstance(manifest, dict) and "format" in manifest:  # (manifests of before the field: read)
        problem = format_problem(path, manifest, SNAPSHOT_FORMAT)
        if problem:
            raise SnapshotError(problem)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("snapshots", []), list):
        raise SnapshotError(f"malformed snapshot manifest {path}: not an object with a 'snapshots' list")
    if not isinstance(manifest.get("tensors", []), list):
        raise SnapshotError(f"malformed snapshot manifest {path}: 'tensors' is not a list")
    for entry in manifest.get("snapshots", []):
        manifest_entry(directory, entry, path)
    return manifest


def dumps_manifest(manifest: Mapping[str, Any]) -> str:
    """JSON with one line per field, and one line per tensor and per snapshot entry."""
    lines = []
    for key, value in manifest.items():
        if key in ("tensors", "snapshots") and value:
            items = ",\n".join(f"  {json.dumps(item)}" for item in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"
