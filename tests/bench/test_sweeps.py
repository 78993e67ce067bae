"""``flashprobe bench seqlen`` and ``flashprobe bench tiles`` (paper Figs 5 and 6)."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from flashprobe.bench import seqlen, tiles
from flashprobe.kernels import get_kernel


def _inputs(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The documented recipe of ``make_inputs`` (normal): q, k, v from one generator, then cast."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))


def _baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention written out by hand, every step in the inputs' dtype."""
    return torch.softmax((q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1])), dim=-1) @ v


def _load(out: Path, name: str) -> tuple[list[dict], list[dict]]:
    rows = json.loads((out / f"{name}.json").read_text())["rows"]
    with open(out / f"{name}.csv", newline="") as fh:
        csv_rows = list(csv.DictReader(fh))
    assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    return rows, csv_rows


def test_seqlen_rows_and_an_independent_oracle(tmp_path: Path) -> None:
    argv = ["--seq-len", "64", "24", "--heads", "1", "--head-dim", "8", "--dtype", "fp32", "bf16"]
    assert seqlen.main([*argv, "--kernel", "tiled", "--repeats", "2", "--out", str(tmp_path)]) == 0
    rows, csv_rows = _load(tmp_path, "seqlen")
    assert [(r["dtype"], r["seq_len"]) for r in rows] == [
        ("bf16", 24),
        ("bf16", 64),
        ("fp32", 24),
        ("fp32", 64),
    ]
    assert [(r["dtype"], int(r["seq_len"])) for r in csv_rows] == [(r["dtype"], r["seq_len"]) for r in rows]
    for row in rows:
        assert {
            "kernel",
            "dtype",
            "seq_len",
            "primary_baseline_max_abs",
            "error_ratio",
            "error_ratio_hi",
        } <= set(row)
    tiled = get_kernel("tiled")
    devs = []
    for seed in (0, 1):
        q, k, v = _inputs((1, 1, 64, 8), seed, torch.float32)
        devs.append((tiled(q, k, v) - _baseline(q, k, v)).abs().max().item())
    assert rows[3]["primary_baseline_max_abs"] == pytest.approx(statistics.median(devs), rel=1e-9)


def test_fig5_bf16_deviation_grows_with_sequence_length(tmp_path: Path) -> None:
    """docs/microbenchmark.md, Fig 5 (deterministic on CPU): in bf16 the paper preset's relative
    error against golden grows with N faster than the baseline's, at the default tile (Bc = 128)
    and much more at Bc = 16, where the absolute deviation from the baseline and the error ratio
    grow too; the fa2 preset's (fp32 statistics) does not grow faster than the baseline's."""
    paper, small_tiles = "tiled:preset=paper", "tiled:preset=paper,block_k=16"
    argv = ["--kernel", paper, "--kernel", small_tiles, "--kernel", "tiled:block_k=16"]
    argv += ["--dtype", "bf16", "--seq-len", "64", "256", "1024", "--heads", "1", "--head-dim", "16"]
    assert seqlen.main([*argv, "--out", str(tmp_path)]) == 0
    rows, _ = _load(tmp_path, "seqlen")
    by = {(r["kernel"], r["seq_len"]): r for r in rows}

    def growth(kernel: str, key: str) -> float:
        return by[(kernel, 1024)][key] / by[(kernel, 64)][key]

    baseline_growth = growth(paper, "baseline_golden_rel_l2")
    assert growth(paper, "primary_golden_rel_l2") > baseline_growth
    assert growth(small_tiles, "primary_golden_rel_l2") > 1.8 * baseline_growth
    assert growth("tiled:block_k=16", "primary_golden_rel_l2") < 1.3 * baseline_growth
    small = [by[(small_tiles, n)] for n in (64, 256, 1024)]
    devs = [r["primary_baseline_max_abs"] for r in small]
    ratios = [r["error_ratio"] for r in small]
    assert devs[2] > devs[0] and ratios == sorted(ratios) and ratios[2] > 2 * ratios[0], (devs, ratios)


