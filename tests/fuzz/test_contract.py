"""The contract catalogue: kernels registered with flash-attn's and FlashInfer's apis, fuzzed.

Oracles: planted bugs known by construction (:data:`lab.mutants.CONTRACT_MUTANTS`, one step of a
correct stand-in overridden) must fail the cases built for their class; correct kernels computed
differently from the golden (online softmax over tiles, exp2 with a base-2 LSE, split-KV merged
through LSEs, a base-2 merge, FP8 with P prescaled before its cast) must pass every case they are
posed, over several seeds; the LSE direction against hand-computed LSEs.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flashprobe.formats.reproducer import load_contract_reproducer
from flashprobe.fuzz.cli import main as fuzz_main
from flashprobe.fuzz.contract_cases import CONTRACT_CASES, contract_cases
from flashprobe.fuzz.contract_run import check_contract_case, run_contract_catalogue, split_case_patterns
from flashprobe.fuzz.reproducer import contract_reproducer
from flashprobe.judge import judge_lse
from flashprobe.kernels import get_kernel, register_kernel, unregister_kernel
from flashprobe.probing.replay_cli import main as replay_main
from lab import contracts
from lab.mutants import CONTRACT_MUTANTS, CORRECT_CONTRACTS, register_mutants

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}


@pytest.fixture
def suite():
    """The mutation suite registered for one test (unregistered afterwards)."""
    names = register_mutants()
    yield
    for name in names:
        unregister_kernel(name)


@pytest.mark.parametrize("name", sorted(CONTRACT_MUTANTS))
def test_every_planted_contract_bug_fails_the_cases_of_its_class(suite, name: str) -> None:
    mutant = CONTRACT_MUTANTS[name]
    for case in mutant.catches:
        result, _ = check_contract_case(f"bug_{name}", case, _DTYPES[mutant.dtype], backward=False)
        assert result.verdict == "fail", f"bug_{name} on {case}: {result.verdict}: {result.reason}"


def test_every_contract_api_has_planted_bugs_and_a_correct_kernel() -> None:
    apis = {m.api for m in CONTRACT_MUTANTS.values()}
    assert apis == {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_state"}
    assert {api for _, api, _ in CORRECT_CONTRACTS.values()} == apis
    for m in CONTRACT_MUTANTS.values():  # each names cases posed to its api
        assert all(m.api in CONTRACT_CASES[c].apis for c in m.catches), m.name


#: the cases the planted bugs fail (the fast test's share of the catalogue; the slow one runs all)
_POINTED = sorted(
    {c for m in CONTRACT_MUTANTS.values() for c in m.catches} | {"ragged_causal", "merge_dominant"}
)


@pytest.mark.parametrize("name", sorted(CORRECT_CONTRACTS))
def test_correct_contract_kernels_pass_the_cases_that_catch_the_bugs(suite, name: str) -> None:
    rows = run_contract_catalogue([f"ok_{name}"], [torch.float32], seed=0, backward=False, names=_POINTED)
    assert rows
    bad = [
        (r.case, r.verdict, r.reason) for r in rows if r.verdict not in ("pass", "no_backward", "unsupported")
    ]
    assert not bad, bad
    tested = [r for r in rows if r.verdict in ("pass", "no_backward")]
    assert len(tested) >= len(rows) // 2  # most cases are posed: unsupported only where a limit is the point


def test_gradients_of_a_varlen_kernel_are_judged_both_ways(suite) -> None:
    ok, _ = check_contract_case("ok_exp2_varlen", "ragged_causal", torch.float32)
    assert ok.verdict == "pass" and ok.backward == "pass", ok.reason

    def no_dkdv(*args, **kwargs):  # the forward right; gradients reach q only, as zeros
        found = contracts.flash_attn_varlen_func(*args, **kwargs)
        out, rest = (found[0], found[1:]) if isinstance(found, tuple) else (found, ())
        out = out.detach() + 0.0 * args[0]
        return (out, *rest) if rest else out

    caps = contracts.CAPABILITIES["flash_attn_varlen_func"]
    register_kernel(
        "varlen_no_dkdv", no_dkdv, api="flash_attn_varlen_func", capabilities=caps, overwrite=True
    )
    try:
        bad, _ = check_contract_case("varlen_no_dkdv", "ragged_causal", torch.float32)
        assert bad.verdict == "fail" and bad.backward == "fail", bad.reason
    finally:
        unregister_kernel("varlen_no_dkdv")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CORRECT_CONTRACTS))
def test_correct_contract_kernels_pass_over_many_seeds(suite, name: str) -> None:
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    dtypes += [torch.float8_e4m3fn] if name == "fp8_prescale" else []
    for seed in range(1, 6):
        rows = run_contract_catalogue([f"ok_{name}"], dtypes, seed=seed, backward=False)
        bad = [(r.case, r.dtype, r.reason) for r in rows if r.verdict == "fail"]
        assert not bad, (seed, bad)


def test_fp8_pcast_fixture_fails_without_the_prescale_and_passes_with_it(suite) -> None:
    fixture = CONTRACT_CASES["fp8_pcast_fixture"]
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        ok, _ = check_contract_case("ok_fp8_prescale", fixture, dtype)
        assert ok.verdict == "pass", ok.reason
        for bug in ("bug_fp8_no_prescale", "bug_fp8_stale_max"):
            bad, _ = check_contract_case(bug, fixture, dtype)
            assert bad.verdict == "fail", (bug, dtype, bad.reason)


def test_lse_direction_reads_base_and_empty_rows_as_the_golden() -> None:
    golden = torch.tensor([1.5, -0.25, float("-inf")], dtype=torch.float64)
    ok = judge_lse(golden.float(), golden.float(), golden, dtype=torch.float32)
    assert ok.verdict == "pass", ok.reason
    base2 = golden * math.log2(math.e)  # a base-2 LSE read as natural: off by (log2 e − 1)·lse
    assert judge_lse(base2.float(), golden.float(), golden, dtype=torch.float32).criterion == "lse"
    plus_inf = golden.masked_fill(torch.isinf(golden), math.inf)  # flash-attn 2's empty row
    assert judge_lse(plus_inf, golden, golden, dtype=torch.float32).criterion == "empty_row"
    assert judge_lse(plus_inf, golden, golden, dtype=torch.float32, empty=math.inf).verdict == "pass"
    nan = golden.clone()
    nan[0] = float("nan")
    assert judge_lse(nan, golden, golden, dtype=torch.float32).criterion == "nonfinite"


def test_case_patterns_split_between_the_catalogues() -> None:
    assert split_case_patterns([]) == (([], list(CONTRACT_CASES)))
    dense, contract = split_case_patterns(["paged_*"])
    assert dense is None and contract == [n for n in CONTRACT_CASES if n.startswith("paged_")]
    dense, contract = split_case_patterns(["sentinel_*"])
    assert dense == ["sentinel_*"] and contract == []
    dense, contract = split_case_patterns(["-merge_*"])
    assert dense == ["-merge_*"] and "merge_halves" not in contract and "paged_16" in contract


def test_cases_keep_their_point_inside_declared_limits() -> None:
    caps = replace(contracts.CAPABILITIES["flash_attn_varlen_func"], page_sizes=frozenset({16, 64}))
    posed = {c.name for c in contract_cases("flash_attn_varlen_func", caps)}
    assert {"paged_256", "paged_16", "empty_keys_in_batch"} <= posed
    register_kernel("varlen_16_64", contracts.flash_attn_varlen_func, api="flash_attn_varlen_func",
                    capabilities=caps, overwrite=True)  # fmt: skip
    try:
        big, _ = check_contract_case("varlen_16_64", "paged_256", torch.float32, backward=False)
        assert big.verdict == "unsupported" and "not applicable" in big.reason  # the size is the point
        over, call = check_contract_case(
            "varlen_16_64", "paged_over_allocated", torch.float32, backward=False
        )
        assert over.verdict == "pass" and call.page_size in (16, 64)  # any size it takes keeps the point
    finally:
        unregister_kernel("varlen_16_64")


def test_a_kv_cache_call_with_num_splits_reaches_kernels_that_take_it(tmp_path: Path) -> None:
    """``cache_num_splits`` passes ``num_splits=4`` to a KV-cache kernel whose signature has it (split-KV
    with empty splits: the correct merge passes), and is not applicable to one whose signature lacks it
    (refused before the kernel runs)."""
    seen: list[int] = []

    def recording(q, k_cache, v_cache, *args, num_splits=0, **kwargs):
        seen.append(num_splits)
        return contracts.flash_attn_with_kvcache(q, k_cache, v_cache, *args, num_splits=num_splits, **kwargs)

    def without(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False,
                return_softmax_lse=False):  # fmt: skip
        seen.append(-1)
        return contracts.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                 softmax_scale=softmax_scale, causal=causal,
                                                 return_softmax_lse=return_softmax_lse)  # fmt: skip

    caps = contracts.CAPABILITIES["flash_attn_with_kvcache"]
    for name, fn in (("splits_recording", recording), ("splits_without", without)):
        register_kernel(name, fn, api="flash_attn_with_kvcache", capabilities=caps, overwrite=True)
    try:
        ok, call = check_contract_case("splits_recording", "cache_num_splits", torch.float32)
        assert ok.verdict == "pass", ok.reason
        assert seen == [4] and call.num_splits == 4 and "num_splits=4" in ok.shape
        saved = contract_reproducer(ok, "splits_recording", call, CONTRACT_CASES["cache_num_splits"])
        assert load_contract_reproducer(saved.save(tmp_path / "splits.safetensors")).call.num_splits == 4
        plain, _ = check_contract_case("splits_recording", "cache_append", torch.float32)
        assert plain.verdict == "pass" and seen == [4, 0]  # not passed: the kernel's default
        refused, _ = check_contract_case("splits_without", "cache_num_splits", torch.float32)
        assert refused.verdict == "unsupported" and "no num_splits" in refused.reason
        assert refused.reason.startswith("not applicable") and seen == [4, 0]
    finally:
        for name in ("splits_recording", "splits_without"):
            unregister_kernel(name)


def test_a_contract_only_run_reports_the_contract_properties_and_writes_fuzz_md(
    suite, tmp_path: Path, capsys
) -> None:
    """A merge kernel fuzzed on contract cases only: the property table counts the contract
    properties posed to it and names the selected ones no case poses to its api (``window``), and
    ``fuzz.md`` is written."""
    argv = ["--kernel", "ok_merge_base2", "--dtype", "fp32", "--case", "merge_halves", "--case", "window_0_0"]
    assert fuzz_main([*argv, "--out", str(tmp_path), "-q"]) == 0
    out = capsys.readouterr().out
    assert "ok_merge_base2: 1 of 2 properties tested" in out
    assert "not applicable: window, because window_0_0: its cases take flash_attn_func" in out
    assert "not merge_state ones" in out
    md = (tmp_path / "fuzz.md").read_text()
    assert "| window | not applicable, because window_0_0" in md and "1 of 2 tested" in md


def test_gradients_must_be_zero_in_masked_rows_not_where_one_key_makes_the_golden_zero() -> None:
    """A varlen kernel whose dq carries a rounding-sized extra term ``2^-20 · dO`` (its forward exact):
    where each query sees one key (``length_one_key``, ``window_0_0``) the golden dq is 0 by the
    softmax, not by a mask, and the kernel passes; rows of a sequence without keys must be 0, and it
    fails there (``dq:masked``)."""

    def rounding_dq(q, k, v, *args, **kwargs):
        found = contracts.flash_attn_varlen_func(q, k, v, *args, **kwargs)  # (out, lse, None) with the LSE
        out = found[0] if isinstance(found, tuple) else found
        out = out + 2.0**-20 * (q - q.detach())  # the same forward; dq + 2^-20 dO
        return (out, *found[1:]) if isinstance(found, tuple) else out

    caps = contracts.CAPABILITIES["flash_attn_varlen_func"]
    register_kernel("rounding_dq", rounding_dq, api="flash_attn_varlen_func", capabilities=caps)
    try:
        for case in ("length_one_key", "window_0_0"):
            ok, _ = check_contract_case("rounding_dq", case, torch.float32)
            assert ok.verdict == "pass" and ok.backward == "pass", f"{case}: {ok.reason}"
        masked, _ = check_contract_case("rounding_dq", "empty_keys_in_batch", torch.float32)
        assert masked.verdict == "fail" and masked.backward_failure == "dq:masked", masked.reason
    finally:
        unregister_kernel("rounding_dq")


def test_fuzz_saves_contract_reproducers_and_replay_judges_them(suite, tmp_path: Path, capsys) -> None:
    kernels = ["--kernel", "bug_pages_past_128", "--kernel", "bug_cu_seqlens_unchecked"]
    cases = ["--case", "paged_256", "--case", "refuse_cu_seqlens_*"]
    args = [*kernels, *cases, "--dtype", "fp32", "--quiet", "--out", str(tmp_path)]
    assert fuzz_main(args) == 1
    paged = next(tmp_path.glob("repro_paged_256_*.safetensors"))
    refused = next(tmp_path.glob("repro_refuse_cu_seqlens_decreasing_*.safetensors"))
    capsys.readouterr()
    assert replay_main([str(paged)]) == 1  # the recorded kernel still fails
    assert "FAIL" in capsys.readouterr().out
    assert replay_main([str(paged), "--kernel", "ok_exp2_varlen"]) == 0
    assert replay_main([str(refused), "--kernel", "ok_exp2_varlen"]) == 0  # refusing it passes
    assert replay_main([str(refused), "--kernel", "bug_cu_seqlens_unchecked"]) == 1
    caps = replace(contracts.CAPABILITIES["flash_attn_varlen_func"], page_sizes=frozenset({16}))
    register_kernel("varlen_16", contracts.flash_attn_varlen_func, api="flash_attn_varlen_func",
                    capabilities=caps, overwrite=True)  # fmt: skip
    try:  # a kernel that refuses the call says nothing about the bug: 2, not 1
        assert replay_main([str(paged), "--kernel", "varlen_16"]) == 2
    finally:
        unregister_kernel("varlen_16")
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}  # lab is importable from the repository's root
    script = subprocess.run([sys.executable, str(paged.with_suffix(".py"))], capture_output=True, text=True,
                            cwd=root, env=env, timeout=300)  # fmt: skip
    assert script.returncode == 1, script.stderr  # the script imports lab.mutants, which registers it


def test_kernels_listing_poses_the_tiny_call_in_the_kernel_api(suite) -> None:
    from flashprobe.cli import _availability

    caps = replace(contracts.CAPABILITIES["flash_attn_varlen_func"], head_dims=frozenset({128}))
    register_kernel("varlen_64", contracts.flash_attn_varlen_func, api="flash_attn_varlen_func",
                    capabilities=caps, overwrite=True)  # fmt: skip
    try:
        assert get_kernel("varlen_64").api == "flash_attn_varlen_func"
        found = _availability("varlen_64", "cpu", call=True)
        assert set(found.dtypes) == {"bf16", "fp16", "fp32", "fp64"}, found.reasons
        assert "e4m3" in _availability("ok_fp8_prescale", "cpu", call=True).dtypes
    finally:
        unregister_kernel("varlen_64")


def test_a_merge_is_not_given_partial_states_its_float32_lse_cannot_hold(suite) -> None:
    """``sentinel_halfmax`` at fp32: every valid logit near −3e38, so a partial state's LSE in base 2
    (×1.44) is past float32's range. Given as −inf, it made a correct base-2 ``merge_state`` return
    zeros (a false failure); the call is unsupported, saying why. Where the LSEs fit, it runs."""
    from flashprobe.fuzz.check import check_kernel

    cases = ["sentinel_halfmax", "sentinel_1e5"]
    found = check_kernel("ok_merge_base2", dtypes=["fp32"], cases=cases, backward=False)
    verdicts = {r.case: (r.verdict, r.reason) for r in found.results}
    assert verdicts["sentinel_halfmax"][0] == "unsupported", verdicts
    assert "float32 LSE in base 2" in verdicts["sentinel_halfmax"][1]
    assert verdicts["sentinel_1e5"][0] == "pass", verdicts
