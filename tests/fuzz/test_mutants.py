"""The mutation suite: every planted bug is caught by the default profile, the correct kernels are not.

Oracle: kernels whose one bug is known by construction (:mod:`lab.mutants`), each run on
the default-profile cases built to expose its class; the same kernel without a bug (``bug_none``)
and torch's own kernels are the controls that must pass.
"""

from __future__ import annotations

import pytest
import torch

from flashprobe.fuzz import (
    CATALOGUE,
    RandomCaseSpec,
    check_case,
    make_random_case,
    run_catalogue,
    save_reproducer,
    select_cases,
)
from flashprobe.fuzz.layouts import LAYOUTS
from flashprobe.fuzz.ledger import load_ledger
from flashprobe.fuzz.reproducer import case_inputs, case_reproducer, replay_case
from flashprobe.kernels import unregister_kernel
from flashprobe.probing.repro import load_reproducer, shrink_reproducer
from lab.mutants import MUTANTS, Catch, Mutant, correct_flash, register_mutants

from ._helpers import case

#: The bug classes issue 23 lists by name, each a mutant here.
ISSUE_CLASSES = {
    "dq_unscaled",
    "dk_partial_tile",
    "dq_nan",
    "ds_bf16",
    "strides_ignored",
    "head_dim_truncated",
    "keys_truncated",
    "large_grid_head_mixup",
}
CORRECT = ["math", "tiled", "tiled:preset=paper", "sdpa_flash", "sdpa_math", "bug_none"]
#: every (mutant, catalogue case that must catch it)
CATCHES = [(m, c) for m in MUTANTS.values() for c in m.catches]


@pytest.fixture(scope="module", autouse=True)
def mutants():
    """The suite registered as ``bug_<name>``, the control as ``bug_none``."""
    names = register_mutants()
    yield
    for name in names:
        unregister_kernel(name)


def test_the_suite_has_twenty_distinct_classes_including_every_one_the_issue_names():
    fuzzed = {m.name: m for m, _ in CATCHES}
    assert len(fuzzed) >= 20 and len({m.bug for m in fuzzed.values()}) == len(fuzzed)
    assert set(fuzzed) >= ISSUE_CLASSES
    assert any(c.failure.startswith("d") for _, c in CATCHES)  # backward bugs
    assert sum(m.direction == "out" for m in fuzzed.values()) >= 10  # forward bugs
    default = {c.name for c in select_cases()}
    assert all(c.case in default for _, c in CATCHES)  # each is caught by the default profile


@pytest.mark.parametrize(
    ("mutant", "catch"),
    [pytest.param(m, c, marks=[pytest.mark.slow] if c.case == "offsets_2e24" else []) for m, c in CATCHES],
    ids=[f"{m.name}-{c.case}" for m, c in CATCHES],
)
def test_every_mutant_fails_the_case_built_for_its_class(mutant: Mutant, catch: Catch):
    (result,) = run_catalogue([f"bug_{mutant.name}"], [catch.dtype], cases=select_cases([catch.case]))
    assert result.verdict == "fail", result.reason
    assert (result.failure or "").startswith(catch.failure), result.reason
    if catch.failure.startswith(("dq", "dk", "dv")):  # a backward bug's first broken direction
        assert catch.failure.split(":")[0] in mutant.directions


def test_backward_bugs_pass_with_no_backward_and_fail_with_it():
    """--no-backward really skips the gradients: a dq-only bug is then invisible."""
    inputs = case("odd_shapes")
    forward_only = check_case("bug_dq_unscaled", inputs, backward=False)
    assert forward_only.verdict == "pass" and forward_only.backward is None and not forward_only.gradients
    full = check_case("bug_dq_unscaled", inputs)
    assert full.verdict == "fail" and full.backward == "fail" and full.failure == "dq:values"
    assert full.gradients["dq"]["max_abs"] > full.gradients["dq"]["tolerance"]
    assert full.gradients["dk"]["max_abs"] <= full.gradients["dk"]["tolerance"]  # only dq is wrong


