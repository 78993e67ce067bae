"""Tests of ``flashprobe fuzz``: the catalogue, the verdict rule, the CLI, the random search.

Oracles: logits recomputed by hand in float64 from the cast inputs; outputs with a known defect
(NaN, zero rows, a wrong scale, a planted offset) built from the golden itself; and the FlashInfer
bug reproduced by ``tiled:mask_value=-5e4``, whose rows below the sentinel must come back as zeros.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flashprobe
from flashprobe import KernelUnavailableError, golden_attention, math_attention, register_kernel
from flashprobe.bench import fuzz
from flashprobe.bench.fuzz import (
    ZEROS_REASON,
    check_case,
    main,
    random_search,
    references,
    run_catalogue,
    save_reproducer,
)
from flashprobe.bench.fuzz_cases import (
    CATALOGUE,
    SENTINELS,
    CaseInputs,
    RandomCaseSpec,
    exact_logit_qk,
    make_random_case,
    sample_random_spec,
    select_cases,
)
from flashprobe.kernels import registry

SENTINEL_KERNEL = "tiled:mask_value=-5e4"
REPO = Path(flashprobe.__file__).resolve().parents[1]


@pytest.fixture
def register():
    """``register(name, fn)``: register a kernel for one test, removed afterwards."""
    names: list[str] = []

    def add(name: str, fn) -> str:
        register_kernel(name, fn, overwrite=True)
        names.append(name)
        return name

    yield add
    for name in names:
        registry._REGISTRY.pop(name, None)


def _case(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> CaseInputs:
    return CATALOGUE[name].make(dtype, fuzz._case_generator(seed, name))


def _logits64(inputs: CaseInputs) -> torch.Tensor:
    """Scaled logits of the cast inputs in float64, computed here independently of the fuzzer."""
    q, k = inputs.q.double(), inputs.k.double()
    scale = 1 / math.sqrt(q.shape[-1]) if inputs.scale is None else inputs.scale
    return torch.einsum("bhqd,bhkd->bhqk", q, k) * scale


# --------------------------------------------------------------------------------------------
# the catalogue's construction


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_logits_are_exact_in_every_dtype(dtype):
    gen = torch.Generator().manual_seed(1)
    z = -6e4 + 8 * torch.rand(2, 3, 5, 37, generator=gen, dtype=torch.float64)
    q, k = exact_logit_qk(z, dtype, head_dim=16, c=16.0, scale=1.0)
    computed = torch.matmul(q, k.transpose(-2, -1))  # in the dtype itself
    assert torch.equal(computed.double(), z.to(dtype).double())


@pytest.mark.parametrize("key", ["5e4", "1e5", "halfmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sentinel_cases_put_every_valid_logit_below_the_sentinel(key, dtype):
    inputs = _case(f"sentinel_{key}", dtype)
    logits = _logits64(inputs)
    sentinel = SENTINELS[key](dtype)
    assert logits.max().item() < sentinel
    assert torch.isfinite(logits.to(dtype)).all()  # representable in the dtype
    valid = inputs.valid_keys()
    assert valid[0].all() and not valid[1].all()  # one batch unmasked, one with masked keys


def test_expected_semantics_of_cases_with_a_closed_form():
    """The golden of these cases equals a value computed by hand from v and the mask."""
    inputs = _case("one_valid_key")
    index = inputs.attn_mask.double().argmax(-1)  # (B, H, N_q): the only valid key
    expected = torch.gather(inputs.v.double(), 2, index.unsqueeze(-1).expand(-1, -1, -1, inputs.v.shape[-1]))
    assert torch.equal(references(inputs).golden, expected)

    inputs = _case("scale_zero_causal")
    v = inputs.v.double()
    cumulative_mean = v.cumsum(2) / torch.arange(1, v.shape[2] + 1, dtype=torch.float64).view(-1, 1)
    torch.testing.assert_close(references(inputs).golden, cumulative_mean, rtol=1e-12, atol=1e-12)

    inputs = _case("padding_mask")  # batch 0 has length 0: every row of it is 0
    golden = references(inputs).golden
    assert torch.equal(golden[0], torch.zeros_like(golden[0])) and golden[1:].abs().amax(-1).min() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_samples_with_a_logit_level_have_exact_logits(dtype):
    rng = random.Random(11)
    specs = [s for s in (sample_random_spec(rng, dtype) for _ in range(60)) if s.level]
    assert len(specs) >= 10
    for spec in specs:
        inputs = make_random_case(spec, dtype)
        in_dtype = torch.matmul(inputs.q, inputs.k.transpose(-2, -1))  # any summation order is exact
        assert torch.equal(in_dtype.double(), inputs.q.double() @ inputs.k.double().transpose(-2, -1))
        logits = _logits64(inputs)
        assert logits.max() < 0.9 * spec.level  # every row sits at the level (×1 … ×1.1)
        assert torch.isfinite(logits.to(dtype)).all()


def test_sentinel_1e5_is_skipped_in_fp16_with_the_reason():
    (row,) = run_catalogue(["tiled"], ["fp16"], cases=select_cases(["sentinel_1e5"]))
    assert row.verdict == "skip"
    assert "fp16" in row.reason and "65504" in row.reason


def test_select_cases_patterns():
    assert [c.name for c in select_cases(["sentinel_5e4"])] == ["sentinel_5e4"]
    names = [c.name for c in select_cases(["*", "-sentinel_*", "!gqa_*"])]
    assert "gqa_broadcast" not in names and not any(n.startswith("sentinel_") for n in names)
    assert len(names) == len(CATALOGUE) - 5
    with pytest.raises(ValueError, match="matches no case"):
        select_cases(["no_such_case"])


# --------------------------------------------------------------------------------------------
# the FlashInfer class of bug


def test_sentinel_kernel_fails_the_sentinel_cases_with_the_zeros_reason():
    results = run_catalogue([SENTINEL_KERNEL, "tiled"], ["fp32", "bf16"], cases=select_cases(["sentinel_*"]))
    verdict = {(r.kernel, r.case, r.dtype): r for r in results}
    for dtype in ("fp32", "bf16"):
        for key in ("5e4", "1e5", "halfmax"):
            row = verdict[SENTINEL_KERNEL, f"sentinel_{key}", dtype]
            assert row.verdict == "fail" and row.failure == "zeros"
            assert ZEROS_REASON in row.reason
            assert row.primary_vs_golden_max > 0.1
        # logits in [-3e4, -1.05e4] lie above -5e4: the sentinel kernel is right there
        assert verdict[SENTINEL_KERNEL, "sentinel_1e4", dtype].verdict == "pass"
        for key in SENTINELS:
            assert verdict["tiled", f"sentinel_{key}", dtype].verdict == "pass"


def test_tiled_passes_the_whole_catalogue_at_fp32():
    results = run_catalogue(["tiled"], ["fp32"])
    assert {r.case for r in results} == set(CATALOGUE)
    for r in results:
        expected = "unsupported" if r.case == "gqa_broadcast" else "pass"
        assert r.verdict == expected, (r.case, r.reason)
    gqa = next(r for r in results if r.case == "gqa_broadcast")
    assert "KernelInputError" in gqa.reason


def test_fp16_qk_overflow_is_judged_against_what_fp16_can_represent():
    cases = select_cases(["qk_overflow", "scale_tiny"])
    results = run_catalogue(["tiled", "sdpa_math"], ["fp16"], cases=cases)
    for r in results:
        assert r.baseline_vs_golden_max is None and r.baseline_nonfinite > 0  # math overflows too
        assert r.noise_from == "rounded-logits baseline"
        if r.kernel == "tiled":  # forms q·kᵀ unscaled in fp16: NaN where the golden is finite
            assert r.verdict == "fail" and r.failure == "nonfinite"
            assert "overflows fp16 before the scale" in r.reason
        else:  # torch scales q and k by √scale before the product
            assert r.verdict == "pass", r.reason
    # the logits themselves fit fp16: the case is posable, not a skip
    for case in cases:
        inputs = case.make(torch.float16, fuzz._case_generator(0, case.name))
        assert _logits64(inputs).abs().max() < 65504 < (_logits64(inputs) / _scale(inputs)).abs().max()


def _scale(inputs: CaseInputs) -> float:
    return 1 / math.sqrt(inputs.q.shape[-1]) if inputs.scale is None else inputs.scale


# --------------------------------------------------------------------------------------------
# the rule, on user-registered kernels with known defects


def _naive_softmax(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """softmax without the fully-masked-row guard: NaN for rows that see no key."""
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _falsy_scale(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """The `scale or default` bug: scale=0.0 silently becomes 1/sqrt(d)."""
    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale or None)


def _masked_mean(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Fully masked rows get the mean of v instead of 0."""
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    dead = (out == 0).all(-1, keepdim=True)
    return torch.where(dead, v.mean(-2, keepdim=True), out)


