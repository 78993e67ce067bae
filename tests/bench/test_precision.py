"""``flashprobe bench precision``, checked against FP64 oracles."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from flashprobe.bench import precision
from flashprobe.bench.results import load_results, write_results
from flashprobe.cli import main as cli_main
from flashprobe.kernels import get_kernel

SMALL = ["--batch", "1", "--heads", "2", "--seq-len", "96", "--head-dim", "16"]
KEYS = {
    "kernel",
    "dtype",
    "primary_baseline_max_abs",
    "primary_golden_max_abs",
    "baseline_golden_max_abs",
    "error_ratio",
    "primary_baseline_mean_abs",
    "primary_baseline_std_abs",
    "primary_golden_mean_abs",
    "primary_golden_std_abs",
    "baseline_golden_mean_abs",
    "baseline_golden_std_abs",
    "error_ratio_lo",
    "error_ratio_hi",
}


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """The documented recipe of ``make_inputs`` for ``normal``: q, k, v from one generator."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))


def _golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Hand-written attention in float64 (the oracle)."""
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _run(tmp_path: Path, *args: str) -> tuple[dict, list[dict]]:
    """Run the command (with ``--kernel tiled`` unless ``args`` name kernels) and read its files."""
    out = tmp_path / "out"
    kernels = [] if "--kernel" in args else ["--kernel", "tiled"]
    assert precision.main([*SMALL, *kernels, *args, "--out", str(out)]) == 0
    doc = json.loads((out / "precision.json").read_text())
    with open(out / "precision.csv", newline="") as fh:
        csv_rows = list(csv.DictReader(fh))
    png = (out / "precision.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    return doc, csv_rows


#: one xdist worker runs the whole module (.ci/run: --dist loadgroup), so its module fixture runs once
pytestmark = pytest.mark.xdist_group("bench/test_precision")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    """One run at every dtype with 3 seeds, shared by the tests below."""
    return _run(tmp_path_factory.mktemp("precision"), "--repeats", "3")


def test_files_and_keys(default_run: tuple[dict, list[dict]]) -> None:
    doc, csv_rows = default_run
    rows = doc["rows"]
    assert [r["dtype"] for r in rows] == ["bf16", "fp16", "fp32", "fp64"]
    for row in rows:
        assert row.keys() >= KEYS
        assert row["kernel"] == "tiled" and row["baseline"] == "math" and row["repeats"] == 3
    assert [r["dtype"] for r in csv_rows] == ["bf16", "fp16", "fp32", "fp64"]
    assert csv_rows[0].keys() >= KEYS
    assert float(csv_rows[0]["primary_golden_max_abs"]) == pytest.approx(rows[0]["primary_golden_max_abs"])
    assert doc["command"].startswith("flashprobe bench precision --batch 1")
    assert doc["config"]["seeds"] == [0, 1, 2]


def test_bf16_row_matches_an_independent_computation(default_run: tuple[dict, list[dict]]) -> None:
    """Recompute the bf16 row seed by seed: tiled vs a hand-written FP64 softmax, and the bf16
    baseline written out by hand (matmul, scale, softmax, matmul, all in bf16)."""
    row = default_run[0]["rows"][0]
    tiled = get_kernel("tiled")
    p_vs_g, b_vs_g, ratios = [], [], []
    for seed in range(3):
        q, k, v = (t.to(torch.bfloat16) for t in _inputs((1, 2, 96, 16), seed))
        golden = _golden(q, k, v)
        baseline = torch.softmax((q @ k.transpose(-2, -1)) * (1 / math.sqrt(16)), dim=-1) @ v
        p_vs_g.append((tiled(q, k, v).double() - golden).abs().max().item())
        b_vs_g.append((baseline.double() - golden).abs().max().item())
        ratios.append(p_vs_g[-1] / b_vs_g[-1])
    assert row["primary_golden_max_abs"] == pytest.approx(statistics.median(p_vs_g), rel=1e-9)
    assert row["primary_golden_max_abs_lo"] == pytest.approx(min(p_vs_g), rel=1e-9)
    assert row["primary_golden_max_abs_hi"] == pytest.approx(max(p_vs_g), rel=1e-9)
    assert row["baseline_golden_max_abs"] == pytest.approx(statistics.median(b_vs_g), rel=1e-9)
    assert row["error_ratio"] == pytest.approx(statistics.median(ratios), rel=1e-9)


def test_fp64_row_is_exact_to_rounding(default_run: tuple[dict, list[dict]]) -> None:
    doc, csv_rows = default_run
    fp64 = doc["rows"][3]
    assert fp64["primary_baseline_max_abs"] <= 1e-12
    assert fp64["primary_golden_max_abs"] <= 1e-12
    # In fp64 the baseline *is* the golden value: its error is 0, so the ratio is taken against
    # the noise floor (half an ulp of the largest golden value) instead of being infinite.
    assert fp64["baseline_golden_max_abs"] == 0.0
    assert math.isfinite(fp64["error_ratio"]) and 0 < fp64["error_ratio"] < 64
    assert float(csv_rows[3]["error_ratio"]) == fp64["error_ratio"]


def test_an_exact_baseline_gives_the_ratio_against_the_noise_floor(tmp_path: Path) -> None:
    doc, _ = _run(tmp_path, "--dtype", "fp64", "--repeats", "1")
    (row,) = doc["rows"]
    golden = _golden(*_inputs((1, 2, 96, 16), 0))  # the oracle: hand-written fp64 attention, seed 0
    floor = 0.5 * torch.finfo(torch.float64).eps * golden.abs().max().item()
    assert row["baseline_golden_max_abs"] == 0.0
    assert row["error_ratio"] == pytest.approx(row["primary_golden_max_abs"] / floor, rel=1e-9)


def test_fig3_deviation_falls_with_mantissa_bits(default_run: tuple[dict, list[dict]]) -> None:
    """Paper Fig 3 (docs/microbenchmark.md): primary-vs-baseline deviation decreases from bf16 to
    fp64, for the max and the mean, by orders of magnitude between fp16 and fp32."""
    rows = default_run[0]["rows"]
    for key in ("primary_baseline_max_abs", "primary_baseline_mean_abs"):
        values = [r[key] for r in rows]
        assert values == sorted(values, reverse=True) and len(set(values)) == 4, (key, values)
    assert rows[1]["primary_baseline_max_abs"] > 100 * rows[2]["primary_baseline_max_abs"]


def test_default_kernels_are_both_presets() -> None:
    args = precision.build_parser().parse_args([])
    assert args.kernel is None and args.kernel_default == ["tiled:preset=paper", "tiled"]


def test_sdpa_flash_and_both_presets_run_side_by_side(tmp_path: Path) -> None:
    doc, _ = _run(
        tmp_path,
        "--kernel",
        "tiled:preset=paper",
        "--kernel",
        "tiled",
        "--kernel",
        "sdpa_flash",
        "--dtype",
        "bf16",
        "--repeats",
        "1",
    )
    rows = {r["kernel"]: r for r in doc["rows"]}
    assert set(rows) == {"tiled:preset=paper", "tiled", "sdpa_flash"}
    # The fa2 preset models real kernels: within a factor 2 of sdpa_flash's ratio.
    flash = rows["sdpa_flash"]["error_ratio"]
    assert flash / 2 <= rows["tiled"]["error_ratio"] <= 2 * flash
    # The baseline and golden are shared, so baseline_golden_max_abs is one number for all kernels.
    assert len({r["baseline_golden_max_abs"] for r in rows.values()}) == 1
    # torch's CPU flash kernel upcasts bf16 to fp32 inside: it is closer to the golden value than
    # the all-bf16 baseline (docs/microbenchmark.md, "real kernel").
    assert rows["sdpa_flash"]["error_ratio"] < 1


def test_cli_dispatch_and_input_distributions(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    argv = ["bench", "precision", *SMALL, "--dtype", "fp32", "--repeats", "1", "--out", str(out)]
    assert cli_main([*argv, "--distribution", "outliers"]) == 0
    text = (out / "precision.json").read_text()
    row = json.loads(text)["rows"][0]
    assert row["distribution"] == "outliers" and row["outlier_scale"] == 30.0
    # --replot redraws the figure from the JSON without measuring (the JSON is left as it was).
    (out / "precision.png").unlink()
    assert cli_main(["bench", "precision", "--replot", "--out", str(out)]) == 0
    assert (out / "precision.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "precision.json").read_text() == text


def test_replot_without_results_says_what_to_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert precision.main(["--replot", "--out", str(tmp_path)]) == 2
    assert "run `flashprobe bench precision --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kernel", "nope"], "unknown kernel 'nope'"),
        (["--kernel", "tiled:blocky=3"], "no option 'blocky'"),
        (["--kernel", "tiled:loop=sideways"], "loop='sideways'"),
        (["--baseline", "nope"], "unknown kernel 'nope'"),
        (["--dtype", "int8"], "unsupported dtype 'int8'"),
        (["--seq-len", "0"], "seq_len must be a positive integer (--seq-len)"),
        (["--distribution", "cauchy"], "unknown input distribution 'cauchy'"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
    ],
)
def test_bad_arguments_give_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert precision.main([*SMALL, *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashprobe bench precision: error:") and message in err
    assert not (tmp_path / "precision.json").exists()


def test_replot_reads_infinite_ratios_back(tmp_path: Path) -> None:
    """An infinite value is written as "inf" and read back as a float by --replot, which redraws
    the very figure the measuring run drew."""
    doc, _ = _run(tmp_path, "--dtype", "fp32", "fp64", "--repeats", "1")
    out = tmp_path / "out"
    rows = doc["rows"]
    rows[1]["error_ratio_hi"] = math.inf  # e.g. a seed whose golden output is all zeros
    write_results(out, "precision", rows)
    assert json.loads((out / "precision.json").read_text())["rows"][1]["error_ratio_hi"] == "inf"
    loaded = load_results(out, "precision")
    assert loaded["rows"][1]["error_ratio_hi"] == math.inf and loaded["rows"][1]["seq_len"] == 96
    assert isinstance(loaded["rows"][1]["seq_len"], int)  # only "inf"/"nan" strings are decoded
    drawn = (out / "precision.png").read_bytes()
    (out / "precision.png").unlink()
    assert precision.main(["--replot", "--out", str(out)]) == 0
    assert (out / "precision.png").read_bytes() == drawn
