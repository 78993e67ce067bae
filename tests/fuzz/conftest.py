"""Fixtures of the fuzz tests: kernels registered for one test only."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from flashprobe import register_kernel
from flashprobe.kernels import unregister_kernel


@pytest.fixture
def register() -> Iterator[Callable[..., str]]:
    """``register(name, fn, **options)``: register a kernel for one test (``options`` as
    :func:`~flashprobe.register_kernel` takes them, e.g. ``capabilities``), unregistered afterwards."""
    names: dict[str, None] = {}

    def add(name: str, fn: Callable[..., object], **options: object) -> str:
        register_kernel(name, fn, overwrite=True, **options)
        names[name] = None
        return name

    yield add
    for name in names:
        unregister_kernel(name)
