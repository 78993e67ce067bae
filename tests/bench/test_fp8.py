"""``flashprobe bench fp8``: FP8 error vs FP64 and the P-cast collapse (issue 41).

Oracles: the P underflow and saturation counts worked out by hand on four-key examples; bounds
derived from the formats (a stale max lags by at most the threshold); the inputs' documented
construction (sink logit, outlier channels, per-token magnitudes); the files' own rows.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from flashprobe.bench import fp8
from flashprobe.bench.inputs import Shape

LABELS = ("fp8_qkv", "fp8_scaling", "fp8_p", "p_scale", "order", "rotation", "rescale_threshold")


def test_p_underflow_by_hand():
    """Scale 1, q = (1, 0); keys: sink (20, 0), then three at logit 0, tiles of two keys.
    Forward: the sink's tile comes first, m = 20, every other P = e^-20 (below E4M3's 2^-10 even
    ×448): 3 of 3 underflow. Reverse: keys 2, 3 come first with m = 0 (P = 1), key 1 after the
    sink: 1 of 3."""
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[20.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]]])
    kw = {"p_scales": [1.0, 448.0], "block_k": 2, "scale": 1.0}
    assert fp8.p_underflow(q, k, order="forward", **kw) == {1.0: 1.0, 448.0: 1.0}
    assert fp8.p_underflow(q, k, order="reverse", **kw) == {1.0: 1 / 3, 448.0: 1 / 3}
    # key 0 at logit 0, the others at -7: e^-7 = 9.1e-4 is below half of E4M3's smallest value
    # (2^-10 = 9.8e-4), so it rounds to 0 at S = 1 but not at S = 16
    k = torch.tensor([[[[0.0, 0.0], [-7.0, 0.0], [-7.0, 0.0], [-7.0, 0.0]]]])
    kw = {"p_scales": [1.0, 16.0], "block_k": 2, "scale": 1.0}
    assert fp8.p_underflow(q, k, order="forward", **kw) == {1.0: 1.0, 16.0: 0.0}
    assert fp8.p_underflow(q, k, order="reverse", **kw) == {1.0: 1 / 3, 16.0: 0.0}


def test_p_saturation_by_hand():
    """Scale 1, q = (1, 0), tiles of two keys, reverse order: keys 2, 3 at logit 0 come first
    (m = 0, P = 1), then key 0 at Δ·ln 2 (Δ bits above) with key 1 at 0. A stale max (Δ ≤ the
    threshold) gives key 0 P = 2^Δ: Δ = 3 makes ×256 = 2048 > 448 (1 of 4 entries saturates), ×1 = 8
    does not, nor E5M2's 57344; Δ = 5 > 4 updates the max (P ≤ 1); forward order sees key 0 first."""
    q = torch.tensor([[[[1.0, 0.0]]]])
    kw = {"p_scales": [1.0, 256.0], "block_k": 2, "scale": 1.0}

    def keys(rise_bits: float) -> torch.Tensor:
        return torch.tensor([[[[rise_bits * math.log(2.0), 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]]])

    assert fp8.p_saturation(q, keys(3), threshold=4, **kw) == {1.0: 0.0, 256.0: 0.25}
    assert fp8.p_saturation(q, keys(3), threshold=4, p_fp8="e5m2", **kw) == {1.0: 0.0, 256.0: 0.0}
    assert fp8.p_saturation(q, keys(5), threshold=4, **kw) == {1.0: 0.0, 256.0: 0.0}
    assert fp8.p_saturation(q, keys(3), threshold=0, **kw) == {1.0: 0.0, 256.0: 0.0}
    assert fp8.p_saturation(q, keys(3), threshold=4, order="forward", **kw) == {1.0: 0.0, 256.0: 0.0}
    # the kernel agrees: V = 1 with key 0's P·256 = 2048 saturated to 448 in the numerator only
    out = fp8.get_kernel("tiled:p_fp8=e4m3,p_scale=256,rescale_threshold=4,block_k=2")(
        q, keys(3), torch.ones(1, 1, 4, 2), scale=1.0
    )
    assert out[0, 0, 0, 0].item() == pytest.approx((3 + 448 / 256) / (3 + 8), rel=1e-6)


def test_fp8_inputs_follow_their_construction():
    shape = Shape(batch=1, heads=2, seq_len=64, head_dim=64)
    q, k, _ = fp8.fp8_inputs(shape, "sink", seed=1, sink_strength=10.0)
    logits = q @ k.transpose(-2, -1) / 8.0
    assert (logits[..., 0] - 10.0).abs().max() < 10.0 * 5 / 8  # 10·(1 + z/√D), |z| < 5
    assert logits[..., 1:].abs().max() < 6
    q, k, _ = fp8.fp8_inputs(shape, "outlier_channels", seed=1)
    per_channel = q.abs().mean(dim=(0, 1, 2))
    assert (per_channel > 5).sum() == 2 and torch.equal(per_channel > 5, k.abs().mean(dim=(0, 1, 2)) > 5)
    q, _, v = fp8.fp8_inputs(shape, "dynamic_range", seed=1)
    norms = v.norm(dim=-1)
    assert norms.max() / norms.min() > 2**8
    with pytest.raises(fp8.BenchArgumentError, match="unknown distribution 'cauchy'"):
        fp8.fp8_inputs(shape, "cauchy", seed=0)


def test_bench_fp8_tiny_writes_named_rows_and_figures(tmp_path: Path, capsys):
    assert fp8.main(["--tiny", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "fp8.json").read_text())
    rows = doc["rows"]
    for row in rows:
        assert all(key in row for key in LABELS), row
    errors = [r for r in rows if r["part"] == "error"]
    assert {r["variant"] for r in errors} == {v.label for v in fp8.VARIANTS}
    assert {r["distribution"] for r in errors} == set(fp8.DISTRIBUTIONS)
    fa3 = next(r for r in errors if r["variant"] == "fa3 fp8")
    assert (fa3["fp8_qkv"], fa3["fp8_p"], fa3["p_scale"], fa3["order"]) == ("e4m3", "e4m3", 256.0, "reverse")
    assert fa3["fp8_scaling"] == "block amax" and fa3["rotation"] == "hadamard (seed 0)"
    base = next(r for r in errors if r["variant"] == "baseline bf16")
    assert base["error_ratio"] == 1.0 and base["fp8_qkv"] == "off" and base["order"] == "-"
    # every FP8 variant is coarser than 16-bit flash on the same inputs
    for row in errors:
        flash = next(
            r
            for r in errors
            if r["variant"] == "flash bf16"
            and all(r[k] == row[k] for k in ("distribution", "seq_len", "head_dim"))
        )
        if row["fp8_qkv"] != "off":
            assert row["rel_l2"] > 3 * flash["rel_l2"]
    pcast = [r for r in rows if r["part"] == "pcast"]
    assert {(r["order"], r["p_scale"]) for r in pcast} == {
        (o, s) for o in ("forward", "reverse") for s in fp8.P_SCALES
    }
    assert all(0.0 <= r["p_underflow"] <= 1.0 for r in pcast)
    ratio = doc["summary"]["pcast_ratio"]
    assert ratio["seeds"] == 2 and ratio["ci95_lo"] <= ratio["geomean"] <= ratio["ci95_hi"]
    assert ratio["paper"] == [3.0, 10.0]
    assert doc["summary"]["rotation_outlier_channels"]["factor"]["seeds"] == 1
    _check_saturation_rows(rows, doc["summary"]["saturation"])
    with open(tmp_path / "fp8.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    for name in ("fp8_errors.png", "fp8_pcast.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    md = (tmp_path / "fp8.md").read_text()
    assert "MSE(forward, S=1) / MSE(reverse, S=256)" in md and "| fa3 fp8 | e4m3 | block amax |" in md
    assert "## P saturation under lazy rescale (flash-attention issue 2716)" in md
    printed = capsys.readouterr().out
    assert "the paper reports 3-10x" in printed and "Hadamard rotation on outlier_channels" in printed
    assert "Lazy rescale at threshold 4, P e4m3 x256" in printed
    (tmp_path / "fp8_pcast.png").unlink()
    assert fp8.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "fp8_pcast.png").exists()


def _check_saturation_rows(rows: list[dict], summary: list[dict]) -> None:
    """A stale max lags by at most the threshold t, so ``P ≤ 2^t`` and ``P·S ≤ 2^(t + log2 S)``:
    nothing saturates at S = 1 (16 < 448), in E5M2 (2^12 < 57344) or under the bound t ≤ log2(448)
    − 8 = 0.807 at S = 256; where nothing saturates (S = 256: every P·256 of these logits is normal)
    the V = 1 output is within E4M3's 2^-4 of 1, plus its bf16 rounding (2^-7 above 1)."""
    saturation = [r for r in rows if r["part"] == "saturation"]
    casts = (("e4m3", 1.0), ("e4m3", 256.0), ("e5m2", 256.0))
    assert {(r["fp8_p"], r["p_scale"], r["rescale_threshold"]) for r in saturation} == {
        (fmt, s, t) for t in fp8.RESCALE_THRESHOLDS for fmt, s in casts
    }
    for row in saturation:
        fa4 = (row["fp8_p"], row["p_scale"], row["rescale_threshold"]) == ("e4m3", 256.0, 4.0)
        assert (row["p_saturated"] > 0) is fa4, row
        if row["fp8_p"] == "e4m3" and row["p_scale"] == 256.0:
            assert (row["v1_max_abs"] > 2.0**-4 + 2.0**-7) is fa4, row
    (entry,) = summary
    assert entry["threshold"] == 4.0 and entry["rel_l2_lazy"] > entry["rel_l2_eager"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--head-dim", "48"], "head dim 48 is not a power of two"),
        (["--logit-std", "0"], "--logit-std values must be finite and positive"),
        (["--rescale-threshold", "-1"], "--rescale-threshold values must be finite and ≥ 0"),
        (["--part", "speed"], "argument --part: invalid choice: 'speed'"),
        (["--distribution", "cauchy"], "unknown --distribution 'cauchy'"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_bench_fp8_refuses_bad_input_before_any_work(argv, message, tmp_path: Path, capsys):
    assert fp8.main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o" / "fp8.json").exists()


def test_summary_interval_over_seeds():
    rows: list[dict] = []
    mse = {(8.0, "forward", 1.0): [4.0, 8.0, 6.0], (8.0, "reverse", 256.0): [1.0, 1.0, 2.0]}
    ratio = fp8.summarize(rows, mse, 8.0)["pcast_ratio"]
    assert ratio["geomean"] == pytest.approx((4 * 8 * 3) ** (1 / 3))
    assert (ratio["min"], ratio["max"]) == (3.0, 8.0)
    assert ratio["ci95_lo"] < ratio["geomean"] < ratio["ci95_hi"]
    assert math.log(ratio["ci95_hi"]) - math.log(ratio["geomean"]) == pytest.approx(
        math.log(ratio["geomean"]) - math.log(ratio["ci95_lo"])
    )


def test_rotation_factor_pairs_the_seeds():
    point = {"part": "error", "axis": "distribution", "distribution": "outlier_channels", "seq_len": 64}
    rows = [
        {**point, "head_dim": 16, "variant": "fa3 fp8 no rotation", "rel_l2": 0.3},
        {**point, "head_dim": 16, "variant": "fa3 fp8", "rel_l2": 0.1},
    ]
    rel_l2 = {
        ("fa3 fp8 no rotation", "outlier_channels", 64, 16): [0.2, 0.3, 0.8],
        ("fa3 fp8", "outlier_channels", 64, 16): [0.1, 0.1, 0.2],
    }
    gain = fp8.summarize(rows, {}, 8.0, rel_l2)["rotation_outlier_channels"]
    assert (gain["rel_l2_without"], gain["rel_l2_with"]) == (0.3, 0.1)
    factor = gain["factor"]  # seed by seed: 2, 3, 4
    assert factor["geomean"] == pytest.approx(24 ** (1 / 3)) and (factor["min"], factor["max"]) == (2.0, 4.0)
    assert "rotation_gaussian" not in fp8.summarize(rows, {}, 8.0, rel_l2)


def test_a_sequence_too_long_for_memory_is_refused_with_the_estimate_before_any_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``bench fp8 --seq-len 10000000`` started measuring towards an out-of-memory kill (issue 42's
    table): 8 float64 tensors of 1x1x10^7x64 are 38.1 GiB before the 2 GiB reference block."""
    from flashprobe.kernels import reference

    monkeypatch.setattr(reference, "_available_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(fp8, "error_rows", lambda **kw: pytest.fail("measured despite the size"))
    assert fp8.main(["--seq-len", "10000000", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "flashprobe bench fp8: error: --seq-len 10000000 with --batch 1 --heads 1 --head-dim 64 " in err
    assert "needs at least 40.1 GiB" in err and "but cpu has 8 GiB available" in err
    assert fp8.main(["--head-dim", "1048576", "--base-seq-len", "4096", "--out", str(tmp_path / "out")]) == 2
    assert "--seq-len 4096 with --batch 1 --heads 1 --head-dim 1048576 needs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
