"""``probe.jsonl``: the attention probe's log of one run, written and read here only.

One JSON line per logging step, appended in step order::

    {"step": 25, "summary": {...}, "sites": {"model.blocks.0.attn": {...}, ...}}

``summary`` is :meth:`flashprobe.probing.Probe.summary`, ``sites`` :meth:`flashprobe.probing.Probe.stats`
of the logging interval (numbers as :mod:`flashprobe.formats.jsonio`); the signed bias
(:mod:`flashprobe.bias`) is the run's so far.

A record is one ``write`` of a whole line then ``fsync``, so a crash leaves at most one torn last
line: readers take the valid prefix; the writer cuts the torn tail, and on resume from step ``S``
the records after ``S``, before it appends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashprobe.formats.atomic import DiskFullError, atomic_write_text, disk_full
from flashprobe.formats.jsonio import decode, dumps
from flashprobe.formats.nofollow import open_append
from flashprobe.formats.probe_summary import ProbeSummary

__all__ = [
    "PROBE_LOG_NAME",
    "ProbeLog",
    "ProbeLogWriter",
    "load_probe_records",
    "read_probe_log",
    "record_summary",
]

log = logging.getLogger(__name__)

#: The file name of the log in a run directory.
PROBE_LOG_NAME = "probe.jsonl"

#: Fields of a record that hold text (site names), never decoded as numbers.
_TEXT_KEYS = frozenset(
    {
        "max_error_ratio_site",
        "max_backward_error_ratio_site",
        "nonfinite_sites",
        "primary_nonfinite_sites",
        "first_primary_nonfinite_sites",
        "max_bias_site",
    }
)


@dataclass
class ProbeLog:
    """The records of a ``probe.jsonl`` file, in file order.

    Attributes:
        path: the file.
        records: the complete, valid records (numbers decoded).
        dropped: what was not read, in words, or ``""`` when the whole file was read.
        valid_bytes: length of the valid prefix of the file.
    """

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    dropped: str = ""
    valid_bytes: int = 0

    @property
    def steps(self) -> list[int]:
        return [int(r["step"]) for r in self.records]


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return decode(record, text_keys=_TEXT_KEYS)


def read_probe_log(path: str | os.PathLike[str]) -> ProbeLog:
    """Read the valid prefix of a ``probe.jsonl`` file (see the module docstring).

    Raises:
        FileNotFoundError: no such file, naming the callback that writes one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a run writes {PROBE_LOG_NAME} when trained with the AttentionProbe "
            "callback (flashprobe train with attention.probe.enabled=true)"
        )
    data = path.read_bytes()
    result = ProbeLog(path)
    offset = 0
    lines = data.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        complete = line.endswith(b"\n")
        if complete and not line.strip():
            offset += len(line)
            continue
        record = _parse(line) if complete else None  # a line without its newline was cut short
        if record is None:
            rest = len(data) - offset
            if number == len(lines) and not complete:
                result.dropped = f"a torn last line ({rest} bytes, an interrupted write) at line {number}"
            else:
                result.dropped = f"line {number} and everything after it ({rest} bytes): not a probe record"
            break
        result.records.append(record)
        offset += len(line)
    result.valid_bytes = offset
    return result


def load_probe_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The valid records of a ``probe.jsonl`` file; logs a warning naming anything dropped."""
    probe_log = read_probe_log(path)
    if probe_log.dropped:
        log.warning("%s: read %d records, dropped %s", path, len(probe_log.records), probe_log.dropped)
    return probe_log.records


def record_summary(record: Mapping[str, Any]) -> ProbeSummary:
    """A record's ``summary`` as a :class:`~flashprobe.formats.probe_summary.ProbeSummary`, with the
    record's step.

    Raises:
        ValueError: the record's summary is not a probe summary, naming the step and the keys.
    """
    try:
        return ProbeSummary.from_dict({**(record.get("summary") or {}), "step": record["step"]})
    except ValueError as err:
        raise ValueError(f"the record of step {record['step']}: {err}") from None


class ProbeLogWriter:
    """Appends records to a run's ``probe.jsonl`` (use from rank zero only).

    Args:
        path: the file (created with its directory on the first append).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.opened = False

    def open(self, keep_until: int | None) -> list[int]:
        """Prepare the file for appending; returns the steps of the records dropped.

        Args:
            keep_until: the step a resumed run starts from (later records are dropped); ``None``: a
                fresh run, which starts an empty log.
        """
        self.opened = True
        if not self.path.exists():
            return []
        existing = read_probe_log(self.path)
        kept = [r for r in existing.records if keep_until is not None and r["step"] <= keep_until]
        dropped = [r["step"] for r in existing.records if r not in kept]
        if existing.dropped:
            log.warning("%s: cutting %s before appending", self.path, existing.dropped)
        if dropped or existing.dropped:
            atomic_write_text(self.path, "".join(dumps(r) + "\n" for r in kept))
        return dropped

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one record as a line and fsync it (see the module docstring)."""
        if not self.opened:
            self.open(None)
        line = (dumps(record) + "\n").encode("utf-8")
        with open_append(self.path) as fd, open(os.dup(fd), "ab", buffering=0) as fh:
            size = fh.seek(0, os.SEEK_END)
            try:
                written = 0
                while written < len(line):
                    written += fh.write(line[written:])
                os.fsync(fh.fileno())
            except OSError as err:  # no torn line left behind: cut back to the last whole record
                with contextlib.suppress(OSError):
                    fh.truncate(size)
                if disk_full(err):
                    kept = f"{self.path.name} is kept up to its last whole record"
                    raise DiskFullError(self.path, kept=kept) from err
                raise
