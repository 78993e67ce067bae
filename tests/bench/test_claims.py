"""The verdict logic of ``flashprobe bench paper``, on hand-made numbers.

Each claim's criterion (flashprobe.bench.claims.CRITERIA) is checked at and around its thresholds,
so a verdict is shown to follow from the numbers and nothing else.
"""

from __future__ import annotations

import math

import pytest

from flashprobe.bench.claims import (
    CLAIM_IDS,
    CRITERIA,
    PAPER,
    VERDICTS,
    Claim,
    Judgement,
    Spread,
    judge_f3,
    judge_f4,
    judge_f5,
    judge_f6a,
    judge_f6b,
    judge_f6c,
    rank_correlation,
)

R, P, N = VERDICTS


def test_rank_correlation_known_values():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Spearman = Pearson on ranks; y ranks (1, 3, 2, 4): 1 - 6·Σd²/(n(n²-1)) = 1 - 6·2/60 = 0.8
    assert rank_correlation([1, 2, 3, 4], [1.0, 5.0, 2.0, 9.0]) == pytest.approx(0.8)
    # ties share their mean rank: y ranks (1.5, 1.5, 3) against (1, 2, 3): r = 1.5/√(2·1.5)
    assert rank_correlation([1, 2, 3], [7, 7, 9]) == pytest.approx(1.5 / math.sqrt(3.0))
    assert rank_correlation([1, 2, 3], [5, 5, 5]) is None
    assert rank_correlation([1], [2]) is None
    with pytest.raises(ValueError, match="3 x values but 2 y values"):
        rank_correlation([1, 2, 3], [1, 2])


def test_every_claim_has_its_paper_text_and_criterion():
    assert set(PAPER) == set(CRITERIA) == set(CLAIM_IDS) == {"F3", "F4", "F5", "F6a", "F6b", "F6c"}
    assert "2×" in CRITERIA["F4"] and "10×" in CRITERIA["F4"]


@pytest.mark.parametrize(
    ("devs", "verdict"),
    [
        ({"bf16": 4e-3, "fp16": 5e-4, "fp32": 2e-7, "fp64": 7e-16}, R),
        ({"bf16": 4e-3, "fp16": 5e-3, "fp32": 2e-7, "fp64": 7e-16}, P),  # fp16 worse than bf16
        ({"bf16": 4e-3, "fp16": 4e-3, "fp32": 2e-7, "fp64": 7e-16}, P),  # no drop at one step
        ({"bf16": 1e-7, "fp16": 5e-4, "fp32": 2e-7, "fp64": 7e-3}, N),
        ({"bf16": 1e-3}, N),
    ],
)
def test_f3(devs, verdict):
    assert judge_f3(devs).verdict == verdict


@pytest.mark.parametrize(
    ("median", "lo", "hi", "verdict"),
    [
        (10.7, 8.6, 13.8, R),
        (5.0, 2.1, 9.0, R),  # the lower edge of "within a factor 2 of 10"
        (20.0, 12.0, 30.0, R),
        (21.0, 12.0, 30.0, P),  # above ≈10×
        (4.9, 3.0, 6.0, P),
        (8.0, 1.9, 9.0, P),  # one seed within flash-attention's 2× bound
        (2.0, 1.0, 3.0, N),
        (0.3, 0.2, 0.4, N),
        (None, None, None, N),
        (math.nan, 1.0, 2.0, N),
    ],
)
def test_f4(median, lo, hi, verdict):
    judgement = judge_f4(median, lo, hi)
    assert judgement.verdict == verdict, judgement.why


def test_f4_says_why():
    why = judge_f4(10.7, 8.6, 13.8).why
    assert "10.7×" in why and "8.6×" in why and "13.8×" in why and "factor 2" in why
    assert "below ≈10×" in judge_f4(4.0, 3.0, 5.0).why


