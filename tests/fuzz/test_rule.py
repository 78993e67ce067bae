"""The fuzzer's verdict: the one rule (:mod:`flashprobe.judge`) on a case's references, plus the
structure a case knows.

Oracles: the baseline's two scale placements recomputed here with ``math_attention``; outputs with
a known defect (a planted offset, zero rows, NaN) built from the golden itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe import golden_attention, math_attention
from flashprobe.fuzz import Verdict, check_case, check_output, references, value_floor
from flashprobe.fuzz.rule import rounding_floor
from flashprobe.judge import ABSOLUTE_RATIO, RELATIVE_LIMITS, absolute_limit

from ._helpers import case


@pytest.mark.parametrize("name", ["odd_shapes", "outliers"])
def test_references_hold_the_baselines_noise_and_the_rule_judges_against_it(register, name):
    inputs = case(name)
    refs = references(inputs)
    golden = golden_attention(inputs.q, inputs.k, inputs.v, is_causal=inputs.is_causal)
    root = (1 / math.sqrt(inputs.q.shape[-1])) ** 0.5  # torch SDPA's placement: (q√s)·(k√s)ᵀ, scale 1
    placements = [
        math_attention(inputs.q, inputs.k, inputs.v, is_causal=inputs.is_causal),
        math_attention(inputs.q * root, inputs.k * root, inputs.v, is_causal=inputs.is_causal, scale=1.0),
    ]
    errors = [(out.double() - golden).abs().max().item() for out in placements]
    floor = torch.finfo(torch.float32).eps * inputs.v.abs().max().item()
    assert refs.baseline_golden_max_abs == pytest.approx(errors[0])
    assert refs.floor == pytest.approx(floor)
    assert refs.tolerance == pytest.approx(2 * max(errors) + floor)  # the reported 2x tolerance
    base_l2 = max((out.double() - golden).norm().item() for out in placements)
    assert refs.noise_l2 == pytest.approx(base_l2)
    # Every element off by a known relative amount: it fails at the first criterion's threshold,
    # relative (8x the baseline's relative error F, floored at the rounding of the largest logit) or
    # absolute (beyond the dtype's limit, widened by that rounding, and 4x F).
    eps = torch.finfo(torch.float32).eps
    floor = max(0.5 * eps, eps * refs.logit_max)
    f = max(base_l2 / golden.norm().item(), floor)
    absolute = max(absolute_limit(torch.float32, "out"), 4 * floor, ABSOLUTE_RATIO * f)
    limit = min(RELATIVE_LIMITS["out"] * f, absolute)
    for factor, expected in ((0.8, "pass"), (1.25, "fail")):
        rel = factor * limit

        def scaled(q, k, v, *, attn_mask=None, is_causal=False, scale=None, _rel=rel):
            g = golden_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
            return g * (1 + _rel)  # relative L2 error exactly _rel

        result = check_case(register("user_scaled", scaled), inputs, refs=refs, backward=False)
        assert result.verdict == expected, result.reason
        if expected == "fail":
            assert result.failure == "values", result.reason


def test_zero_rows_are_flagged_only_where_golden_is_clearly_non_zero(register):
    def zero_first_row(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        out[:, :, 0] = 0
        return out

    result = check_case(register("user_zero_row", zero_first_row), case("odd_shapes"))
    assert result.failure == "zeros" and "6 of 678 rows" in result.reason  # B·H = 6 first rows
    # fully masked rows are zero in the golden too: not a zeros failure
    result = check_case("tiled", case("fully_masked_rows"))
    assert result.verdict == "pass", result.reason


def test_value_floor_is_one_ulp_of_the_largest_value():
    v = torch.tensor([[-3.0, 0.5], [2.0, 1.0]], dtype=torch.bfloat16)
    assert value_floor(v, torch.bfloat16) == 3.0 * 2.0**-7
    assert value_floor(v, torch.float32) == 3.0 * 2.0**-23
    assert value_floor(torch.empty(0), torch.float16) == 0.0


def test_rounding_floor_is_flash_attentions_rounding_of_the_golden():
    # 1 + 0.3 − 0.3 in fp32 is 1 − 2⁻²⁴; in bf16 it is 1 − 2⁻⁸ (hand-computed roundings).
    one = torch.ones(2, 1, 3, 4, dtype=torch.float64)
    assert rounding_floor(one, torch.float32) == 2**-24
    assert rounding_floor(one, torch.bfloat16) == 2**-8
    assert rounding_floor(one * 0.0, torch.float16) == 0.0


def test_check_output_applies_the_same_rule_as_the_fuzzer():
    """A baseline 1e-3 off the golden (relative): a kernel 3e-3 off passes, one 5e-3 off fails
    (beyond 4x the baseline and float32's absolute limit); one wrong row fails the row criterion."""
    golden = torch.ones(1, 2, 8, 4, dtype=torch.float64)
    baseline = golden * (1 + 1e-3)
    for rel, expected in ((3e-3, "pass"), (5e-3, "fail")):
        verdict = check_output((golden * (1 + rel)).float(), baseline.float(), golden)
        assert isinstance(verdict, Verdict) and verdict.verdict == expected, verdict.reason
        assert verdict.passed is (expected == "pass")
        assert verdict.primary_golden_max_abs == pytest.approx(rel, rel=1e-4)
    one_row = golden.clone()
    one_row[0, 1, 5] = -1.0  # 1 of 16 rows wrong: relative L2 error 0.5, the row reads 2
    verdict = check_output(one_row.float(), baseline.float(), golden)
    assert verdict.failure == "values" and "(row)" in verdict.reason, verdict.reason


def test_check_output_fails_nan_and_refuses_a_nonfinite_baseline():
    golden = torch.ones(1, 1, 3, 2, dtype=torch.float64)
    out = golden.float().clone()
    out[0, 0, 2, 1] = float("nan")
    verdict = check_output(out, golden.float(), golden, floor=1e-6)
    assert verdict.failure == "nonfinite" and verdict.primary_nonfinite == 1
    assert verdict.primary_golden_max_abs is None
    with pytest.raises(ValueError, match="baseline is NaN/Inf at 1 positions"):
        check_output(golden.float(), out, golden)


def test_verdict_rejects_an_unknown_verdict():
    with pytest.raises(ValueError, match="must be one of pass, fail, skip, unsupported, no_backward"):
        Verdict(verdict="ok", reason="")