def test_the_control_and_torchs_kernels_pass_the_default_profile():
    """One seed here; the 20-seed calibration is the slow test below and docs/calibration.md. The 2^24-element
    case (a third of this test's time per dtype) runs in bf16 only: it tests offsets, not rounding."""
    results = run_catalogue(CORRECT, ["bf16", "fp32"], seed=1, cases=select_cases(["*", "-offsets_2e24"]))
    results += run_catalogue(CORRECT, ["bf16"], seed=1, cases=select_cases(["offsets_2e24"]))
    assert {r.case for r in results} == {c.name for c in select_cases()}
    # tiled at fp32 does not merely not fail: it passes every case, but those with grouped heads
    tiled = [r for r in results if (r.kernel, r.dtype) == ("tiled", "fp32")]
    for r in tiled:
        expected = "unsupported" if r.case in ("gqa_broadcast", "mqa") else "pass"
        assert r.verdict == expected, (r.case, r.reason)
    assert all("KernelInputError" in r.reason for r in tiled if r.verdict == "unsupported")
    report = load_ledger("builtin").apply(results)  # torch's and the baseline's documented findings
    assert [(r.kernel, r.case, r.dtype, r.reason) for r in report.failures] == [] and report.passed
    checked = [r for r in results if r.kernel == "bug_none" and r.verdict == "pass"]
    assert checked and all(r.backward == "pass" for r in checked if CATALOGUE[r.case].backward)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_correct_kernels_never_fail_over_twenty_seeds(seed):
    results = run_catalogue(CORRECT, ["bf16", "fp16", "fp32"], seed=seed)
    report = load_ledger("builtin").apply(results)  # torch's and the baseline's documented findings
    assert [(r.kernel, r.case, r.dtype, r.reason) for r in report.failures] == [] and report.passed


def test_a_kernel_without_backward_is_reported_as_such_not_as_a_pass(register):
    def forward_only(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        with torch.no_grad():
            return correct_flash(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    kernel = register("user_forward_only", forward_only)
    result = check_case(kernel, case("odd_shapes"))
    assert result.verdict == "no_backward" and result.backward == "no_backward"
    assert "no backward" in result.reason
    # a wrong forward is still a failure
    bad = register("user_forward_only_bad", lambda q, k, v, **kw: forward_only(q, k, v, **kw) * 2)
    assert check_case(bad, case("odd_shapes")).verdict == "fail"


def test_every_case_can_run_in_every_layout_and_a_strided_read_fails_each_strided_one():
    cases = select_cases(["odd_shapes", "gqa_broadcast"])
    results = run_catalogue(["bug_strides_ignored", "sdpa_math"], ["fp32"], cases=cases, layouts=LAYOUTS)
    verdict = {(r.kernel, r.case, r.layout): r.verdict for r in results}
    assert {layout for _, _, layout in verdict} == set(LAYOUTS)
    for name in ("odd_shapes", "gqa_broadcast"):
        for layout in LAYOUTS:
            assert verdict["sdpa_math", name, layout] == "pass"
            # contiguous and offset views read right; every other layout has a non-contiguous tensor
            strided = layout in ("bnhd", "fused_qkv", "expanded_kv", "kv_strides", "mixed")
            assert verdict["bug_strides_ignored", name, layout] == ("fail" if strided else "pass")


def test_a_gradient_failure_is_shrunk_and_saved_with_its_kind(tmp_path):
    spec = RandomCaseSpec(
        batch=2, heads=4, n_q=40, n_k=70, head_dim=24, mask="padding", logit_std=2.0, level=0.0,
        scale=None, outliers=False, seed=3, kv_heads=2, layout="bnhd",
    )  # fmt: skip
    inputs = make_random_case(spec, torch.float32)
    result = check_case("bug_dq_unscaled", inputs)
    assert result.failure == "dq:values"
    call = case_reproducer("grad", "bug_dq_unscaled", inputs, result, params=spec.as_dict())
    small, _ = shrink_reproducer(call, "bug_dq_unscaled", judge=replay_case)
    assert small.q.numel() * small.k.shape[2] < inputs.q.numel() * inputs.k.shape[2]
    fuzz = small.meta["fuzz"]  # simplified along every axis: contiguous, plain heads
    assert fuzz["layout"] == "contiguous" and small.k.shape[1] == small.q.shape[1]
    path = save_reproducer(
        tmp_path, "grad", "bug_dq_unscaled", case_inputs(small), result, params=spec.as_dict()
    )
    again = case_inputs(load_reproducer(path))
    assert load_reproducer(path).meta["fuzz"]["backward"] is True and again.layout == "contiguous"
    assert check_case("bug_dq_unscaled", again).failure == "dq:values"
    assert check_case("bug_none", again).verdict == "pass"
