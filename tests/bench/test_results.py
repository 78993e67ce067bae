"""``flashprobe.bench.results``: atomic JSON and CSV, non-finite numbers, the terminal table."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest

from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.results import format_table, load_results, write_results


def test_write_results(tmp_path: Path) -> None:
    rows = [{"a": 1.5, "b": math.inf}, {"a": 2.0, "c": "z"}]
    paths = write_results(tmp_path / "r", "t", rows, meta={"command": "x"})
    doc = json.loads(paths["json"].read_text())
    # Non-finite numbers follow flashprobe.formats.jsonio: strings, not null (null = not recorded).
    assert doc["rows"] == [{"a": 1.5, "b": "inf"}, {"a": 2.0, "c": "z"}] and doc["command"] == "x"
    assert paths["csv"].read_text() == "a,b,c\n1.5,inf,\n2.0,,z\n"
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["t.csv", "t.json"]  # no temp files left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(paths["json"].stat().st_mode) == 0o666 & ~umask  # not mkstemp's private 0600
    table = format_table(rows, [("a", "A"), ("b", "B")]).splitlines()
    assert (
        table[0].split() == ["A", "B"]
        and table[2].split() == ["1.5", "inf"]
        and table[3].split() == ["2", "-"]
    )


def test_load_results_decodes_non_finite_numbers(tmp_path: Path) -> None:
    rows = [{"kernel": "tiled", "n": 3, "r": math.inf, "lo": -math.inf, "x": math.nan, "none": None}]
    write_results(tmp_path, "t", rows, skipped=[{"kernel": "k", "ratio": math.inf, "reason": "why"}])
    doc = load_results(tmp_path, "t")
    (row,) = doc["rows"]
    assert row["r"] == math.inf and row["lo"] == -math.inf and math.isnan(row["x"])
    assert row["none"] is None and row["kernel"] == "tiled"
    assert row["n"] == 3 and isinstance(row["n"], int)
    assert doc["skipped"] == [{"kernel": "k", "ratio": math.inf, "reason": "why"}]


def test_load_results_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(BenchArgumentError, match="without --replot first"):
        load_results(tmp_path, "t")
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(BenchArgumentError, match="not valid JSON at line 1"):
        load_results(tmp_path, "t")
    (tmp_path / "t.json").write_text('{"rows": []}')
    with pytest.raises(BenchArgumentError, match="no rows under 'rows'"):
        load_results(tmp_path, "t")
