"""Weight snapshots on disk: atomic writes and a lazy reader.

A run's snapshots are ``RUN_DIR/snapshots/step_NNNNNNN.safetensors`` files listed in
``RUN_DIR/snapshots/manifest.json``; that layout and the manifest's format are
:mod:`flashprobe.formats.snapshot_manifest`'s (its names are re-exported here).

Writes are atomic (a hidden temporary file renamed over the final name), the manifest rewritten only
after the snapshot file is complete: a killed process leaves a manifest whose every listed snapshot
is readable. :class:`SnapshotStore` reads lazily, one tensor at a time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flashprobe.formats.atomic import (
    TMP_SUFFIX,
    atomic_write_file,
    atomic_write_text,
    remove_temporary,
)
from flashprobe.formats.jsonio import utc_now
from flashprobe.formats.paths import library_path
from flashprobe.formats.snapshot_manifest import (
    MANIFEST_NAME,
    SNAPSHOT_DIRNAME,
    SNAPSHOT_FORMAT,
    SnapshotError,
    dumps_manifest,
    manifest_entry,
    read_manifest,
    resolved_inside,
    snapshot_filename,
)

__all__ = [
    "MANIFEST_NAME",
    "SNAPSHOT_DIRNAME",
    "SNAPSHOT_FORMAT",
    "NonFiniteSnapshotError",
    "SnapshotError",
    "SnapshotStore",
    "SnapshotWriter",
    "TensorSpec",
    "read_manifest",
    "snapshot_filename",
]

log = logging.getLogger(__name__)


class NonFiniteSnapshotError(SnapshotError):
    """Weights holding a NaN or an infinity, refused as a snapshot (a snapshot holds finite weights)."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one saved tensor.

    Attributes:
        name: the module path of the tensor, e.g. ``blocks.0.attn.qkv.weight``.
        shape: its shape.
        dtype: its dtype without the ``torch.`` prefix (``float32``, ``bfloat16``, ...).
        kind: ``parameter`` or ``buffer``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = "parameter"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": self.kind}

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, kind: str = "parameter") -> TensorSpec:
        return cls(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), kind)


def _snapshot_dir(run_dir: str | os.PathLike[str]) -> Path:
    """``RUN_DIR/snapshots``, or ``run_dir`` itself when it already holds a manifest; it and its manifest
    must resolve inside ``run_dir`` (:func:`~flashprobe.formats.snapshot_manifest.resolved_inside`)."""
    run_dir = Path(run_dir)
    if (run_dir / MANIFEST_NAME).is_file() and not (run_dir / SNAPSHOT_DIRNAME).is_dir():
        directory = run_dir
    else:
        directory = resolved_inside(
            run_dir / SNAPSHOT_DIRNAME, run_dir, f"{run_dir}'s {SNAPSHOT_DIRNAME} directory"
        )
    if (directory / MANIFEST_NAME).exists():
        resolved_inside(directory / MANIFEST_NAME, directory, f"the snapshot manifest of {directory}")
    return directory


