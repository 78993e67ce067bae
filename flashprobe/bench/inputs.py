"""The inputs of a microbenchmark: their shape, how they are drawn, and their dtype.

:func:`make_inputs` draws ``q, k, v`` in float64 from a seed, so every precision sees the same
values once :func:`cast_inputs` has cast them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashprobe.bench.errors import BenchArgumentError

__all__ = ["DISTRIBUTIONS", "InputConfig", "Shape", "cast_inputs", "make_inputs"]

#: Input distributions accepted by ``--distribution``.
DISTRIBUTIONS = ("normal", "uniform", "outliers")


@dataclass(frozen=True, kw_only=True)
class Shape:
    """Shape of the attention inputs: ``q, k, v`` are ``(batch, heads, seq_len, head_dim)``."""

    batch: int
    """B, the batch size."""
    heads: int
    """H, the number of heads."""
    seq_len: int
    """N, the sequence length (queries and keys)."""
    head_dim: int
    """D, the head dimension."""

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_len", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise BenchArgumentError(f"{name} must be a positive integer ({flag}), got {value!r}")

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """``(B, H, N, D)``."""
        return (self.batch, self.heads, self.seq_len, self.head_dim)

    def as_dict(self) -> dict[str, int]:
        """``{"batch", "heads", "seq_len", "head_dim"}``, the shape's entries of a result row."""
        return {"batch": self.batch, "heads": self.heads, "seq_len": self.seq_len, "head_dim": self.head_dim}


@dataclass(frozen=True, kw_only=True)
class InputConfig:
    """How ``q, k, v`` are drawn (see :func:`make_inputs`)."""

    distribution: str = "normal"
    """``normal`` (N(0, 1)), ``uniform`` (U(−√3, √3), unit variance) or ``outliers`` (normal with
    a fraction ``outlier_frac`` of entries multiplied by ``outlier_scale``)."""
    scale: float = 1.0
    """Every entry is multiplied by this; larger values give larger logits (peakier softmax)."""
    outlier_frac: float = 0.001
    """Fraction of entries turned into outliers (``outliers`` only)."""
    outlier_scale: float = 30.0
    """Factor applied to outlier entries (``outliers`` only)."""

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise BenchArgumentError(
                f"unknown input distribution {self.distribution!r}; use one of: {', '.join(DISTRIBUTIONS)}"
            )
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise BenchArgumentError(f"input scale must be a finite positive number, got {self.scale}")
        if not 0.0 <= self.outlier_frac <= 1.0:
            raise BenchArgumentError(f"outlier fraction must lie in [0, 1], got {self.outlier_frac}")
        if not math.isfinite(self.outlier_scale):
            raise BenchArgumentError(f"outlier scale must be finite, got {self.outlier_scale}")

    def as_dict(self) -> dict[str, Any]:
        """The distribution's entries of a result row (outlier settings only for ``outliers``)."""
        out: dict[str, Any] = {"distribution": self.distribution, "input_scale": self.scale}
        if self.distribution == "outliers":
            out |= {"outlier_frac": self.outlier_frac, "outlier_scale": self.outlier_scale}
        return out


def _draw(shape: tuple[int, ...], config: InputConfig, gen: torch.Generator) -> torch.Tensor:
    if config.distribution == "uniform":
        x = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * math.sqrt(3.0)
    else:
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        if config.distribution == "outliers":
            outlier = torch.rand(shape, generator=gen, dtype=torch.float64) < config.outlier_frac
            x = torch.where(outlier, x * config.outlier_scale, x)
    return x * config.scale


def make_inputs(
    shape: Shape, seed: int, config: InputConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw ``q, k, v``, each ``(B, H, N, D)`` float64 on the CPU, in that order from one generator
    seeded with ``seed``, from ``config`` (default: standard normal)."""
    config = config or InputConfig()
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (_draw(shape.dims, config, gen) for _ in range(3))  # drawn in this order
    return q, k, v


def cast_inputs(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """Cast float64 inputs (any shape, e.g. ``(B, H, N, D)``) to ``dtype`` on ``device``."""
    return tuple(t.to(device=device, dtype=dtype) for t in tensors)
