"""Building blocks of the case generators: seeded float64 tensors and masks.

Generators build every tensor in float64 and cast it to the dtype under test at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

F64 = torch.float64


def rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Uniform ``[0, 1)`` float64 of ``shape``."""
    return torch.rand(*shape, generator=gen, dtype=F64)


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Standard normal float64 of ``shape``."""
    return torch.randn(*shape, generator=gen, dtype=F64)


def uniform(gen: torch.Generator, lo: float, hi: float, *shape: int) -> torch.Tensor:
    """Uniform ``[lo, hi)`` float64 of ``shape``."""
    return lo + (hi - lo) * rand(gen, *shape)


def finfo_max(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype``."""
    return float(torch.finfo(dtype).max)


def padding_mask(lengths: Iterable[int], n_k: int) -> torch.Tensor:
    """``(B, 1, 1, N_k)`` boolean key-padding mask keeping the first ``length`` keys of each batch."""
    lengths = torch.tensor(list(lengths))
    return (torch.arange(n_k) < lengths[:, None]).view(len(lengths), 1, 1, n_k)


def additive_mask(keep: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float mask: ``bias`` where ``keep``, ``-inf`` elsewhere, in ``dtype`` (shape of ``keep``)."""
    return torch.where(keep, bias, float("-inf")).to(dtype)
