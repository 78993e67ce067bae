"""Random search, shrinking and reproducers (the one format: safetensors + JSON metadata + a script).

Oracles: a kernel with a planted bug (NaN for rows with no valid key) registered by a user module;
the FlashInfer sentinel bug, which must be found exactly in samples whose logits lie below −5e4;
``tiled`` (correct) as the control that must pass the same reproducer.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flashprobe
from flashprobe.cli import main as flashprobe_main
from flashprobe.fuzz import (
    ZEROS_REASON,
    CaseInputs,
    FuzzResult,
    RandomCaseSpec,
    check_case,
    make_random_case,
    random_search,
    run_catalogue,
    save_reproducer,
    select_cases,
)
from flashprobe.fuzz.cli import main
from flashprobe.fuzz.random_cases import MAX_KEYS
from flashprobe.fuzz.reproducer import case_inputs, replay_case
from flashprobe.kernels import available_kernels, unregister_kernel
from flashprobe.probing.repro import ReproducerError, load_reproducer, replay, shrink_reproducer

from ._helpers import SENTINEL_KERNEL, case, logits64

REPO = Path(flashprobe.__file__).resolve().parents[1]

PLANTED = '''
import torch
from flashprobe import register_kernel


@register_kernel("planted_nan")
def planted_nan(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct attention, except that a row with no valid key comes back as NaN."""
    g = q.shape[1] // k.shape[1]  # grouped-query attention: each k/v head serves g query heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
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
    if "planted_nan" in available_kernels():
        unregister_kernel("planted_nan")
    sys.modules.pop("planted_kernels", None)


