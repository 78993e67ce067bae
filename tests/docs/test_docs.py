"""Every Python block and every command of the docs runs, at a tiny budget (issue 15).

The pages are listed in :data:`DOCS`; adding a page there puts all of its snippets under test.
Python blocks run as written, each in a fresh temporary directory (after the page's file blocks,
such as ``mypkg/kernels.py``, are created there, as the page tells the reader to). Commands run
as written plus a tiny budget (:mod:`tests.docs._budget`); inputs they name (``runs/...``,
``RUN_DIR``) are real: made by the documented command that produces them, once per session
(:mod:`tests.docs._inputs`). A failure is named ``<page>:block<N>[.<command>]``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from ._budget import HYDRA_TINY, budget, family, outputs
from ._inputs import REPO, CommandResult, SharedRuns, run
from ._snippets import Snippet, extract

#: the Markdown pages whose snippets must run; a page added here is tested in full
DOCS = (
    "README.md",
    "docs/probe.md",
    "docs/integrations.md",
    "docs/calibration.md",
    "docs/fuzz.md",
    "docs/microbenchmark.md",
    "docs/microbenchmark-reference.md",
    "docs/weights.md",
    "docs/README.md",
    "docs/study.md",
    "docs/training.md",
    "conf/README.md",
)

#: budgets for documented scripts (``python SCRIPT ...``, ``python -m MODULE ...``): their own flags, appended
SCRIPT_BUDGETS: dict[str, tuple[str, ...]] = {
    "-m lab.recall": (
        *("--strategies", "random", "--budget", "1"),
        *("--mutants", "falsy_scale", "--kernels", "sdpa_math"),
    ),
    "-m lab.rules": (
        *("--seeds", "1", "--precision", "fp32"),
        *("--mutants", "one_batch_wrong", "--kernels", "sdpa_math"),
    ),
    "make_runs.py": ("--max-steps", "4"),
    "examples/probe_any_model.py": ("--steps", "1"),
    "examples/lightning_callbacks.py": (),
    "scripts/fuzz_rule_calibration.py": ("--calls", "2"),
    "-m pytest": ("-p", "no:cacheprovider", "-k", "version or kernels"),  # lab/robustness: 6 quick cases
}

#: the page whose file block and command make the ``runs/`` directories other snippets read
RUNS_DOC, RUNS_SCRIPT = "docs/weights.md", "make_runs.py"

SNIPPETS = [s for doc in DOCS for s in extract(REPO, doc)]
RUNNABLE = [s for s in SNIPPETS if s.kind != "file"]


def _files(doc: str) -> dict[str, str]:
    """The file blocks of a page (``mypkg/kernels.py``), path → text, as its reader creates them."""
    return {s.path: s.text for s in extract(REPO, doc) if s.kind == "file"}


def _inputs(doc: str) -> dict[str, str]:
    """What a command of the page finds in its directory: the repository's ``conf/`` and the page's files."""
    conf = sorted(p for p in (REPO / "conf").rglob("*") if p.is_file())
    return {**{str(p.relative_to(REPO)): p.read_text() for p in conf}, **_files(doc)}


def _argv(snippet: Snippet) -> list[str]:
    """The command as written plus its tiny budget."""
    argv = snippet.argv
    if argv[0] in ("python", "python3"):
        script = " ".join(argv[1:3]) if argv[1:2] == ["-m"] else argv[1] if len(argv) > 1 else ""
        if script not in SCRIPT_BUDGETS:
            raise KeyError(f"{snippet.id}: no budget for 'python {script}'; add it to SCRIPT_BUDGETS")
        return [*argv, *SCRIPT_BUDGETS[script]]
    extra = budget(argv)
    if family(argv) not in ("study", "train"):
        return [*argv, *extra]
    # Hydra commands: argparse flags of the budget (``--runs X``) go before the first Hydra override, which
    # argparse reads as its trailing positionals; the budget's overrides go last, so they win
    n_flags = next((i for i, a in enumerate(extra) if "=" in a and not a.startswith("-")), len(extra))
    first = next((i for i, a in enumerate(argv) if i > 1 and "=" in a and not a.startswith("-")), len(argv))
    return [*argv[:first], *extra[:n_flags], *argv[first:], *extra[n_flags:]]


def _missing_modules(code: str, local: dict[str, str]) -> list[str]:
    """Top-level modules the code imports that are neither installed nor one of the page's files."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    local_roots = {Path(p).parts[0].removesuffix(".py") for p in local}
    return sorted(n for n in names - local_roots if importlib.util.find_spec(n) is None)


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> SharedRuns:
    """Producing commands run once per session, shared by the xdist workers."""
    base = tmp_path_factory.getbasetemp()
    return SharedRuns((base.parent if worker_id != "master" else base) / "docs-inputs")


