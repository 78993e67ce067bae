"""BiasStats: against a numpy oracle, and both ways — truncation reads biased, correct kernels do not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashprobe.bias import BIAS_TOLERANCE, BIAS_Z_LIMIT, BiasStats
from flashprobe.kernels import get_kernel
from flashprobe.kernels.math import golden_attention
from lab.mutants import output_truncated


def _oracle(primary: np.ndarray, golden: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    """Per (…, N, D) slice: [offset, magnitude] means in units of the baseline's error RMS, by hand."""
    rows = []
    for p, g, b in zip(
        primary.reshape(-1, *primary.shape[-2:]),
        golden.reshape(-1, *golden.shape[-2:]),
        baseline.reshape(-1, *baseline.shape[-2:]),
        strict=True,
    ):
        e, eb = (p - g).ravel(), (b - g).ravel()
        rms = math.sqrt(sum(x * x for x in eb) / len(eb))
        rows.append(
            [
                sum(e) / len(e) / rms,
                sum(x * s for x, s in zip(e, np.sign(g).ravel(), strict=True)) / len(e) / rms,
            ]
        )
    return np.array(rows)


def test_sums_match_a_hand_computed_oracle_across_calls_and_merges():
    rng = np.random.default_rng(0)
    calls = []
    for _ in range(3):
        g = rng.standard_normal((2, 3, 5, 4))
        calls.append(
            (g + 0.01 * rng.standard_normal(g.shape) + 0.002, g, g + 0.01 * rng.standard_normal(g.shape))
        )
    first, second = BiasStats(("out",)), BiasStats(("out",))
    for i, (p, g, b) in enumerate(calls):
        (first if i < 2 else second).add("out", *(torch.from_numpy(x) for x in (p, g, b)))
    stats = first.merge(second).as_dict()["out"]
    r = np.concatenate([_oracle(*c) for c in calls])  # (18, 2)
    assert stats["replicates"] == 18
    for j, name in enumerate(("offset", "magnitude")):
        assert stats[name]["mean"] == pytest.approx(r[:, j].mean(), rel=1e-12)
        assert stats[name]["z"] == pytest.approx(r[:, j].sum() / math.sqrt((r[:, j] ** 2).sum()), rel=1e-12)


def test_nonfinite_elements_are_left_out_and_unknown_direction_is_refused():
    g = torch.ones(1, 1, 2, 2, dtype=torch.float64)
    p = g + torch.tensor([[0.1, float("nan")], [0.1, 0.1]], dtype=torch.float64)
    b = g + torch.tensor([[0.1, -0.1], [0.1, -0.1]], dtype=torch.float64)
    stats = BiasStats(("out",))
    stats.add("out", p, g, b)
    got = stats.as_dict()["out"]
    # finite elements: errors 0.1, 0.1, 0.1 over baseline errors 0.1, 0.1, -0.1 (rms 0.1): mean 1
    assert got["offset"]["mean"] == pytest.approx(1.0)
    assert math.isfinite(got["z"])
    with pytest.raises(ValueError, match="unknown direction 'dq'"):
        stats.add("dq", p, g, b)


def test_a_consistent_sign_grows_with_calls_as_sqrt_n():
    stats = BiasStats(("out",))
    g = torch.linspace(-1, 1, 64, dtype=torch.float64).reshape(1, 1, 8, 8)
    b = g + 1e-3 * torch.where(torch.arange(64).reshape(1, 1, 8, 8) % 2 == 0, 1.0, -1.0)
    # constant bias of one baseline RMS: z = √n exactly; the verdict's z, the excess of the mean
    # over the tolerance, (1 − τ)·√n, reaches the limit at the first n ≥ (limit / (1 − τ))²
    first = math.ceil((BIAS_Z_LIMIT / (1 - BIAS_TOLERANCE)) ** 2)
    zs, excess = [], []
    for _ in range(first - 1):
        stats.add("out", g + 1e-3, g, b)
        entry = stats.as_dict()["out"]
        zs.append(entry["offset"]["z"])
        excess.append(entry["z"])
    assert zs == pytest.approx([math.sqrt(n) for n in range(1, first)])
    assert excess == pytest.approx([(1 - BIAS_TOLERANCE) * math.sqrt(n) for n in range(1, first)])
    assert entry["mean"] == pytest.approx(1.0) and entry["tolerance"] == BIAS_TOLERANCE
    assert stats.verdict() == {"out": "unbiased"}
    stats.add("out", g + 1e-3, g, b)
    assert stats.verdict() == {"out": "biased"}


