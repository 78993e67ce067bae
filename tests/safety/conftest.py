"""The safety tests' fixtures: ``flashprobe`` called in this process, as the console script calls it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from flashprobe.cli import main


class _Result:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """``flashprobe ARGS`` in this process (the same entry point as the console script), in ``cwd``."""

    def run(*args: str, cwd: Path) -> _Result:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 2
        finally:  # a command may point the root logger at this test's captured streams: undo it
            root.handlers[:], root.level = handlers, level
        out, err = capsys.readouterr()
        return _Result(code, out, err)

    return run
