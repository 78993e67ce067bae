"""A grid of generated images with their captions, saved as one PNG (``samples/step_XXXXXXX.png``)."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from flashprobe.formats.atomic import atomic_write

__all__ = ["sample_grid_figure", "save_sample_grid"]

_CELL_INCHES = 1.5
_LINE_INCHES = 0.13
_WRAP = 24


def _to_hwc(images: torch.Tensor | np.ndarray, value_range: tuple[float, float]) -> np.ndarray:
    """``(N, C, H, W)`` with C = 1 or 3 in ``value_range`` → ``(N, H, W, 3)`` float in [0, 1]."""
    array = images.detach().float().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if array.ndim != 4 or array.shape[1] not in (1, 3):
        raise ValueError(f"images must be (N, C, H, W) with C = 1 or 3, got shape {array.shape}")
    lo, hi = value_range
    if not hi > lo:
        raise ValueError(f"value_range must be (low, high) with high > low, got {value_range}")
    array = np.nan_to_num(array.astype(np.float32), nan=lo)  # non-finite pixels show as `lo`
    array = np.clip((array - lo) / (hi - lo), 0.0, 1.0).transpose(0, 2, 3, 1)
    return np.repeat(array, 3, axis=3) if array.shape[3] == 1 else array


def sample_grid_figure(
    images: torch.Tensor | np.ndarray,
    captions: Sequence[str],
    *,
    ncols: int | None = None,
    title: str | None = None,
    value_range: tuple[float, float] = (-1.0, 1.0),
) -> Figure:
    """Draw images in a grid, each with its caption wrapped underneath.

    Args:
        images: ``(N, C, H, W)``, C = 1 or 3, values in ``value_range`` (clipped).
        captions: ``N`` captions (empty strings allowed).
        ncols: images per row (default ``ceil(sqrt(N))``).
        title: drawn above the grid.
        value_range: the pixel values shown as black and as full intensity.

    Returns:
        A matplotlib :class:`~matplotlib.figure.Figure` (not attached to pyplot).

    Raises:
        ValueError: bad shapes, or the numbers of images and captions differ.
    """
    pixels = _to_hwc(images, value_range)
    n = pixels.shape[0]
    if len(captions) != n:
        raise ValueError(f"got {n} images but {len(captions)} captions; pass one caption per image")
    if n == 0:
        raise ValueError("no images to draw")
    ncols = max(1, min(ncols or math.ceil(math.sqrt(n)), n))
    nrows = math.ceil(n / ncols)
    wrapped = [textwrap.fill(c, _WRAP) for c in captions]
    lines = max(w.count("\n") + 1 for w in wrapped) if any(captions) else 0
    cell_h = _CELL_INCHES + lines * _LINE_INCHES + 0.1
    top = 0.35 if title else 0.05
    fig = Figure(figsize=(ncols * _CELL_INCHES, nrows * cell_h + top), dpi=100)
    for i in range(n):
        row, col = divmod(i, ncols)
        # axes rectangle in figure fractions: left, bottom, width, height
        width, height = 1 / ncols, _CELL_INCHES / (nrows * cell_h + top)
        bottom = 1 - (top + row * cell_h + _CELL_INCHES) / (nrows * cell_h + top)
        ax = fig.add_axes((col * width + 0.03 * width, bottom, 0.94 * width, height))
        ax.imshow(pixels[i], interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(wrapped[i], fontsize=6.5, labelpad=2, linespacing=1.0)
    if title:
        fig.suptitle(title, fontsize=9, y=1 - 0.12 / (nrows * cell_h + top))
    return fig


def save_sample_grid(
    images: torch.Tensor | np.ndarray,
    captions: Sequence[str],
    path: str | os.PathLike[str],
    *,
    ncols: int | None = None,
    title: str | None = None,
    value_range: tuple[float, float] = (-1.0, 1.0),
) -> Path:
    """Save :func:`sample_grid_figure` (same arguments) as a PNG at ``path``, atomically, creating
    parent folders; returns the path written."""
    fig = sample_grid_figure(images, captions, ncols=ncols, title=title, value_range=value_range)
    return atomic_write(path, lambda fh: fig.savefig(fh, format="png"), binary=True)
