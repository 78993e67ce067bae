"""The fuzz axes of issue 38: cases fitted to a kernel's limits, properties, and the new axes.

Oracles: the golden of a fitted call recomputed in float64 from the original call (the fitted rows
must give the same answer); kernels whose one bug is known by construction (the mutants of
:mod:`lab.mutants` catalogued for the new axes fail their cases in
``tests/fuzz/test_mutants.py``); torch's own kernels and a correct shape-limited kernel passing them.
"""

from __future__ import annotations

import pytest
import torch

from flashprobe import golden_attention, register_kernel
from flashprobe.fuzz import CATALOGUE, run_catalogue, select_cases
from flashprobe.fuzz.fit import NotApplicableError, fit_inputs
from flashprobe.fuzz.ledger import load_ledger
from flashprobe.fuzz.tables import property_coverage
from flashprobe.kernels import unregister_kernel
from lab.mutants import TRITON_LIKE, blockwise_attention, first_block_nan

from ._helpers import case

NEW_CASES = [
    "left_padding",
    "raw_sentinel_5e4",
    "raw_sentinel_5e4_d256",
    "poisoned_nan",
    "poisoned_huge",
    "nan_inputs",
    "grad_out_transposed",
    "grad_out_expanded",
    "grad_out_tiny",
    "grad_out_huge",
]
CORRECT = ["math", "tiled", "tiled:preset=paper", "sdpa_flash", "sdpa_math"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The blockwise kernel with Triton-like limits, correct and with the first-block NaN."""
    register_kernel("blockwise", blockwise_attention, capabilities=TRITON_LIKE, overwrite=True)
    register_kernel("blockwise_nan", first_block_nan, capabilities=TRITON_LIKE, overwrite=True)
    names = ["blockwise", "blockwise_nan"]
    yield
    for name in names:
        unregister_kernel(name)


def _golden(inputs):
    k, v = inputs.reference_kv()
    return golden_attention(
        inputs.q.double(), k.double(), v.double(), attn_mask=inputs.attn_mask, is_causal=inputs.is_causal,
        scale=inputs.scale,
    )  # fmt: skip


@pytest.mark.parametrize(
    "name", ["odd_shapes", "sentinel_5e4", "padding_mask", "odd_shapes_causal", "rising_max"]
)
def test_a_fitted_call_gives_the_original_rows_the_same_answer(name):
    original = case(name)
    fitted = fit_inputs(original, TRITON_LIKE)
    q = fitted.inputs.q
    assert q.shape[2] == fitted.inputs.k.shape[2] and q.shape[2] % 128 == 0 and q.shape[3] in (32, 64, 128)
    assert fitted.changes  # every one of these is odd-sized
    n_q, d_v = original.q.shape[2], original.v.shape[-1]
    torch.testing.assert_close(
        _golden(fitted.inputs)[:, :, :n_q, :d_v], _golden(original), rtol=1e-12, atol=1e-12
    )


def test_what_a_case_fixes_makes_it_not_applicable_with_the_reason():
    with pytest.raises(NotApplicableError, match="N_q=45, N_k=203"):
        fit_inputs(case("causal_nq_lt_nk"), TRITON_LIKE, fixed=CATALOGUE["causal_nq_lt_nk"].fixed)
    with pytest.raises(NotApplicableError, match="head dim 160"):
        fit_inputs(case("head_dim_160"), TRITON_LIKE, fixed=CATALOGUE["head_dim_160"].fixed)
    with pytest.raises(NotApplicableError, match="bool masks only as key padding"):
        fit_inputs(case("fully_masked_rows"), TRITON_LIKE)


#: cases the fast test poses to the shape-limited kernel: each fitted a different way
FITTED = ["odd_shapes", "sentinel_5e4", "padding_mask", "left_padding", "gqa_broadcast", "single_key"]


def test_a_shape_limited_kernel_is_posed_each_case_within_its_limits():
    results = run_catalogue(["blockwise"], ["fp32"], cases=select_cases(FITTED), seed=0)
    assert [(r.case, r.reason) for r in results if r.verdict == "fail"] == []
    assert all(r.verdict in ("pass", "no_backward") and r.fitted for r in results), [
        (r.case, r.verdict, r.reason) for r in results
    ]
    assert {r.case: r.backward for r in results}["gqa_broadcast"] == "pass"  # causal: a backward


@pytest.mark.slow
def test_a_shape_limited_kernel_tests_most_properties_and_fails_none():
    """The floor of issue 38 at one seed and dtype (20 seeds: the slow test below)."""
    results = run_catalogue(["blockwise"], ["fp32"], seed=0)
    assert [(r.case, r.reason) for r in results if r.verdict == "fail"] == []
    cover = property_coverage(results)["blockwise"]
    tested = [p for p, e in cover.items() if e["status"] == "tested"]
    assert len(tested) >= 0.8 * len(cover), {p: e["reason"] for p, e in cover.items() if p not in tested}
    for prop, entry in cover.items():  # never silently fewer: each untested property says why
        assert entry["status"] == "tested" or entry["reason"], prop
    assert any(r.backward == "pass" for r in results)  # causal cases have their gradients checked
    assert any(r.verdict == "no_backward" for r in results)  # key padding: forward only, as declared


def test_the_first_block_nan_bug_fails_left_padding():
    (row,) = run_catalogue(["blockwise_nan"], ["fp32"], cases=select_cases(["left_padding"]))
    assert row.verdict == "fail" and row.failure == "nonfinite", row.reason
    assert "N_q 64→384" in row.fitted


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_a_shape_limited_kernel_fails_nothing_over_twenty_seeds(seed):
    results = run_catalogue(["blockwise"], ["bf16", "fp16", "fp32"], seed=seed)
    assert [(r.case, r.dtype, r.reason) for r in results if r.verdict == "fail"] == []


def test_correct_kernels_pass_the_new_axes():
    """One seed here; 20 seeds in the slow test below."""
    results = run_catalogue(CORRECT, ["bf16", "fp32"], cases=select_cases(NEW_CASES), seed=0)
    assert [(r.kernel, r.case, r.dtype, r.reason) for r in results if r.verdict == "fail"] == []
    assert all(r.verdict in ("pass", "skip") for r in results), [
        (r.kernel, r.case, r.verdict) for r in results
    ]


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_correct_kernels_pass_the_new_axes_over_twenty_seeds(seed):
    cases = select_cases([*NEW_CASES, "offsets_2e24"])
    results = run_catalogue(CORRECT, ["bf16", "fp16", "fp32"], cases=cases, seed=seed)
    report = load_ledger("builtin").apply(results)  # torch's and the baseline's documented findings
    assert [(r.kernel, r.case, r.dtype, r.reason) for r in report.failures] == [] and report.passed


def test_nan_inputs_stay_nan_in_exactly_the_rows_that_depend_on_them():
    inputs = case("nan_inputs")
    rows = inputs.nan_rows()
    assert rows[0, 0].sum() == 1 and rows[1, 1].sum() == 1 and rows[1, 0].all()  # two queries, one head
    assert int(rows.sum()) == 1 + 1 + inputs.q.shape[2]


def test_a_bool_mask_is_posed_as_the_additive_mask_it_equals_to_a_kernel_without_bool_masks():
    from flashprobe.kernels import KernelCapabilities

    original = case("left_padding")
    fitted = fit_inputs(original, KernelCapabilities(masks=frozenset({"causal", "float"})))
    assert fitted.inputs.attn_mask.is_floating_point() and "additive" in fitted.changes
    torch.testing.assert_close(_golden(fitted.inputs), _golden(original), rtol=1e-12, atol=1e-12)