@pytest.mark.parametrize(
    ("devs", "relative", "verdict"),
    [
        ([1.0, 1.2, 1.6, 2.0], None, R),
        ([1.0, 0.7, 0.9, 1.5], None, P),  # grows 1.5× but not steadily (rank correlation 0.4)
        ([1.0, 1.1, 1.2, 1.3], None, P),  # steady but only 1.3×
        ([1.0, 0.9, 0.8, 0.7], None, N),
        ([1.0, 0.9, 0.8, 0.7], [1.0, 2.0, 3.0, 6.0], P),  # only the relative error grows
        ([1.0, 0.9, 0.8, 0.7], [1.0, 1.1, 1.2, 1.3], N),
    ],
)
def test_f5(devs, relative, verdict):
    judgement = judge_f5([512, 1024, 2048, 4096], devs, relative)
    assert judgement.verdict == verdict, judgement.why


def test_f5_growth_and_correlation_in_the_reason():
    why = judge_f5([512, 8192], [1.0, 2.0], [1.0, 3.0]).why
    assert "grows 2× from 512 to 8192" in why and "relative error vs golden: it grows 3×" in why


def _s(median: float, spread: float = 0.05) -> Spread:
    return Spread(median, median * (1 - spread), median * (1 + spread))


@pytest.mark.parametrize(
    ("reordered", "default", "swapped", "verdict"),
    [
        ({"reverse": _s(1.5), "shuffle": _s(1.4)}, _s(1.0), _s(2.0), R),
        ({"reverse": _s(1.5), "shuffle": _s(1.05)}, _s(1.0), _s(2.0), P),  # shuffle: no effect
        ({"reverse": Spread(1.2, 0.9, 1.4), "shuffle": _s(1.4)}, _s(1.0), _s(2.0), P),  # in the noise
        ({"reverse": _s(1.0), "shuffle": _s(1.0)}, _s(1.0), _s(2.0), P),
        ({"reverse": _s(1.0), "shuffle": _s(1.0)}, _s(1.0), _s(1.05), N),
        ({"reverse": _s(1.0), "shuffle": _s(1.0)}, _s(1.0), None, N),
        ({}, None, None, N),
    ],
)
def test_f6a(reordered, default, swapped, verdict):
    judgement = judge_f6a(_s(1.0), reordered, default, swapped)
    assert judgement.verdict == verdict, judgement.why


def test_f6a_names_noise():
    why = judge_f6a(_s(1.0, 0.3), {"reverse": _s(1.2, 0.3)}).why
    assert "reverse 1.2× (within the seeds' noise)" in why and "swapped vs default tile: not measured" in why


@pytest.mark.parametrize(
    ("ratio", "verdict"), [(1.0, R), (1.09, R), (0.91, R), (1.15, P), (0.85, P), (1.5, N), (None, N)]
)
def test_f6b(ratio, verdict):
    assert judge_f6b(ratio).verdict == verdict


@pytest.mark.parametrize(
    ("devs", "verdict"),
    [
        ([8e-3, 5e-3, 4e-3, 2e-3], R),
        ([8e-3, 8e-3, 4e-3, 2e-3], R),  # a tie: rank correlation -0.95
        ([3e-3, 2.5e-3, 2.2e-3, 2e-3], P),  # steady but only 1.5×
        ([8e-3, 2e-3, 9e-3, 4e-3], P),  # 2× but no trend
        ([2e-3, 2e-3, 2e-3, 2e-3], N),
        ([1e-3, 2e-3, 3e-3, 4e-3], N),
    ],
)
def test_f6c(devs, verdict):
    judgement = judge_f6c([16, 64, 256, 512], devs)
    assert judgement.verdict == verdict, judgement.why


def test_claim_record():
    claim = Claim(
        id="F4",
        measured=10.7,
        unit="error ratio",
        display="10.7× (8.6–13.8)",
        spread=(8.6, 13.8),
        setting={"seq_len": 8192},
        judgement=Judgement(R, "because"),
        real={"sdpa_flash": {"measured": 0.35, "display": "0.35×", "verdict": N}},
    )
    record = claim.as_dict()
    assert record["paper"] == PAPER["F4"] and record["criterion"] == CRITERIA["F4"]
    assert record["verdict"] == R and record["why"] == "because"
    assert record["spread"] == {"min": 8.6, "max": 13.8}
    assert record["measured"] == 10.7 and record["real"]["sdpa_flash"]["verdict"] == N
