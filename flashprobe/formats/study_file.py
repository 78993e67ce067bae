"""``study.json`` and ``study.csv``: the result of comparing runs' weights, written and read here only.

``study.json`` (format ``flashprobe.compare/1``) is columnar: every curve is a list aligned with the
pair's ``steps``::

    {"format": "flashprobe.compare/1", "group_depth": 2,
     "pairs": {"flash_vs_baseline": {
         "run_a": "runs/flash", "run_b": "runs/baseline",
         "runs": {"a": {"run_id", "seed", "attention", "precision", "steps"}, "b": {...}},
         "differs": {"attention": ["sdpa_flash", "math"]}, "unrecorded": [],
         "steps": [0, 20, ...], "steps_only_a": [], "steps_only_b": [],
         "model": {"numel": 1234, "wasserstein": [...], "max_abs": [...],
                   "nonfinite_a": [...], "nonfinite_b": [...]},
         "groups": {"blocks.0": {...same columns...}}, "tensors": {"head.weight": {...}}}},
     ...further top-level fields a study adds (e.g. "study")}

``differs``: what the runs were recorded to differ in (:mod:`flashprobe.weights.differences`). A
study adds ``study``: its plan, kernel, warm-up, overrides and machine facts. Numbers follow
:mod:`flashprobe.formats.jsonio`. ``study.csv``: one row per pair × step × level × name
(:data:`CSV_FIELDS`).
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from flashprobe.formats.atomic import atomic_write_text
from flashprobe.formats.jsonio import decode, format_problem, read_json, write_json
from flashprobe.formats.paths import OutputPathError, safe_name

__all__ = ["CSV_FIELDS", "STUDY_FORMAT", "STUDY_NAME", "read_study", "write_study"]

STUDY_FORMAT = "flashprobe.compare/1"
STUDY_NAME = "study.json"
CSV_FIELDS = (
    "pair",
    "step",
    "level",
    "name",
    "numel",
    "wasserstein",
    "max_abs",
    "nonfinite_a",
    "nonfinite_b",
)
_WRITERS = "flashprobe compare RUN_A RUN_B --out DIR` or `flashprobe study --out DIR"
_TEXT_KEYS = frozenset({"run_a", "run_b", "run_id", "attention", "precision", "differs"})


def write_study(
    out_dir: str | os.PathLike[str], doc: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]
) -> list[Path]:
    """Write ``out_dir/study.json`` (``doc``, with ``format`` set) and ``out_dir/study.csv`` (``rows``);
    returns the two paths."""
    out = Path(out_dir)
    from flashprobe import __version__

    json_path = write_json(out / STUDY_NAME, {"format": STUDY_FORMAT, "flashprobe": __version__, **doc})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    csv_path = atomic_write_text(out / "study.csv", buffer.getvalue())
    return [json_path, csv_path]


def read_study(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check ``study.json`` (or the ``study.json`` in a directory); numbers decoded.

    Raises:
        FileNotFoundError: no such file, naming the commands that write one.
        ValueError: not JSON, another format, or pairs without aligned ``steps`` and ``model``
            columns, naming the file and the problem.
    """
    path = Path(path)
    if path.is_dir():
        path = path / STUDY_NAME
    doc = read_json(path, written_by=_WRITERS)
    problem = format_problem(path, doc, STUDY_FORMAT)
    if problem:
        raise ValueError(f"{problem}; or rewrite it with `{_WRITERS}`")
    pairs = doc.get("pairs")
    if not isinstance(pairs, dict) or not pairs:
        raise ValueError(f"{path}: no comparison under 'pairs'; rewrite it with `{_WRITERS}`")
    for name, pair in pairs.items():
        try:
            safe_name(name, what="pair name")  # it becomes part of a figure's file name
        except OutputPathError as err:
            raise ValueError(f"{path}: {err}") from None
        steps = pair.get("steps") if isinstance(pair, dict) else None
        model = pair.get("model") if isinstance(pair, dict) else None
        if not isinstance(steps, list) or not isinstance(model, dict):
            raise ValueError(f"{path}: pair {name!r} has no 'steps' list and 'model' columns")
        bad = next((s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0), None)
        if bad is not None or len(set(steps)) != len(steps):
            what = f"holds {bad!r}" if bad is not None else "repeats a step"
            raise ValueError(
                f"{path}: pair {name!r} 'steps' {what}; steps are distinct non-negative integers (training "
                f"steps): rewrite it with `{_WRITERS}`"
            )
        for column in ("wasserstein", "max_abs"):
            values = model.get(column)
            if not isinstance(values, list) or len(values) not in (0, len(steps)):
                raise ValueError(
                    f"{path}: pair {name!r} column model.{column} does not align with its {len(steps)} steps"
                )
    return decode(doc, text_keys=_TEXT_KEYS)