#: Runs reproducer scripts one after another in one fresh interpreter, as `python script.py`
#: would (run_name="__main__", no arguments), printing each exit status: one torch import instead
#: of several.
_DRIVER = """
import runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path]
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


def test_budget_search_finds_shrinks_and_saves_a_planted_bug(planted_module, tmp_path, capsys):
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
    capsys.readouterr()
    assert main(["--import", "planted_kernels", *argv]) == 1
    rows = json.loads((out / "fuzz.json").read_text())["rows"]
    failed = [r for r in rows if r["verdict"] == "fail"]
    assert failed and all(r["failure"] == "nonfinite" for r in failed)
    first = next(r for r in failed if r["repro"])
    last = capsys.readouterr().out.rstrip().splitlines()[-1]  # names every file written
    repros = list(dict.fromkeys(r["repro"] for r in failed if r["repro"]))
    files = ", ".join(f"{path}, {Path(path).with_suffix('.py')}" for path in repros)
    assert last.endswith(f"wrote {out / 'fuzz.json'}, {files}")
    # one reproducer per property of a failing sample (its mask kind, a logit level), not per row
    properties = {(r["params"]["mask"], bool(r["params"]["level"])) for r in failed}
    assert len(repros) == len(properties)
    assert first["repro"].endswith(".safetensors")
    call = load_reproducer(first["repro"])
    assert call.meta["primary"] == "planted_nan" and call.meta["kernel_module"] == "planted_kernels"
    assert call.meta["fuzz"]["failure"] == "nonfinite" and call.meta["fuzz"]["backward"] is True
    inputs = case_inputs(call)
    assert (~inputs.valid_keys().any(-1)).any()  # the bug's trigger survived shrinking
    params = first["params"]
    before = params["batch"] * params["heads"] * params["n_q"] * params["n_k"] * params["head_dim"]
    b, h, n_q, d = inputs.q.shape
    assert b * h * n_q * inputs.k.shape[2] * d < before
    assert max(inputs.q.shape[2], inputs.k.shape[2]) <= 2  # halving went all the way down

    ((code, out),) = _run_snippets(Path(first["repro"]).with_suffix(".py"), path=planted_module)
    assert code == 1 and "planted_nan: FAIL: " in out and "NaN" in out, out


def test_reproducer_snippet_exits_zero_once_the_kernel_passes(tmp_path):
    spec = RandomCaseSpec(
        batch=2, heads=2, n_q=9, n_k=33, head_dim=8, mask="none", logit_std=3.0,
        level=-8e4, scale=None, outliers=False, seed=5,
    )  # fmt: skip
    inputs = make_random_case(spec, torch.float32)
    assert logits64(inputs).max() < -5e4  # every row below the FlashInfer sentinel
    saved = {}
    for kernel in (SENTINEL_KERNEL, "tiled"):
        result = check_case(kernel, inputs, case="planted")
        saved[kernel] = save_reproducer(tmp_path, "planted", kernel, inputs, result, params=spec.as_dict())
    assert saved[SENTINEL_KERNEL] != saved["tiled"]
    (code_bug, out_bug), (code_ok, out_ok) = _run_snippets(
        saved[SENTINEL_KERNEL].with_suffix(".py"), saved["tiled"].with_suffix(".py")
    )
    assert code_bug == 1 and ZEROS_REASON in out_bug, out_bug
    assert code_ok == 0 and out_ok.rstrip().splitlines()[-1].startswith("  tiled: PASS: "), out_ok


def test_reproducer_snippet_is_valid_python_whatever_the_reason_says(tmp_path):
    reason = (
        "raised ValueError: bad path C:\\new\\x41 \\N{oops} \\u12 \"\"\"ended\"\"\" '''too'''\nsecond line\\"
    )
    inputs = case("single_key")
    result = FuzzResult(
        kernel="tiled", case="odd", dtype="fp32", verdict="fail", reason=reason, failure="raised"
    )
    path = save_reproducer(tmp_path, "odd", "tiled", inputs, result)
    source = path.with_suffix(".py").read_text(encoding="utf-8")
    compile(source, str(path.with_suffix(".py")), "exec")  # a SyntaxError fails the test
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.isupper()
    }
    assert constants["REASON"] == reason and constants["KERNEL"] == "tiled" and constants["CASE"] == "odd"
    assert load_reproducer(path).meta["reason"] == reason
    with pytest.raises(ValueError, match=r"case name '\.\./up' cannot be used in a file name"):
        save_reproducer(tmp_path, "../up", "tiled", inputs, result)


def test_random_search_finds_the_sentinel_bug_and_no_false_alarm_on_correct_kernels(monkeypatch):
    # lengths up to 1,024 keys, not 8,192: two 5,077- and 2,645-key samples took 25 of the 30 s
    monkeypatch.setitem(MAX_KEYS, "default", 1024)
    results = random_search(["tiled", "sdpa_flash", SENTINEL_KERNEL], ["fp32"], budget=16, seed=0)
    by_kernel = {k: [r for r in results if r.kernel == k] for k in ("tiled", "sdpa_flash", SENTINEL_KERNEL)}
    for kernel in ("tiled", "sdpa_flash"):
        assert {r.verdict for r in by_kernel[kernel]} <= {"pass", "skip", "unsupported"}, [
            r.reason for r in by_kernel[kernel]
        ]
        unsupported = [r for r in by_kernel[kernel] if r.verdict == "unsupported"]
        assert all(kernel == "tiled" and "head counts differ" in r.reason for r in unsupported)
    sentinel_fails = [r for r in by_kernel[SENTINEL_KERNEL] if r.verdict == "fail"]
    assert sentinel_fails and all(r.failure == "zeros" for r in sentinel_fails)
    assert all(r.params["level"] < -5e4 for r in sentinel_fails)  # exactly the rows below the sentinel


def test_reproducer_snippet_exits_two_when_the_kernels_module_cannot_be_loaded(planted_module, tmp_path):
    """Exit 1 means "the bug still reproduces": a module that fails to import must not read so."""
    import planted_kernels  # noqa: F401  (registers planted_nan)

    inputs = case("fully_masked_rows")
    result = check_case("planted_nan", inputs, case="planted", backward=False)
    assert result.verdict == "fail"
    path = save_reproducer(tmp_path / "r", "planted", "planted_nan", inputs, result, backward=False)
    assert load_reproducer(path).meta["kernel_module"] == "planted_kernels"
    (found,) = _run_snippets(path.with_suffix(".py"), path=planted_module)
    (missing,) = _run_snippets(path.with_suffix(".py"))  # the module is not on the path
    assert found[0] == 1 and missing[0] == 2, (found, missing)


def test_a_catalogue_run_keeps_one_reproducer_per_property_and_direction(tmp_path):
    from flashprobe.fuzz.reproducer import ReproducerStore

    store = ReproducerStore(tmp_path, limit=2)
    cases = select_cases(["sentinel_1e4", "sentinel_5e4", "scale_zero"])
    results = run_catalogue([SENTINEL_KERNEL], ["fp32", "bf16"], cases=cases, reproducers=store)
    failed = [r for r in results if r.verdict == "fail"]
    assert {r.case for r in failed} >= {"sentinel_5e4"}
    saved = [r for r in failed if r.repro]
    assert len(saved) == 1 and saved[0].case == "sentinel_5e4"  # one per (kernel, property, direction)
    directions = {d for kernel, prop, d in store.saved if (kernel, prop) == (SENTINEL_KERNEL, "sentinel")}
    assert "out" in directions and len(store.saved) == len(directions)  # its output (and gradients)
    assert len(list(tmp_path.glob("repro_*.safetensors"))) == 1


def _below_sentinel(layout: str = "contiguous") -> CaseInputs:
    """2 x 2 x 9 x 33 inputs whose every logit lies below the FlashInfer sentinel (−5e4)."""
    spec = RandomCaseSpec(
        batch=2, heads=2, n_q=9, n_k=33, head_dim=8, mask="none", logit_std=3.0,
        level=-8e4, scale=None, outliers=False, seed=5,
    )  # fmt: skip
    inputs = make_random_case(spec, torch.float32)
    assert logits64(inputs).max() < -5e4
    return inputs.with_layout(layout)


def test_a_fuzz_reproducer_replays_and_shrinks_with_replay_and_fuzz_from(tmp_path, capsys):
    inputs = _below_sentinel("bnhd")
    result = check_case(SENTINEL_KERNEL, inputs, case="sentinel")
    assert result.failure == "zeros"
    path = save_reproducer(tmp_path, "sentinel", SENTINEL_KERNEL, inputs, result)
    assert (
        path.suffix == ".safetensors"
        and path.with_suffix(".py").is_file()
        and not list(tmp_path.glob("*.pt"))
    )
    call = load_reproducer(path)
    again = case_inputs(call)  # laid out as the failing call was: (B, N, H, D) memory, viewed (B, H, N, D)
    assert again.layout == "bnhd" and again.q.stride() == inputs.q.stride() and torch.equal(again.q, inputs.q)
    assert flashprobe_main(["replay", str(path)]) == 1  # the recorded kernel fails again
    assert flashprobe_main(["replay", str(path), "--kernel", "tiled"]) == 0  # a correct one passes
    assert "fuzz case 'sentinel'" in capsys.readouterr().out
    out = tmp_path / "fuzz"
    assert main(["--from", str(path), "--out", str(out)]) == 1
    assert "shrunk B x H x N_q x N_k 2x2x9x33 -> " in capsys.readouterr().out
    (shrunk,) = out.glob("*.shrunk.safetensors")
    small = load_reproducer(shrunk)
    assert small.q.numel() < call.q.numel() and small.meta["fuzz"]["layout"] == "contiguous"
    results = replay(small, [SENTINEL_KERNEL, "tiled"], judge=replay_case)
    assert results[SENTINEL_KERNEL]["failure"] == "zeros" and results["tiled"]["verdict"] == "pass"
    assert main(["--from", str(path), "--kernel", "tiled", "--out", str(out)]) == 0


def test_the_shrinker_keeps_the_failure_kind_and_the_kernels_limits():
    """A fuzz case shrinks to the smallest cut that fails the same way (``zeros``: every row below
    the sentinel, so one query and one key do); cuts the kernel refuses are not tried."""
    from flashprobe.fuzz.reproducer import case_reproducer

    inputs = _below_sentinel()
    result = check_case(SENTINEL_KERNEL, inputs, case="sentinel")
    call = case_reproducer("sentinel", SENTINEL_KERNEL, inputs, result)
    small, tries = shrink_reproducer(call, SENTINEL_KERNEL, judge=replay_case)
    assert small.q.shape[:3] == (1, 1, 1) and small.k.shape[2] == 1 and tries < 60
    assert replay(small, [SENTINEL_KERNEL], judge=replay_case)[SENTINEL_KERNEL]["failure"] == "zeros"
    with pytest.raises(ValueError, match="does not fail with 'tiled'"):
        shrink_reproducer(call, "tiled", judge=replay_case)
    # the probe's replay takes the fuzzer's judge from its caller; without it, one line names it
    with pytest.raises(ReproducerError, match=r"judge=flashprobe\.fuzz\.reproducer\.replay_case"):
        replay(small, [SENTINEL_KERNEL])


def test_old_pt_reproducers_are_refused_with_the_reason(tmp_path, capsys):
    """Nothing a user hands in is unpickled: a ``.pt`` reproducer of older versions is refused,
    saying what it is and what to do, by ``replay`` and ``fuzz --from`` alike (exit 2)."""
    old = tmp_path / "repro_sentinel_0123abcd.pt"
    torch.save({"q": torch.zeros(1, 1, 1, 1), "kernel": "tiled"}, old)
    renamed = tmp_path / "renamed.safetensors"  # a pickle under a safetensors name
    renamed.write_bytes(old.read_bytes())
    for path in (old, renamed):
        with pytest.raises(SystemExit) as info:
            flashprobe_main(["replay", str(path), "--kernel", "tiled"])
        assert info.value.code == 2
        assert "old .pt format (a torch pickle" in capsys.readouterr().err
        assert main(["--from", str(path), "--out", str(tmp_path / "fuzz")]) == 2
        assert "does not unpickle" in capsys.readouterr().err


def test_a_probe_reproducers_script_exits_1_while_it_fails_0_once_fixed_2_when_unloadable(tmp_path):
    """The script of a call saved in training, run as ``python script.py`` in a new interpreter."""
    from flashprobe.formats.reproducer import save_reproducer as save_call

    inputs = _below_sentinel()
    scripts = []
    for name, kernel, module in (
        ("bug", SENTINEL_KERNEL, None),
        ("fixed", "tiled", None),
        ("unloadable", SENTINEL_KERNEL, "no_such_module_i39"),
    ):
        path = save_call(
            tmp_path / f"{name}.safetensors", q=inputs.q, k=inputs.k, v=inputs.v, attn_mask=None,
            is_causal=False, scale=None, meta={"site": "attn", "primary": kernel, "kernel_module": module},
        )  # fmt: skip
        scripts.append(path.with_suffix(".py"))
    (bug, out_bug), (fixed, out_fixed), (unloadable, _) = _run_snippets(*scripts)
    assert bug == 1 and f"{SENTINEL_KERNEL}: FAIL" in out_bug, out_bug
    assert fixed == 0 and "tiled: PASS" in out_fixed, out_fixed
    assert unloadable == 2


def test_a_reproducer_whose_header_starts_like_a_pickle_still_loads(tmp_path):
    """Only a file that fails to read as safetensors is taken for an old pickle: a safetensors
    header length whose low byte is 0x80 (a pickle's first byte) is a valid reproducer (a probe
    reproducer in tests/integration/test_hf_trainer.py had one)."""
    from flashprobe.formats.reproducer import save_reproducer as save_call

    q = torch.zeros(1, 1, 2, 4)
    for n in range(256):
        path = save_call(
            tmp_path / "call.safetensors", q=q, k=q, v=q, attn_mask=None, is_causal=False, scale=None,
            meta={"reason": "x" * n},
        )  # fmt: skip
        if path.read_bytes()[0] == 0x80:
            break
    else:
        pytest.fail("no reason length gave a header length with low byte 0x80")
    assert load_reproducer(path).meta["reason"] == "x" * n
    # self-attention on one tensor (q is k is v) is saved too, each its own copy
    same = save_call(
        tmp_path / "same.safetensors", q=q, k=q, v=q, attn_mask=None, is_causal=False, scale=None
    )
    call = load_reproducer(same)
    assert torch.equal(call.q, q) and torch.equal(call.k, q) and torch.equal(call.v, q)


def test_a_reproducer_of_an_output_gradient_case_replays_with_that_gradient(tmp_path):
    """`math` in fp16 forms dO·vᵀ in fp16: the case's output gradient × 2^12 overflows it (±Inf in dq,
    dk). Its reproducer fails again on replay, judged with that gradient, not the standard one."""
    from flashprobe.fuzz.reproducer import ReproducerStore

    store = ReproducerStore(tmp_path)
    (result,) = run_catalogue(["math"], ["fp16"], cases=select_cases(["grad_out_huge"]), reproducers=store)
    assert result.verdict == "fail" and "±Inf" in result.reason and result.repro
    path = Path(result.repro)
    assert replay(load_reproducer(path), ["math"], judge=replay_case)["math"]["verdict"] == "fail"
    assert flashprobe_main(["replay", str(path)]) == 1  # the recorded kernel fails again
    assert flashprobe_main(["replay", str(path), "--kernel", "tiled"]) == 0  # fp32 intermediates pass
