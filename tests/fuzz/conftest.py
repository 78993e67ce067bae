"""Fixtures of the fuzz tests: kernels registered for one test only."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from flashprobe import register_kernel
from flashprobe.kernels import unregister_kernel


@pytest.fixture
def register() -> Iterator[Callable[..., str]]:
    """``register(name, fn)``: register a kernel for one test, unregistered afterwards."""
    names: dict[str, None] = {}

    def add(name: str, fn: Callable[..., object]) -> str:
        register_kernel(name, fn, overwrite=True)
        names[name] = None
        return name

    yield add
    for name in names:
        unregister_kernel(name)
