"""``flashprobe fuzz``: exit codes, fuzz.json and fuzz.md, the printed output, bad input.

Bad input must fail before any case runs, with exit code 2 and one message that names the
argument and the fix.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import flashprobe.fuzz.cli as cli
from flashprobe.fuzz import VERDICTS, ZEROS_REASON
from flashprobe.fuzz.cli import main
from flashprobe.kernels import unregister_kernel

from ._helpers import SENTINEL_KERNEL


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
        "primary_golden_max_abs",
        "baseline_golden_max_abs",
        "reason",
    }
    for row in rows:
        assert required <= row.keys()
        assert row["verdict"] in VERDICTS
        for key in ("primary_golden_max_abs", "baseline_golden_max_abs"):
            assert row[key] is None or (isinstance(row[key], float) and row[key] >= 0)
    assert payload["summary"] == {**{v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}, "known": 0}
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


def test_output_lists_skip_and_unsupported_reasons_and_every_file_written(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--kernel", "tiled", "--kernel", "sdpa_efficient", "--dtype", "fp16,fp32"]
    assert main([*argv, "--case", "sentinel_1e5,gqa_broadcast", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    reasons = [line for line in lines if line.startswith(("SKIP ", "UNSUP "))]
    rows = json.loads((out / "fuzz.json").read_text())["rows"]
    distinct = {(r["verdict"], r["reason"]) for r in rows if r["verdict"] in ("skip", "unsupported")}
    assert len(reasons) == len(distinct) == 3, reasons  # one line per distinct reason
    skip = next(line for line in reasons if line.startswith("SKIP "))
    assert skip.startswith("SKIP  ×2") and "sentinel_1e5 | fp16 | tiled, sdpa_efficient: " in skip
    cuda = next(line for line in reasons if "runs on CUDA devices only" in line)
    assert (
        cuda.startswith("UNSUP ×3") and "sentinel_1e5, gqa_broadcast | fp32, fp16 | sdpa_efficient: " in cuda
    )
    gqa = next(line for line in reasons if "KernelInputError" in line)
    assert "gqa_broadcast | fp16, fp32 | tiled: KernelInputError" in gqa
    assert lines[-1] == f"1 pass, 0 fail, 2 skip, 5 unsupported; wrote {out / 'fuzz.json'}, {out / 'fuzz.md'}"


def test_kernels_that_fail_alike_share_one_reason_line(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--kernel", "math", "--kernel", "tiled", "--kernel", "tiled:preset=paper", "--dtype", "fp32"]
    assert main([*argv, "--case", "gqa_broadcast,single_key", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    reasons = [line for line in lines if line.startswith(("SKIP ", "UNSUP "))]
    rows = json.loads((out / "fuzz.json").read_text())["rows"]
    assert len({r["reason"] for r in rows if r["verdict"] == "unsupported"}) == 2  # each names its kernel
    assert reasons == [
        "UNSUP ×3   gqa_broadcast | fp32 | math, tiled, tiled:preset=paper: KernelInputError: <kernel>: "
        "head counts differ: q 8, k 2, v 2; repeat k/v heads for grouped-query attention "
        "(k.repeat_interleave(g, dim=1))"
    ]
    assert lines[-1] == f"3 pass, 0 fail, 0 skip, 3 unsupported; wrote {out / 'fuzz.json'}, {out / 'fuzz.md'}"


def test_import_finds_a_module_in_the_working_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "userkernels_cwd").mkdir()
    (tmp_path / "userkernels_cwd" / "mine.py").write_text(
        "from flashprobe import math_attention, register_kernel\n\n\n"
        "@register_kernel('cwd_kernel', overwrite=True)\n"
        "def cwd_kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):\n"
        "    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        argv = ["--import", "userkernels_cwd.mine", "--kernel", "cwd_kernel", "--dtype", "fp32"]
        assert main([*argv, "--case", "single_key", "--out", "out"]) == 0
    finally:
        unregister_kernel("cwd_kernel")
    assert capsys.readouterr().out.rstrip().endswith("wrote out/fuzz.json, out/fuzz.md")


@pytest.fixture
def no_run(monkeypatch):
    """Fails the test if any case runs."""

    def refuse(*args, **kwargs):
        raise AssertionError("a case ran despite bad input")

    monkeypatch.setattr(cli, "check_kernel", refuse)


def _bad_input(argv: list[str], capsys) -> str:
    """Run ``flashprobe fuzz`` expecting exit 2; its one-line message."""
    assert main(["--kernel", "tiled", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("make_out", "message"),
    [
        (lambda tmp: tmp / "file", "--out {out} is a file; give a directory path"),
        (
            lambda tmp: tmp / "file" / "sub",
            "--out {out} lies under {tmp}/file, which is a file; give a directory",
        ),
    ],
    ids=["is-a-file", "under-a-file"],
)
def test_bad_out_fails_before_any_case_runs(tmp_path, capsys, no_run, make_out, message):
    (tmp_path / "file").write_text("not a directory")
    out = make_out(tmp_path)
    text = _bad_input(["--out", str(out)], capsys)
    assert message.format(out=out, tmp=tmp_path) in text
    assert (tmp_path / "file").read_text() == "not a directory"


def test_unwritable_out_fails_before_any_case_runs(tmp_path, capsys, no_run, monkeypatch):
    out = tmp_path / "readonly"

    def denied(self, *args, **kwargs):  # what a read-only directory does (root may write anywhere)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "touch", denied)
    text = _bad_input(["--out", str(out)], capsys)
    assert f"--out {out} is not writable (Permission denied); give a directory you can write to" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_fails_before_any_case_runs(tmp_path, capsys, no_run):
    text = _bad_input(["--device", "cuda", "--out", str(tmp_path)], capsys)
    assert text == "flashprobe fuzz: --device cuda: CUDA is not available on this machine; use --device cpu"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", ","], "--dtype ',' lists nothing; give e.g. --dtype bf16,fp32, or leave --dtype out"),
        (["--dtype", "fp32,int8"], "--dtype int8: unknown dtype; use one of bf16, fp16, fp32, fp64"),
        (["--case", " , "], "--case ' , ' lists nothing; give e.g. --case 'sentinel_*', or leave --case out"),
        (["--budget", "-1"], "--budget -1: must be ≥ 0 (random samples; 0 runs only the catalogue)"),
        (["--device", "nonsense"], "--device 'nonsense': "),
        (["--baseline", "nope"], "--baseline 'nope': unknown kernel 'nope'"),
        # issue 42's table: each ran (a traceback, a silent exit 0, or a refusal after --out was made)
        (["--seed", "-1"], "--seed -1: must be ≥ 0"),
        (["--device", "meta"], "--device meta: flashprobe fuzz runs on cpu or cuda[:N]; use --device cpu"),
        (["--exclude", "*"], "--exclude '*' leaves no case of the default profile to run"),
        (["--no-catalogue"], "--no-catalogue with --budget 0 runs nothing; give --budget N"),
        (["--layout", "nosuch"], "--layout nosuch: unknown layout"),
        (["--import", "../evil"], "--import '../evil' is not a module name: give a dotted Python name"),
        (["--threads", "0"], "--threads 0: must be ≥ 1 (torch intra-op CPU threads)"),
    ],
    ids=[
        "empty-dtype",
        "unknown-dtype",
        "empty-case",
        "negative-budget",
        "bad-device",
        "bad-baseline",
        "negative-seed",
        "meta-device",
        "no-case-left",
        "nothing-to-run",
        "unknown-layout",
        "import-a-path",
        "zero-threads",
    ],
)
def test_bad_arguments_fail_before_any_case_runs(tmp_path, capsys, no_run, argv, message):
    out = tmp_path / "out"
    text = _bad_input([*argv, "--out", str(out)], capsys)
    assert text.startswith("flashprobe fuzz: ") and message in text
    assert not out.exists()  # nothing created either


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU, where FlexAttention has no backward")
def test_flex_runs_the_catalogue_forward_and_reports_its_gradients_as_unsupported(tmp_path, capsys):
    assert main(["--kernel", "flex:compile=false", "--dtype", "fp32", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "fuzz.json").read_text())["rows"]
    results = [r for r in rows if not r["case"].startswith(("seq_", "inv_"))]  # the catalogue's rows
    verdicts = {r["verdict"] for r in results}
    assert verdicts <= {"pass", "no_backward", "skip"} and "no_backward" in verdicts
    assert {r["verdict"] for r in rows if r not in results} <= {"pass", "unsupported"}
    judged = [r for r in results if r["verdict"] == "no_backward"]
    assert all("has no backward on CPU (only on CUDA)" in r["reason"] for r in judged)


def _raising(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    raise RuntimeError("illegal memory access")


def _wrong_shape(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    return torch.zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[-1], dtype=q.dtype)  # (B, N, H, D)


def _wrong_dtype(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).double()


@pytest.mark.parametrize("bug", [_raising, _wrong_shape, _wrong_dtype])
def test_fuzz_from_exits_1_when_the_kernel_raises_or_returns_the_wrong_shape_or_dtype(
    bug, register, tmp_path, capsys
):
    """A CI gate on ``fuzz --from`` must not pass a kernel that crashes (as ``replay`` does not)."""
    from flashprobe.probing.repro import save_reproducer

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
    path = save_reproducer(
        tmp_path / "call.safetensors", q=q, k=k, v=v, attn_mask=None, is_causal=False, scale=None
    )
    name = register("bug_" + bug.__name__.strip("_"), bug)
    argv = ["--from", str(path), "--kernel", name, "--out", str(tmp_path / "fuzz")]
    assert main(argv) == 1
    printed = capsys.readouterr().out
    assert f"{name}: ERROR" in printed
    assert not (tmp_path / "fuzz").exists()  # nothing shrunk, nothing written
    assert main(["--from", str(path), "--kernel", "math", "--out", str(tmp_path / "fuzz")]) == 0


def test_fuzz_from_refuses_a_recorded_baseline_it_cannot_build_before_any_work(tmp_path, capsys):
    """A reproducer naming a baseline not registered here was reported as an ERROR of the kernel asked
    for (issue 42, item 7); it is a usage error naming the recorded baseline and the fix, and
    ``--baseline math`` (the default spelled out) overrides the recorded one."""
    from flashprobe.probing.repro import save_reproducer

    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    path = save_reproducer(
        tmp_path / "call.safetensors",
        q=q,
        k=k,
        v=v,
        attn_mask=None,
        is_causal=False,
        scale=None,
        meta={"primary": "math", "baseline": "nosuch_baseline"},
    )
    out = tmp_path / "fuzz"
    assert main(["--from", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--from: the call's recorded baseline 'nosuch_baseline' cannot be used here" in err
    assert "--baseline SPEC, e.g. --baseline math" in err and not out.exists()
    assert main(["--from", str(path), "--baseline", "nosuch", "--out", str(out)]) == 2
    assert "--baseline 'nosuch': unknown kernel 'nosuch'" in capsys.readouterr().err and not out.exists()
    assert main(["--from", str(path), "--baseline", "math", "--out", str(out)]) == 0
    assert "math: PASS" in capsys.readouterr().out


def test_progress_lines_only_on_a_terminal_outside_ci(monkeypatch, capsys):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli._progress(quiet=True) is None
    show = cli._progress(quiet=False)
    assert show is not None
    show("[1/2] odd_shapes fp32 seed 0: tiled pass (0.1 s)")
    assert capsys.readouterr().err == "[1/2] odd_shapes fp32 seed 0: tiled pass (0.1 s)\n"
    monkeypatch.setenv("CI", "true")
    assert cli._progress(quiet=False) is None
    monkeypatch.delenv("CI")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli._progress(quiet=False) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="sdpa_cudnn may run here")
def test_kernels_none_of_which_run_here_are_refused_not_passed_unjudged(tmp_path, capsys):
    """``fuzz --kernel sdpa_cudnn`` on a CPU exited 0 with every row unsupported (issue 42's table)."""
    out = tmp_path / "out"
    assert main(["--kernel", "sdpa_cudnn", "--kernel", "sdpa_efficient", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no kernel given runs on cpu at bf16, fp16, fp32, so nothing would be judged" in err
    assert "sdpa_cudnn: runs on CUDA devices only" in err and "sdpa_efficient: runs on CUDA" in err
    assert not out.exists()


def test_a_random_search_outside_a_terminal_says_its_estimate_and_a_line_a_minute(monkeypatch, capsys):
    """``fuzz --budget 1000000000`` in a log file or CI ran silently (issue 42, item 7)."""
    monkeypatch.setenv("CI", "true")
    assert cli._progress(quiet=False) is None  # no random search: the catalogue's lines stay quiet
    assert cli._progress(quiet=True, budget=10) is None
    show = cli._progress(quiet=False, budget=10)
    show("[1/10] random_000 fp32: math pass (1 s; about 9 s left)")
    show("[2/10] random_001 fp32: math pass (2 s; about 8 s left)")  # within the minute: not shown
    show("random search: 10 samples of 1 kernel(s), about 9 s at the catalogue's pace")
    assert capsys.readouterr().err.splitlines() == [
        "[1/10] random_000 fp32: math pass (1 s; about 9 s left)",
        "random search: 10 samples of 1 kernel(s), about 9 s at the catalogue's pace",
    ]
    monkeypatch.setattr(cli, "_SPARSE_PROGRESS_S", 0.0)
    show = cli._progress(quiet=False, budget=10)
    show("a")
    show("b")
    assert capsys.readouterr().err == "a\nb\n"


def test_report_has_seconds_properties_and_the_slowest_cases(tmp_path):
    out = tmp_path / "run"
    argv = ["--kernel", "tiled", "--dtype", "fp32", "--case", "odd_shapes,gqa_broadcast,left_padding"]
    assert main([*argv, "--quiet", "--out", str(out)]) == 0
    payload = json.loads((out / "fuzz.json").read_text())
    assert all(r["seconds"] > 0 and r["property"] for r in payload["rows"])
    assert list(payload["case_seconds"]) and set(payload["case_seconds"]) == {
        "odd_shapes",
        "gqa_broadcast",
        "left_padding",
    }
    tiled = payload["properties"]["tiled"]
    assert tiled["partial tile"]["status"] == "tested" and tiled["left padding"]["status"] == "tested"
    assert tiled["GQA"]["status"] == "unsupported" and "head counts differ" in tiled["GQA"]["reason"]
    table = (out / "fuzz.md").read_text()
    assert "## Properties" in table and "| GQA | unsupported, because gqa_broadcast:" in table
    assert "## Slowest cases" in table and "| `odd_shapes` |" in table.split("## Slowest cases")[1]


def test_gradients_are_judged_when_the_output_fails(register):
    """A forward bug does not hide a backward bug: both are reported."""
    from flashprobe.fuzz import check_case

    from ._helpers import case

    def both_wrong(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        out = torch.nn.functional.scaled_dot_product_attention(q, k * 2, v, attn_mask=attn_mask, scale=scale)
        return out + 0.0 * q.sum()

    result = check_case(register("user_both_wrong", both_wrong), case("odd_shapes"))
    assert result.verdict == "fail" and result.failure == "values"
    assert result.backward == "fail" and (result.backward_failure or "").startswith("d")
    assert "dq" in result.reason or "dk" in result.reason


def test_the_run_takes_threads_and_leaves_the_callers_setting(tmp_path, register):
    """``--threads T`` (default 1) is torch's intra-op threads while the cases run, kernels' calls
    included; fuzz.json records it, and the caller's setting is back after."""
    seen: list[int] = []

    def counting(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        seen.append(torch.get_num_threads())
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )

    name = register("threads_counting", counting)
    before = torch.get_num_threads()
    argv = ["--kernel", name, "--dtype", "fp32", "--case", "single_key", "--no-backward", "-q"]
    for threads, flags in ((1, []), (2, ["--threads", "2"])):
        seen.clear()
        assert main([*argv, *flags, "--out", str(tmp_path)]) == 0
        assert seen and set(seen) == {threads}
        assert json.loads((tmp_path / "fuzz.json").read_text())["threads"] == threads
        assert torch.get_num_threads() == before
