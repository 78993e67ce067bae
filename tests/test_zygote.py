"""The test zygote runs a command as a fresh ``python`` process does: checked against a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _zygote as zygote
from tests.docs._inputs import ENV, REPO

#: a script that shows what a process sees and does at exit; ``python SCRIPT CODE``
SCRIPT = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.2)
    print("thread finished", flush=True)
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "var", os.environ.get("ZYGOTE_VAR"))
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("to stderr", file=sys.stderr)
print("torch threads", __import__("torch").get_num_threads())
threading.Thread(target=late).start()
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", ["0", "3", "raise"])
def test_a_forked_command_behaves_as_a_subprocess(tmp_path: Path, code: str) -> None:
    (tmp_path / "work").mkdir()
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO), "ZYGOTE_VAR": code}
    cmd = [sys.executable, str(script), code]
    forked = zygote.run(cmd, cwd=tmp_path / "work", env=env, timeout=120)
    plain = subprocess.run(cmd, cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout) == (plain.returncode, plain.stdout)
    assert forked.returncode == {"0": 0, "3": 3, "raise": 1}[code]
    assert f"argv ['{code}'] cwd work var {code}" in forked.stdout
    assert "path0 True" in forked.stdout and "torch threads 1" in forked.stdout
    assert forked.stdout.rstrip().splitlines()[-2:] == ["thread finished", "atexit ran"]
    assert forked.stderr.startswith("to stderr")
    assert ("ValueError: boom" in forked.stderr) == (code == "raise")


def test_a_module_runs_as_main_and_a_timeout_kills_it(tmp_path: Path) -> None:
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO)}
    done = zygote.run([sys.executable, "-m", "flashprobe.cli", "--help"], cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0 and "usage: flashprobe COMMAND" in done.stdout, done
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, "sleep.py"], cwd=tmp_path, env=env, timeout=1)
    again = zygote.run([sys.executable, "-m", "flashprobe.cli", "--help"], cwd=tmp_path, env=env, timeout=120)
    assert again.returncode == 0, again  # the zygote serves the next command after a killed one
