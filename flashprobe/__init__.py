"""flashprobe: is this attention kernel numerically safe to train with?

Following *Is Flash Attention Stable?* (Golden et al., 2024, arXiv 2405.02803), flashprobe compares
an attention kernel with plain attention in the same dtype and with its float64 value, and gives a
verdict. ``__all__`` lists the names of its tasks:

* probe a model in training: ``with probe(model) as p: ...; p.summary()`` (:func:`probe`,
  :class:`ProbeConfig`; :class:`ShadowAttention` in place of SDPA; :func:`use_kernel` to route a
  model's attention to a kernel without statistics);
* check a kernel on adversarial cases: :func:`check_kernel` (:class:`KernelCheck`), as ``flashprobe
  fuzz`` does;
* bring a kernel: :func:`register_kernel` with its :class:`KernelCapabilities`, :func:`get_kernel`,
  :func:`available_kernels`, the references :func:`math_attention` and :func:`golden_attention`, and
  the errors a kernel raises or is refused with;
* catch flashprobe's errors: every one derives from :class:`FlashprobeError` (and keeps its built-in
  class: a bad kernel spec is also a ``ValueError``);
* compare the weights of runs: :func:`save_snapshot`, :class:`SnapshotStore`, :func:`compare_runs`.

The names are imported on first use, so ``import flashprobe.kernels`` (and ``flashprobe --help``)
do not pay for the probe's and the fuzzer's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashprobe.deviation import Deviation, error_ratio
    from flashprobe.errors import FlashprobeError
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

#: public name → the module that defines it (imported on first use)
_PUBLIC: dict[str, str] = {
    **dict.fromkeys(("ProbeConfig", "ShadowAttention", "probe", "use_kernel"), "flashprobe.probing"),
    **dict.fromkeys(("KernelCheck", "check_kernel"), "flashprobe.fuzz.check"),
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
    **dict.fromkeys(
        ("SnapshotStore", "compare_runs", "max_abs_diff", "save_snapshot", "wasserstein_distance"),
        "flashprobe.weights",
    ),
    **dict.fromkeys(("Deviation", "error_ratio"), "flashprobe.deviation"),
    "FlashprobeError": "flashprobe.errors",
}


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'flashprobe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


__all__ = [  # noqa: RUF022  (grouped by task, not sorted)
    # probe a model in training
    "ProbeConfig",
    "ShadowAttention",
    "probe",
    "use_kernel",
    # check a kernel on adversarial cases
    "KernelCheck",
    "check_kernel",
    # bring a kernel
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
    # compare the weights of runs
    "SnapshotStore",
    "compare_runs",
    "max_abs_diff",
    "save_snapshot",
    "wasserstein_distance",
    # the deviation statistics
    "Deviation",
    "error_ratio",
    # every error flashprobe raises on purpose derives from it
    "FlashprobeError",
    "__version__",
]
