"""``RUN_DIR/run.json``: what a training run is, where it stands, and how long it took.

Written at the start and end of every session (a first start or a resume)::

    {"format": "flashprobe.run/1",
     "status": "starting" | "running" | "finished" | "stopped" | "failed" | "interrupted",
     "max_steps": 900, "global_step": 900,
     "sessions": [{"started": "...", "from_step": 0, "to_step": 300, "seconds": 80.1,
                   "resumed_from": null, "failed": "why it ended early (if it did)"}, ...],
     "machine": {...flashprobe.app.machine.machine_facts()...},
     "outputs": ["checkpoints", "config.yaml", ...]}

A session killed before its end keeps ``"seconds": null``. ``outputs`` names what flashprobe
created in the directory (:func:`claim_outputs`), the only files it ever deletes there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flashprobe.formats.atomic import atomic_write_bytes
from flashprobe.formats.jsonio import read_json, utc_now, write_json

__all__ = [
    "RUN_FORMAT",
    "RUN_RECORD",
    "claim_outputs",
    "finish_session",
    "owned_outputs",
    "read_run_record",
    "run_seconds",
    "start_session",
]

RUN_FORMAT = "flashprobe.run/1"
RUN_RECORD = "run.json"

#: Space held while a session runs, given back to write its end (a full disk cannot leave it "running").
RESERVE = ".run.json.reserve"
RESERVE_BYTES = 64 * 1024


def read_run_record(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's ``run.json``, or ``None`` when it has none (or an unreadable one)."""
    path = Path(run_dir) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = read_json(path, written_by="flashprobe train")
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("format") == RUN_FORMAT else None


def owned_outputs(run_dir: str | os.PathLike[str], candidates: list[str] | tuple[str, ...]) -> list[str]:
    """The names among ``candidates`` that the run's ``run.json`` records as created by flashprobe
    (none without a record; every one for a record without ``outputs``; ``run.json`` itself always)."""
    record = read_run_record(run_dir)
    if record is None:
        return []
    listed = record.get("outputs")
    if not isinstance(listed, list):
        return list(candidates)
    names = {n for n in listed if isinstance(n, str)} | {RUN_RECORD}
    return [n for n in candidates if n in names]


def claim_outputs(run_dir: str | os.PathLike[str], names: list[str] | tuple[str, ...]) -> None:
    """Record in ``run.json`` (created if needed) that flashprobe creates ``names`` in ``run_dir``,
    before the run writes any of them."""
    record = read_run_record(run_dir) or {"format": RUN_FORMAT, "status": "starting", "sessions": []}
    record["outputs"] = sorted({*record.get("outputs", []), *names, RUN_RECORD})
    write_json(Path(run_dir) / RUN_RECORD, record)


def start_session(
    run_dir: str | os.PathLike[str],
    *,
    from_step: int,
    max_steps: int,
    machine: dict[str, Any],
    resumed_from: str | None = None,
    imports: list[str] | tuple[str, ...] = (),
) -> None:
    """Record that a session starts at ``from_step``, with the ``--import`` modules a resume needs,
    and hold :data:`RESERVE` so its end can be written on a full disk."""
    existing = read_run_record(run_dir) or {}
    record = (existing if resumed_from is not None and existing else None) or {
        "format": RUN_FORMAT,
        "sessions": [],
    }
    if "outputs" in existing:
        record["outputs"] = existing["outputs"]
    record.update(status="running", max_steps=max_steps, global_step=from_step, machine=machine)
    record.update(flashprobe=_version(), **({"imports": list(imports)} if imports else {}))
    if not imports:
        record.pop("imports", None)
    record["sessions"].append(
        {
            "started": utc_now(),
            "from_step": from_step,
            "to_step": None,
            "seconds": None,
            "resumed_from": resumed_from,
        }
    )
    write_json(Path(run_dir) / RUN_RECORD, record)
    atomic_write_bytes(Path(run_dir) / RESERVE, bytes(RESERVE_BYTES))


def finish_session(
    run_dir: str | os.PathLike[str],
    *,
    global_step: int,
    seconds: float,
    failed: str | None = None,
    note: str | None = None,
    attention: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Record the end of the current session; the run is ``finished`` once it reached ``max_steps``.

    Args:
        run_dir: the run directory.
        global_step: the step the session ended at.
        seconds: how long it trained.
        failed: why the session ended early: the status is then ``failed`` (``interrupted`` for
            Ctrl-C) and the reason kept in the session.
        note: something the run met but trained through (``on_nonfinite=continue``).
        attention: what computed the attention (:func:`flashprobe.probing.session.attention_record`),
            merged into the session.
    """
    record = read_run_record(run_dir)
    if record is None or not record["sessions"]:
        raise ValueError(f"{Path(run_dir) / RUN_RECORD}: no session was started")
    record["sessions"][-1].update(to_step=global_step, seconds=round(seconds, 3))
    record["global_step"] = global_step
    done = record.get("max_steps") in (None, -1) or global_step >= record["max_steps"]
    record["status"] = "finished" if done else "stopped"
    if failed is not None:
        record["status"] = "interrupted" if failed.startswith("interrupted") else "failed"
        record["sessions"][-1]["failed"] = failed
    if note is not None:
        record["sessions"][-1]["note"] = note
    if attention is not None:
        record["sessions"][-1].update(attention)
    (Path(run_dir) / RESERVE).unlink(missing_ok=True)  # the space this write may need
    write_json(Path(run_dir) / RUN_RECORD, record)
    return record


def _version() -> str:
    from flashprobe import __version__

    return __version__


def run_seconds(record: dict[str, Any]) -> float | None:
    """Training time over all completed sessions (``None`` if no session completed)."""
    times = [s["seconds"] for s in record.get("sessions", []) if s.get("seconds") is not None]
    return sum(times) if times else None
