"""flashprobe: is this attention kernel numerically safe to train with?

Four tools, following *Is Flash Attention Stable?* (Golden et al., 2024, arXiv 2405.02803):
a precision microbenchmark with a re-implementation of FlashAttention (:mod:`flashprobe.bench`),
a shadow probe that compares kernels at every attention call in training (:mod:`flashprobe.probing`),
weight-deviation bounds across runs (:mod:`flashprobe.weights`), and kernel edge-case fuzzing.

The library's five entry points are ``from flashprobe import probe, ProbeConfig, check_kernel,
save_snapshot, compare_runs``. Every name here is a function or a class, never a module:
``flashprobe.probe`` is the :func:`~flashprobe.probing.probe` context manager (the probe's package is
:mod:`flashprobe.probing`; its old path ``flashprobe.probe.*`` still imports for one release, with a
``DeprecationWarning``), and ``flashprobe.deviation`` is the module of the deviation statistics (its
function is ``flashprobe.deviation.deviation``).

The public names below are imported on first use, so ``import flashprobe.kernels`` (and commands
such as ``flashprobe kernels``) do not pay for the probe's import of ``torch._dynamo``.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from flashprobe import _renamed

if TYPE_CHECKING:
    from flashprobe.deviation import Deviation, error_ratio
    from flashprobe.fuzz.check import KernelCheck, check_kernel
    from flashprobe.kernels import (
        Kernel,
        KernelCapabilities,
        KernelInputError,
        KernelSpecError,
        KernelUnavailableError,
        KernelUnsupportedError,
        available_kernels,
        get_kernel,
        golden_attention,
        math_attention,
        register_kernel,
        tiled_attention,
    )
    from flashprobe.probing import ProbeConfig, ShadowAttention, probe, use_kernel
    from flashprobe.weights import (
        SnapshotStore,
        compare_runs,
        max_abs_diff,
        save_snapshot,
        wasserstein_distance,
    )

__version__ = "0.1.0"

#: public name → the module that defines it
_PUBLIC: dict[str, str] = {
    **dict.fromkeys(("Deviation", "error_ratio"), "flashprobe.deviation"),
    **dict.fromkeys(
        (
            "Kernel",
            "KernelCapabilities",
            "KernelInputError",
            "KernelSpecError",
            "KernelUnavailableError",
            "KernelUnsupportedError",
            "available_kernels",
            "get_kernel",
            "golden_attention",
            "math_attention",
            "register_kernel",
            "tiled_attention",
        ),
        "flashprobe.kernels",
    ),
    **dict.fromkeys(("KernelCheck", "check_kernel"), "flashprobe.fuzz.check"),
    **dict.fromkeys(("ProbeConfig", "ShadowAttention", "probe", "use_kernel"), "flashprobe.probing"),
    **dict.fromkeys(
        ("SnapshotStore", "compare_runs", "max_abs_diff", "save_snapshot", "wasserstein_distance"),
        "flashprobe.weights",
    ),
}


#: submodules that ``flashprobe.<name>`` imports on first use, as a public name is
_MODULES = ("deviation",)


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _PUBLIC:
        raise AttributeError(f"module 'flashprobe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_MODULES})


_renamed.install(sys.modules[__name__])


__all__ = [
    "Deviation",
    "Kernel",
    "KernelCapabilities",
    "KernelCheck",
    "KernelInputError",
    "KernelSpecError",
    "KernelUnavailableError",
    "KernelUnsupportedError",
    "ProbeConfig",
    "ShadowAttention",
    "SnapshotStore",
    "__version__",
    "available_kernels",
    "check_kernel",
    "compare_runs",
    "error_ratio",
    "get_kernel",
    "golden_attention",
    "math_attention",
    "max_abs_diff",
    "probe",
    "register_kernel",
    "save_snapshot",
    "tiled_attention",
    "use_kernel",
    "wasserstein_distance",
]
