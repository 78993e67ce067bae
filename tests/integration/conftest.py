"""Integration tests against third-party model classes (the ``integration`` extra): small random-init
configs, no downloads (``HF_HUB_OFFLINE=1``), one intra-op thread and no probe left attached
(:mod:`tests._probe_guard`)."""

from __future__ import annotations

import os

from tests._probe_guard import _one_thread_and_no_leaks  # noqa: F401 (an autouse fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
