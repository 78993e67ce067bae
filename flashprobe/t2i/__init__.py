"""The text-to-image workload: synthetic captioned shapes, a tiny text-conditioned DiT, training.

``ShapesDataModule`` renders a deterministic captioned-shapes dataset (no download);
``TextToImageDiT`` (presets in ``DIT_MODELS``) denoises images (predicts v or ε) with self-attention over
image patches and cross-attention to the caption, every attention call through torch SDPA;
``TextToImageModule`` trains it with Lightning, routes attention to a chosen kernel, and writes a
grid of generated samples with a caption-agreement score after each validation.
"""

from flashprobe.t2i.data import (
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    VOCAB,
    CaptionTokenizer,
    ShapeAttributes,
    ShapesDataModule,
    ShapesDataset,
    describe,
    parse_caption,
    render,
    sample_attributes,
)
from flashprobe.t2i.diffusion import GaussianDiffusion
from flashprobe.t2i.metrics import CaptionAgreement, ImageReading, caption_agreement, read_images
from flashprobe.t2i.model import DIT_MODELS, DiTConfig, TextToImageDiT, dit_small, dit_tiny
from flashprobe.t2i.module import TextToImageModule, default_sample_captions
from flashprobe.t2i.precision import PRECISIONS, trainer_precision

__all__ = [
    "COLOURS",
    "DIT_MODELS",
    "POSITIONS",
    "PRECISIONS",
    "SHAPES",
    "SIZES",
    "VOCAB",
    "CaptionAgreement",
    "CaptionTokenizer",
    "DiTConfig",
    "GaussianDiffusion",
    "ImageReading",
    "ShapeAttributes",
    "ShapesDataModule",
    "ShapesDataset",
    "TextToImageDiT",
    "TextToImageModule",
    "caption_agreement",
    "default_sample_captions",
    "describe",
    "dit_small",
    "dit_tiny",
    "parse_caption",
    "read_images",
    "render",
    "sample_attributes",
    "trainer_precision",
]
