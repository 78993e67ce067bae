"""FP8 kernels are judged as FP8 kernels: against the FP8 baseline ``math:fp8=<format>`` with the
format's limits (:mod:`flashprobe.judge`, "FP8"), both ways: correct FP8 kernels pass, FP8 bugs fail.

The oracle of the baseline is a hand-built E4M3 grid (every finite value from its bits) and FP64
attention; the fuzzer's verdicts are checked on kernels of real FP8 bug classes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashprobe import judge
from flashprobe.fuzz import random_search, run_catalogue, select_cases
from flashprobe.judge import ABSOLUTE_RATIO, FP8_DRAWS, fp8_baseline, fp8_realisations, judge_errors
from flashprobe.kernels import (
    KernelCapabilities,
    get_kernel,
    golden_attention,
)
from flashprobe.kernels.fp8 import FP8_DTYPES, realisation_shifts

from ._fp8_mutants import register_fp8_bugs, unregister_fp8_bugs

#: Cases a forward-only FP8 kernel meets in training: masks, odd shapes, padding, outliers, long rows.
CASES = ("padding_mask", "odd_shapes", "odd_shapes_causal", "outliers", "one_valid_key", "causal_nq_lt_nk")


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative E4M3 (fn) value from its bits: 4 exponent bits (bias 7), 3 mantissa
    bits, subnormals at exponent 0, no infinity, S.1111.111 is NaN."""
    values = []
    for e, m in itertools.product(range(16), range(8)):
        if e == 15 and m == 7:
            continue  # NaN
        values.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(sorted(values), dtype=torch.float64)


def _round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value (ties away from the grid's odd mantissas are rare in random
    data; the test's inputs avoid exact ties), saturating at ±448."""
    grid = _e4m3_grid()
    a = x.abs().clamp(max=448.0).reshape(-1, 1)
    nearest = grid[(a - grid).abs().argmin(dim=1)]
    return (nearest.reshape(x.shape) * x.sign()).to(torch.float64)


def test_the_fp8_baseline_is_attention_on_per_tensor_e4m3_inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, 24, 16, generator=gen, dtype=torch.float64).to(torch.bfloat16) for _ in range(3)
    )
    by_hand = []
    for x in (q, k, v):
        amax = x.double().abs().max()
        by_hand.append(_round_e4m3(x.double() * (448.0 / amax)) * (amax / 448.0))
    expected = golden_attention(*by_hand, is_causal=True)
    got = get_kernel("math:fp8=e4m3")(q, k, v, is_causal=True)
    assert got.dtype == torch.bfloat16
    # float32 arithmetic after the rounding, then the bf16 output: within bf16's rounding of the result
    torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=2**-8 * expected.abs().max().item())
    # and it carries E4M3's error: far above bf16's own, below E4M3's half-ulp bound
    err = (
        (got.double() - golden_attention(q.double(), k.double(), v.double(), is_causal=True)).norm()
        / expected.norm()
    ).item()
    assert 2**-8 < err < 2**-4


