"""probe.jsonl: records round-trip, a torn tail is dropped by readers and cut by the writer."""

from __future__ import annotations

import json
import logging
import math

import pytest

from flashprobe.formats.probe_log import ProbeLogWriter, load_probe_records, read_probe_log


def _record(step: int, ratio: float = 1.5) -> dict:
    return {
        "step": step,
        "summary": {"max_error_ratio": ratio, "max_error_ratio_site": "inf", "nonfinite": 0},
        "sites": {"model.a.attn": {"forward": {"out": {"error_ratio": ratio}}}},
    }


def _write(path, steps) -> ProbeLogWriter:
    writer = ProbeLogWriter(path)
    writer.open(None)
    for step in steps:
        writer.append(_record(step))
    return writer


def test_records_round_trip_with_non_finite_numbers_and_text_fields(tmp_path):
    path = tmp_path / "probe.jsonl"
    writer = ProbeLogWriter(path)
    writer.append(_record(1, math.inf))
    writer.append(_record(2, math.nan))
    assert json.loads(path.read_text().splitlines()[0])["summary"]["max_error_ratio"] == "inf"
    first, second = read_probe_log(path).records
    assert first["summary"]["max_error_ratio"] == math.inf
    assert first["summary"]["max_error_ratio_site"] == "inf"  # a site name stays text
    assert math.isnan(second["sites"]["model.a.attn"]["forward"]["out"]["error_ratio"])


def test_a_torn_last_line_is_dropped_by_readers_and_reported(tmp_path, caplog):
    path = tmp_path / "probe.jsonl"
    _write(path, [1, 2, 3])
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"step": 4, "summ')  # killed mid-append
    probe_log = read_probe_log(path)
    assert probe_log.steps == [1, 2, 3]
    assert probe_log.valid_bytes == len(whole)
    assert probe_log.dropped.startswith("a torn last line (17 bytes")
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in load_probe_records(path)] == [1, 2, 3]
    assert "torn last line" in caplog.text


def test_a_corrupt_line_in_the_middle_stops_the_reader_there(tmp_path):
    path = tmp_path / "probe.jsonl"
    _write(path, [1])
    path.write_bytes(path.read_bytes() + b"not json\n" + json.dumps(_record(2)).encode() + b"\n")
    probe_log = read_probe_log(path)
    assert probe_log.steps == [1]
    assert probe_log.dropped.startswith("line 2 and everything after it")


def test_the_writer_cuts_a_torn_tail_before_appending(tmp_path, caplog):
    path = tmp_path / "probe.jsonl"
    _write(path, [1, 2])
    path.write_bytes(path.read_bytes() + b'{"step": 3, "su')
    writer = ProbeLogWriter(path)
    with caplog.at_level(logging.WARNING):
        assert writer.open(keep_until=2) == []
    writer.append(_record(3))
    assert read_probe_log(path).steps == [1, 2, 3] and read_probe_log(path).dropped == ""
    assert "cutting a torn last line" in caplog.text


def test_resume_drops_the_abandoned_records_and_a_fresh_start_empties_the_log(tmp_path):
    path = tmp_path / "probe.jsonl"
    _write(path, [2, 4, 6, 8])
    writer = ProbeLogWriter(path)
    assert writer.open(keep_until=4) == [6, 8]
    writer.append(_record(6))
    assert read_probe_log(path).steps == [2, 4, 6]
    assert ProbeLogWriter(path).open(None) == [2, 4, 6]
    assert path.read_text() == ""


def test_a_missing_log_names_the_callback(tmp_path):
    with pytest.raises(FileNotFoundError, match="AttentionProbe"):
        read_probe_log(tmp_path / "probe.jsonl")


def test_an_append_on_a_full_disk_leaves_no_torn_line(tmp_path, monkeypatch):
    import errno

    from flashprobe.formats import probe_log
    from flashprobe.formats.atomic import DiskFullError

    writer = ProbeLogWriter(tmp_path / "probe.jsonl")
    writer.append({"step": 2, "verdict": "pass"})
    before = (tmp_path / "probe.jsonl").read_bytes()

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(probe_log.os, "fsync", no_space)
    with pytest.raises(DiskFullError, match=r"probe\.jsonl is kept up to its last whole record"):
        writer.append({"step": 4, "verdict": "pass"})
    assert (tmp_path / "probe.jsonl").read_bytes() == before
