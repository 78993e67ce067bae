"""The 2x rule: ``max|primary − golden| ≤ 2 · max|baseline − golden| + eps(dtype) · max|v|``.

Oracles: the baseline's two scale placements recomputed here with ``math_attention``; outputs with
a known defect (a planted offset, zero rows, NaN) built from the golden itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe import golden_attention, math_attention
from flashprobe.fuzz import Verdict, check_case, check_output, references, value_floor
from flashprobe.fuzz.rule import L2_FACTOR, rounding_floor

from ._helpers import case


@pytest.mark.parametrize("name", ["odd_shapes", "outliers"])
def test_values_rule_is_two_times_baseline_plus_floor(register, name):
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
    tol = 2 * max(errors) + floor
    assert refs.baseline_golden_max_abs == pytest.approx(errors[0])
    assert refs.floor == pytest.approx(floor)
    assert refs.tolerance == pytest.approx(tol)
    base_l2 = max((out.double() - golden).norm().item() for out in placements)
    assert refs.noise_l2 == pytest.approx(base_l2)
    # one element off by 1.25 × tol breaks the max rule only: the L2 rule keeps it a pass;
    # every element off by it breaks both
    for factor, where, expected in ((0.8, "all", "pass"), (1.25, "all", "fail"), (1.25, "one", "pass")):
        offset = factor * tol

        def shifted(q, k, v, *, attn_mask=None, is_causal=False, scale=None, _offset=offset, _where=where):
            g = golden_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
            out = g.clone()
            if _where == "one":
                out[0, 0, 0, 0] += _offset  # one element off by a known amount, in float64
            else:
                out += _offset
            return out

        result = check_case(register("user_shifted", shifted), inputs, refs=refs, backward=False)
        assert result.verdict == expected, result.reason
        assert result.primary_golden_max_abs == pytest.approx(offset, rel=1e-6)
        l2 = offset * (golden.numel() if where == "all" else 1) ** 0.5
        assert (l2 > L2_FACTOR * base_l2 + torch.finfo(torch.float32).eps * golden.norm().item()) is (
            where == "all"
        )


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
    """Known errors: baseline off by 1e-3, floor 5e-4: tolerance 2.5e-3."""
    golden = torch.zeros(1, 1, 2, 4, dtype=torch.float64)
    baseline = golden.clone()
    baseline[0, 0, 1, 3] = 1e-3
    for offset, expected in ((2.45e-3, "pass"), (2.55e-3, "fail")):
        out = golden + offset  # every element: ‖out − golden‖₂ = offset·√8 > 4 × 1e-3 (the L2 rule)
        verdict = check_output(out, baseline, golden, floor=0.5e-3)
        assert isinstance(verdict, Verdict) and verdict.verdict == expected, verdict.reason
        assert verdict.passed is (expected == "pass")
        assert verdict.primary_golden_max_abs == pytest.approx(offset)
    strict = check_output(out, baseline, golden)  # floor 0: flash-attention's plain rule
    assert strict.failure == "values" and "2 × baseline 0.001 + floor 0" in strict.reason


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
