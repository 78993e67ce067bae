"""The JSON convention: non-finite numbers as strings, null as not recorded, clear read errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flashprobe.formats import dumps, encode, number, read_json, write_json


def test_non_finite_numbers_round_trip_and_null_stays_none(tmp_path):
    value = {"ratio": math.inf, "low": -math.inf, "undefined": math.nan, "none": None, "x": 0.25, "n": 3}
    path = write_json(tmp_path / "v.json", value)
    raw = json.loads(path.read_text())  # strict JSON: the standard parser reads it
    assert raw == {"ratio": "inf", "low": "-inf", "undefined": "nan", "none": None, "x": 0.25, "n": 3}
    decoded = {k: number(v) for k, v in read_json(path, written_by="test").items()}
    assert decoded["ratio"] == math.inf and decoded["low"] == -math.inf and math.isnan(decoded["undefined"])
    assert decoded["none"] is None and decoded["x"] == 0.25 and decoded["n"] == 3.0


def test_encode_walks_containers_and_stringifies_objects():
    assert encode({1: (1.0, math.inf), "p": Path("a/b")}) == {"1": [1.0, "inf"], "p": "a/b"}
    assert "NaN" not in dumps([math.nan]) and dumps([math.nan]) == '["nan"]'


def test_number_rejects_other_strings():
    with pytest.raises(ValueError, match="expected a number"):
        number("infinity")
    with pytest.raises(ValueError):  # bools are not numbers here
        number(True)


def test_read_json_names_the_file_and_the_writer(tmp_path):
    with pytest.raises(FileNotFoundError, match="written by `flashprobe compare`"):
        read_json(tmp_path / "study.json", written_by="flashprobe compare")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n')
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON at line 2"):
        read_json(bad, written_by="flashprobe compare")
