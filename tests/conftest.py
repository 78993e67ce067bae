"""Shared fixtures: random attention inputs from a private generator; a clean kernel registry per test."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import pytest
import torch

from flashprobe.kernels import KernelSpecError, available_kernels, unregister_kernel

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(autouse=True, scope="session")
def _no_kernel_registered_by_an_imported_module() -> None:
    """Every test starts from the built-in registry, as a fresh process does: the kernels a module
    registered when the test modules were imported (``lab.mutants`` registers the mutation suite, for
    ``--import lab.mutants``) are removed before the first test; tests register what they use."""
    for name in available_kernels():
        with contextlib.suppress(KernelSpecError):  # a built-in kernel stays
            unregister_kernel(name)


@pytest.fixture(autouse=True)
def _kernels_registered_by_a_test_stay_in_it() -> Iterator[None]:
    """Unregister every kernel a test registered, so no later test sees it (the registry is global)."""
    before = set(available_kernels())
    yield
    for name in set(available_kernels()) - before:
        unregister_kernel(name)


@pytest.fixture(autouse=True)
def _no_root_log_handler_outlives_its_test() -> Iterator[None]:
    """Remove the root logger's handlers a test's in-process command added (Hydra's job logging, a study's
    console): they write to the test's captured streams, which are closed once it ends, so a later test
    in the worker printed ``--- Logging error ---`` on its first warning. pytest's own handlers stay."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def make_qkv() -> Callable[..., QKV]:
    """Factory ``make_qkv(n_q, n_k, d, d_v=None, *, b=1, h=2, dtype=fp32, seed=0) -> (q, k, v)``.

    Returns ``q (b, h, n_q, d)``, ``k (b, h, n_k, d)``, ``v (b, h, n_k, d_v)``, standard normal.
    """

    def make(
        n_q: int,
        n_k: int,
        d: int,
        d_v: int | None = None,
        *,
        b: int = 1,
        h: int = 2,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> QKV:
        gen = torch.Generator().manual_seed(seed)
        shapes = ((b, h, n_q, d), (b, h, n_k, d), (b, h, n_k, d_v or d))
        return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)  # type: ignore[return-value]

    return make
