"""``flashprobe bench wasserstein`` on tiny sizes: rows, files and agreement with scipy."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from flashprobe.cli import main as cli_main


@pytest.fixture
def keep_torch_threads():
    """``--threads`` sets torch's process-wide thread count; restore it for the other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_bench_writes_rows_that_agree_with_scipy(tmp_path: Path, capsys, keep_torch_threads) -> None:
    code = cli_main(
        [
            "bench",
            "wasserstein",
            "--sizes",
            "1000",
            "2001",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "wasserstein.json").read_text())
    rows = data["rows"]
    assert [(r["case"], r["n"], r["m"]) for r in rows] == [
        ("equal", 1000, 1000),
        ("unequal", 1000, 750),
        ("weighted", 1000, 1000),
        ("equal", 2001, 2001),
        ("unequal", 2001, 1500),
        ("weighted", 2001, 2001),
    ]
    for row in rows:
        assert row["rel_diff"] <= 1e-9
        assert row["scipy_value"] > 0
        assert row["speedup"] == row["scipy_ms"] / row["torch_ms"]
        assert row["vs_sort"] == row["torch_ms"] / row["sort_floor_ms"]
    assert data["torch_threads"] == 1
    with open(tmp_path / "wasserstein.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 6
    table = capsys.readouterr().out
    assert "speedup" in table and "rel_diff" in table and "vs_np.sort×2" in table


def test_bench_rejects_bad_arguments(tmp_path: Path, capsys) -> None:
    assert cli_main(["bench", "wasserstein", "--cases", "sideways", "--out", str(tmp_path)]) == 2
    assert "unknown case(s) ['sideways']" in capsys.readouterr().err
    assert cli_main(["bench", "wasserstein", "--sizes", "0", "--out", str(tmp_path)]) == 2
    assert cli_main(["bench", "wasserstein", "--repeats", "0", "--out", str(tmp_path)]) == 2


def test_bench_refuses_sizes_that_cannot_fit_before_drawing_any(tmp_path: Path, capsys, monkeypatch) -> None:
    """``--sizes 100000000000`` ended in numpy's ``_ArrayMemoryError`` traceback (issue 42's table):
    12 float64 arrays of 10^11 values are 8941 GiB, refused with the estimate (8 GiB available here)."""
    from flashprobe.kernels import reference

    monkeypatch.setattr(reference, "_available_bytes", lambda device: 8 << 30)
    out = tmp_path / "out"
    assert cli_main(["bench", "wasserstein", "--sizes", "1000", "100000000000", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--sizes 100000000000 needs at least 8.94e+03 GiB (12 float64 arrays of 100000000000" in err
    assert "but the host has 8 GiB available; lower --sizes" in err and "Traceback" not in err
    assert not out.exists()
