"""``python -m lab.rules``: the peer rules against hand-computed tolerances, and the table at a tiny
budget against independent checks (a known-wrong mutant is caught by flashprobe's rule and by
``torch.testing.assert_close``; a correct float32 kernel passes flashprobe's rule and PyTorch's).
The full table is in docs/calibration.md."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.mutants import MUTANTS, correct_flash
from lab.rules import CALLS, RULES, peer_failures, run_rules
from lab.rules import main as rules_main


def test_flash_attentions_rule_is_twice_the_baseline_max_plus_its_slack() -> None:
    golden = torch.tensor([[0.25, -1.5, 3.0, 0.125]], dtype=torch.float64)
    ref = golden.float()  # exact in float32
    baseline = ref + torch.tensor([[1e-3, 0.0, 0.0, 0.0]])
    # slack: 2 · max|(ref + 0.3 − 0.3) − ref| in float32, by hand
    slack = 2 * max(abs(float(((ref + 0.3) - 0.3)[0, i]) - float(ref[0, i])) for i in range(4))
    allowed = 2 * float((baseline - ref).abs().max()) + slack
    within = ref.clone()
    within[0, 2] += 0.9 * allowed
    beyond = ref.clone()
    beyond[0, 2] += 1.1 * allowed
    assert not peer_failures(within, baseline, golden, "dv")["flash-attention"]
    assert peer_failures(beyond, baseline, golden, "dv")["flash-attention"]
    nan = ref.clone()
    nan[0, 0] = math.nan
    assert peer_failures(nan, baseline, golden, "out") == dict.fromkeys(RULES[1:], True)


def test_pytorchs_sdpa_tolerances_are_its_fudge_factor_times_the_low_precision_error() -> None:
    golden = torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64)
    lp = torch.tensor([1.1, 2.0, -4.0])  # the same-dtype math: 0.1 off, relative 0.1
    # out: atol = rtol = 4 · 0.1 = 0.4, so |x − ref| ≤ 0.4 + 0.4 · |ref| (0.8 at ref = 1)
    assert not peer_failures(torch.tensor([1.75, 2.0, -4.0]), lp, golden, "out")["pytorch-sdpa"]
    assert peer_failures(torch.tensor([1.85, 2.0, -4.0]), lp, golden, "out")["pytorch-sdpa"]
    # dk: 16 · 0.1 = 1.6 each, so 1 + 3.2 at ref = 1
    assert not peer_failures(torch.tensor([4.1, 2.0, -4.0]), lp, golden, "dk")["pytorch-sdpa"]
    # an exact low-precision math: the defaults, 4 · 1e-5 and 4 · 1.3e-6 in float32
    exact = golden.float()
    assert peer_failures(exact + torch.tensor([1e-4, 0, 0]), exact, golden, "out")["pytorch-sdpa"]


def test_assert_close_and_kernelbench_use_their_fixed_tolerances() -> None:
    golden = torch.tensor([1.0, 100.0], dtype=torch.float64)
    x = torch.tensor([1.0, 100.0], dtype=torch.bfloat16)
    off = torch.tensor([1.0, 101.0], dtype=torch.bfloat16)  # 1 % off: within bf16's rtol 1.6e-2
    assert not peer_failures(off, x, golden, "out")["assert_close"]
    far = torch.tensor([1.0, 102.0], dtype=torch.bfloat16)  # 2 %: beyond 1.6e-2 · 100 + 1e-5
    assert peer_failures(far, x, golden, "out")["assert_close"]
    # KernelBench: |x − baseline| ≤ 1e-2 + 1e-2 · |baseline|, against the same-dtype baseline
    assert not peer_failures(off, x, golden, "out")["kernelbench"]
    assert peer_failures(far, x, golden, "out")["kernelbench"]
    assert "kernelbench" not in peer_failures(off, x, golden, "dq")  # outputs only


def test_a_tiny_table_fails_the_bugs_and_passes_a_correct_fp32_kernel() -> None:
    rows, details = run_rules(
        ["fp32", "bf16"],
        [0],
        correct=("sdpa_math", "ok_flash_backward"),
        calls=(CALLS[0], CALLS[2]),
        mutants=["kv_tile_zeroed", "delta_dropped", "one_head_wrong"],
    )
    by = {(r["rule"], r["dtype"]): r for r in rows}
    assert {(r, d) for r, d in by} == {(r, d) for r in RULES for d in ("fp32", "bf16")}
    for dtype in ("fp32", "bf16"):
        ours = by["flashprobe", dtype]
        assert ours["correct_calls"] == 4 and ours["false_alarms"] == 0 and ours["failed_kernels"] == ""
        # each mutant fires on both calls (77 keys > 32, two heads, every call drops the term)
        assert ours["bug_calls"] == 6 and ours["caught"] == 6 and ours["missed_bugs"] == ""
        assert by["assert_close", dtype]["caught"] == 6
    # the counts are the entries': recount them
    for (rule, dtype), row in by.items():
        mine = [e for e in details if e["dtype"] == dtype]
        assert row["false_alarms"] == sum(e[rule] for e in mine if not e["bug"])
        assert row["caught"] == sum(e[rule] for e in mine if e["bug"])
    assert by["pytorch-sdpa", "fp32"]["false_alarms"] == 0


def test_the_correct_kernel_is_exact_where_the_table_says_it_passes() -> None:
    """Independent of the rules: the bug-free kernel is within 1e-5 of the FP64 golden in float32,
    and the zeroed key tile is plainly wrong (the keys 16–31 of dk are 0)."""
    inputs = CALLS[0].inputs(torch.float32, 0)
    q, k, v = (t.clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    out = correct_flash(q, k, v)
    (dk,) = torch.autograd.grad(out.sum(), (k,))
    wide = [t.detach().double().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v)]
    gold = torch.softmax(wide[0] @ wide[1].transpose(-2, -1) / math.sqrt(32), dim=-1) @ wide[2]
    (gold_dk,) = torch.autograd.grad(gold.sum(), (wide[1],))
    torch.testing.assert_close(out.double(), gold, atol=1e-5, rtol=0)
    torch.testing.assert_close(dk.double(), gold_dk, atol=1e-4, rtol=1e-4)
    bad = MUTANTS["kv_tile_zeroed"].fn(q, k, v)
    (bad_dk,) = torch.autograd.grad(bad.sum(), (k,))
    assert bad_dk[..., 16:32, :].abs().max() == 0 and gold_dk[..., 16:32, :].abs().max() > 0.1


def test_the_command_writes_json_csv_and_the_markdown_table(tmp_path: Path) -> None:
    argv = ["--seeds", "1", "--precision", "fp32", "--mutants", "one_batch_wrong"]
    argv += ["--kernels", "sdpa_math,tiled"]
    assert rules_main([*argv, "--check", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "rules.json").read_text())
    assert [r["rule"] for r in doc["rows"]] == list(RULES)
    assert (tmp_path / "rules.csv").read_text().startswith("rule,dtype,")
    table = (tmp_path / "rules.md").read_text()
    assert table.startswith("Produced by `python -m lab.rules --seeds 1")
    assert "| flashprobe | fp32 |" in table
    assert rules_main(["--precision", "fp8", "--out", str(tmp_path)]) == 2
    assert rules_main(["--mutants", "nope", "--out", str(tmp_path)]) == 2
    assert rules_main(["--kernels", "no_such_kernel", "--out", str(tmp_path)]) == 2


@pytest.mark.parametrize("seeds", ["0", "-1"])
def test_bad_seeds_are_refused(seeds: str, tmp_path: Path) -> None:
    assert rules_main(["--seeds", seeds, "--out", str(tmp_path)]) == 2


def test_python_m_lab_rules_runs_from_the_repository_root(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    argv = ["--seeds", "1", "--precision", "fp32", "--mutants", "one_batch_wrong", "--kernels", "sdpa_math"]
    done = subprocess.run(
        [sys.executable, "-m", "lab.rules", *argv, "--out", str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads((tmp_path / "rules.json").read_text())
    assert doc["command"].startswith("python -m lab.rules --seeds 1")
