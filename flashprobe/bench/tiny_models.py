"""Tiny random-init models of real model classes, each with a batch for every step.

``flashprobe bench verdicts`` calibrates the verdict on them and the integration tests probe them.
Each builder seeds torch's global generator with ``seed`` and takes keyword overrides of the model's
config; transformers and diffusers (the ``integration`` extra) are imported when a model is built.
:data:`MODELS` maps the calibration's model names to a builder of :class:`TinyModel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "MODELS",
    "TOKENS",
    "VOCAB",
    "TinyModel",
    "TokenDataset",
    "bert",
    "dit",
    "dit_batch",
    "gpt2",
    "last_hidden_state",
    "left_padded_tokens",
    "llama",
    "logits",
    "pixart",
    "sample",
    "t2i",
    "tokens",
    "unet",
    "unet_batch",
    "vit",
    "vit_batch",
]

#: Vocabulary size and sequence length of the language models' batches.
VOCAB, TOKENS = 64, 8
#: Depth and width shared by the Llama, BERT and ViT configs.
_SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}


class TinyModel(NamedTuple):
    """A model with what trains it: ``model(**batch(step))`` is a forward, ``output(...)`` of its
    result the tensor the loss is taken of."""

    model: nn.Module
    batch: Callable[[int], dict[str, Any]]
    output: Callable[[Any], torch.Tensor]


def tokens(step: int, *, left_pad: bool = False) -> dict[str, torch.Tensor]:
    """The batch of ``step``: ``input_ids (2, TOKENS)`` drawn from a generator seeded by the step; with
    ``left_pad``, also ``attention_mask (2, TOKENS)`` with the first sequence left-padded by 3."""
    gen = torch.Generator().manual_seed(step)
    batch = {"input_ids": torch.randint(1, VOCAB, (2, TOKENS), generator=gen)}
    if left_pad:
        mask = torch.ones(2, TOKENS, dtype=torch.long)
        mask[0, :3] = 0
        batch["attention_mask"] = mask
    return batch


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random token sequences of length :data:`TOKENS` (seed 0) whose labels are the inputs,
    for a causal LM in ``transformers.Trainer``."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(1, VOCAB, (n, TOKENS), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def left_padded_tokens(step: int) -> dict[str, torch.Tensor]:
    """:func:`tokens` of ``step`` with the first sequence left-padded by 3 tokens."""
    return tokens(step, left_pad=True)


def logits(out: Any) -> torch.Tensor:
    """A language model output's ``logits``."""
    return out.logits


def last_hidden_state(out: Any) -> torch.Tensor:
    """An encoder output's ``last_hidden_state``."""
    return out.last_hidden_state


def sample(out: Any) -> torch.Tensor:
    """A diffusers model output's ``sample``."""
    return out.sample


def gpt2(attn_implementation: str = "sdpa", *, seed: int = 0, **config: Any) -> nn.Module:
    """A 2-layer ``GPT2LMHeadModel`` (width 32, 4 heads), attention dropout 0, on transformers'
    ``attn_implementation``; ``config`` overrides ``GPT2Config`` fields."""
    import transformers

    fields = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB, "n_positions": 16,
              "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    torch.manual_seed(seed)
    config = transformers.GPT2Config(**{**fields, **config}, attn_implementation=attn_implementation)
    return transformers.GPT2LMHeadModel(config)


def llama(attn_implementation: str = "sdpa", *, seed: int = 0, **config: Any) -> nn.Module:
    """A 2-layer ``LlamaForCausalLM`` (width 32, 4 query heads sharing 2 key/value heads) on
    transformers' ``attn_implementation``; ``config`` overrides ``LlamaConfig`` fields."""
    import transformers

    fields = {**_SMALL, "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 32,
              "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # fmt: skip
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**fields, **config}, attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config)


def bert(*, seed: int = 0, **config: Any) -> nn.Module:
    """A 2-layer ``BertModel`` (width 32, 4 heads) on SDPA, attention dropout 0; ``config`` overrides
    ``BertConfig`` fields."""
    import transformers

    fields = {**_SMALL, "vocab_size": VOCAB, "max_position_embeddings": 32,
              "attention_probs_dropout_prob": 0.0}  # fmt: skip
    torch.manual_seed(seed)
    return transformers.BertModel(transformers.BertConfig(**{**fields, **config}, attn_implementation="sdpa"))