def _per_tensor_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` rounded to E4M3 with one scale (the hand grid), in FP64."""
    return _round_e4m3(x.double() * scale) / scale


def test_each_realisation_of_the_fp8_baseline_is_per_tensor_e4m3_with_shifted_amax_scales():
    assert realisation_shifts(0) == (1.0, 1.0, 1.0)  # draw 0: the amax scales, the FP8 baseline itself
    shifts = [realisation_shifts(r) for r in range(FP8_DRAWS)]
    for tensor in range(3):  # q, k, v: each draw rounds each tensor its own way
        factors = [s[tensor] for s in shifts]
        assert all(0.5 < c <= 1.0 for c in factors)  # the amax stays within E4M3's range
        # no two factors a power of two apart (those would round every value alike)
        assert len({round(math.log2(c) % 1.0, 9) for c in factors}) == FP8_DRAWS
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 2, 24, 16, generator=gen, dtype=torch.float64).to(torch.bfloat16) for _ in range(3)
    )
    outs = []
    for draw, factors in enumerate(shifts):
        by_hand = [
            _per_tensor_e4m3(x, c * 448.0 / x.double().abs().max().item())
            for x, c in zip((q, k, v), factors, strict=True)
        ]
        expected = golden_attention(*by_hand, is_causal=True)
        got = get_kernel(f"math:fp8=e4m3,fp8_draw={draw}")(q, k, v, is_causal=True)
        tol = 2**-8 * expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=tol)
        outs.append(got)
    assert not any(torch.equal(outs[0], other) for other in outs[1:])


def test_fp8_realisations_are_the_fp8_baselines_other_draws():
    draws = [f"math:fp8=e4m3,fp8_draw={r}" for r in range(1, FP8_DRAWS)]
    assert fp8_realisations("math:fp8=e4m3") == draws
    assert fp8_realisations(get_kernel("math:fp8=e5m2"))[0] == "math:fp8=e5m2,fp8_draw=1"
    for other in ("math", "sdpa_math", "math:fp8=e4m3,fp8_draw=2", "math:fp8=off"):
        assert fp8_realisations(other) == []  # a 16-bit baseline, a chosen draw: no spread to add
    with pytest.raises(ValueError, match="fp8_draw=-1 must be an integer ≥ 0"):
        get_kernel("math:fp8=e4m3,fp8_draw=-1")
    with pytest.raises(ValueError, match="give fp8=e4m3 or fp8=e5m2 too"):
        get_kernel("math:fp8_draw=1")


def test_an_fp8_kernel_is_judged_against_the_spread_of_fp8s_rounding(monkeypatch):
    """The ``outliers`` call of seed 8 (bf16; a channel of q and k 20x the others, one of v 1000x):
    per-tensor E4M3 with equally valid static scales is 4-38 % off the golden (computed here, on the
    hand grid, in FP64), the kernel with its block scales 37.8 %, the amax-scaled FP8 baseline 9.4 %.
    Judged against that one draw the kernel failed (4x it); against the largest of the FP8 baseline's
    realisations it passes (judge.py, "FP8")."""
    case = select_cases(["outliers"])[0]
    x = case.build(torch.bfloat16, seed=8)
    golden = golden_attention(x.q.double(), x.k.double(), x.v.double(), is_causal=True)

    def off(out: torch.Tensor) -> float:
        return ((out.double() - golden).norm() / golden.norm()).item()

    spread = [
        off(golden_attention(*(_per_tensor_e4m3(t, s) for t in (x.q, x.k, x.v)), is_causal=True))
        for s in (0.14, 0.12, 0.11, 0.10, 0.08)  # v's amax is 3200: 0.14 x 3200 = 448
    ]
    kernel = "tiled:preset=fa3_fp8,rotation=off"
    with torch.no_grad():
        err = off(get_kernel(kernel)(x.q, x.k, x.v, is_causal=True))
        plain = off(get_kernel("math:fp8=e4m3")(x.q, x.k, x.v, is_causal=True))
    assert min(spread) < plain < ABSOLUTE_RATIO * plain < err <= max(spread)
    [row] = run_catalogue([kernel], ["bf16"], cases=[case], seed=8, backward=False)
    assert row.verdict == "pass", row.reason
    monkeypatch.setattr(judge, "FP8_DRAWS", 1)  # the amax draw alone: the earlier yardstick
    [row] = run_catalogue([kernel], ["bf16"], cases=[case], seed=8, backward=False)
    assert row.verdict == "fail" and "(absolute)" in row.reason, row.reason


def test_fp8_kernels_declare_their_format_and_get_the_fp8_baseline():
    assert get_kernel("tiled:preset=fa3_fp8").capabilities.fp8 == "e4m3"
    assert get_kernel("tiled:preset=fa3_fp8,qkv_fp8=e5m2").capabilities.fp8 == "e5m2"  # the coarsest
    assert get_kernel("tiled:preset=fa3_fp8,qkv_fp8=off,p_fp8=off").capabilities.fp8 is None  # rotation only
    assert get_kernel("tiled").capabilities.fp8 is None
    assert get_kernel("math:fp8=e5m2").capabilities.fp8 == "e5m2"
    assert fp8_baseline("tiled:preset=fa3_fp8", "math") == ("math:fp8=e4m3", torch.float8_e4m3fn)
    assert fp8_baseline("tiled", "math") == ("math", None)
    assert fp8_baseline("tiled:preset=fa3_fp8", "sdpa_math") == ("sdpa_math", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8='e3m4' must be one of 'e4m3', 'e5m2', 'off'"):
        get_kernel("math:fp8=e3m4")
    with pytest.raises(ValueError, match="must be one of e4m3, e5m2"):
        KernelCapabilities(fp8="int8")


def test_fp8_limits_are_the_formats():
    # an FP8 kernel 3 % off where the FP8 baseline is 2 % off: fails bf16's limits, passes E4M3's
    g_sq, p_sq, b_sq = 1.0, 0.03**2, 0.02**2
    errors = [p_sq, b_sq, g_sq, 0.0, 0.06, 0.05, 1.0]  # ERROR_COLUMNS
    assert judge_errors(errors, torch.bfloat16, "out").verdict == "pass"  # 1.5x the baseline: passes either
    wrong = [0.2**2, b_sq, g_sq, 0.0, 0.3, 0.05, 1.0]  # 20 % off, 10x the FP8 baseline
    judged = judge_errors(wrong, torch.bfloat16, "out", precision=FP8_DTYPES["e4m3"])
    assert judged.verdict == "fail" and judged.criterion == "relative"
    assert "FP8 baseline" in judged.reason


@pytest.fixture
def fp8_mutants():
    yield register_fp8_bugs()
    unregister_fp8_bugs()


def test_correct_fp8_kernels_pass_and_fp8_bugs_fail(fp8_mutants):
    correct = ["tiled:preset=fa3_fp8,rotation=off", "tiled:preset=fa3_fp8,fp8_scaling=tensor,rotation=off"]
    rows = []
    for seed in (0, 1):
        rows += run_catalogue(
            [*correct, *fp8_mutants], ["bf16", "fp16"], cases=select_cases(CASES), seed=seed, backward=False
        )
    by_kernel = {k: [r for r in rows if r.kernel == k] for k in (*correct, *fp8_mutants)}
    for kernel in correct:
        verdicts = {r.verdict for r in by_kernel[kernel]}
        assert verdicts <= {"pass", "unsupported"}, [
            r.reason for r in by_kernel[kernel] if r.verdict != "pass"
        ]
    for kernel in fp8_mutants:
        failed = [r for r in by_kernel[kernel] if r.verdict == "fail"]
        assert failed, f"{kernel} passed every case"
    # the descale left out and the one-sided rotation fail every case they run but two: a single valid
    # key (its softmax weight is 1 whatever the scores) for the rotation, and the outliers call of seed 1
    # for the descale (89 % off where the FP8 baseline itself is 23 % off: under 4x the baseline's error);
    # the last V block's descale left out fails every call whose queries see keys past the first 128
    # (causal_nq_lt_nk's 45 causal queries see keys 0-44 only) but outliers, whose 22 rows that see
    # those keys are as far off as the FP8 baseline's worst rows there
    allowed = {
        "fp8_bug_no_v_descale": {("outliers", 1)},
        "fp8_bug_rotate_q_only": {("one_valid_key", 0), ("one_valid_key", 1)},
        "fp8_bug_tail_v_no_descale": {(c, s) for c in ("causal_nq_lt_nk", "outliers") for s in (0, 1)},
    }
    for kernel, excused in allowed.items():
        judged = [r for r in by_kernel[kernel] if r.verdict in ("pass", "fail")]
        passed = {(r.case, r.seed) for r in judged if r.verdict == "pass"}
        assert len(judged) >= 16 and passed <= excused, (kernel, passed)


def _fa3_fp8_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """FA3's FP8 forward in FP64, written out from the paper and ``hopper/softmax.h``: Q and K times
    ``diag(s)·H/√d`` (H built here by Sylvester's doubling, the signs drawn as the rotation's seed 0
    draws them), E4M3 with one amax scale per 64 rows of Q and per 128 rows of K and V (the hand
    grid), P = exp(s − max)·256 cast to E4M3 for the P·V product, the row sum from P before its cast.
    One softmax over all keys (the kernel's running max rounds P differently, by E4M3's unit)."""
    d = q.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(0)).double() * 2 - 1
    m = signs[:, None] * h / d**0.5

    def blocks(x: torch.Tensor, rows: int) -> torch.Tensor:
        out = torch.empty_like(x)
        for i in range(0, x.shape[-2], rows):
            tile = x[..., i : i + rows, :]
            amax = tile.abs().amax(dim=(-2, -1), keepdim=True)
            out[..., i : i + rows, :] = _round_e4m3(tile * (448.0 / amax)) * (amax / 448.0)
        return out

    q8, k8, v8 = blocks(q.double() @ m, 64), blocks(k.double() @ m, 128), blocks(v.double(), 128)
    s = q8 @ k8.transpose(-2, -1) * scale
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return _round_e4m3(p * 256.0) / 256.0 @ v8 / p.sum(dim=-1, keepdim=True)


def test_random_search_judges_an_fp8_kernel_against_the_fp8_baseline(fp8_mutants):
    """As the catalogue does: against plain ``math`` with 16-bit limits, the correct FP8 kernel failed
    the second of these samples (values; FP8 rounding is not a bug)."""
    kernels = ["tiled:preset=fa3_fp8,rotation=off", "fp8_bug_no_v_descale"]
    rows = random_search(kernels, ["bf16"], budget=6, seed=0, backward=False)
    correct, bug = ([r for r in rows if r.kernel == k] for k in kernels)
    assert {r.verdict for r in correct} <= {"pass", "unsupported"}, [r.reason for r in correct]
    assert sum(r.verdict == "pass" for r in correct) >= 3
    assert any(r.verdict == "fail" for r in bug)


def test_the_rotation_fails_rising_max_as_fa3s_own_algorithm_does():
    """The rotated preset's ``rising_max`` failure is FA3's algorithm, not the emulation's nor the
    judge's (judge.py, "FP8"): the kernel is within 1 % of the hand-written FA3 forward, both are
    about 30 % off the golden; the fuzzer fails it on its worst row in fp16 and fp32, seeds 0-2, judged
    against the spread of the FP8 baseline's rounding; without the rotation the same kernel passes."""
    case = select_cases(["rising_max"])[0]
    x = case.build(torch.float16, seed=0)
    scale = 1 / x.q.shape[-1] ** 0.5
    golden = golden_attention(x.q.double(), x.k.double(), x.v.double(), scale=scale)
    with torch.no_grad():
        out = get_kernel("tiled:preset=fa3_fp8")(x.q, x.k, x.v).double()
    by_hand = _fa3_fp8_by_hand(x.q, x.k, x.v, scale)
    assert ((out - by_hand).norm() / golden.norm()).item() < 0.01
    assert ((out - golden).norm() / golden.norm()).item() > 0.2
    specs = ["tiled:preset=fa3_fp8", "tiled:preset=fa3_fp8,rotation=off"]
    for seed in (0, 1, 2):
        rows = run_catalogue(specs, ["fp16", "fp32"], cases=[case], seed=seed, backward=False)
        for r in rows:
            if r.kernel == specs[0]:
                assert r.verdict == "fail" and "worst row" in r.reason, (seed, r.dtype, r.reason)
            else:
                assert r.verdict == "pass", (seed, r.dtype, r.reason)