def _runs_command() -> Snippet:
    return next(s for s in extract(REPO, RUNS_DOC) if s.kind == "command" and RUNS_SCRIPT in s.argv[1:2])


def _make_runs(shared: SharedRuns) -> CommandResult:
    """``python make_runs.py`` of docs/weights.md at its tiny budget: runs/baseline, flash, ..."""
    return shared.run(_argv(_runs_command()), _files(RUNS_DOC))


def _train_run(shared: SharedRuns) -> CommandResult:
    """A finished tiny ``flashprobe train`` run in ``RUN_DIR`` of the result's directory."""
    return shared.run(["flashprobe", "train", "hydra.run.dir=RUN_DIR", *HYDRA_TINY])


def _prepare(snippet: Snippet, shared: SharedRuns, cwd: Path) -> str:
    """Create what the snippet needs in ``cwd``; returns its text with placeholders filled in."""
    shutil.copytree(REPO / "conf", cwd / "conf")  # the docs' commands run from the repository root
    for path, text in _files(snippet.doc).items():
        (cwd / path).parent.mkdir(parents=True, exist_ok=True)
        (cwd / path).write_text(text)
    text = snippet.text
    produces_runs = RUNS_SCRIPT in text or ".fit(" in text  # trains into runs/ itself
    if "runs/" in text and not produces_runs:
        made = _make_runs(shared)
        assert made.returncode == 0, made.explain()
        shutil.copytree(made.cwd / "runs", cwd / "runs")
    if "RUN_DIR" in text:
        made = _train_run(shared)
        assert made.returncode == 0, made.explain()
        shutil.copytree(made.cwd / "RUN_DIR", cwd / "RUN_DIR")
    return text


def _check_fuzz(result: CommandResult, argv: list[str]) -> None:
    """fuzz exits 1 exactly when a (kernel, case, dtype) failed or is not_declared outside its ledger,
    or a ledger entry passed unexpectedly (its documented CI contract)."""
    [json_path] = [p for p in outputs(argv) if p.endswith("fuzz.json")]
    payload = json.loads((result.cwd / json_path).read_text())
    summary = payload["summary"]
    failing = summary["fail"] or summary.get("not_declared") or payload.get("ledger", {}).get("unexpected")
    assert result.returncode == (1 if failing else 0), result.explain()


def _check_study(result: CommandResult, argv: list[str]) -> None:
    """study exits with the code of its answer (docs/study.md "The answer"): at the tiny budget's
    ``--runs flash,baseline`` that is UNDETERMINED (4), recomputed here from the study.json it wrote."""
    from flashprobe.formats.study_file import read_study
    from flashprobe.report.study_verdict import EXIT_CODES, UNDETERMINED, verdict

    [json_path] = [p for p in outputs(argv) if p.endswith("study.json")] or [
        "out/study/study.json"
    ]  # --out's default
    found = verdict(read_study(result.cwd / json_path))
    answer = found.answer if found else UNDETERMINED
    assert answer == UNDETERMINED and result.returncode == EXIT_CODES[answer], result.explain()


