"""A run directory's files: what it holds, what flashprobe owns in it, where a resume continues from.

Read as data only (checkpoints with ``weights_only=True``); only what ``run.json`` records as
flashprobe's is deleted. The decisions are :class:`flashprobe.app.run_dir.RunDir`'s.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from flashprobe.formats.atomic import remove_temporary, stray_temporaries
from flashprobe.formats.paths import library_path
from flashprobe.formats.run_record import owned_outputs, read_run_record
from flashprobe.formats.snapshot_manifest import MANIFEST_NAME, SNAPSHOT_DIRNAME, read_manifest

__all__ = [
    "RUN_DIR_NAMES",
    "RUN_OUTPUTS",
    "check_links",
    "check_resumable",
    "checkpoint_step",
    "existing_run",
    "last_checkpoint",
    "occupied",
    "refuse_foreign",
    "remove_later_checkpoints",
    "remove_outputs",
    "remove_stray_temporaries",
    "resume_point",
]

log = logging.getLogger(__name__)

#: What a run writes into its directory; a directory holding any of these holds a run.
RUN_OUTPUTS = (
    "run.json",
    "config.yaml",
    "snapshots",
    "probe.jsonl",
    "probe.png",
    "checkpoints",
    "samples",
    "csv",
    "wandb",
)

#: What a run directory may hold (outputs, Hydra's record, lock, log); a directory holding none is not one.
RUN_DIR_NAMES = (*RUN_OUTPUTS, ".hydra", ".flashprobe.lock", "train.log")


def existing_run(run_dir: Path) -> list[str]:
    """The outputs of an earlier run found in ``run_dir`` (empty when there is none)."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def occupied(run_dir: Path, found: list[str]) -> str:
    """The refusal of a fresh start in ``run_dir``, which holds the outputs ``found`` of a run."""
    return (
        f"{run_dir} already holds a run ({', '.join(found)}); flashprobe never deletes a run it did not "
        f"create. Continue it with `flashprobe train resume={run_dir}`, start afresh there with "
        "overwrite=true (deletes those outputs), or choose another directory"
    )


