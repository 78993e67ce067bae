"""``flashprobe bench speed``: timing rows, peak memory in a fresh process, skipping math."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import pytest
import torch

from flashprobe.bench import speed
from flashprobe.bench.inputs import Shape

SMALL = ["--batch", "1", "--heads", "2", "--head-dim", "16", "--repeats", "2"]


def test_rows_ratios_and_files(tmp_path: Path) -> None:
    argv = [*SMALL, "--seq-len", "64", "128", "--kernel", "tiled", "--no-memory", "--out", str(tmp_path)]
    assert speed.main(argv) == 0
    doc = json.loads((tmp_path / "speed.json").read_text())
    rows = doc["rows"]
    assert doc["complete"] is True and doc["command"].startswith("flashprobe bench speed")
    with open(tmp_path / "speed.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 4
    assert (tmp_path / "speed.png").read_bytes().startswith(b"\x89PNG")
    assert [(r["kernel"], r["seq_len"]) for r in rows] == [
        ("math", 64),
        ("tiled", 64),
        ("math", 128),
        ("tiled", 128),
    ]
    for math_row, tiled_row in (rows[0:2], rows[2:4]):
        for row in (math_row, tiled_row):
            assert {"kernel", "seq_len", "dtype", "ms", "peak_mb", "ratio_vs_math"} <= set(row)
            assert row["dtype"] == "fp32" and row["ms_lo"] <= row["ms"] <= row["ms_hi"] and row["ms"] > 0
            assert row["peak_mb"] is None
        assert math_row["ratio_vs_math"] == 1.0
        assert tiled_row["ratio_vs_math"] == pytest.approx(tiled_row["ms"] / math_row["ms"])


def test_peak_memory_sees_the_score_matrix(tmp_path: Path) -> None:
    """math holds the (B, H, N, N) scores: its peak is at least one fp32 score matrix (16 MiB
    here) and at most a few; tiled holds a few (B, H, N, Bc) tiles at a time: less than one matrix."""
    argv = ["--heads", "4", "--head-dim", "32", "--seq-len", "1024", "--kernel", "tiled", "--repeats", "1"]
    assert speed.main([*argv, "--out", str(tmp_path)]) == 0
    math_row, tiled_row = json.loads((tmp_path / "speed.json").read_text())["rows"]
    matrix_mb = 4 * 1024 * 1024 * 4 / 2**20
    assert math_row["memory_method"] in ("VmHWM-VmRSS", "ru_maxrss-VmRSS")
    assert matrix_mb <= math_row["peak_mb"] <= 4 * matrix_mb, math_row
    assert tiled_row["peak_mb"] < 0.8 * matrix_mb, (tiled_row, math_row)  # less than one score matrix
    assert tiled_row["mem_ratio_vs_math"] == pytest.approx(tiled_row["peak_mb"] / math_row["peak_mb"])


def test_math_is_skipped_when_it_would_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 3·B·H·N²·4 bytes at N = 256 is 1.5 MiB > 0.001 GiB: math is skipped, tiled still runs.
    argv = [*SMALL, "--seq-len", "256", "--kernel", "tiled", "--max-memory-gb", "0.001", "--no-memory"]
    assert speed.main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped math at fp32, N=256: would need ~0.0 GiB" in out
    doc = json.loads((tmp_path / "speed.json").read_text())
    assert [r["kernel"] for r in doc["rows"]] == ["tiled"]
    assert doc["rows"][0]["ratio_vs_math"] is None and doc["rows"][0]["ms"] > 0
    assert doc["skipped"][0]["kernel"] == "math" and "--max-memory-gb" in doc["skipped"][0]["reason"]


def test_materialised_bytes() -> None:
    shape = Shape(batch=1, heads=8, seq_len=32768, head_dim=64)
    assert speed.materialised_bytes(shape, torch.float32) == 3 * 8 * 32768**2 * 4  # 96 GiB


def test_time_kernels_interleaves_counts_and_times_in_ms() -> None:
    calls: list[str] = []

    def make(name: str, sleep_s: float = 0.0):
        def fn(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
            calls.append(name)
            time.sleep(sleep_s)
            return q

        return fn

    q = torch.zeros(1, 1, 4, 4)
    kernels = [make("a"), make("b", sleep_s=0.02)]
    start = time.perf_counter()
    times = speed.time_kernels(kernels, q, q, q, repeats=3)  # type: ignore[arg-type]
    total_ms = (time.perf_counter() - start) * 1e3
    assert calls == ["a", "b"] * 4  # one warm-up round, then three interleaved timed rounds
    assert [len(t) for t in times] == [3, 3]
    # The slow kernel sleeps 20 ms per call: each of its times is at least that, in milliseconds,
    # and all timed calls together fit in the wall time of the whole (warm-up included).
    assert all(t >= 20.0 for t in times[1]), times
    assert sum(times[0]) + sum(times[1]) <= total_ms - 20.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--dtype", "int8"], "unsupported dtype 'int8'"),
        (["--kernel", "tiled:nope=1"], "no option 'nope'"),
        (["--max-memory-gb", "-1"], "--max-memory-gb must be positive"),
    ],
)
def test_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert speed.main(["--seq-len", "32", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashprobe bench speed: error:") and message in err, err