def _unavailable(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    raise KernelUnavailableError("needs a TPU")


def _crashes(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    raise RuntimeError("index out of range")


def _in_place(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    q.zero_()
    return out


def _gqa_capable(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


@pytest.mark.parametrize(
    ("fn", "case", "verdict", "failure", "text"),
    [
        (_naive_softmax, "fully_masked_rows", "fail", "nonfinite", "all in fully masked rows"),
        (_naive_softmax, "padding_mask", "fail", "nonfinite", "NaN"),
        (_naive_softmax, "odd_shapes", "pass", None, "≤"),
        (_falsy_scale, "scale_zero", "fail", "values", "wrong values"),
        (_masked_mean, "fully_masked_rows", "fail", "masked_nonzero", "fully masked rows returned non-zero"),
        (_unavailable, "odd_shapes", "unsupported", None, "needs a TPU"),
        (_crashes, "odd_shapes", "fail", "raised", "raised RuntimeError: index out of range"),
        (_in_place, "odd_shapes", "fail", "inplace", "modified its inputs in place: q"),
        (_gqa_capable, "gqa_broadcast", "pass", None, "≤"),
    ],
)
def test_user_kernels_with_known_defects_get_the_right_verdict(register, fn, case, verdict, failure, text):
    name = register(f"user_{fn.__name__.strip('_')}", fn)
    result = check_case(name, _case(case), case=case)
    assert (result.verdict, result.failure) == (verdict, failure), result.reason
    assert text in result.reason


@pytest.mark.parametrize("name", ["odd_shapes", "outliers"])
def test_values_rule_is_two_times_baseline_plus_floor(register, name):
    inputs = _case(name)
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
    assert refs.baseline_max == pytest.approx(errors[0])
    assert refs.floor == pytest.approx(floor)
    assert refs.tolerance == pytest.approx(tol)
    for factor, expected in ((0.8, "pass"), (1.25, "fail")):
        offset = factor * tol

        def shifted(q, k, v, *, attn_mask=None, is_causal=False, scale=None, _offset=offset):
            g = golden_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
            out = g.clone()
            out[0, 0, 0, 0] += _offset  # one element off by a known amount, in float64
            return out

        result = check_case(register("user_shifted", shifted), inputs, refs=refs)
        assert result.verdict == expected, result.reason
        assert result.primary_vs_golden_max == pytest.approx(offset, rel=1e-6)


def test_zero_rows_are_flagged_only_where_golden_is_clearly_non_zero(register):
    def zero_first_row(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        out[:, :, 0] = 0
        return out

    result = check_case(register("user_zero_row", zero_first_row), _case("odd_shapes"))
    assert result.failure == "zeros" and "6 of 678 rows" in result.reason  # B·H = 6 first rows
    # fully masked rows are zero in the golden too: not a zeros failure
    result = check_case("tiled", _case("fully_masked_rows"))
    assert result.verdict == "pass", result.reason


# --------------------------------------------------------------------------------------------
# CLI


def test_main_exit_codes_json_schema_and_table(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--kernel", "tiled", "--kernel", SENTINEL_KERNEL, "--dtype", "fp32,fp16", "--case", "sentinel_*"]
    assert main([*argv, "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert SENTINEL_KERNEL in printed and ZEROS_REASON in printed
    payload = json.loads((out / "fuzz.json").read_text())
    assert payload["kernels"] == ["tiled", SENTINEL_KERNEL] and payload["dtypes"] == ["fp32", "fp16"]
    rows = payload["rows"]
    assert len(rows) == 4 * 2 * 2
    required = {
        "kernel",
        "case",
        "dtype",
        "verdict",
        "primary_vs_golden_max",
        "baseline_vs_golden_max",
        "reason",
    }
    for row in rows:
        assert required <= row.keys()
        assert row["verdict"] in fuzz.VERDICTS
        for key in ("primary_vs_golden_max", "baseline_vs_golden_max"):
            assert row[key] is None or (isinstance(row[key], float) and row[key] >= 0)
    assert payload["summary"] == {v: sum(r["verdict"] == v for r in rows) for v in fuzz.VERDICTS}
    assert payload["summary"]["skip"] == 2  # sentinel_1e5 in fp16, for both kernels
    table = (out / "fuzz.md").read_text()
    assert (
        f"`{SENTINEL_KERNEL}`" in table and "| `sentinel_5e4` | pass / pass | **FAIL** / **FAIL** |" in table
    )

    assert main(["--kernel", "tiled", "--dtype", "fp32", "--case", "sentinel_*", "--out", str(out)]) == 0
    argv = ["--kernel", SENTINEL_KERNEL, "--dtype", "fp32", "--case", "sentinel_*", "--out", str(out)]
    assert main([*argv, "--exclude", "sentinel_5e4,sentinel_1e5,sentinel_halfmax"]) == 0  # only 1e4 left
    assert [r["case"] for r in json.loads((out / "fuzz.json").read_text())["rows"]] == ["sentinel_1e4"]
    assert main(["--kernel", "no_such_kernel", "--out", str(out)]) == 2
    assert main(["--out", str(out)]) == 2
    assert main(["--kernel", "tiled", "--case", "nothing_matches", "--out", str(out)]) == 2
    assert main(["--kernel", "tiled", "--dtype", "int8", "--out", str(out)]) == 2
    assert main(["--import", "no_such_module_for_fuzz", "--kernel", "tiled", "--out", str(out)]) == 2
    assert main(["--list"]) == 0
    assert "sentinel_5e4" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# random search, shrinking, reproducers

PLANTED = '''
import torch
from flashprobe import register_kernel


@register_kernel("planted_nan")
def planted_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct attention, except that a row with no valid key comes back as NaN."""
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v
'''


@pytest.fixture
def planted_module(tmp_path, monkeypatch):
    """A user module on disk, importable, that registers ``planted_nan`` when imported."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "planted_kernels.py").write_text(textwrap.dedent(PLANTED))
    monkeypatch.syspath_prepend(str(src))
    yield src
    registry._REGISTRY.pop("planted_nan", None)
    sys.modules.pop("planted_kernels", None)


#: Runs reproducer snippets one after another in one fresh interpreter, as `python snippet.py`
#: would (run_name="__main__"), printing each exit status: one torch import instead of several.
_DRIVER = """
import runpy, sys
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        print(f"EXIT {stop.code}", flush=True)
"""


def _run_snippets(*snippets: Path, path: Path | None = None) -> list[tuple[int, str]]:
    """Exit status and stdout of each snippet, run in a new Python process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*([str(path)] if path else []), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, *map(str, snippets)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    parts = re.split(r"^EXIT (-?\d+)$", proc.stdout, flags=re.MULTILINE)  # out, code, out, code, ""
    return [(int(code), out) for out, code in zip(parts[0:-1:2], parts[1::2], strict=True)]


def test_budget_search_finds_shrinks_and_saves_a_planted_bug(planted_module, tmp_path):
    out = tmp_path / "out"
    argv = [
        "--kernel",
        "planted_nan",
        "--dtype",
        "fp32",
        "--budget",
        "10",
        "--no-catalogue",
        "--out",
        str(out),
    ]
    assert main(argv) == 2  # not registered yet
    assert main(["--import", "planted_kernels", *argv]) == 1
    rows = json.loads((out / "fuzz.json").read_text())["rows"]
    failed = [r for r in rows if r["verdict"] == "fail"]
    assert failed and all(r["failure"] == "nonfinite" for r in failed)
    first = next(r for r in failed if r["repro"])
    saved = torch.load(first["repro"], weights_only=True)
    assert saved["kernel"] == "planted_nan" and saved["kernel_module"] == "planted_kernels"

    inputs = CaseInputs(
        q=saved["q"],
        k=saved["k"],
        v=saved["v"],
        attn_mask=saved["attn_mask"],
        is_causal=saved["is_causal"],
        scale=saved["scale"],
    )
    assert (~inputs.valid_keys().any(-1)).any()  # the bug's trigger survived shrinking
    params = first["params"]
    before = params["batch"] * params["heads"] * params["n_q"] * params["n_k"] * params["head_dim"]
    b, h, n_q, d = inputs.q.shape
    assert b * h * n_q * inputs.k.shape[2] * d < before
    assert max(inputs.q.shape[2], inputs.k.shape[2]) <= 2  # halving went all the way down

    ((code, out),) = _run_snippets(Path(first["repro"]).with_suffix(".py"), path=planted_module)
    assert code == 1 and "fail: " in out and "NaN" in out, out


def test_reproducer_snippet_exits_zero_once_the_kernel_passes(tmp_path):
    spec = RandomCaseSpec(
        batch=2, heads=2, n_q=9, n_k=33, head_dim=8, mask="none", logit_std=3.0,
        level=-8e4, scale=None, outliers=False, seed=5,
    )  # fmt: skip
    inputs = make_random_case(spec, torch.float32)
    assert _logits64(inputs).max() < -5e4  # every row below the FlashInfer sentinel
    saved = {}
    for kernel in (SENTINEL_KERNEL, "tiled"):
        result = check_case(kernel, inputs, case="planted")
        saved[kernel] = save_reproducer(tmp_path, "planted", kernel, inputs, result, params=spec.as_dict())
    assert saved[SENTINEL_KERNEL] != saved["tiled"]
    (code_bug, out_bug), (code_ok, out_ok) = _run_snippets(
        saved[SENTINEL_KERNEL].with_suffix(".py"), saved["tiled"].with_suffix(".py")
    )
    assert code_bug == 1 and ZEROS_REASON in out_bug, out_bug
    assert code_ok == 0 and out_ok.rstrip().splitlines()[-1].startswith("pass: "), out_ok


def test_random_search_finds_the_sentinel_bug_and_no_false_alarm_on_correct_kernels():
    results = random_search(["tiled", "sdpa_flash", SENTINEL_KERNEL], ["fp32"], budget=16, seed=0)
    by_kernel = {k: [r for r in results if r.kernel == k] for k in ("tiled", "sdpa_flash", SENTINEL_KERNEL)}
    for kernel in ("tiled", "sdpa_flash"):
        assert {r.verdict for r in by_kernel[kernel]} <= {"pass", "skip"}, [
            r.reason for r in by_kernel[kernel]
        ]
    sentinel_fails = [r for r in by_kernel[SENTINEL_KERNEL] if r.verdict == "fail"]
    assert sentinel_fails and all(r.failure == "zeros" for r in sentinel_fails)
    assert all(r.params["level"] < -5e4 for r in sentinel_fails)  # exactly the rows below the sentinel
