"""Synthetic captioned shapes: determinism, images that show their captions, tokenizer, data module."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashprobe.t2i import (
    COLOURS,
    POSITIONS,
    VOCAB,
    CaptionTokenizer,
    ShapeAttributes,
    ShapesDataModule,
    ShapesDataset,
    describe,
    parse_caption,
    render,
)

# Colour names judged from raw channel values, independently of the palette: (R, G, B) each
# "hi" (> 0.6), "lo" (< 0.3).
CHANNEL_RULES = {
    "red": ("hi", "lo", "lo"),
    "green": ("lo", "hi", "lo"),
    "blue": ("lo", "lo", "hi"),
    "yellow": ("hi", "hi", "lo"),
    "white": ("hi", "hi", "hi"),
    "black": ("lo", "lo", "lo"),
}
# Pixel (row, col) of each position's anchor in a 32×32 image, worked out by hand: 0.27·32 = 8.6,
# 0.5·32 = 16, 0.73·32 = 23.4.
ANCHOR_PIXELS_32 = {
    "top left": (8, 8),
    "top right": (8, 23),
    "bottom left": (23, 8),
    "bottom right": (23, 23),
    "center": (16, 16),
}
# A pixel no shape at that position reaches (the opposite corner; any corner for the center).
FAR_PIXELS_32 = {
    "top left": (31, 31),
    "top right": (31, 0),
    "bottom left": (0, 31),
    "bottom right": (0, 0),
    "center": (0, 0),
}


def looks_like(pixel: torch.Tensor, colour: str) -> bool:
    """Does an RGB pixel in [-1, 1] have the channel pattern of ``colour``?"""
    rgb = ((pixel + 1) / 2).tolist()
    return all(
        (v > 0.6) if rule == "hi" else (v < 0.3) for v, rule in zip(rgb, CHANNEL_RULES[colour], strict=True)
    )


def test_same_seed_gives_identical_data_and_other_seed_differs() -> None:
    a, b, c = ShapesDataset(64, 32, seed=3), ShapesDataset(64, 32, seed=3), ShapesDataset(64, 32, seed=4)
    assert torch.equal(a.images, b.images) and a.captions == b.captions and torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.images, c.images) and a.captions != c.captions


def test_every_image_shows_its_captioned_colours_at_the_captioned_position() -> None:
    data = ShapesDataset(300, 32, seed=11)
    assert data.images.shape == (300, 3, 32, 32) and data.images.dtype == torch.float32
    assert data.images.min() >= -1 and data.images.max() <= 1
    for image, caption in zip(data.images, data.captions, strict=True):
        words = caption.split()
        colour, background = words[2], words[-2]
        position = " ".join(words[6:-4])
        row, col = ANCHOR_PIXELS_32[position]
        assert looks_like(image[:, row, col], colour), caption
        far_row, far_col = FAR_PIXELS_32[position]
        assert looks_like(image[:, far_row, far_col], background), caption


def test_every_combination_of_attributes_occurs() -> None:
    data = ShapesDataset(4000, 16, seed=0)
    seen = {(a.shape, a.colour, a.size, a.position) for a in data.attributes}
    assert len(seen) == 3 * len(COLOURS) * 2 * len(POSITIONS)
    assert all(a.colour != a.background for a in data.attributes)


@pytest.mark.parametrize(
    ("shape", "area"),
    [
        ("circle", lambda r: math.pi * r**2),
        ("square", lambda r: math.pi * r**2),  # the square is drawn with the circle's area
        ("triangle", lambda r: 3 * math.sqrt(3) / 4 * r**2),  # equilateral, circumradius r
    ],
)
def test_drawn_area_matches_geometry(shape: str, area) -> None:
    size = 64
    attrs = [ShapeAttributes(shape, "white", "black", s, "center") for s in ("small", "large")]
    images = render(attrs, size)
    for image, radius in zip(images, (0.13, 0.24), strict=True):
        covered = ((image[0] + 1) / 2).sum().item()  # white = 1, black ≈ 0.05: partial pixels count
        covered = (covered - 0.05 * size**2) / 0.9  # undo the colours' offset and range
        assert covered == pytest.approx(area(radius) * size**2, rel=0.03)


def test_shapes_differ_where_geometry_says() -> None:
    size = 64
    attrs = [
        ShapeAttributes(s, "white", "black", "large", "center") for s in ("circle", "square", "triangle")
    ]
    circle, square, triangle = (render(attrs, size)[:, 0] + 1) / 2 > 0.5
    c = size // 2
    diag = int(0.19 * size)  # |(0.19, 0.19)| = 0.27 > r = 0.24, but inside the square (half side 0.213)
    assert square[c + diag, c + diag] and not circle[c + diag, c + diag]
    up, down = int(0.8 * 0.24 * size), int(0.6 * 0.24 * size)  # apex at -r, base at +r/2
    assert triangle[c - up, c] and not triangle[c + down, c] and circle[c + down, c]


def test_caption_template_round_trip() -> None:
    attrs = ShapeAttributes("triangle", "red", "blue", "small", "top left")
    caption = describe(attrs)
    assert caption == "a small red triangle in the top left on a blue background"
    assert parse_caption(caption) == attrs
    assert parse_caption("a large white circle in the center on a black background").position == "center"
    with pytest.raises(ValueError, match="does not match the template"):
        parse_caption("a red circle")
    with pytest.raises(ValueError, match="unknown colour 'purple'"):
        ShapeAttributes("circle", "purple", "blue", "small", "center")
    with pytest.raises(ValueError, match="must differ"):
        ShapeAttributes("circle", "red", "red", "small", "center")


def test_tokenizer_round_trip_and_errors() -> None:
    tok = CaptionTokenizer()
    data = ShapesDataset(200, 16, seed=5)
    ids = tok.encode(data.captions)
    assert ids.shape == (200, 12) and ids.dtype == torch.long
    assert tok.decode(ids) == data.captions
    assert tok.decode(tok.encode(data.captions[0])) == data.captions[0]
    short = "a large white circle in the center on a black background"  # 11 words → one pad
    assert tok.encode(short)[-1].item() == tok.pad_id == 0
    assert tok.vocab_size == len(VOCAB) and VOCAB[0] == "<pad>"
    with pytest.raises(ValueError, match=r"'purple'.*not in the vocabulary"):
        tok.encode("a small purple circle")
    with pytest.raises(ValueError, match="max_length is 12"):
        tok.encode(" ".join(["a"] * 13))


def test_data_module_splits_and_batches() -> None:
    dm = ShapesDataModule(num_train=100, num_val=40, image_size=16, batch_size=32, seed=2)
    with pytest.raises(RuntimeError, match="setup"):
        dm.train_dataloader()
    dm.setup("fit")
    assert len(dm.train_set) == 100 and len(dm.val_set) == 40
    assert not set(dm.train_set.captions[:20]) >= set(dm.val_set.captions[:20])  # different draws
    train = list(dm.train_dataloader())
    assert len(train) == 3  # drop_last
    batch = train[0]
    assert batch["image"].shape == (32, 3, 16, 16) and batch["tokens"].shape == (32, 12)
    assert len(batch["caption"]) == 32
    val = list(dm.val_dataloader())
    assert [len(b["caption"]) for b in val] == [32, 8]
    assert [c for b in val for c in b["caption"]] == dm.val_set.captions  # in order
    again = ShapesDataModule(num_train=100, num_val=40, image_size=16, batch_size=32, seed=2)
    again.setup("fit")
    assert torch.equal(again.train_set.images, dm.train_set.images)
    with pytest.raises(ValueError, match="num_train must be positive"):
        ShapesDataModule(num_train=0)


def test_render_without_jitter_is_centred() -> None:
    image = render([ShapeAttributes("circle", "red", "white", "small", "center")], 32)[0]
    red = (((image + 1) / 2)[0] > 0.6) & (((image + 1) / 2)[1] < 0.3)
    rows, cols = np.nonzero(red.numpy())
    assert rows.mean() == pytest.approx(15.5, abs=0.01) and cols.mean() == pytest.approx(15.5, abs=0.01)
