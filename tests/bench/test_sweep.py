"""``flashprobe.bench.sweep``: deviation statistics, seed summaries and the row vocabulary."""

from __future__ import annotations

import statistics

import pytest
import torch

from flashprobe.bench.sweep import STATS, compare_to_references, deviation_stats, summarize_seeds
from flashprobe.deviation import PAIRS
from flashprobe.kernels import KernelInputError, get_kernel


def test_mean_and_std_match_numpy_style_statistics() -> None:
    a = torch.tensor([1.0, 2.0, 4.0, float("nan")])
    b = torch.tensor([0.0, 0.0, 0.0, 1.0])
    stats = deviation_stats(a, b)
    assert stats["max_abs"] == 4.0
    assert stats["mean_abs"] == pytest.approx(7 / 3)
    assert stats["std_abs"] == pytest.approx(statistics.pstdev([1.0, 2.0, 4.0]))
    assert stats["nonfinite"] == 1


def test_summarize_seeds_gives_median_spread_and_summed_counts() -> None:
    summary = summarize_seeds(
        [{"x": 3.0, "nonfinite": 1}, {"x": 1.0, "nonfinite": 0}, {"x": 10.0, "nonfinite": 2}]
    )
    assert summary == {"x": 3.0, "x_lo": 1.0, "x_hi": 10.0, "nonfinite": 3}


def test_rows_use_the_project_pair_and_statistic_names() -> None:
    """Keys are ``{pair}_{stat}`` with the pairs of flashprobe.deviation, and the error ratio is
    primary_golden_max_abs / baseline_golden_max_abs."""
    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    (row,) = compare_to_references(q, k, v, [get_kernel("tiled:block_k=4")], get_kernel("math"))
    pair_keys = {f"{pair}_{stat}" for pair in PAIRS for stat in STATS}
    assert set(row) == pair_keys | {"error_ratio", "primary_nonfinite", "baseline_nonfinite"}
    assert "primary_golden_max_abs" in pair_keys and "baseline_golden_rel_l2" in pair_keys
    assert row["error_ratio"] == row["primary_golden_max_abs"] / row["baseline_golden_max_abs"]


def test_bad_tensors_name_the_problem() -> None:
    math_k = get_kernel("math")
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(KernelInputError, match=r"\(B, H, N, D\)"):
        compare_to_references(q[0], q[0], q[0], [math_k], math_k)
    with pytest.raises(KernelInputError, match="head counts differ"):
        compare_to_references(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16), [math_k], math_k)
    with pytest.raises(KernelInputError, match="head dims"):
        compare_to_references(q, torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 16), [math_k], math_k)
