"""Run a command as a fresh ``python`` process would, forked from one that has already imported torch.

A documented or end-to-end command (``python -m flashprobe.cli train ...``, ``python snippet.py``) run
as a plain subprocess spends 3–9 CPU-seconds importing torch, Lightning, Hydra and W&B before it does
anything; the suite runs about a hundred of them. A *zygote* is a subprocess started once per test
worker with a clean interpreter state (not the test worker's: no pytest capture, logging or warning
hooks), which imports those libraries and then forks one child per command. The child sets up what
``python`` would — its argv, working directory, environment, ``sys.path[0]`` and standard streams —
runs the module or script as ``__main__``, exits as the interpreter does (threads joined, ``atexit``
handlers run) with the command's exit code. Nothing of one command reaches the next: each runs in its
own forked process, as a subprocess would.

What differs from a subprocess: the libraries were imported before the command's own environment was
set, so variables read at import time must match the zygote's; :func:`run` starts one zygote per
distinct set of :data:`IMPORT_VARS` and uses a plain subprocess for anything else it cannot fork
(other executables, ``python -c``, or ``FLASHPROBE_TESTS_NO_ZYGOTE=1`` in the environment to compare).

Run as a script, this file is the zygote's server loop (one JSON request per line on stdin).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["IMPORT_VARS", "run"]

#: environment variables libraries read when imported: a zygote serves only commands that agree on them
IMPORT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MPLBACKEND", "PYTHONPATH", "CUDA_VISIBLE_DEVICES")

#: what the zygote imports before it forks (what the commands under test import, heaviest first). Not
#: W&B: its import makes a media directory that its exit handler removes, so the first child to exit
#: would remove it for every later one.
PRELOAD = (
    "torch",
    "lightning.pytorch",
    "hydra",
    "omegaconf",
    "scipy.stats",
    "safetensors.torch",
    "matplotlib",
    "flashprobe.cli",
    "flashprobe.app.train",
    "flashprobe.app.study",
    "flashprobe.fuzz.cli",
    "flashprobe.report.cli",
    "flashprobe.t2i.module",
    "flashprobe.callbacks",
)


# --------------------------------------------------------------------------- the client (test side)


class _Zygote:
    """One zygote process and its request pipe."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=dict(env),
            bufsize=0,
        )
        self._received = b""  # what the zygote wrote after the last complete reply
        if self._reply(timeout=300).get("ready") is not True:
            raise RuntimeError("the test zygote did not start")

    def _reply(self, timeout: float) -> dict:
        """The zygote's next reply line. Read from the pipe's descriptor, unbuffered: a buffered reader
        can hold the pid and the exit code together, and ``select`` would then wait for a line it holds."""
        assert self.proc.stdout is not None
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + timeout
        while b"\n" not in self._received:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("the test zygote did not answer")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the test zygote exited (code {self.proc.wait()})")
            self._received += chunk
        line, _, self._received = self._received.partition(b"\n")
        return json.loads(line)

    def run(self, request: dict, timeout: float) -> int:
        """Fork a child for ``request``; its exit code, or ``TimeoutExpired`` once it ran past ``timeout``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        pid = self._reply(timeout=60)["pid"]
        try:
            return int(self._reply(timeout=timeout)["returncode"])
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._reply(timeout=60)
            raise subprocess.TimeoutExpired(request["argv"], timeout) from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(timeout=10)


_ZYGOTES: dict[tuple[str | None, ...], _Zygote] = {}
atexit.register(lambda: [z.close() for z in _ZYGOTES.values()])


def _forkable(cmd: Sequence[str]) -> bool:
    """``python -m MODULE ...`` or ``python SCRIPT ...`` with this interpreter."""
    if len(cmd) < 2 or cmd[0] != sys.executable or os.environ.get("FLASHPROBE_TESTS_NO_ZYGOTE"):
        return False
    return (cmd[1] == "-m" and len(cmd) > 2) or not cmd[1].startswith("-")


def run(
    cmd: Sequence[str],
    *,
    cwd: str | Path,
    env: Mapping[str, str],
    timeout: float,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` as ``subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)`` would.

    Args:
        cmd: ``[sys.executable, "-m", module, *args]`` or ``[sys.executable, script, *args]`` fork from a
            zygote; anything else runs as a plain subprocess.
        cwd: the working directory; env: the whole environment of the command.
        timeout: seconds before the command is killed (``subprocess.TimeoutExpired`` is raised).
        merge_stderr: put standard error into ``stdout`` (``stderr`` is then ``""``), in output order.

    Returns:
        The command's exit code and output, as a ``CompletedProcess``.
    """
    cwd = Path(cwd)
    if not _forkable(cmd):
        proc = subprocess.run(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            text=True,
            timeout=timeout,
            check=False,
        )
        return subprocess.CompletedProcess(list(cmd), proc.returncode, proc.stdout, proc.stderr or "")
    key = tuple(env.get(name) for name in IMPORT_VARS)
    if key not in _ZYGOTES:
        _ZYGOTES[key] = _Zygote({name: value for name, value in env.items() if not name.startswith("WANDB")})
    with tempfile.TemporaryDirectory(prefix="zygote-") as captured:
        stdout, stderr = Path(captured, "stdout"), Path(captured, "stderr")
        stdout.touch()  # read back even when the child dies before it opens them
        stderr.touch()
        request = {
            "argv": list(cmd[1:]),
            "cwd": str(cwd),
            "env": dict(env),
            "stdout": str(stdout),
            "stderr": str(stdout if merge_stderr else stderr),
        }
        code = _ZYGOTES[key].run(request, timeout)
        out, err = stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
    return subprocess.CompletedProcess(list(cmd), code, out, err)


# --------------------------------------------------------------------------- the zygote (server side)


def _exit_code(code: object) -> int:
    """The exit status ``python`` gives ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(request: dict) -> None:
    """In the forked child: become ``python ARGV`` in the request's directory and exit; never returns."""
    code = 1
    try:
        out, err = (os.open(request[name], os.O_WRONLY | os.O_APPEND) for name in ("stdout", "stderr"))
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own standard streams
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        import runpy

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # run_module replaces argv[0] with the module's file
            sys.modules.pop(argv[1], None)  # ``-m`` runs a fresh copy of a preloaded module, unwarned
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [argv[0], *argv[1:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        # what the interpreter does at exit: wait for the command's threads, run its atexit handlers
        try:
            import threading

            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve() -> None:
    """Import :data:`PRELOAD`, then fork a child per request line and report its pid and exit code."""
    sys.path.pop(0)  # this file's folder (tests/) is not on a command's path
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    reply = sys.stdout

    def send(**fields: object) -> None:
        reply.write(json.dumps(fields) + "\n")
        reply.flush()

    send(ready=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        send(pid=pid)
        _, status = os.waitpid(pid, 0)
        send(returncode=os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    _serve()
