"""Does an image show what its caption says? A pixel-level check for generated shapes.

Each pixel takes the nearest of :data:`~flashprobe.t2i.data.COLOURS` (none when far from all). The
most common is the **background**, the most common other (covering ``min_fraction``) the
**foreground**, whose centroid snapped to :data:`~flashprobe.t2i.data.POSITIONS` is the **position**.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from flashprobe.t2i.data import COLOURS, POSITIONS, parse_caption

__all__ = ["CaptionAgreement", "ImageReading", "caption_agreement", "read_images"]

_NAMES = list(COLOURS)
_PALETTE = torch.tensor([COLOURS[c] for c in _NAMES])  # (K, 3) in [0, 1]
_ANCHORS = torch.tensor([POSITIONS[p] for p in POSITIONS])  # (P, 2) as (x, y)


@dataclass(frozen=True)
class ImageReading:
    """What the pixel classifier sees in one image (``None`` where it finds nothing)."""

    background: str | None
    colour: str | None
    position: str | None


@dataclass(frozen=True)
class CaptionAgreement:
    """Fractions of images whose reading matches their caption.

    Attributes:
        colour: the foreground colour is the captioned shape colour.
        background: the background colour is the captioned one.
        position: the foreground sits at the captioned position.
        all: all three match.
        count: number of images.
    """

    colour: float
    background: float
    position: float
    all: float
    count: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _readings(
    images: torch.Tensor, max_distance: float, min_fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices of background, foreground and position, each ``(N,)``, −1 where none is found."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (N, 3, H, W) in [-1, 1], got shape {tuple(images.shape)}")
    h, w = images.shape[2:]
    rgb = (images.detach().float().cpu().clamp(-1, 1) + 1) / 2  # (N, 3, H, W) in [0, 1]
    rgb = torch.nan_to_num(rgb, nan=-1.0)  # NaN pixels match no colour
    dist = (rgb[:, None] - _PALETTE[None, :, :, None, None]).norm(dim=2)  # (N, K, H, W)
    nearest, label = dist.min(dim=1)  # (N, H, W)
    label = torch.where(nearest <= max_distance, label, -1)
    counts = torch.stack([(label == k).sum(dim=(1, 2)) for k in range(len(_NAMES))], dim=1)  # (N, K)
    bg_count, background = counts.max(dim=1)
    others = counts.scatter(1, background[:, None], -1)
    fg_count, foreground = others.max(dim=1)
    found = fg_count >= max(1.0, min_fraction * h * w)
    foreground = torch.where(found, foreground, -1)
    mask = (label == foreground[:, None, None]) & found[:, None, None]  # (N, H, W)
    ys = (torch.arange(h, dtype=torch.float32) + 0.5) / h
    xs = (torch.arange(w, dtype=torch.float32) + 0.5) / w
    total = mask.sum(dim=(1, 2)).clamp(min=1)
    cx = (mask * xs[None, None, :]).sum(dim=(1, 2)) / total
    cy = (mask * ys[None, :, None]).sum(dim=(1, 2)) / total
    centroid = torch.stack([cx, cy], dim=1)  # (N, 2)
    position = torch.cdist(centroid, _ANCHORS).argmin(dim=1)
    position = torch.where(found, position, -1)
    background = torch.where(bg_count > 0, background, -1)  # no pixel near any palette colour
    return background, foreground, position


def read_images(
    images: torch.Tensor, *, max_distance: float = 0.3, min_fraction: float = 0.01
) -> list[ImageReading]:
    """Read background colour, foreground colour and foreground position from each image.

    Args:
        images: ``(N, 3, H, W)`` in ``[-1, 1]``.
        max_distance: a pixel farther than this (RGB in [0, 1], Euclidean) from every palette
            colour is left unclassified.
        min_fraction: the least share of the image the foreground must cover to count.

    Returns:
        ``N`` :class:`ImageReading`.
    """
    bg, fg, pos = _readings(images, max_distance, min_fraction)
    positions = list(POSITIONS)
    return [
        ImageReading(
            _NAMES[b] if b >= 0 else None, _NAMES[f] if f >= 0 else None, positions[p] if p >= 0 else None
        )
        for b, f, p in zip(bg.tolist(), fg.tolist(), pos.tolist(), strict=True)
    ]


def caption_agreement(
    images: torch.Tensor, captions: Sequence[str], *, max_distance: float = 0.3, min_fraction: float = 0.01
) -> CaptionAgreement:
    """How often the images show the captioned colour, background and position.

    Args:
        images: ``(N, 3, H, W)`` in ``[-1, 1]``.
        captions: ``N`` captions in the dataset's template.
        max_distance, min_fraction: see :func:`read_images`.

    Raises:
        ValueError: the counts differ, or a caption does not follow the template.
    """
    if len(captions) != images.shape[0]:
        raise ValueError(f"got {images.shape[0]} images but {len(captions)} captions")
    readings = read_images(images, max_distance=max_distance, min_fraction=min_fraction)
    wanted = [parse_caption(c) for c in captions]
    colour = [r.colour == a.colour for r, a in zip(readings, wanted, strict=True)]
    background = [r.background == a.background for r, a in zip(readings, wanted, strict=True)]
    position = [r.position == a.position for r, a in zip(readings, wanted, strict=True)]
    n = max(len(wanted), 1)
    return CaptionAgreement(
        colour=sum(colour) / n,
        background=sum(background) / n,
        position=sum(position) / n,
        all=sum(c and b and p for c, b, p in zip(colour, background, position, strict=True)) / n,
        count=len(wanted),
    )