class SnapshotWriter:
    """Writes snapshots and the manifest of one run directory (use from rank zero only).

    Args:
        run_dir: the run directory; files go to ``run_dir/snapshots``.
        header: manifest fields other than ``tensors`` and ``snapshots`` (``run_id``, ``seed``,
            ``attention``, ``precision``, ``config``); must be JSON-serialisable.

    An existing manifest in the directory is loaded and extended (resumed runs); stray temporary
    files left by a killed writer are removed.
    """

    def __init__(self, run_dir: str | os.PathLike[str], header: Mapping[str, Any]) -> None:
        self.directory = Path(run_dir) / SNAPSHOT_DIRNAME
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f".*{TMP_SUFFIX}"):  # (its own directory: any hidden .tmp)
            log.warning("removing incomplete snapshot file %s left by an interrupted write", stale)
            remove_temporary(stale)
        from flashprobe import __version__

        self.manifest: dict[str, Any] = {
            "format": SNAPSHOT_FORMAT,
            "flashprobe": __version__,
            **header,
            "tensors": [],
            "snapshots": [],
        }
        if (self.directory / MANIFEST_NAME).is_file():
            old = read_manifest(self.directory)
            self.manifest["tensors"] = old.get("tensors", [])
            self.manifest["snapshots"] = [
                entry
                for entry in old.get("snapshots", [])
                if manifest_entry(self.directory, entry, self.directory / MANIFEST_NAME)[1].is_file()
            ]

    @property
    def steps(self) -> list[int]:
        """Steps listed in the manifest, ascending."""
        return sorted(entry["step"] for entry in self.manifest["snapshots"])

    def write(
        self, step: int, tensors: Mapping[str, torch.Tensor], specs: Iterable[TensorSpec], **extra: Any
    ) -> Path:
        """Save one snapshot atomically, then list it in the manifest (replacing an entry of that step).

        Args:
            step: the global step the weights belong to.
            tensors: name → tensor (CPU, contiguous, not sharing memory with each other).
            specs: the spec of every tensor, in model order (written to the manifest).
            **extra: JSON-serialisable fields stored in the snapshot's manifest entry (e.g. epoch).

        Returns:
            The path of the snapshot file.

        Raises:
            NonFiniteSnapshotError: a tensor holds a NaN or an infinity; nothing is written, and the
                manifest records the first such step (``nonfinite_step``).
        """
        bad = {n: int((~torch.isfinite(t)).sum()) for n, t in tensors.items() if t.is_floating_point()}
        if any(bad.values()):
            first = next(n for n, c in bad.items() if c)
            if self.manifest.get("nonfinite_step") is None:
                self.update_header({"nonfinite_step": step})
            raise NonFiniteSnapshotError(
                f"the weights of step {step} hold {sum(bad.values())} NaN or infinite values (first in "
                f"{first}): no snapshot of them is written to {self.directory}; the earlier snapshots hold "
                "finite weights"
            )
        name = snapshot_filename(step)
        final = self.directory / name
        run_id = os.fsencode(str(self.manifest.get("run_id"))).decode("utf-8", "backslashreplace")
        metadata = {"format": SNAPSHOT_FORMAT, "step": str(step), "run_id": run_id}

        def save(tmp: Path) -> None:
            try:
                save_file(dict(tensors), str(tmp), metadata=metadata)
            except UnicodeEncodeError:  # a path that is not UTF-8, which safetensors cannot open: bytes
                tmp.write_bytes(safetensors.torch.save(dict(tensors), metadata=metadata))

        atomic_write_file(final, save)
        entry = {"step": step, "file": name, "bytes": final.stat().st_size, **extra, "saved_at": utc_now()}
        snapshots = [e for e in self.manifest["snapshots"] if e["step"] != step] + [entry]
        self.manifest["snapshots"] = sorted(snapshots, key=lambda e: e["step"])
        self.manifest["tensors"] = [spec.as_dict() for spec in specs]
        self._write_manifest()
        return final

    def update_header(self, fields: Mapping[str, Any]) -> bool:
        """Set manifest header fields (e.g. what computed the attention) and rewrite the manifest
        when any changed; returns whether it did (host-side dict work only otherwise)."""
        if {"tensors", "snapshots"} & set(fields):
            raise ValueError("update_header: 'tensors' and 'snapshots' are written by write()")
        changed = {k: v for k, v in fields.items() if self.manifest.get(k) != v}
        if not changed:
            return False
        self.manifest.update(changed)
        self._write_manifest()
        return True

    def prune_after(self, step: int) -> list[int]:
        """Delete the snapshots of steps after ``step`` (a timeline abandoned by a resume); returns them."""
        dropped = [e for e in self.manifest["snapshots"] if e["step"] > step]
        nonfinite = self.manifest.get("nonfinite_step")
        if isinstance(nonfinite, int) and nonfinite > step:  # that timeline is abandoned too
            self.manifest.pop("nonfinite_step")
            self._write_manifest()
        if not dropped:
            return []
        self.manifest["snapshots"] = [e for e in self.manifest["snapshots"] if e["step"] <= step]
        self._write_manifest()  # unlist first, delete after: a crash in between leaves only orphans
        for entry in dropped:
            manifest_entry(self.directory, entry, self.directory / MANIFEST_NAME)[1].unlink(missing_ok=True)
        return [e["step"] for e in dropped]

    def _write_manifest(self) -> None:
        atomic_write_text(self.directory / MANIFEST_NAME, dumps_manifest(self.manifest))


