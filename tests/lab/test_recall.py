"""``python -m lab.recall``: recall and false alarms per input strategy, scored against hand-built rows
(a mutant failing where its control fails too is no catch; the shipped ledger's findings are no false
alarm) and, at a tiny budget, on real kernels (``falsy_scale`` is caught by the catalogue's
``scale_zero``, its control passes; a strategy whose module is missing reads ``not available``)."""

from __future__ import annotations

import json

from flashprobe.fuzz import FuzzResult
from lab.mutants import MUTANTS
from lab.recall import STRATEGIES, _score, control_of, markdown_table, recall_rows
from lab.recall import main as recall_main


def _row(kernel: str, case: str, verdict: str, dtype: str = "fp32", seed: int = 0) -> FuzzResult:
    return FuzzResult(kernel=kernel, case=case, dtype=dtype, verdict=verdict, reason="", seed=seed)


def test_a_catch_needs_the_control_to_pass_the_same_case_and_a_ledger_finding_is_no_alarm():
    assert control_of("falsy_scale") == "bug_none"
    assert control_of("first_block_nan") == "ctl_blockwise"
    assert control_of("tail_tile_mask") == "ctl_blockwise_64"
    rows = [
        _row("bug_falsy_scale", "scale_zero", "fail"),  # the control passes: a catch
        _row("bug_none", "scale_zero", "pass"),
        _row("bug_scale_ignored", "odd_shapes", "fail", seed=1),  # the control fails too: no catch
        _row("bug_none", "odd_shapes", "fail", seed=1),
        _row("bug_causal_off_by_one", "odd_shapes", "pass"),  # never fails: missed
        _row("sdpa_flash", "scale_zero_causal", "fail"),  # torch's documented NaN: in the ledger
        _row("sdpa_math", "scale_zero_causal", "pass"),
    ]
    correct = ["bug_none", "sdpa_flash", "sdpa_math"]
    row = _score("catalogue", rows, ["falsy_scale", "scale_ignored", "causal_off_by_one"], correct)
    assert (row["caught"], row["mutants"], row["recall"]) == (1, 3, 0.333)
    assert row["missed"] == "scale_ignored,causal_off_by_one"
    # bug_none's odd_shapes failure is a false alarm; sdpa_flash's is the ledger's finding
    assert (row["false_alarm_kernels"], row["false_alarm_rows"], row["correct_rows"]) == (1, 1, 4)
    assert row["alarmed"] == "bug_none"


def test_the_catalogue_catches_a_planted_bug_its_control_does_not_have(tmp_path):
    rows = recall_rows(
        ["catalogue", "sequences"],
        ["fp32"],
        range(1),
        cases=["scale_zero", "single_key"],
        mutants=["falsy_scale"],
        correct=["sdpa_math"],
    )
    catalogue, sequences = rows
    assert (catalogue["caught"], catalogue["mutants"], catalogue["false_alarm_kernels"]) == (1, 1, 0)
    assert catalogue["correct_kernels"] == 2 and catalogue["correct_rows"] > 0  # bug_none, sdpa_math
    try:
        import flashprobe.fuzz.invariants  # noqa: F401
    except ImportError:
        assert not sequences["available"] and "not available" in markdown_table(rows)
    else:
        assert sequences["available"] and sequences["false_alarm_kernels"] == 0


def test_the_command_writes_its_table_and_refuses_an_unknown_strategy(tmp_path, capsys):
    out = tmp_path / "recall"
    argv = ["--strategies", "random search", "--mutants", "falsy_scale", "--kernels", "sdpa_math"]
    assert recall_main([*argv, "--budget", "1", "--out", str(out)]) == 0
    payload = json.loads((out / "recall.json").read_text())
    assert [r["strategy"] for r in payload["rows"]] == ["random search"]
    assert "| random search |" in (out / "recall.md").read_text()
    assert recall_main(["--strategies", "fuzzing", "--out", str(out)]) == 2
    assert "choose from " + ", ".join(STRATEGIES) in capsys.readouterr().err
    assert set(MUTANTS) >= {"tail_tile_mask", "k_strides_from_v"}
