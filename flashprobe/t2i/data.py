"""Synthetic captioned shapes: a deterministic text-to-image dataset that needs no download.

Every image is a flat background with one shape on it; its caption names all the attributes::

    "a small red circle in the top left on a blue background"

Images are ``(3, S, S)`` floats in ``[-1, 1]`` with antialiased edges, a function of the seed only.
:class:`CaptionTokenizer` maps each word of :data:`VOCAB` to an id (``0`` is padding).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from flashprobe.t2i.steps import StepLoader, StepSampler

__all__ = [
    "COLOURS",
    "POSITIONS",
    "SHAPES",
    "SIZES",
    "VOCAB",
    "CaptionTokenizer",
    "ShapeAttributes",
    "ShapesDataModule",
    "ShapesDataset",
    "describe",
    "parse_caption",
    "render",
    "sample_attributes",
]

#: Colour name → RGB in ``[0, 1]``; chosen far apart so a pixel's nearest colour is unambiguous.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.12),
    "green": (0.12, 0.72, 0.18),
    "blue": (0.12, 0.25, 0.90),
    "yellow": (0.95, 0.85, 0.10),
    "white": (0.95, 0.95, 0.95),
    "black": (0.05, 0.05, 0.05),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: Size name → "radius" as a fraction of the image side (circumradius for the triangle).
SIZES: dict[str, float] = {"small": 0.13, "large": 0.24}
#: Position name → centre ``(x, y)`` as fractions of the image side (y grows downwards).
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.5, 0.5),
}
#: Largest shift of a shape's centre from its position's anchor, as a fraction of the side.
JITTER = 0.04
_CHUNK = 4096

_PAD = "<pad>"
_WORDS = ["a", "in", "the", "on", "background", *SIZES, *SHAPES, *COLOURS]
_WORDS += sorted({w for p in POSITIONS for w in p.split()})
#: Every word a caption can contain, id order; id 0 is padding.
VOCAB: tuple[str, ...] = (_PAD, *dict.fromkeys(_WORDS))


@dataclass(frozen=True)
class ShapeAttributes:
    """What one image shows; :func:`describe` turns it into the caption."""

    shape: str
    colour: str
    background: str
    size: str
    position: str

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("shape", self.shape, SHAPES),
            ("colour", self.colour, COLOURS),
            ("background", self.background, COLOURS),
            ("size", self.size, SIZES),
            ("position", self.position, POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")
        if self.colour == self.background:
            raise ValueError(f"shape colour and background are both {self.colour!r}; they must differ")


def describe(attrs: ShapeAttributes) -> str:
    """The caption of an image, e.g. ``"a small red circle in the top left on a blue background"``."""
    a = attrs
    return f"a {a.size} {a.colour} {a.shape} in the {a.position} on a {a.background} background"


def parse_caption(caption: str) -> ShapeAttributes:
    """Inverse of :func:`describe`.

    Raises:
        ValueError: the caption does not follow the dataset's template.
    """
    words = caption.split()
    template = "'a SIZE COLOUR SHAPE in the POSITION on a BACKGROUND background'"
    ok = len(words) in (11, 12) and words[0] == "a" and words[4:6] == ["in", "the"]
    if ok:
        position = " ".join(words[6:-4])
        ok = words[-4:-2] == ["on", "a"] and words[-1] == "background"
    if not ok:
        raise ValueError(f"caption {caption!r} does not match the template {template}")
    return ShapeAttributes(
        shape=words[3], colour=words[2], background=words[-2], size=words[1], position=position
    )


def sample_attributes(n: int, generator: np.random.Generator) -> list[ShapeAttributes]:
    """Draw ``n`` attribute sets uniformly (the background uniformly among the other colours)."""
    colours, sizes, positions = list(COLOURS), list(SIZES), list(POSITIONS)
    shape = generator.integers(len(SHAPES), size=n)
    colour = generator.integers(len(colours), size=n)
    background = (colour + 1 + generator.integers(len(colours) - 1, size=n)) % len(colours)
    size = generator.integers(len(sizes), size=n)
    position = generator.integers(len(positions), size=n)
    draws = np.stack([shape, colour, background, size, position], axis=1).tolist()  # (n, 5) ints
    return [
        ShapeAttributes(SHAPES[sh], colours[c], colours[b], sizes[si], positions[p])
        for sh, c, b, si, p in draws
    ]


def render(
    attrs: Sequence[ShapeAttributes], image_size: int, offsets: np.ndarray | None = None
) -> torch.Tensor:
    """Draw images of the given attributes.

    Args:
        attrs: ``N`` attribute sets.
        image_size: side ``S`` in pixels (at least 8).
        offsets: ``(N, 2)`` shift of each shape's centre as a fraction of the side (the jitter);
            zeros when omitted.

    Returns:
        ``(N, 3, S, S)`` float32 in ``[-1, 1]``.
    """
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 pixels, got {image_size}")
    n, s = len(attrs), image_size
    offsets = np.zeros((n, 2)) if offsets is None else np.asarray(offsets, dtype=np.float64)
    anchors = np.array([POSITIONS[a.position] for a in attrs]).reshape(n, 2)
    centres = torch.from_numpy((anchors + offsets).astype(np.float32))
    radius = torch.tensor([SIZES[a.size] for a in attrs])
    fg = torch.tensor([COLOURS[a.colour] for a in attrs]).reshape(n, 3, 1, 1) * 2 - 1
    bg = torch.tensor([COLOURS[a.background] for a in attrs]).reshape(n, 3, 1, 1) * 2 - 1
    pixels = (torch.arange(s, dtype=torch.float32) + 0.5) / s  # pixel centres in [0, 1]
    images = torch.empty(n, 3, s, s)
    shapes = np.array([SHAPES.index(a.shape) for a in attrs])
    for code, shape in enumerate(SHAPES):
        for chunk in torch.from_numpy(np.flatnonzero(shapes == code)).split(_CHUNK):
            sd = _signed_distance(shape, centres[chunk], radius[chunk], pixels)
            cover = (0.5 - sd * s).clamp_(0, 1)  # (n, 1, S, S); antialiased edges: a pixel-wide ramp
            images[chunk] = torch.addcmul(bg[chunk], fg[chunk] - bg[chunk], cover)
    return images


def _signed_distance(
    shape: str, centres: torch.Tensor, radius: torch.Tensor, pixels: torch.Tensor
) -> torch.Tensor:
    """Signed distance (negative inside) from each pixel centre to ``n`` shapes, ``(n, 1, S, S)``.

    Exact for the circle; for the square and triangle the largest distance to an edge line, which
    is exact inside and near the edges (all the antialiasing needs).
    """
    r = radius[:, None, None, None]
    dx = pixels[None, None, None, :] - centres[:, 0, None, None, None]  # (n, 1, 1, S)
    dy = pixels[None, None, :, None] - centres[:, 1, None, None, None]  # (n, 1, S, 1)
    if shape == "circle":
        return (dx**2 + dy**2).sqrt() - r
    if shape == "square":  # same area as the circle
        half = r * math.sqrt(math.pi) / 2
        return torch.maximum(dx.abs() - half, dy.abs() - half)
    # upright equilateral triangle centred on its centroid, circumradius r: three edge lines
    bottom = dy - r / 2
    right = (math.sqrt(3) * dx - dy - r) / 2
    left = (-math.sqrt(3) * dx - dy - r) / 2
    return torch.maximum(torch.maximum(bottom, right), left)


class CaptionTokenizer:
    """Word tokenizer over the caption vocabulary; id 0 pads every caption to ``max_length``.

    Args:
        vocab: the words, id order, padding first (default :data:`VOCAB`).
        max_length: token sequence length ``L``; longer captions are an error.
    """

    def __init__(self, vocab: Sequence[str] = VOCAB, max_length: int = 12) -> None:
        if not vocab or vocab[0] != _PAD or len(set(vocab)) != len(vocab):
            raise ValueError(f"vocab must list distinct words with {_PAD!r} first, got {list(vocab)[:5]}...")
        self.vocab = tuple(vocab)
        self.max_length = max_length
        self._ids = {w: i for i, w in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        return 0

    def encode(self, captions: str | Sequence[str]) -> torch.Tensor:
        """Token ids of one caption ``(L,)`` or of several ``(N, L)``, int64, padded with 0.

        Raises:
            ValueError: a word is not in the vocabulary, or a caption is longer than ``L`` words.
        """
        if isinstance(captions, str):
            return self.encode([captions])[0]
        rows = []
        for caption in captions:
            words = caption.split()
            if len(words) > self.max_length:
                raise ValueError(
                    f"caption {caption!r} has {len(words)} words; the tokenizer's max_length is "
                    f"{self.max_length} (raise max_length)"
                )
            unknown = [w for w in words if w not in self._ids]
            if unknown:
                raise ValueError(
                    f"word {unknown[0]!r} of caption {caption!r} is not in the vocabulary: "
                    + " ".join(self.vocab[1:])
                )
            rows.append([self._ids[w] for w in words] + [self.pad_id] * (self.max_length - len(words)))
        return torch.tensor(rows, dtype=torch.long).reshape(len(captions), self.max_length)

    def decode(self, ids: torch.Tensor) -> str | list[str]:
        """Captions of ``(L,)`` ids (a string) or ``(N, L)`` ids (a list); padding is dropped."""
        if ids.dim() == 1:
            return " ".join(self.vocab[i] for i in ids.tolist() if i != self.pad_id)
        return [self.decode(row) for row in ids]  # type: ignore[misc]


class ShapesDataset(Dataset):
    """``N`` captioned shapes drawn from ``seed``; items are ``{"image", "tokens", "caption"}``.

    Args:
        num_samples: ``N``.
        image_size: side ``S`` in pixels.
        seed: the only source of randomness.
        tokenizer: encodes the captions (default :class:`CaptionTokenizer`).

    Attributes:
        images: ``(N, 3, S, S)`` float32 in ``[-1, 1]``.
        tokens: ``(N, L)`` int64.
        captions: the ``N`` captions.
        attributes: the ``N`` :class:`ShapeAttributes`.
    """

    def __init__(
        self, num_samples: int, image_size: int = 16, seed: int = 0, tokenizer: CaptionTokenizer | None = None
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        rng = np.random.default_rng(seed)
        self.attributes = sample_attributes(num_samples, rng)
        offsets = rng.uniform(-JITTER, JITTER, size=(num_samples, 2))
        self.images = render(self.attributes, image_size, offsets)
        self.captions = [describe(a) for a in self.attributes]
        self.tokenizer = tokenizer or CaptionTokenizer()
        self.tokens = self.tokenizer.encode(self.captions)

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | str]:
        return {"image": self.images[index], "tokens": self.tokens[index], "caption": self.captions[index]}


class ShapesDataModule(L.LightningDataModule):
    """Train/val splits of :class:`ShapesDataset`, each from its own seed derived from ``seed``.

    Batches are dicts: ``image`` ``(B, 3, S, S)`` in ``[-1, 1]``, ``tokens`` ``(B, L)`` int64,
    ``caption`` (list of ``B`` strings). The training order is a
    :class:`~flashprobe.t2i.steps.StepSampler` (the Trainer needs ``use_distributed_sampler=False``).

    Args:
        num_train: training images.
        num_val: validation images.
        image_size: side in pixels.
        batch_size: batch size of both loaders (per rank).
        seed: seed of the data (independent of the training seed).
        shuffle_seed: seed of the training order; default: ``PL_GLOBAL_SEED``, else 0.
        num_workers: DataLoader workers (0 keeps everything in-process and deterministic).
    """

    def __init__(
        self,
        num_train: int = 10_000,
        num_val: int = 256,
        image_size: int = 16,
        batch_size: int = 32,
        seed: int = 0,
        shuffle_seed: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("num_train", num_train), ("num_val", num_val), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.save_hyperparameters()
        self.tokenizer = CaptionTokenizer()
        self.train_set: ShapesDataset | None = None
        self.val_set: ShapesDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Render both splits once (well under a second for 10,000 images of 16×16)."""
        if self.train_set is None:
            train_seed, val_seed = np.random.SeedSequence(self.hparams.seed).spawn(2)
            size = self.hparams.image_size
            self.train_set = ShapesDataset(self.hparams.num_train, size, train_seed, self.tokenizer)
            self.val_set = ShapesDataset(self.hparams.num_val, size, val_seed, self.tokenizer)

    def _loader(self, dataset: ShapesDataset | None, sampler: StepSampler | None = None) -> DataLoader:
        if dataset is None:
            raise RuntimeError("ShapesDataModule: call setup() before asking for a dataloader")
        workers = self.hparams.num_workers
        return (DataLoader if sampler is None else StepLoader)(
            dataset,
            batch_size=self.hparams.batch_size,
            sampler=sampler,
            drop_last=sampler is not None,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def _next_batch(self) -> int:
        """The index (over the whole run) of the next training batch: what the Trainer has done."""
        if self.trainer is None:
            return 0
        return self.trainer.fit_loop.epoch_loop.total_batch_idx + 1

    def train_dataloader(self) -> DataLoader:
        seed = self.hparams.shuffle_seed
        if seed is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        if self.train_set is None:
            return self._loader(None)  # raises: setup() first
        sampler = StepSampler(
            len(self.train_set),
            self.hparams.batch_size,
            seed,
            self._next_batch,
            rank=rank,
            world_size=world,
        )
        return self._loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)
