"""Real inputs for documented snippets, made once per test session and shared by xdist workers.

Docs refer to things an earlier step made: ``runs/flash`` (the run directories ``make_runs.py``
of docs/weights.md trains), ``RUN_DIR`` (a ``flashprobe train`` run directory), ``mypkg/kernels.py``
(a file the page tells the reader to create). :class:`SharedRuns` runs such producing commands
once, under a file lock in a directory all xdist workers share, and hands out copies.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from tests import _zygote as zygote

__all__ = ["ENV", "CommandResult", "SharedRuns", "run"]

REPO = Path(__file__).resolve().parents[2]

#: the environment of every documented snippet: offline W&B, no display, one thread per process
ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "MPLBACKEND": "Agg",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
TIMEOUT_S = 300


@dataclass(frozen=True)
class CommandResult:
    """What one command did: its argv, exit code, combined output and working directory."""

    argv: list[str]
    returncode: int
    output: str
    cwd: Path

    def explain(self) -> str:
        """The command, its exit code and its last output lines, for an assertion message."""
        tail = "\n".join(self.output.splitlines()[-40:])
        return f"$ {' '.join(self.argv)}  (in {self.cwd})\nexit {self.returncode}\n{tail}"


def executable(argv: Sequence[str]) -> list[str]:
    """``flashprobe ...`` and ``python ...`` as this interpreter runs them."""
    if argv[0] == "flashprobe":
        return [sys.executable, "-m", "flashprobe.cli", *argv[1:]]
    if argv[0] in ("python", "python3"):
        if argv[1:3] == ["-m", "pytest"]:  # the repository's own suites (lab/...): their paths in it
            paths = [str(REPO / a) if not a.startswith("-") and (REPO / a).exists() else a for a in argv[3:]]
            return [sys.executable, "-m", "pytest", *paths]
        script = argv[1:2]
        if script and not Path(script[0]).is_absolute() and (REPO / script[0]).is_file():
            script = [str(REPO / script[0])]  # a script of the repository (examples/...)
        return [sys.executable, *script, *argv[2:]]
    return list(argv)


def run(argv: Sequence[str], cwd: Path) -> CommandResult:
    """Run a documented command in ``cwd`` with :data:`ENV`, as a new process (forked from a zygote that
    has imported torch and Lightning: :mod:`tests._zygote`); never raises on a non-zero exit."""
    env = {**os.environ, **ENV}
    # as a reader's shell: the package and the cwd, nothing of the test's own path; the package is
    # this checkout's (a worktree's venv may have another checkout installed)
    env["PYTHONPATH"] = str(REPO)
    proc = zygote.run(executable(argv), cwd=cwd, env=env, timeout=TIMEOUT_S, merge_stderr=True)
    return CommandResult(list(argv), proc.returncode, proc.stdout, cwd)


class SharedRuns:
    """Commands run once per session in a directory every xdist worker sees; results cached.

    Args:
        root: the shared directory (``tmp_path_factory.getbasetemp().parent`` under xdist).
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def run(self, argv: Sequence[str], files: dict[str, str] | None = None) -> CommandResult:
        """Run ``argv`` in a fresh directory holding ``files`` (path → text), or reuse that run."""
        files = dict(files or {})
        key = hashlib.sha256(json.dumps([list(argv), sorted(files.items())]).encode()).hexdigest()[:16]
        cwd = self.root / key
        record = self.root / f"{key}.json"
        with FileLock(str(self.root / f"{key}.lock")):
            if record.is_file():
                data = json.loads(record.read_text())
                return CommandResult(data["argv"], data["returncode"], data["output"], cwd)
            shutil.rmtree(cwd, ignore_errors=True)
            cwd.mkdir()
            for path, text in files.items():
                (cwd / path).parent.mkdir(parents=True, exist_ok=True)
                (cwd / path).write_text(text)
            result = run(argv, cwd)
            fields = {"argv": result.argv, "returncode": result.returncode, "output": result.output}
            record.write_text(json.dumps(fields))
            return result
