"""wasserstein_distance and max_abs_diff against scipy / numpy as the oracle."""

from __future__ import annotations

import math
import time

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


@pytest.mark.slow
def test_speed_floor_10x_scipy_on_4m_float64() -> None:
    """The issue's floor: >= 10x scipy on 4M float64 (equal sizes), same value to 1e-9 relative."""
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal(4_000_000), rng.standard_normal(4_000_000) * 1.02
    tu, tv = torch.from_numpy(u), torch.from_numpy(v)
    scipy_s, torch_s = [], []
    for _ in range(3):
        start = time.perf_counter()
        expected = scipy.stats.wasserstein_distance(u, v)
        scipy_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        got = wasserstein_distance(tu, tv)
        torch_s.append(time.perf_counter() - start)
    assert abs(got - expected) <= 1e-9 * expected
    assert min(scipy_s) / min(torch_s) >= 10


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


@pytest.mark.parametrize("weighted", [False, True])
def test_two_threads_sort_the_samples_to_the_same_distance(weighted: bool) -> None:
    from flashprobe.weights import distances

    g = torch.Generator().manual_seed(3)
    n, m = distances._TWO_THREADS_MIN + 5, distances._TWO_THREADS_MIN * 2
    u, v = torch.randn(n, dtype=torch.float64, generator=g), torch.randn(m, dtype=torch.float64, generator=g)
    uw = torch.rand(n, dtype=torch.float64, generator=g) if weighted else None
    vw = torch.rand(m, dtype=torch.float64, generator=g) if weighted else None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = wasserstein_distance(u, v, uw, vw)
        torch.set_num_threads(2)
        two = wasserstein_distance(u, v, uw, vw)
    finally:
        torch.set_num_threads(threads)
    assert two == one  # the same sorts, only concurrent
    expected = scipy.stats.wasserstein_distance(
        u.numpy(), v.numpy(), None if uw is None else uw.numpy(), None if vw is None else vw.numpy()
    )
    assert two == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("where", ["distinct", "ties_at_the_split", "v_below", "v_above", "single_u"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_merge_split_at_the_median_of_u_matches_scipy(where: str, weighted: bool) -> None:
    """The merge runs as two stretches split at u's median; ties across the split, a v entirely on
    one side of it, or a u too short to split change nothing."""
    rng = np.random.default_rng(7)
    u = {"single_u": np.array([0.5]), "distinct": np.linspace(-1.0, 1.0, 15) ** 3}.get(
        where, np.repeat([-1.0, 0.0, 2.0], [3, 9, 4])
    )
    v = {
        "distinct": rng.standard_normal(11),
        "ties_at_the_split": np.array([-2.0, 0.0, 0.0, 0.0, 1.0, 3.0]),
        "v_below": np.array([-5.0, -4.0, -4.0]),
        "v_above": np.array([4.0, 5.0, 5.0, 6.0]),
        "single_u": np.array([0.0, 0.5, 1.0]),
    }[where]
    uw, vw = (rng.random(u.size), rng.random(v.size)) if weighted else (None, None)
    expected = scipy.stats.wasserstein_distance(u, v, uw, vw)
    assert wasserstein_distance(u, v, uw, vw) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert wasserstein_distance(v, u, vw, uw) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(
    ("u_weighted", "v_weighted"), [(False, True), (True, False), (True, True), (False, False)]
)
def test_wasserstein_sorted_with_steps_of_either_sample_matches_scipy(
    u_weighted: bool, v_weighted: bool
) -> None:
    """The public sorted-input form: CDF steps given for one sample, both or neither."""
    from flashprobe.weights.distances import wasserstein_sorted

    rng = np.random.default_rng(11)
    u, v = np.sort(rng.standard_normal(40)), np.sort(rng.standard_normal(27) + 0.2)
    uw = rng.random(40) if u_weighted else None
    vw = rng.random(27) if v_weighted else None
    steps = [None if w is None else torch.from_numpy(w / w.sum()) for w in (uw, vw)]
    got = float(wasserstein_sorted(torch.from_numpy(u), torch.from_numpy(v), *steps))
    assert got == pytest.approx(scipy.stats.wasserstein_distance(u, v, uw, vw), rel=1e-12)
