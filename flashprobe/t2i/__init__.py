"""The text-to-image workload: synthetic captioned shapes (``ShapesDataModule``), a tiny
text-conditioned DiT (``TextToImageDiT``) and its LightningModule (``TextToImageModule``).

Names are imported on first use (PEP 562), so :mod:`flashprobe.t2i.precision` alone does not
import Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Each module and the public names it defines (as imported above).
_DEFINED_IN: dict[str, str] = {
    "data": "COLOURS POSITIONS SHAPES SIZES VOCAB CaptionTokenizer ShapeAttributes ShapesDataModule "
    "ShapesDataset describe parse_caption render sample_attributes",
    "diffusion": "GaussianDiffusion",
    "metrics": "CaptionAgreement ImageReading caption_agreement read_images",
    "model": "DIT_MODELS DiTConfig TextToImageDiT dit_small dit_tiny",
    "module": "TextToImageModule default_sample_captions",
    "precision": "PRECISIONS trainer_precision",
}
_MODULES: dict[str, str] = {name: module for module, names in _DEFINED_IN.items() for name in names.split()}

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


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