def last_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint of the highest step (``last.ckpt`` among those of that step), whatever the
    files' names or times (a copied run may hold a stale ``last.ckpt``).

    Raises:
        CheckpointError: a checkpoint of the run is unsafe, truncated or not a checkpoint.
    """
    directory = run_dir / "checkpoints"
    found = [p for p in directory.glob("*.ckpt") if p.is_file()] if directory.is_dir() else []
    if not found:
        return None
    return max(found, key=lambda p: (checkpoint_step(p), p.name == "last.ckpt", p.stat().st_mtime))


def checkpoint_step(checkpoint: str | Path) -> int:
    """A checkpoint's ``global_step``, read with ``weights_only=True``.

    Raises:
        CheckpointError: the checkpoint is unsafe to unpickle, truncated or not a checkpoint.
    """
    from flashprobe.formats.checkpoint_io import load_checkpoint

    return int(load_checkpoint(checkpoint)["global_step"])


def resume_point(run_dir: Path, max_steps: int | None) -> Path | None:
    """The checkpoint a resume continues from: the newest, unless it holds the last step; then the
    newest earlier one, or None (Lightning would skip what the run still had to do after saving it)."""
    newest = last_checkpoint(run_dir)
    if newest is None or max_steps in (None, -1) or checkpoint_step(newest) != max_steps:
        return newest  # (a checkpoint past max_steps is refused by the app)
    steps = [(p, checkpoint_step(p)) for p in sorted((run_dir / "checkpoints").glob("*.ckpt"))]
    earlier = [(p, step) for p, step in steps if step < max_steps]
    return max(earlier, key=lambda c: (c[1], c[0].stat().st_mtime))[0] if earlier else None


def remove_later_checkpoints(run_dir: Path, step: int) -> None:
    """Delete the checkpoints after ``step``, which a resume writes again (else ``NAME-v1.ckpt``)."""
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        if path.name != "last.ckpt" and checkpoint_step(path) > step:
            log.warning("removing %s: training from step %d writes it again", path, step)
            path.unlink()


def remove_stray_temporaries(run_dir: Path) -> None:
    """Delete the temporaries a killed run left in its own outputs (the directory is locked)."""
    strays = [p for p in stray_temporaries(run_dir) if p.parent == run_dir]
    for name in owned_outputs(run_dir, RUN_OUTPUTS):
        if (run_dir / name).is_dir() and not (run_dir / name).is_symlink():
            strays += stray_temporaries(run_dir / name)
    for stray in strays:
        log.warning("removing %s, left by an interrupted write", stray)
        remove_temporary(stray)


def refuse_foreign(run_dir: Path, names: list[str]) -> None:
    """Refuse to go on when some of ``names`` in ``run_dir`` were not created by flashprobe.

    Raises:
        FileExistsError: naming them.
    """
    owned = owned_outputs(run_dir, RUN_OUTPUTS)
    foreign = [name for name in names if name not in owned]
    if foreign:
        raise FileExistsError(
            f"{run_dir} holds {', '.join(foreign)}, which no flashprobe run recorded as its own (a run's "
            "run.json lists what it created); flashprobe deletes only its own outputs. Move them out of the "
            "directory, or train into another directory"
        )


def remove_outputs(run_dir: Path, names: list[str]) -> None:
    """Delete the outputs ``names`` of an earlier run — only those its ``run.json`` records as its own.

    Raises:
        FileExistsError: some of ``names`` are not flashprobe's; nothing is deleted then.
    """
    refuse_foreign(run_dir, names)
    for name in names:
        path = run_dir / name
        if not path.exists() and not path.is_symlink():
            continue
        log.warning("removing %s of the earlier run in %s", name, run_dir)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()  # a link is removed, never what it points to


#: Files a run appends to: never through a link, wherever it points.
APPENDED = (".flashprobe.lock", "train.log", "probe.jsonl")


def check_links(directory: Path) -> None:
    """Refuse a run or study directory holding a link, before any work (Hydra and Lightning would follow
    it), or a hard link at a file in :data:`APPENDED`. Allowed: a checkpoint linked to another of the
    run (``save_last="link"``) and what is inside ``wandb/``.

    Raises:
        LinkError: naming the link, where it points and the fix.
    """
    from flashprobe.formats.nofollow import LinkError

    root = directory.resolve()
    if not directory.is_dir():
        return
    for where, dirs, files in os.walk(directory):
        if "wandb" in dirs and not (Path(where) / "wandb").is_symlink():  # (a run's, or a study run's)
            dirs.remove("wandb")
        for name in dirs + files:
            path = Path(where) / name
            if name in APPENDED and path.is_file() and not path.is_symlink() and path.stat().st_nlink > 1:
                raise LinkError(path, directory, "a hard link to another file")
            if not path.is_symlink():
                continue
            inside = path.resolve().is_relative_to(root)
            lightnings = path.parent.name == "checkpoints" and path.suffix == ".ckpt" and path.is_file()
            if not (inside and lightnings):
                raise LinkError(path, directory)


def check_resumable(run_dir: Path, from_step: int) -> None:
    """Refuse now a run to continue whose record or kept snapshots would fail or be lost later.

    Raises:
        LinkError: as for :func:`check_links`.
        ValueError: ``run.json`` is not flashprobe's record, the snapshot manifest is malformed, or a
            snapshot at or before ``from_step`` cannot be read.
    """
    from safetensors import SafetensorError, safe_open

    check_links(run_dir)
    snapshots = run_dir / SNAPSHOT_DIRNAME
    record = run_dir / "run.json"
    if record.exists() and read_run_record(run_dir) is None:
        from flashprobe.formats.jsonio import format_problem, read_json
        from flashprobe.formats.run_record import RUN_FORMAT

        try:
            found = read_json(record, written_by="flashprobe train")
            problem = format_problem(record, found, RUN_FORMAT, "run record")
        except ValueError as err:
            problem = f"{record} is not a flashprobe run record ({err})"
        raise ValueError(
            f"{problem}; it is not a run record this flashprobe can extend, so the run's earlier sessions "
            "would be lost: restore it, or move it away to continue with a fresh record"
        )
    if not (snapshots / MANIFEST_NAME).is_file():
        return
    for entry in read_manifest(snapshots).get("snapshots", []):
        if entry["step"] > from_step or not (snapshots / entry["file"]).is_file():
            continue  # abandoned by the resume, or already gone: the writer drops them
        try:
            with library_path(snapshots / entry["file"]) as name, safe_open(name, framework="pt"):
                pass
        except SafetensorError as err:
            raise ValueError(
                f"snapshot {snapshots / entry['file']} (step {entry['step']}) cannot be read ({err}): it is "
                "truncated or corrupt, and a resume would keep it; restore it, or start the run again with "
                "overwrite=true"
            ) from None
