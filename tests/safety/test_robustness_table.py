"""scripts/robustness_table.py cannot rot: its table is well formed (distinct cases, known setups,
every placeholder filled), its classification sorts each kind of outcome where it belongs, and a few
cases run end to end. The whole table (minutes) is not run here: docs/training.md gives its command
and last figures."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "robustness_table", ROOT / "scripts" / "robustness_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["robustness_table"] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


table = _module()
CASES = table.all_cases()


def test_the_table_holds_the_tests_cases_and_issue_42s_each_distinct() -> None:
    from tests.safety.test_bad_inputs import CASES as BAD_INPUTS

    assert len({c.key for c in CASES}) == len(CASES) >= 290
    args = {c.args for c in CASES}
    assert all(tuple(a) in args for a, _ in BAD_INPUTS)  # the safety tests' table, all of it
    sources = {c.source for c in CASES}
    assert {
        "issue 42",
        "tests/safety/test_resume_is_data.py",
        "tests/probing/test_repro_metadata.py",
    } <= sources
    commands = {c.command for c in CASES}
    for command in ("train", "study", "compare", "report", "fuzz", "replay", "bench tiles", "bench fp8"):
        assert command in commands, command
    assert any("--from" in c.args for c in CASES)


def test_every_case_names_a_known_setup_and_only_placeholders_it_fills() -> None:
    for case in CASES:
        kind = case.setup.partition(":")[0]
        assert kind in table.SETUP_KINDS, case
        for text in (*case.args, *(v for _, v in case.env), case.cwd):
            for name in re.findall(r"\{(\w+)\}", text):
                assert name in table.SETUP_KINDS[kind] or name == "home", (case, name)
        assert case.code in (0, 1, 2, table.RUNS_ON) and all(isinstance(a, str) for a in case.args)


def _case(**kw) -> object:
    return table.Case(args=("fuzz", "--kernel", "nosuch"), **kw)


@pytest.mark.parametrize(
    ("case", "code", "output", "inside", "kind"),
    [
        (_case(expect="unknown kernel"), 2, "flashprobe fuzz: unknown kernel 'nosuch'", [], "clean"),
        (_case(), 1, "Traceback (most recent call last):\n  ...\nKeyError: 'x'", [], "traceback"),
        (_case(), 1, "Error executing job with overrides: []", [], "traceback"),
        (_case(), 0, "", [], "silent"),
        (_case(), 0, "ran every case", [], "silent"),
        (_case(), 2, "  \n", [], "silent"),
        (_case(), 2, "flashprobe fuzz: refused", ["+out"], "late"),
        (_case(), 2, "WeightSnapshot: saved step 0 to ...\nerror: x", [], "late"),
        (_case(), None, "", [], "late"),
        (_case(expect="unknown kernel"), 1, "flashprobe fuzz: unknown kernel 'nosuch'", [], "mismatch"),
        (_case(expect="unknown kernel"), 2, "flashprobe fuzz: something else", [], "mismatch"),
        (_case(code=1, writes=True, expect="ERROR"), 1, "bug: ERROR", ["+out"], "clean"),
        (_case(code=0, writes=True), 0, "wrote out/fuzz.json", ["+out"], "clean"),
        (
            _case(code=table.RUNS_ON, writes=True, expect="s left"),
            None,
            "[1/9] (about 9 s left)",
            [],
            "clean",
        ),
        (_case(code=table.RUNS_ON, writes=True, expect="s left"), None, "", [], "late"),
    ],
)
def test_each_outcome_is_classified_where_it_belongs(case, code, output, inside, kind) -> None:
    assert table.classify(case, code, output, inside)[0] == kind


def test_a_refusal_much_slower_than_its_commands_median_is_late() -> None:
    outcomes = [table.Outcome(_case(), [], 2, s, "x", kind="clean") for s in (3.0, 3.5, 4.0, 30.0)]
    table.late_by_time(outcomes, late_after=15)
    assert [o.kind for o in outcomes] == ["clean", "clean", "clean", "late"]
    assert "median 3.8 s" in outcomes[-1].reason


def test_a_sample_of_the_table_runs_end_to_end(tmp_path: Path, capsys) -> None:
    """Two cheap cases through the script as a user runs it: both clean, JSON and Markdown written."""
    out = tmp_path / "out"
    only = ["--only", "fuzz --kernel nosuch", "--only", "replay nowhere.safetensors"]
    assert table.main([*only, "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    data = json.loads((out / "robustness.json").read_text())
    assert data["summary"]["cases"] == 2 and data["summary"]["counts"]["clean"] == 2, data
    assert data["summary"]["wrote_outside"] == 0
    row = next(r for r in data["cases"] if r["command"].startswith("flashprobe fuzz"))
    assert row["class"] == "clean" and "unknown kernel 'nosuch'" in row["message"], row
    assert "| **all** | **2** | **2** | **0** |" in (out / "robustness.md").read_text()
    assert "| **all** |" in capsys.readouterr().out
    # runs of parts of the table are joined into one table, one row per case
    part = tmp_path / "part.json"
    part.write_text(json.dumps({**data, "cases": data["cases"][:1]}))
    both = [str(part), str(out / "robustness.json")]
    assert table.main(["--merge", *both, "--out", str(tmp_path / "all")]) == 0
    joined = json.loads((tmp_path / "all" / "robustness.json").read_text())
    assert joined["cases"] == data["cases"] and joined["summary"]["counts"] == data["summary"]["counts"]
    wrong = {**data, "cases": [{**data["cases"][0], "index": 0}]}
    part.write_text(json.dumps(wrong))
    assert table.main(["--merge", str(part), "--out", str(tmp_path / "all")]) == 2
    assert "is 'flashprobe train" in capsys.readouterr().err


def test_time_a_command_spends_stopped_does_not_count_toward_its_limit(tmp_path: Path) -> None:
    """A quick refusal stopped for minutes by another job (SIGSTOP) hit the 120 s limit and was called
    late with no output (``train module.prediction=foo``); the limit now counts only running time."""
    stops_itself = (
        "import os, signal, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', "
        "f'import os, signal, time; time.sleep(3); os.kill({os.getpid()}, signal.SIGCONT)'])\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
        "print('refused', file=sys.stderr)\n"
        "sys.exit(2)\n"
    )
    ran = table.run_held([sys.executable, "-c", stops_itself], tmp_path, {}, timeout=2.0)
    assert (ran.returncode, ran.stderr.strip()) == (2, "refused"), ran
    assert 2.0 <= ran.held <= 4.5, ran
    hangs = table.run_held([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, {}, timeout=1.0)
    assert hangs.returncode is None and hangs.cpu is not None and hangs.cpu < 1.0, hangs