def _check_verdict(result: CommandResult, argv: list[str]) -> None:
    """compare and report (of a study or comparison directory) exit with the code of the verdict they
    print, as study does (docs/study.md "The answer"), recomputed here from the study.json there; report
    of a training run directory exits 0 for the PASS its last record gives, 1 for FAIL."""
    from flashprobe.formats.probe_log import load_probe_records
    from flashprobe.formats.study_file import read_study
    from flashprobe.report.study_verdict import EXIT_CODES, UNDETERMINED, verdict

    where = outputs(argv)[0].rpartition("/")[0] if family(argv) == "compare" else argv[2]
    if not (result.cwd / where / "study.json").is_file():
        last = list(load_probe_records(result.cwd / where / "probe.jsonl"))[-1]["summary"]["verdict"]
        code = {"pass": 0, "fail": 1}[last]
        assert family(argv) == "report" and result.returncode == code, result.explain()
        return
    found = verdict(read_study(result.cwd / where))
    assert result.returncode == EXIT_CODES[found.answer if found else UNDETERMINED], result.explain()


@pytest.mark.parametrize("snippet", RUNNABLE, ids=lambda s: s.id)
def test_documented_snippet_runs(snippet: Snippet, shared: SharedRuns, tmp_path: Path) -> None:
    text = _prepare(snippet, shared, tmp_path)
    if snippet.kind == "python":
        if missing := _missing_modules(text, _files(snippet.doc)):
            pytest.skip(f"{snippet.id} needs {', '.join(missing)} (not installed)")
        script = tmp_path / f"{Path(snippet.doc).stem}_block{snippet.block}.py"
        script.write_text(text)
        result = run(["python", script.name], tmp_path)
        assert result.returncode == 0, result.explain()
        return
    argv = _argv(snippet)
    if argv[0] in ("python", "python3") and RUNS_SCRIPT in argv[1:2]:
        result = _make_runs(shared)  # the same command the runs fixture ran: checked, not repeated
        assert result.returncode == 0, result.explain()
        made = sorted(p.parent.parent.name for p in result.cwd.glob("runs/*/snapshots/manifest.json"))
        assert made == ["baseline", "bf16", "flash", "identical", "seed"], result.explain()
        return
    if "runs/" in text or "RUN_DIR" in text:
        result = run(argv, tmp_path)
    else:  # one run of a command on the same files (README's study is docs/study.md's), checked on each page
        result = shared.run(argv, _inputs(snippet.doc))
    if family(argv) == "fuzz":
        _check_fuzz(result, argv)
    elif family(argv) == "study":
        _check_study(result, argv)
    elif family(argv) in ("compare", "report"):
        _check_verdict(result, argv)
    else:
        assert result.returncode == 0, result.explain()
    missing = [p for p in outputs(argv) if not (result.cwd / p).is_file()]
    assert not missing, f"{snippet.id} did not write {missing}\n{result.explain()}"


def test_every_file_block_is_used_on_its_page() -> None:
    """A file the page asks for (``# mypkg/kernels.py``) is imported or run by one of its snippets."""
    for snippet in (s for s in SNIPPETS if s.kind == "file"):
        module = snippet.path.removesuffix(".py").replace("/", ".")
        if snippet.path.endswith((".yaml", ".yml")):  # a Hydra option: conf/<group>/<name>.yaml
            group, name = Path(snippet.path).parent.name, Path(snippet.path).stem
            module = f"{group}={name}"
        users = [s for s in SNIPPETS if s.doc == snippet.doc and s.kind != "file"]
        assert any(module in s.text or snippet.path in s.text for s in users), snippet.id


def test_every_page_has_snippets_and_every_command_a_budget() -> None:
    """The extraction finds code on every listed page, and no command would run at full size."""
    for doc in DOCS:
        assert any(s.doc == doc for s in SNIPPETS), f"{doc}: no snippet found"
    for snippet in (s for s in SNIPPETS if s.kind == "command"):
        _argv(snippet)  # raises KeyError for a command family or script without a budget
