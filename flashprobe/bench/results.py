"""The result files of the ``flashprobe bench`` commands, and their terminal table.

``DIR/<name>.json`` (rows under ``"rows"``, with the command, configuration and environment) and
``DIR/<name>.csv``, written atomically; JSON follows :mod:`flashprobe.formats.jsonio` (non-finite
numbers as ``"inf"``/``"-inf"``/``"nan"``, ``null``: not recorded).
"""

from __future__ import annotations

import csv
import io
import math
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flashprobe.bench.errors import BenchArgumentError
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.formats.jsonio import decode, read_json, write_json

__all__ = ["environment", "format_cell", "format_table", "load_results", "write_results", "wrote_line"]


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def peak_memory() -> dict[str, int | None]:
    """The process's peak memory so far, in bytes: resident set (imports included) and, where CUDA is
    used, the caching allocator's peak on the current device."""
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError):
        rss = None
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.max_memory_allocated()
    return {"peak_rss_bytes": rss, "cuda_peak_allocated_bytes": cuda}


def peak_memory_line(peak: Mapping[str, int | None]) -> str:
    """``peak memory: 1.23 GiB resident (process peak)[, CUDA 0.50 GiB allocated]``."""
    parts = []
    if peak.get("peak_rss_bytes") is not None:
        parts.append(f"{peak['peak_rss_bytes'] / 2**30:.2f} GiB resident (process peak)")
    if peak.get("cuda_peak_allocated_bytes") is not None:
        parts.append(f"CUDA {peak['cuda_peak_allocated_bytes'] / 2**30:.2f} GiB allocated (peak)")
    return "peak memory: " + (", ".join(parts) or "unknown")


def _csv_text(rows: Sequence[Mapping[str, Any]]) -> str:
    """One column per key seen in the rows (first-seen order); missing values are empty."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_results(
    out_dir: Path,
    name: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    meta: Mapping[str, Any] | None = None,
    skipped: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Path]:
    """Write ``out_dir/<name>.json`` (``name``, ``environment``, the ``meta`` entries, ``rows`` and
    ``skipped``) and ``out_dir/<name>.csv`` (:func:`_csv_text`) atomically; returns their paths under
    ``"json"`` and ``"csv"``."""
    out_dir = Path(out_dir)
    doc = {"name": name, "environment": environment(), **(meta or {}), "rows": rows, "skipped": skipped}
    paths = {"json": out_dir / f"{name}.json", "csv": out_dir / f"{name}.csv"}
    write_json(paths["json"], doc)
    atomic_write_text(paths["csv"], _csv_text(rows))
    return paths


def read_results_json(out_dir: Path, name: str) -> tuple[Path, Any]:
    """Read ``out_dir/<name>.json`` for ``--replot``; returns ``(path, the decoded JSON value)``.

    Raises:
        BenchArgumentError: the file is missing or is not JSON.
    """
    path = Path(out_dir) / f"{name}.json"
    try:
        return path, read_json(path, written_by=f"flashprobe bench {name}")
    except FileNotFoundError:
        raise BenchArgumentError(
            f"no {path} to replot; run `flashprobe bench {name} --out {out_dir}` without --replot first"
        ) from None
    except ValueError as err:
        raise BenchArgumentError(str(err)) from None


def load_results(out_dir: Path, name: str) -> dict[str, Any]:
    """Read ``out_dir/<name>.json`` as written by :func:`write_results`, the non-finite numbers of
    ``rows`` and ``skipped`` decoded to floats.

    Raises:
        BenchArgumentError: the file is missing, is not JSON, or has no ``"rows"`` (or none).
    """
    path, doc = read_results_json(out_dir, name)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not doc["rows"]:
        raise BenchArgumentError(f"{path} has no rows under 'rows' to plot; was it written by flashprobe?")
    doc["rows"] = decode(doc["rows"])
    doc["skipped"] = decode(doc.get("skipped", []))
    return doc


def format_cell(value: Any) -> str:
    """A table cell: ``-`` for None, ``yes``/``no``, ``inf`` for an infinite float, 3 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.3g}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Render rows as an aligned text table of ``(key, header)`` columns (missing keys show as ``-``),
    header first, without a trailing newline."""
    cells = [[header for _, header in columns]]
    cells += [[format_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def wrote_line(rows: Sequence[Mapping[str, Any]], seconds: float, paths: Mapping[str, Path]) -> str:
    """The last line a bench command prints: ``"N rows in S s; wrote PATH, PATH, ..."``."""
    return f"{len(rows)} rows in {seconds:.1f} s; wrote " + ", ".join(str(p) for p in paths.values())
