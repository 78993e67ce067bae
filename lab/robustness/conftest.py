"""What the robustness table's cases share: a root with HOME, TMPDIR and a sentinel directory of its own
and the prepared runs, each case running in a directory of its own and checked for writes outside it;
and, at the end of a session, the count of cases in each class per command."""

from __future__ import annotations

import os
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lab.robustness.cases import (
    CLASSES,
    ROOT,
    RUNS_ON,
    Case,
    Prepared,
    SkipCaseError,
    _changes,
    _message,
    classify,
    fingerprint,
    flashprobe,
    flashprobe_until,
    setup,
)


@dataclass
class Outcome:
    """What one case did, and its class (:data:`~lab.robustness.cases.CLASSES`)."""

    case: Case
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    output: str = ""
    inside: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    kind: str = ""
    reason: str = ""

    def explain(self) -> str:
        """The command, its class and why, and the line of its output that matters, for the report."""
        command = " ".join(
            shlex.quote(a.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
            for a in ["flashprobe", *self.command]
        )
        tail = "\n".join(self.output.splitlines()[-15:])
        message = _message(self.output, self.case.expect)
        return (
            f"{self.kind}: {self.reason}\n$ {command}  (setup {self.case.setup}, exit {self.returncode}, "
            f"expected {self.case.code} with {self.case.expect!r})\n{message}\n--- last lines ---\n{tail}"
        )


class Table:
    """The environment every case shares: a root directory with HOME, TMPDIR, a sentinel directory and the
    prepared runs, all checked after each case for writes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home, self.tmp, self.sentinel = root / "home", root / "tmp", root / "sentinel"
        for d in (self.home, self.tmp, self.sentinel, root / "cases", root / "prepared", root / "caches"):
            d.mkdir(parents=True, exist_ok=True)
        (self.sentinel / "keep.txt").write_text("a file of the user's that nothing may touch\n")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_", "FLASHPROBE_"))},
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "HOME": str(self.home),
            "TMPDIR": str(self.tmp),
            "MPLCONFIGDIR": str(root / "caches" / "matplotlib"),
            "CI": "1",
        }
        self.prepared = Prepared(root / "prepared", self.env)

    def _watched(self) -> dict[str, dict[str, tuple]]:
        watched = {
            "HOME": self.home,
            "TMPDIR": self.tmp,
            "sentinel": self.sentinel,
            "prepared": self.root / "prepared",
        }
        return {name: fingerprint(d) for name, d in watched.items()}

    def run(self, case: Case, index: int) -> Outcome:
        """Set up the case's directory, run its command, and classify what it did."""
        d = self.root / "cases" / f"{index:03d}"
        d.mkdir(parents=True)
        try:
            with setup(case.setup, d, self.prepared, self.sentinel) as values:
                values = {"home": str(self.home), "case": str(d), "sentinel": str(self.sentinel), **values}
                args = [_fill_in(a, values) for a in case.args]
                env = {**self.env, **{k: _fill_in(v, values) for k, v in case.env}}
                cwd = Path(_fill_in(case.cwd, values)) if case.cwd else d
                inside, outside = fingerprint(d), self._watched()
                start = time.monotonic()
                ran = (flashprobe_until if case.code == RUNS_ON else flashprobe)(args, cwd, env, case.timeout)
                outcome = Outcome(case, args, ran.returncode, time.monotonic() - start, ran.output)
                outcome.inside = _changes(inside, fingerprint(d))
                after = self._watched()
                outcome.outside = [f"{n}:{c}" for n in outside for c in _changes(outside[n], after[n])]
        except SkipCaseError as skip:
            return Outcome(case, list(case.args), kind="skipped", reason=str(skip))
        outcome.kind, outcome.reason = classify(
            case, ran.returncode, ran.output, outcome.inside, outcome.outside
        )
        return outcome


def _fill_in(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return text


@pytest.fixture(scope="session")
def table(tmp_path_factory: pytest.TempPathFactory) -> Table:
    """The table's root (one per test worker: each prepares its own runs). A first command starts the
    process the cases fork from (what importing torch leaves in TMPDIR is not a case's doing)."""
    table = Table(tmp_path_factory.mktemp("robustness").resolve())
    flashprobe(["--version"], table.root, table.env, 600)
    return table


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The count of cases in each class, per command and in all (a case's class is a property of its
    report, so the counts are the whole run's, with or without workers)."""
    kinds: Counter[tuple[str, str]] = Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            props = dict(getattr(report, "user_properties", []) or [])
            if getattr(report, "when", "") == "call" and "class" in props:
                kinds[(props["command"], props["class"])] += 1
    if not kinds:
        return
    columns = [*CLASSES, "skipped"]
    commands = sorted({c for c, _ in kinds})
    terminalreporter.write_sep("-", "robustness table: cases per class")
    terminalreporter.write_line("| command | cases | " + " | ".join(columns) + " |")
    terminalreporter.write_line("|---|---:|" + "---:|" * len(columns))
    for command in [*commands, "all"]:
        row = [
            sum(n for (c, k), n in kinds.items() if k == kind and command in (c, "all")) for kind in columns
        ]
        terminalreporter.write_line(f"| {command} | {sum(row)} | " + " | ".join(map(str, row)) + " |")
