"""wasserstein_distance and max_abs_diff against scipy / numpy as the oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from flashprobe.weights import max_abs_diff, wasserstein_distance


def _t(x: np.ndarray | None) -> torch.Tensor | None:
    return None if x is None else torch.from_numpy(x)


@pytest.mark.parametrize("n, m", [(1, 1), (2, 1), (7, 7), (7, 13), (200, 200), (1000, 357)])
@pytest.mark.parametrize("weighted", ["none", "u", "v", "both"])
@pytest.mark.parametrize("ties", [False, True])
def test_matches_scipy_on_random_samples(n: int, m: int, weighted: str, ties: bool) -> None:
    rng = np.random.default_rng(1000 * n + m + ties)
    if ties:  # few distinct values: many duplicates within and across the samples
        u, v = rng.integers(-3, 4, n).astype(float), rng.integers(-3, 4, m).astype(float)
    else:
        u, v = rng.standard_normal(n), 1.5 * rng.standard_normal(m) + 0.2
    uw = rng.random(n) + 0.01 if weighted in ("u", "both") else None
    vw = rng.random(m) * 7 if weighted in ("v", "both") else None
    expected = scipy.stats.wasserstein_distance(u, v, uw, vw)
    got = wasserstein_distance(torch.from_numpy(u), torch.from_numpy(v), _t(uw), _t(vw))
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_zero_weights_and_large_sample_match_scipy_to_1e_9() -> None:
    rng = np.random.default_rng(7)
    u, v = rng.standard_normal(200_000), rng.standard_normal(150_001) * 1.01
    uw = rng.random(200_000)
    uw[::3] = 0.0  # zero weights are allowed and remove those values
    for args in ((u, v, None, None), (u, v, uw, None), (u, u[::-1].copy(), None, None)):
        expected = scipy.stats.wasserstein_distance(*args)
        got = wasserstein_distance(*(_t(a) for a in args))
        assert abs(got - expected) <= 1e-9 * abs(expected) + 1e-300


@pytest.mark.parametrize(
    "u, v, uw, vw, expected",
    [
        ([0, 1, 3], [5, 6, 8], None, None, 5.0),  # shift by 5
        ([0, 1], [0, 1], [3, 1], [2, 2], 0.25),  # scipy docstring
        ([3.4, 3.9, 7.5, 7.8], [4.5, 1.4], [1.4, 0.9, 3.1, 7.2], [3.2, 3.5], 4.0781331438047861),
        ([0.0], [2.5], None, None, 2.5),
        ([1, 1, 1], [1], None, None, 0.0),
    ],
)
def test_known_values(u, v, uw, vw, expected: float) -> None:
    assert wasserstein_distance(u, v, uw, vw) == pytest.approx(expected, rel=1e-15)


def test_identical_and_permuted_samples_are_at_distance_zero() -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert wasserstein_distance(x, x) == 0.0
    assert wasserstein_distance(x, x[torch.randperm(1001)]) == 0.0
    assert wasserstein_distance(x, torch.cat([x, x])) == 0.0  # same distribution, twice the size


@pytest.mark.parametrize("shift", [1e-6, 0.5, -3.0, 1e3])
def test_shift_by_x_gives_abs_x(shift: float) -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert wasserstein_distance(x, x + shift) == pytest.approx(abs(shift), rel=1e-9)


def test_any_shape_any_float_dtype_and_grad_tensors() -> None:
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(6, 5, generator=gen, requires_grad=True)  # a float32 weight matrix
    b = torch.randn(3, 7, generator=gen).to(torch.bfloat16)
    expected = scipy.stats.wasserstein_distance(
        a.detach().double().numpy().ravel(), b.double().numpy().ravel()
    )
    assert wasserstein_distance(a, b) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["u", "v", "u_weights", "v_weights"])
def test_non_finite_values_are_rejected_with_a_clear_error(bad: float, where: str) -> None:
    args = {
        "u_values": [0.0, 1.0, 2.0],
        "v_values": [1.0, 2.0],
        "u_weights": [1.0, 1.0, 1.0],
        "v_weights": None,
    }
    key = {"u": "u_values", "v": "v_values"}.get(where, where)
    args[key] = [1.0, bad] if key.startswith("v") else [1.0, bad, 2.0]
    if key == "v_weights":
        args["v_values"] = [1.0, 2.0]
    with pytest.raises(ValueError, match=rf"{key} has 1 non-finite value.*drop or replace"):
        wasserstein_distance(**args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"u_values": [], "v_values": [1.0]}, "u_values is empty"),
        ({"u_values": [1.0], "v_values": torch.empty(0)}, "v_values is empty"),
        ({"u_values": [1.0, 2.0], "v_values": [1.0], "u_weights": [1.0]}, "u_weights has 1 elements"),
        ({"u_values": [1.0, 2.0], "v_values": [1.0], "u_weights": [1.0, -1.0]}, "negative"),
        ({"u_values": [1.0], "v_values": [1.0, 2.0], "v_weights": [0.0, 0.0]}, "sum to 0"),
        ({"u_values": torch.ones(2, dtype=torch.complex64), "v_values": [1.0]}, "complex"),
    ],
)
def test_invalid_distributions_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wasserstein_distance(**kwargs)


def test_max_abs_diff_matches_numpy() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen).to(torch.float16)
    expected = np.max(np.abs(a.double().numpy() - b.double().numpy()))
    assert max_abs_diff(a, b) == expected
    assert max_abs_diff(a, a) == 0.0
    assert max_abs_diff(torch.empty(0, 3), torch.empty(0, 3)) == 0.0


def test_max_abs_diff_rejects_shape_mismatch_and_non_finite() -> None:
    with pytest.raises(ValueError, match=r"shapes differ: \(2, 3\) vs \(3, 2\)"):
        max_abs_diff(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="b has 1 non-finite"):
        max_abs_diff(torch.zeros(2), torch.tensor([0.0, math.nan]))


@pytest.mark.parametrize("n, m, weighted", [(5000, 5000, False), (5000, 3001, False), (4000, 4000, True)])
@pytest.mark.gpu
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA device")
def test_cuda_matches_scipy(n: int, m: int, weighted: bool) -> None:
    rng = np.random.default_rng(n + m)
    u, v = rng.standard_normal(n), rng.standard_normal(m) + 0.1
    uw, vw = (rng.random(n), rng.random(m)) if weighted else (None, None)
    expected = scipy.stats.wasserstein_distance(u, v, uw, vw)
    cuda = [None if x is None else torch.from_numpy(x).cuda() for x in (u, v, uw, vw)]
    assert wasserstein_distance(*cuda) == pytest.approx(expected, rel=1e-12)
    assert max_abs_diff(cuda[0], cuda[0] + 0.5) == pytest.approx(0.5)


def test_equal_sizes_are_the_mean_gap_of_the_sorted_samples() -> None:
    """The path the tool computes itself: mean |sort(u) − sort(v)|, to the bit, and scipy's value."""
    from flashprobe.weights.distances import sorted_values, wasserstein_sorted

    rng = np.random.default_rng(11)
    u, v = rng.standard_normal(4001), rng.standard_normal(4001) * 2 + 0.3
    by_hand = float(np.mean(np.abs(np.sort(u) - np.sort(v))))
    got = float(wasserstein_sorted(sorted_values(torch.from_numpy(u)), sorted_values(torch.from_numpy(v))))
    assert got == pytest.approx(by_hand, rel=1e-14)
    assert wasserstein_distance(u, v) == got
    assert got == pytest.approx(scipy.stats.wasserstein_distance(u, v), rel=1e-12)
    with pytest.raises(ValueError, match="one size, got 3 and 2"):
        wasserstein_sorted(torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