def test_tiles_block_sizes_variants_and_oracle(tmp_path: Path) -> None:
    # d = 8: M = 128 → Bc = 4, Br = 4; M = 512 → Bc = 16, Br = 8; M = 1024 → Bc = 32, Br = 8.
    argv = ["--seq-len", "64", "--heads", "1", "--head-dim", "8", "--dtype", "fp32", "--repeats", "1"]
    assert tiles.main([*argv, "--sram", "128", "512", "1024", "--out", str(tmp_path)]) == 0
    rows, csv_rows = _load(tmp_path, "tiles")
    assert len(rows) == len(csv_rows) == 18  # 6 variants × 3 SRAM sizes
    got = {(r["variant"], r["sram"]): (r["block_q"], r["block_k"], r["block_area"]) for r in rows}
    assert got[("default", 128)] == (4, 4, 16)
    assert got[("default", 512)] == (8, 16, 128)
    assert got[("swapped", 512)] == (16, 8, 128)
    assert got[("square", 1024)] == (8, 8, 64)
    assert got[("loop_q", 1024)] == (8, 32, 256)
    assert got[("reverse", 1024)] == got[("shuffle", 1024)] == (8, 32, 256)
    assert rows[0]["kernel"].startswith("tiled:preset=paper,sram=")  # the default kernel
    by = {(r["variant"], r["sram"]): r for r in rows}
    # Numerics depend on Bc only (Br just batches rows): equal Bc gives identical deviations.
    assert by[("square", 512)]["primary_baseline_max_abs"] == by[("swapped", 512)]["primary_baseline_max_abs"]
    assert by[("square", 128)]["primary_golden_max_abs"] == by[("default", 128)]["primary_golden_max_abs"]
    # Oracle: sram=1024 at d=8 is Bc=32, so the row equals tiled:preset=paper,block_k=32 vs
    # hand-written attention.
    q, k, v = _inputs((1, 1, 64, 8), 0, torch.float32)
    dev = (get_kernel("tiled:preset=paper,block_k=32")(q, k, v) - _baseline(q, k, v)).abs().max().item()
    assert by[("default", 1024)]["primary_baseline_max_abs"] == pytest.approx(dev, rel=1e-9)
    assert by[("loop_q", 1024)]["primary_baseline_max_abs"] == pytest.approx(dev, abs=1e-6)
    for order in ("reverse", "shuffle"):  # fp32: the order changes the last bits only
        assert by[(order, 1024)]["primary_baseline_max_abs"] == pytest.approx(dev, abs=1e-6)


def test_fig6_larger_tiles_smaller_deviation_and_swapped_worse(tmp_path: Path) -> None:
    """docs/microbenchmark.md, Fig 6a/6c at d = 16, N = 512: in bf16 and fp16 the largest tile
    (Bc = 512) deviates less than the smallest (Bc = 16), and swapping Br and Bc (so Bc = d) never
    deviates less than the default order."""
    argv = ["--seq-len", "512", "--heads", "1", "--head-dim", "16", "--dtype", "bf16", "fp16"]
    argv += ["--sram", "1024", "32768", "--variants", "default", "swapped", "--out", str(tmp_path)]
    assert tiles.main(argv) == 0
    rows, _ = _load(tmp_path, "tiles")
    by = {(r["dtype"], r["variant"], r["block_k"]): r["primary_baseline_max_abs"] for r in rows}
    for dtype in ("bf16", "fp16"):
        assert by[(dtype, "default", 512)] < by[(dtype, "default", 16)], by
        assert by[(dtype, "swapped", 16)] >= by[(dtype, "default", 512)], by


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kernel", "math"], "tile options"),
        (["--kernel", "tiled:block_k=64"], "sets 'block_k'"),
        (["--kernel", "tiled:order=reverse"], "sets 'order'"),
        (["--kernel", "tiled", "--kernel", "sdpa_flash"], "varies one kernel"),
        (["--variants", "diagonal"], "unknown variant 'diagonal'"),
        (["--sram", "16"], "sram=16 must be an integer ≥ 4·d = 32"),
        (["--head-dim", "-1"], "head_dim must be a positive integer"),
    ],
)
def test_tiles_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    argv = ["--seq-len", "16", "--head-dim", "8", "--dtype", "fp32", *args, "--out", str(tmp_path)]
    assert tiles.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashprobe bench tiles: error:") and message in err, err


def test_seqlen_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert seqlen.main(["--seq-len", "32", "-5", "--out", str(tmp_path)]) == 2
    assert "seq_len must be a positive integer" in capsys.readouterr().err
    assert seqlen.main(["--seq-len", "32", "--dtype", "fp8", "--out", str(tmp_path)]) == 2
    assert "unsupported dtype 'fp8'" in capsys.readouterr().err