def vit(*, seed: int = 0, **config: Any) -> nn.Module:
    """A 2-layer ``ViTModel`` (width 32, 4 heads) on SDPA, for ``(B, 3, 16, 16)`` images in 4x4 patches;
    ``config`` overrides ``ViTConfig`` fields."""
    import transformers

    fields = {**_SMALL, "image_size": 16, "patch_size": 4}
    torch.manual_seed(seed)
    return transformers.ViTModel(transformers.ViTConfig(**{**fields, **config}, attn_implementation="sdpa"))


def vit_batch(step: int) -> dict[str, torch.Tensor]:
    """The :func:`vit` batch of ``step``: ``pixel_values (2, 3, 16, 16)``."""
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(step))}


def unet(*, seed: int = 0) -> nn.Module:
    """A diffusers ``UNet2DConditionModel`` for ``(B, 4, 8, 8)`` latents: one cross-attention down
    block and one up block (8 attention sites, self- ``attn1`` and cross- ``attn2``), text width 16."""
    import diffusers

    torch.manual_seed(seed)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
        attention_head_dim=8, norm_num_groups=8,
    )  # fmt: skip


def unet_batch(step: int) -> dict[str, torch.Tensor]:
    """The :func:`unet` batch of ``step``: ``sample (2, 4, 8, 8)``, two timesteps and
    ``encoder_hidden_states (2, 5, 16)``."""
    gen = torch.Generator().manual_seed(step)
    return {
        "sample": torch.randn(2, 4, 8, 8, generator=gen),
        "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(2, 5, 16, generator=gen),
    }


def dit(*, seed: int = 0) -> nn.Module:
    """A 2-block diffusers ``DiTTransformer2DModel`` (2 heads of 8) for ``(B, 4, 8, 8)`` latents and
    10 class labels."""
    import diffusers

    torch.manual_seed(seed)
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=8,
    )  # fmt: skip


def dit_batch(step: int) -> dict[str, torch.Tensor]:
    """The :func:`dit` batch of ``step``: ``hidden_states (2, 4, 8, 8)``, two timesteps and labels."""
    gen = torch.Generator().manual_seed(step)
    return {
        "hidden_states": torch.randn(2, 4, 8, 8, generator=gen),
        "timestep": torch.tensor([1, 2]),
        "class_labels": torch.tensor([0, 1]),
    }


def pixart(*, seed: int = 0) -> nn.Module:
    """A 2-block diffusers ``PixArtTransformer2DModel`` (2 heads of 8; self- and cross-attention to
    captions of width 12) for ``(B, 4, 8, 8)`` latents."""
    import diffusers

    torch.manual_seed(seed)
    return diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
        sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=12, norm_num_groups=8,
    )  # fmt: skip


def t2i(*, seed: int = 0) -> TinyModel:
    """The embedded text-to-image DiT at its default size, with padded captions; trained to regress
    towards 0.5 (it starts as the zero function, adaLN-Zero, so its gradients flow)."""
    from flashprobe.t2i.model import TextToImageDiT

    torch.manual_seed(seed)
    model = TextToImageDiT()
    cfg = model.config

    def batch(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(step)
        captions = torch.randint(1, cfg.vocab_size, (4, cfg.max_caption_length), generator=gen)
        captions[:, 6:] = 0  # padded captions, as the tokenizer makes them
        return {
            "x": torch.randn(4, cfg.in_channels, cfg.image_size, cfg.image_size, generator=gen),
            "t": torch.randint(0, 1000, (4,), generator=gen),
            "tokens": captions,
        }

    return TinyModel(model, batch, lambda out: out - 0.5)


#: The calibration's model names (``flashprobe bench verdicts --models``) → builder of the
#: :class:`TinyModel` from a seed.
MODELS: dict[str, Callable[..., TinyModel]] = {
    "gpt2": lambda seed=0: TinyModel(gpt2(seed=seed), tokens, logits),
    "llama": lambda seed=0: TinyModel(llama(seed=seed), left_padded_tokens, logits),
    "bert": lambda seed=0: TinyModel(bert(seed=seed), left_padded_tokens, last_hidden_state),
    "vit": lambda seed=0: TinyModel(vit(seed=seed), vit_batch, last_hidden_state),
    "unet": lambda seed=0: TinyModel(unet(seed=seed), unet_batch, sample),
    "dit": lambda seed=0: TinyModel(dit(seed=seed), dit_batch, sample),
    "t2i": lambda seed=0: t2i(seed=seed),
}