class SnapshotStore:
    """Lazy, read-only view of the snapshots of one run directory.

    Args:
        run_dir: a run directory (holding ``snapshots/manifest.json``) or the snapshot directory
            itself.

    Raises:
        FileNotFoundError: there is no manifest.
        SnapshotError: the manifest is malformed or lists a file that does not exist.

    Example:
        >>> store = SnapshotStore("runs/flash")  # doctest: +SKIP
        >>> for name, w in store.iter_tensors(store.steps[-1]):  # one tensor in memory at a time
        ...     print(name, w.shape)
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.directory = _snapshot_dir(run_dir)
        path = self.directory / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"no snapshot manifest at {path}: is {self.run_dir} a run directory written with the "
                "WeightSnapshot callback (flashprobe.callbacks.WeightSnapshot)?"
            )
        self.manifest: dict[str, Any] = read_manifest(self.directory)  # JSON, lists, plain file names
        try:
            fmt = self.manifest.get("format")
            entries = self.manifest["snapshots"]
            specs = [
                TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], t.get("kind", "parameter"))
                for t in self.manifest["tensors"]
            ]
        except (KeyError, TypeError, AttributeError) as err:
            raise SnapshotError(
                f"malformed snapshot manifest {path} ({type(err).__name__}: {err}); it is written by "
                "flashprobe's WeightSnapshot callback: restore it or train the run again"
            ) from None
        if fmt != SNAPSHOT_FORMAT:
            raise SnapshotError(
                f"{path} has format {fmt!r}; this version of flashprobe reads {SNAPSHOT_FORMAT!r}"
            )
        self.specs: dict[str, TensorSpec] = {s.name: s for s in specs}
        self._files: dict[int, Path] = {}
        for entry in entries:
            step, file = manifest_entry(self.directory, entry, path)
            if not file.is_file():
                raise SnapshotError(f"{path} lists step {step} but {file} does not exist")
            self._files[step] = file

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.run_dir)!r}, run_id={self.run_id!r}, steps={self.steps})"

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, step: object) -> bool:
        return step in self._files

    @property
    def steps(self) -> list[int]:
        """The saved steps, ascending."""
        return sorted(self._files)

    @property
    def run_id(self) -> str | None:
        return self.manifest.get("run_id")

    @property
    def seed(self) -> int | None:
        return self.manifest.get("seed")

    @property
    def attention(self) -> str | None:
        return self.manifest.get("attention")

    @property
    def precision(self) -> str | None:
        return self.manifest.get("precision")

    @property
    def config(self) -> dict[str, Any]:
        return self.manifest.get("config") or {}

    def names(self, kind: str | None = None) -> list[str]:
        """Tensor names in model order; ``kind`` = ``parameter`` or ``buffer`` filters them."""
        return [s.name for s in self.specs.values() if kind is None or s.kind == kind]

    def path(self, step: int) -> Path:
        """The snapshot file of ``step``."""
        try:
            return self._files[step]
        except KeyError:
            raise KeyError(
                f"{self.run_dir} has no snapshot at step {step}; saved steps: {self.steps}"
            ) from None

    @contextlib.contextmanager
    def _open(self, step: int) -> Iterator[Any]:
        """``safe_open`` of one snapshot; a truncated or corrupt file raises :class:`SnapshotError`."""
        path = self.path(step)
        try:
            with library_path(path) as name, safe_open(name, framework="pt") as f:
                yield f
        except SafetensorError as err:
            raise SnapshotError(
                f"snapshot {path} (step {step}) cannot be read ({err}): the file is truncated or corrupt. "
                f"Remove its entry from {self.directory / MANIFEST_NAME} or resume the run from a "
                "checkpoint before that step to write it again"
            ) from None

    def tensor(self, step: int, name: str) -> torch.Tensor:
        """Read one tensor of one snapshot (nothing else is loaded)."""
        with self._open(step) as f:
            if name not in f.keys():  # noqa: SIM118 - safe_open handles have no __contains__
                raise KeyError(f"snapshot {self.path(step)} has no tensor {name!r}")
            return self._as_recorded(step, name, f.get_tensor(name))

    def iter_tensors(
        self, step: int, names: Iterable[str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` of one snapshot one at a time, in model order (or ``names``' order)."""
        with self._open(step) as f:
            available = set(f.keys())
            for name in self.names() if names is None else names:
                if name not in available:
                    raise KeyError(f"snapshot {self.path(step)} has no tensor {name!r}")
                yield name, self._as_recorded(step, name, f.get_tensor(name))

    def _as_recorded(self, step: int, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, if its shape is the one the manifest records for ``name``.

        Raises:
            SnapshotError: another shape (the file was replaced, or written by something else).
        """
        spec = self.specs.get(name)
        if spec is not None and tuple(tensor.shape) != spec.shape:
            raise SnapshotError(
                f"snapshot {self.path(step)} (step {step}): {name} has shape {tuple(tensor.shape)}, but "
                f"{self.directory / MANIFEST_NAME} records {spec.shape}; the file was replaced or written "
                "by something else: restore it, or remove its entry from the manifest"
            )
        return tensor

    def load(self, step: int) -> dict[str, torch.Tensor]:
        """All tensors of one snapshot as a state dict (loads the whole snapshot)."""
        return dict(self.iter_tensors(step))

    def metadata(self, step: int) -> dict[str, str]:
        """The ``safetensors`` header metadata of one snapshot (``step``, ``run_id``, ``format``)."""
        with self._open(step) as f:
            return dict(f.metadata() or {})
