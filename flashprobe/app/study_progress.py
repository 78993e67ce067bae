"""The study's console: a line when a run starts and when it finishes (time, ETA, probe verdict; the
per-site table for a probe that did not pass), read by polling each run's ``run.json``, so runs may
train in this process, in workers or as cluster jobs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from flashprobe.formats.run_record import read_run_record

__all__ = ["StudyProgress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3 min 05 s`` or ``1 h 02 min``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class StudyProgress:
    """Print the study's progress while its runs train (a context manager around the launch).

    Args:
        runs_dir: the study's ``runs`` directory (``runs/<name>/run.json``).
        runs: run name → a short description (e.g. ``"math, bf16-mixed, seed 1"``), in plan order.
        stream: where the lines go (default ``sys.stdout``).
        interval: seconds between two reads of the runs' ``run.json``.
    """

    def __init__(
        self, runs_dir: Path, runs: Mapping[str, str], stream: TextIO | None = None, interval: float = 1.0
    ) -> None:
        self.runs_dir, self.runs, self.interval = Path(runs_dir), dict(runs), interval
        self.stream = stream if stream is not None else sys.stdout
        self._started: set[str] = set()
        self._finished: dict[str, float] = {}  # run → seconds it trained in this invocation
        self._skipped: set[str] = set()
        self._ended: set[str] = set()  # runs that stopped or failed, reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flashprobe-study-progress", daemon=True)
        self._t0 = 0.0
        self._lock = threading.Lock()

    def _say(self, name: str, text: str) -> None:
        k, n = list(self.runs).index(name) + 1, len(self.runs)
        width = max(len(r) for r in self.runs)
        print(f"[{k}/{n}] {name:<{width}}  {text}", file=self.stream, flush=True)

    def _status(self, name: str) -> tuple[str | None, list[dict]]:
        record = read_run_record(self.runs_dir / name) or {}
        return record.get("status"), record.get("sessions", [])

    def __enter__(self) -> StudyProgress:
        self._t0 = time.perf_counter()
        for name in self.runs:
            status, _ = self._status(name)
            if status == "finished":
                self._skipped.add(name)
                self._say(name, "finished earlier: skipped")
        self._thread.start()
        return self

    def poll(self) -> None:
        """Read every unfinished run's ``run.json`` once and print what changed."""
        with self._lock:
            for name, what in self.runs.items():
                if name in self._skipped or name in self._finished:
                    continue
                status, sessions = self._status(name)
                if status in ("running", "finished") and sessions and name not in self._started:
                    # a short run can start and finish between two polls: it still gets its line
                    self._started.add(name)
                    resumed = sessions[-1].get("from_step")
                    self._say(name, f"training ({what}{f', resumed at step {resumed}' if resumed else ''})")
                if status == "finished" and sessions:
                    self._finished[name] = float(sessions[-1].get("seconds") or 0.0)
                    self._ended_line(name, f"done in {format_seconds(self._finished[name])}", self._clock())
                elif status in ("stopped", "failed") and name in self._started and name not in self._ended:
                    self._ended.add(name)  # its error is printed by the run; the probe's table here
                    self._ended_line(name, f"ended: {status}")

    def _ended_line(self, name: str, text: str, clock: str = "") -> None:
        """Say that run ``name`` ended, with its probe's verdict (and the verdict block when it failed)."""
        probe, block = self._probe(name)
        self._say(name, f"{text}{probe}{clock}")
        if block:
            print(block, file=self.stream, flush=True)

    def _probe(self, name: str) -> tuple[str, str]:
        """`` · probe PASS (...)`` for run ``name``'s line, and the verdict block when it did not pass;
        two empty strings without a probe."""
        from flashprobe.probing.session import verdict_block
        from flashprobe.report.study_report import probe_verdict

        found = probe_verdict(self.runs_dir / name)
        if found is None:
            return "", ""
        summary, rows = found
        answer = summary.verdict.upper()
        if answer != "PASS":
            path = self.runs_dir / name / "probe.jsonl"
            return f" · probe {answer} (below)", verdict_block(summary, rows, who=f"{name}: probe", path=path)
        ratios = [summary.max_limit_ratio, summary.max_backward_limit_ratio]
        worst = max((r for r in ratios if r is not None), default=None)
        at = "" if worst is None else f", worst error/limit {worst:.3g}"
        return f" · probe PASS ({summary.sites} sites{at})", ""

    def _clock(self) -> str:
        elapsed = time.perf_counter() - self._t0
        left = len(self.runs) - len(self._finished) - len(self._skipped)
        if left == 0:
            return f" · elapsed {format_seconds(elapsed)}"
        mean = sum(self._finished.values()) / len(self._finished)
        return f" · elapsed {format_seconds(elapsed)} · ETA {format_seconds(mean * left)}"

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        if exc[0] is None:
            trained, took = len(self._finished), format_seconds(time.perf_counter() - self._t0)
            print(
                f"trained {trained} run{'s' * (trained != 1)} in {took}"
                + (f" ({len(self._skipped)} finished earlier)" if self._skipped else ""),
                file=self.stream,
                flush=True,
            )
