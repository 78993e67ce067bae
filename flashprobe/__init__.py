"""flashprobe: is this attention kernel numerically safe to train with?

Four tools, following *Is Flash Attention Stable?* (Golden et al., 2024, arXiv 2405.02803):
a precision microbenchmark with a re-implementation of FlashAttention (:mod:`flashprobe.bench`),
a shadow probe that compares kernels at every attention call in training (:mod:`flashprobe.probe`),
weight-deviation bounds across runs (:mod:`flashprobe.weights`), and kernel edge-case fuzzing.
"""

from flashprobe.deviation import Deviation, deviation, error_ratio
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
from flashprobe.probe import ShadowAttention, use_kernel
from flashprobe.weights import SnapshotStore, compare_runs, max_abs_diff, wasserstein_distance

__version__ = "0.1.0"

__all__ = [
    "Deviation",
    "Kernel",
    "KernelCapabilities",
    "KernelInputError",
    "KernelSpecError",
    "KernelUnavailableError",
    "KernelUnsupportedError",
    "ShadowAttention",
    "SnapshotStore",
    "__version__",
    "available_kernels",
    "compare_runs",
    "deviation",
    "error_ratio",
    "get_kernel",
    "golden_attention",
    "math_attention",
    "max_abs_diff",
    "register_kernel",
    "tiled_attention",
    "use_kernel",
    "wasserstein_distance",
]
