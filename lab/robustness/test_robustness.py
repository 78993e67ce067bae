"""The robustness table, run: every case of :mod:`lab.robustness.cases` as its own ``flashprobe`` process
in a directory of its own (HOME, TMPDIR and a sentinel directory of the table's), each one classified
(:data:`~lab.robustness.cases.CLASSES`) and asserted clean: the exit code expected (2 for bad input) and
a message holding the expected phrase, no traceback, nothing written before the refusal, nothing written
outside its directory, no escape sequence printed raw. The session ends with the count of cases per
class and command.

    python -m pytest lab/robustness            # the whole table (over an hour on a loaded 2-core CPU)
    python -m pytest lab/robustness -n 2 -k "resume"   # part of it

Not part of the CI run (``pyproject.toml``'s ``testpaths`` is ``tests``).
"""

from __future__ import annotations

import re

import pytest

from lab.robustness.cases import (
    GLOBAL_PLACEHOLDERS,
    RUNS_ON,
    SETUP_KINDS,
    Case,
    all_cases,
    classify,
)

CASES = all_cases()


def _id(index: int, case: Case) -> str:
    """``012-train-resume_run-trainer.max_steps_3``: the case's index and command, as pytest -k reads it."""
    words = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(case.args)).strip("_")[:80]
    return f"{index:03d}-{words or 'flashprobe'}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_id(i, c) for i, c in enumerate(CASES)])
def test_case(index: int, table, record_property) -> None:
    case = CASES[index]
    outcome = table.run(case, index)
    record_property("command", case.command)
    record_property("class", outcome.kind)
    if outcome.kind == "skipped":
        pytest.skip(outcome.reason)
    assert outcome.kind == "clean", outcome.explain()


def test_the_table_holds_the_tests_cases_and_the_issues_each_distinct() -> None:
    from tests.safety.test_bad_inputs import CASES as BAD_INPUTS

    assert len({c.key for c in CASES}) == len(CASES) >= 340
    args = {c.args for c in CASES}
    assert all(tuple(a) in args for a, _ in BAD_INPUTS)  # the safety tests' table, all of it
    sources = {c.source for c in CASES}
    for source in ("issue 42", "issue 53", "tests/safety/test_resume_is_data.py"):
        assert source in sources, source
    commands = {c.command for c in CASES}
    for command in ("train", "study", "compare", "report", "fuzz", "replay", "bench tiles", "bench fp8"):
        assert command in commands, command
    assert any("--from" in c.args for c in CASES)


def test_every_case_names_a_known_setup_and_only_placeholders_it_fills() -> None:
    for case in CASES:
        kind = case.setup.partition(":")[0]
        assert kind in SETUP_KINDS, case
        for text in (*case.args, *(v for _, v in case.env), case.cwd):
            for name in re.findall(r"\{(\w+)\}", text):
                assert name in SETUP_KINDS[kind] | GLOBAL_PLACEHOLDERS, (case, name)
        assert case.code in (0, 1, 2, 3, 4, RUNS_ON) and all(isinstance(a, str) for a in case.args)


def _case(**kw) -> Case:
    return Case(args=("fuzz", "--kernel", "nosuch"), **kw)


@pytest.mark.parametrize(
    ("case", "code", "output", "inside", "outside", "kind"),
    [
        (_case(expect="unknown kernel"), 2, "flashprobe fuzz: unknown kernel 'nosuch'", [], [], "clean"),
        (_case(), 1, "Traceback (most recent call last):\n  ...\nKeyError: 'x'", [], [], "traceback"),
        (_case(), 1, "Error executing job with overrides: []", [], [], "traceback"),
        (_case(), 0, "", [], [], "silent"),
        (_case(), 0, "ran every case", [], [], "silent"),
        (_case(), 2, "  \n", [], [], "silent"),
        (_case(), 2, "flashprobe fuzz: refused", ["+out"], [], "late"),
        (_case(), 2, "WeightSnapshot: saved step 0 to ...\nerror: x", [], [], "late"),
        (_case(), None, "", [], [], "late"),
        (_case(), 2, "flashprobe fuzz: refused", [], ["sentinel:~keep.txt"], "writes-outside"),
        (_case(expect="unknown kernel"), 1, "flashprobe fuzz: unknown kernel 'nosuch'", [], [], "mismatch"),
        (_case(expect="unknown kernel"), 2, "flashprobe fuzz: something else", [], [], "mismatch"),
        (_case(), 2, "flashprobe fuzz: bad \x1b[2J reason", [], [], "mismatch"),
        (_case(code=1, writes=True, expect="ERROR"), 1, "bug: ERROR", ["+out"], [], "clean"),
        (_case(code=0, writes=True), 0, "wrote out/fuzz.json", ["+out"], [], "clean"),
        (_case(code=RUNS_ON, writes=True, expect="s left"), None, "[1/9] (about 9 s left)", [], [], "clean"),
        (_case(code=RUNS_ON, writes=True, expect="s left"), None, "", [], [], "late"),
    ],
)
def test_each_outcome_is_classified_where_it_belongs(case, code, output, inside, outside, kind) -> None:
    assert classify(case, code, output, inside, outside)[0] == kind