def test_a_mean_within_the_tolerance_never_reads_biased_however_many_calls():
    """A real but small bias (0.05 of the baseline's error RMS, as torch's fp32 flash gradients):
    z against 0 grows past the limit, the verdict's z stays 0."""
    stats = BiasStats(("out",))
    g = torch.linspace(-1, 1, 64, dtype=torch.float64).reshape(1, 1, 8, 8)
    b = g + 1e-3 * torch.where(torch.arange(64).reshape(1, 1, 8, 8) % 2 == 0, 1.0, -1.0)
    for _ in range(400):
        stats.add("out", g + 5e-5, g, b)
    entry = stats.as_dict()["out"]
    assert entry["offset"]["z"] == pytest.approx(20.0)  # √400 (constant): detectably non-zero
    assert entry["z"] == 0.0 and entry["verdict"] == "unbiased"


def _run(kernel, seed: int, calls: int, shape=(2, 4, 32, 16)) -> BiasStats:
    stats = BiasStats(("out",))
    baseline = get_kernel("math")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(calls):
        q, k, v = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for _ in range(3))
        stats.add("out", kernel(q, k, v), golden_attention(q, k, v), baseline(q, k, v))
    return stats


def test_a_truncating_kernel_reads_biased_within_a_few_calls():
    for seed in range(3):
        stats = _run(output_truncated, seed, calls=16).as_dict()["out"]
        assert stats["verdict"] == "biased"
        assert stats["magnitude"]["z"] < -BIAS_Z_LIMIT  # toward zero
        # about half an ulp toward zero per element, in units of the bf16 baseline's error RMS
        # (larger than one rounding's: the baseline also rounds P): -0.63 for seed 0
        assert -1.0 < stats["magnitude"]["mean"] < -0.3


@pytest.mark.parametrize("spec", ["math", "sdpa_flash", "tiled", "sdpa_math"])
def test_correct_kernels_stay_within_the_band_over_many_seeds(spec):
    kernel = get_kernel(spec)
    zs = []
    for seed in range(12):
        stats = _run(kernel, 100 + seed, calls=6).as_dict()["out"]
        assert stats["verdict"] != "biased", (seed, stats)
        zs += [stats["offset"]["z"], stats["magnitude"]["z"]]
    assert max(abs(z) for z in zs) < BIAS_Z_LIMIT


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        BiasStats(("out", "out"))
    with pytest.raises(ValueError, match="positive"):
        BiasStats(limit=0)
    with pytest.raises(ValueError, match="shapes differ"):
        BiasStats().add("out", torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="directions differ"):
        BiasStats(("out",)).merge(BiasStats(("dq",)))


def test_sample_reads_every_kth_row_as_fed_directly():
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(2, 3, 40, 8, generator=gen, dtype=torch.float64)
    p, b = (g + 0.01 * torch.randn(g.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    sampled = BiasStats(("out",), sample=64)  # 320 elements per slice: every 5th row (8 rows)
    sampled.add("out", p, g, b)
    direct = BiasStats(("out",))
    direct.add("out", p[..., ::5, :], g[..., ::5, :], b[..., ::5, :])
    assert torch.equal(sampled.state, direct.state)
    whole = BiasStats(("out",), sample=320)  # within the cap: every element
    whole.add("out", p, g, b)
    full = BiasStats(("out",))
    full.add("out", p, g, b)
    assert torch.equal(whole.state, full.state)
    with pytest.raises(ValueError, match="sample=0 must be a positive number"):
        BiasStats(sample=0)
