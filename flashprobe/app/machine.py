"""The facts a bit-for-bit CPU result depends on (torch build, threads, CPU, determinism settings),
recorded beside it in ``run.json``, ``study.json`` and the bench results.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["cpu_model", "machine_facts"]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_facts() -> dict[str, Any]:
    """Versions, CPU, threads, device and determinism settings of this process.

    Returns:
        ``torch``, ``python``, ``platform``, ``cpu``, ``cpu_count``, ``torch_threads``,
        ``cpu_capability`` (the vector ISA torch dispatches to, e.g. ``AVX512``), ``cuda`` (device
        name or None), ``deterministic_algorithms`` and ``float32_matmul_precision``.
    """
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: None)()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": capability,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
