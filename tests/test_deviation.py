"""Deviation metrics against numpy and hand-computed values; non-finite values are counted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashprobe.deviation import (
    Deviation,
    deviation,
    deviation_tensors,
    error_ratio,
    finish_deviation,
    noise_floor,
)


def test_hand_values():
    dev = deviation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 1.0]))
    # |a - b| = [0, 1, 2]; ‖a - b‖ = √5, ‖b‖ = √3 (squared from the norms: to the last bit or two)
    assert dev == Deviation(
        max_abs=2.0, mean_abs=1.0, rel_l2=pytest.approx(math.sqrt(5 / 3), rel=1e-15), nonfinite=0, numel=3
    )
    assert dev.as_dict() == {
        "max_abs": 2.0,
        "mean_abs": 1.0,
        "rel_l2": pytest.approx(math.sqrt(5 / 3), rel=1e-15),
        "nonfinite": 0,
        "numel": 3,
    }


def test_matches_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 17, 5)), rng.standard_normal((2, 3, 17, 5))
    dev = deviation(torch.from_numpy(a).float(), torch.from_numpy(b))
    a32 = a.astype(np.float32).astype(np.float64)  # the float32 tensor's values, compared in float64
    diff = np.abs(a32 - b)
    assert dev.max_abs == diff.max()
    assert dev.mean_abs == pytest.approx(diff.mean(), rel=1e-14)
    assert dev.rel_l2 == pytest.approx(np.linalg.norm(a32 - b) / np.linalg.norm(b), rel=1e-14)
    assert (dev.nonfinite, dev.numel) == (0, a.size)


def test_low_precision_difference_is_exact():
    # bf16 has 8 significant bits: 1 + 2^-7 is representable, and the difference is taken in fp64
    dev = deviation(torch.tensor([1.0078125], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.float64))
    assert dev.max_abs == 2.0**-7


def test_nonfinite_values_are_counted_and_do_not_poison_the_maxima():
    a = torch.tensor([math.nan, 1.0, math.inf, 2.0, 5.0])
    b = torch.tensor([0.0, 0.0, 0.0, -math.inf, 4.0])
    dev = deviation(a, b)
    assert dev.nonfinite == 3 and dev.numel == 5
    assert dev.max_abs == 1.0 and dev.mean_abs == 1.0  # finite pairs: |1 - 0|, |5 - 4|
    assert dev.rel_l2 == pytest.approx(math.sqrt(2) / 4)
    everything_bad = deviation(torch.full((4,), math.nan), torch.zeros(4))  # nothing finite compared
    assert (everything_bad.nonfinite, everything_bad.numel) == (4, 4)
    bad = everything_bad
    assert all(math.isnan(x) for x in (bad.max_abs, bad.mean_abs, bad.rel_l2))


def test_zero_reference_and_empty_tensors():
    assert deviation(torch.zeros(3), torch.zeros(3)).rel_l2 == 0.0
    assert deviation(torch.ones(3), torch.zeros(3)).rel_l2 == math.inf
    empty = deviation(torch.zeros(0, 4), torch.zeros(0, 4))
    assert empty == Deviation(max_abs=0.0, mean_abs=0.0, rel_l2=0.0, nonfinite=0, numel=0)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"shapes differ: \(2, 3\) vs \(3, 2\)"):
        deviation(torch.zeros(2, 3), torch.zeros(3, 2))


def test_accumulated_statistics_equal_one_pass():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 50, generator=gen), torch.randn(2, 50, generator=gen)
    a[1, 3] = math.nan
    parts = [deviation_tensors(a[i], b[i]) for i in range(2)]
    assert all(t.dim() == 0 and t.dtype == torch.float64 for t in parts[0].values())
    sums = {key: sum(p[key].item() for p in parts) for key in parts[0]}
    sums["max_abs"] = max(p["max_abs"].item() for p in parts)
    combined, whole = finish_deviation(sums), deviation(a, b)
    assert combined.max_abs == whole.max_abs and combined.nonfinite == whole.nonfinite == 1
    assert combined.numel == whole.numel == 100
    assert combined.mean_abs == pytest.approx(whole.mean_abs, rel=1e-14)
    assert combined.rel_l2 == pytest.approx(whole.rel_l2, rel=1e-14)


@pytest.mark.parametrize(
    ("primary", "baseline", "floor", "expected"),
    [
        (2.0, 1.0, 0.0, 2.0),
        (0.0, 1.0, 0.0, 0.0),
        (0.0, 0.0, 0.0, None),  # 0/0: undefined, not "as good as the baseline"
        (1e-9, 0.0, 0.0, math.inf),
        (math.inf, 1.0, 0.0, math.inf),
        (1.6e-11, 0.0, 4e-12, 4.0),  # an exact baseline: the primary's error in units of the floor
        (3.0, 2.0, 1.0, 1.5),  # a floor below the baseline's error changes nothing
        (0.0, 0.0, 1e-9, 0.0),
    ],
)
def test_error_ratio(primary, baseline, floor, expected):
    assert error_ratio(primary, baseline, floor=floor) == expected


def test_error_ratio_edge_cases():
    assert error_ratio(math.nan, 1.0) is None and error_ratio(1.0, math.nan) is None
    assert error_ratio(math.nan, 0.0) is None
    with pytest.raises(ValueError, match="cannot be negative"):
        error_ratio(-1.0, 1.0)
    with pytest.raises(ValueError, match="cannot be negative"):
        error_ratio(1.0, 1.0, floor=-1.0)


def test_noise_floor_is_half_an_ulp_of_the_largest_golden_value():
    assert noise_floor(1.0, torch.float32) == 2.0**-24  # half of fp32's eps
    assert noise_floor(4.0, torch.bfloat16) == 4.0 * 2.0**-8


def test_max_abs_is_undefined_when_nothing_finite_was_compared():
    dev = deviation(torch.full((3,), math.nan), torch.zeros(3))
    assert math.isnan(dev.max_abs) and dev.nonfinite == 3 and dev.numel == 3
    assert error_ratio(dev.max_abs, 0.1) is None
