"""Kernels on cases: the FlashInfer class of bug, user kernels with defects (the whole catalogue on
``tiled`` is in tests/fuzz/test_mutants.py, the control pass).

Oracle: the FlashInfer bug reproduced by ``tiled:mask_value=-5e4``, whose rows below the sentinel
must come back as zeros; and user-registered kernels whose defect is known by construction.
"""

from __future__ import annotations

import pytest
import torch

from flashprobe.fuzz import (
    SENTINELS,
    ZEROS_REASON,
    call_kernel,
    check_case,
    run_catalogue,
    select_cases,
)
from flashprobe.kernels import get_kernel

from . import _helpers as h
from ._helpers import SENTINEL_KERNEL, case, logits64, scale_of


def test_sentinel_kernel_fails_the_sentinel_cases_with_the_zeros_reason():
    results = run_catalogue([SENTINEL_KERNEL, "tiled"], ["fp32", "bf16"], cases=select_cases(["sentinel_*"]))
    verdict = {(r.kernel, r.case, r.dtype): r for r in results}
    for dtype in ("fp32", "bf16"):
        for key in ("5e4", "1e5", "halfmax"):
            row = verdict[SENTINEL_KERNEL, f"sentinel_{key}", dtype]
            assert row.verdict == "fail" and row.failure == "zeros"
            assert ZEROS_REASON in row.reason
            assert row.primary_golden_max_abs > 0.1
        # logits in [-3e4, -1.05e4] lie above -5e4: the sentinel kernel is right there
        assert verdict[SENTINEL_KERNEL, "sentinel_1e4", dtype].verdict == "pass"
        for key in SENTINELS:
            assert verdict["tiled", f"sentinel_{key}", dtype].verdict == "pass"


def test_fp16_qk_overflow_is_judged_against_what_fp16_can_represent(register):
    unscaled = register("user_unscaled_logits", h.naive_softmax)  # q·kᵀ in fp16, then the scale
    cases = select_cases(["qk_overflow", "scale_tiny"])
    results = run_catalogue([unscaled, "tiled", "sdpa_math"], ["fp16"], cases=cases)
    assert len(results) == 6
    for r in results:
        assert r.baseline_golden_max_abs is None and r.baseline_nonfinite > 0  # math overflows too
        assert r.noise_from == "rounded-logits baseline"
        if r.kernel == unscaled:  # forms q·kᵀ unscaled in fp16: inf − inf = NaN where the golden is finite
            assert r.verdict == "fail" and r.failure == "nonfinite"
            assert "overflows fp16 before the scale" in r.reason
        else:  # tiled scales in its fp32 accumulator as real kernels do; torch scales q and k by √scale
            assert r.verdict == "pass", r.reason
    # the logits themselves fit fp16: the case is posable, not a skip
    for c in cases:
        inputs = c.build(torch.float16)
        assert logits64(inputs).abs().max() < 65504 < (logits64(inputs) / scale_of(inputs)).abs().max()


@pytest.mark.parametrize(
    ("fn", "name", "verdict", "failure", "text"),
    [
        (h.naive_softmax, "fully_masked_rows", "fail", "nonfinite", "all in fully masked rows"),
        (h.naive_softmax, "padding_mask", "fail", "nonfinite", "NaN"),
        (h.naive_softmax, "odd_shapes", "pass", None, "error / limit"),
        (h.falsy_scale, "scale_zero", "fail", "values", "wrong values"),
        (h.masked_mean, "fully_masked_rows", "fail", "masked_nonzero", "fully masked rows returned non-zero"),
        (h.unavailable, "odd_shapes", "unsupported", None, "needs a TPU"),
        (h.crashes, "odd_shapes", "fail", "raised", "raised RuntimeError: index out of range"),
        (h.in_place, "odd_shapes", "fail", "inplace", "modified its inputs in place: q"),
        (h.gqa_capable, "gqa_broadcast", "pass", None, "error / limit"),
    ],
)
def test_user_kernels_with_known_defects_get_the_right_verdict(register, fn, name, verdict, failure, text):
    kernel = register(f"user_{fn.__name__}", fn)
    # with gradients torch itself refuses an in-place write to an input that requires grad
    result = check_case(kernel, case(name), case=name, backward=fn is not h.in_place)
    assert (result.verdict, result.failure) == (verdict, failure), result.reason
    assert text in result.reason


def test_kernel_call_gives_an_output_or_the_verdict_reached(register):
    inputs = case("odd_shapes")
    ok = call_kernel(get_kernel("tiled"), inputs)
    assert ok.problem is None and ok.output.shape == inputs.q.shape
    crashed = call_kernel(get_kernel(register("user_crashes", h.crashes)), inputs)
    assert crashed.output is None and crashed.problem.failure == "raised"
    assert torch.equal(inputs.q, case("odd_shapes").q)  # the case's own tensors are never handed out
    changed = call_kernel(get_kernel(register("user_in_place", h.in_place)), inputs)
    assert changed.output is None and changed.problem.failure == "inplace"
    assert torch.equal(inputs.q, case("odd_shapes").q)
