"""Probe tests: one intra-op thread and no probe or route left attached (:mod:`tests._probe_guard`)."""

from __future__ import annotations

from tests._probe_guard import _one_thread_and_no_leaks  # noqa: F401 (an autouse fixture)
