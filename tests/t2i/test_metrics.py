"""The caption-agreement check: exact on the data itself, chance on mismatched captions."""

from __future__ import annotations

import random

import pytest
import torch

from flashprobe.t2i import ShapesDataset, caption_agreement, read_images
from flashprobe.t2i.metrics import ImageReading


def test_dataset_images_agree_with_their_captions_and_not_with_others() -> None:
    data = ShapesDataset(600, 32, seed=9)
    exact = caption_agreement(data.images, data.captions)
    assert exact.as_dict() == {"colour": 1.0, "background": 1.0, "position": 1.0, "all": 1.0, "count": 600}
    shuffled = list(data.captions)
    random.Random(0).shuffle(shuffled)
    chance = caption_agreement(data.images, shuffled)
    # colour and background: 1/6 by chance; position: 1/5
    assert 0.08 < chance.colour < 0.27 and 0.08 < chance.background < 0.27
    assert 0.1 < chance.position < 0.3 and chance.all < 0.03


def test_reading_a_hand_drawn_image() -> None:
    image = torch.zeros(1, 3, 32, 32)
    image[0, 2] = 0.9  # blue background (0.1, 0.2, 0.95) in [0, 1] → roughly (-0.8, -0.5, 0.9)
    image[0, 0], image[0, 1] = -0.8, -0.5
    image[0, :, 20:28, 4:12] = torch.tensor([0.8, -0.76, -0.76]).view(3, 1, 1)  # a red patch, bottom left
    assert read_images(image) == [ImageReading(background="blue", colour="red", position="bottom left")]
    empty = torch.full((1, 3, 32, 32), -0.9)  # black, nothing on it
    assert read_images(empty) == [ImageReading(background="black", colour=None, position=None)]
    noise = torch.full((1, 3, 32, 32), float("nan"))
    assert read_images(noise) == [ImageReading(background=None, colour=None, position=None)]


def test_agreement_errors() -> None:
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        caption_agreement(torch.zeros(2, 3, 8, 8), ["a small red circle in the center on a blue background"])
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\)"):
        caption_agreement(torch.zeros(1, 1, 8, 8), ["a small red circle in the center on a blue background"])
