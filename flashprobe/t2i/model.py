"""A tiny text-conditioned diffusion transformer (DiT-style) that denoises an image (predicts ε or v).

Layout (after DiT, Peebles & Xie 2023, with PixArt-style cross-attention):

* a small **text encoder** (token + position embeddings, pre-norm transformer blocks) turns the
  caption ``(B, L)`` into ``(B, L, D)`` features;
* the noisy image ``(B, 3, S, S)`` is cut into ``(S/p)²`` patches, embedded, plus a fixed 2-D
  sin-cos position embedding;
* the timestep embedding plus a projection of all caption features (in word order) conditions
  every block through adaLN-Zero (shift, scale, gate); each block runs **self-attention** over
  the patches, **cross-attention** from the patches to the caption, and an MLP;
* a final adaLN layer maps each patch back to pixels: the prediction ``(B, 3, S, S)`` (the noise
  ε, or the velocity v; see :mod:`flashprobe.t2i.diffusion`).

Every attention call is one :func:`torch.nn.functional.scaled_dot_product_attention` call in
:class:`Attention`, looked up at call time, so a probe or kernel swap applies unchanged. Sizes:
:data:`DIT_MODELS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.t2i.data import VOCAB

__all__ = [
    "DIT_MODELS",
    "Attention",
    "DiTBlock",
    "DiTConfig",
    "TextEncoder",
    "TextToImageDiT",
    "dit_small",
    "dit_tiny",
    "timestep_embedding",
]


@dataclass(kw_only=True)
class DiTConfig:
    """Sizes of :class:`TextToImageDiT`."""

    image_size: int = 16
    """Side ``S`` of the square input images, in pixels."""
    in_channels: int = 3
    """Image channels ``C``."""
    patch_size: int = 2
    """Side ``p`` of a patch; the image becomes ``(S/p)²`` tokens."""
    dim: int = 64
    """Width ``D`` of the image tokens and the text features."""
    depth: int = 4
    """Number of DiT blocks."""
    heads: int = 2
    """Attention heads; ``D`` must be divisible by it."""
    mlp_ratio: float = 4.0
    """Hidden width of the MLPs as a multiple of ``D``."""
    vocab_size: int = len(VOCAB)
    """Caption vocabulary size (id 0 is padding)."""
    max_caption_length: int = 12
    """Caption length ``L`` (the tokenizer's ``max_length``)."""
    text_depth: int = 1
    """Number of transformer blocks in the text encoder."""

    def __post_init__(self) -> None:
        positive = ("image_size", "in_channels", "patch_size", "dim", "depth", "heads", "vocab_size")
        for name in (*positive, "max_caption_length", "text_depth", "mlp_ratio"):
            value = getattr(self, name)
            if value < (0 if name == "text_depth" else 1) or (name == "mlp_ratio" and value <= 0):
                raise ValueError(f"DiTConfig.{name} must be positive, got {value}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"DiTConfig: image_size {self.image_size} is not divisible by patch_size {self.patch_size}"
            )
        if self.dim % self.heads:
            raise ValueError(f"DiTConfig: dim {self.dim} is not divisible by heads {self.heads}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding of (possibly fractional) timesteps.

    Args:
        t: ``(B,)`` timesteps.
        dim: embedding width (even).

    Returns:
        ``(B, dim)`` float32.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]  # (B, dim/2)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding ``(grid², dim)`` (DiT, MAE)."""
    coords = torch.arange(grid, dtype=torch.float32)
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    emb_y = timestep_embedding(y.flatten(), dim // 2, max_period=10_000.0)
    emb_x = timestep_embedding(x.flatten(), dim // 2, max_period=10_000.0)
    return torch.cat([emb_y, emb_x], dim=1)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: ``x (B, N, D) · (1 + scale (B, D)) + shift (B, D)``."""
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    """Multi-head attention through one :func:`torch.nn.functional.scaled_dot_product_attention` call.

    Self-attention when ``context`` is omitted, cross-attention to ``context`` otherwise.

    Args:
        dim: width ``D`` of the queries and the output.
        heads: number of heads ``H`` (``D % H == 0``).
        context_dim: width of ``context`` (default ``D``).
    """

    def __init__(self, dim: int, heads: int, context_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(context_dim or dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """Args: x ``(B, N, D)``; context ``(B, M, D_c)`` or None. Returns ``(B, N, D)``."""
        b, n, d = x.shape
        context = x if context is None else context
        q = self.q(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)  # (B, H, N, D/H)
        k, v = (
            self.kv(context).view(b, -1, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )  # (B, H, M, D/H)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, N, D/H)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class _Mlp(nn.Sequential):
    def __init__(self, dim: int, ratio: float) -> None:
        hidden = int(dim * ratio)
        super().__init__(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))


class _TextBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _Mlp(dim, mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    """Caption tokens ``(B, L)`` → features ``(B, L, D)``; padding (id 0) is an ordinary token.

    The all-padding caption is the "empty" caption used for classifier-free guidance.
    """

    def __init__(self, vocab_size: int, max_length: int, dim: int, depth: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.max_length = max_length
        self.token = nn.Embedding(vocab_size, dim)
        self.position = nn.Parameter(torch.zeros(max_length, dim))
        self.blocks = nn.ModuleList(_TextBlock(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] != self.max_length:
            raise ValueError(
                f"caption tokens must be (B, {self.max_length}) int64, got {tuple(tokens.shape)}; "
                "encode captions with flashprobe.t2i.CaptionTokenizer"
            )
        x = self.token(tokens) + self.position  # (B, L, D)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class DiTBlock(nn.Module):
    """adaLN-Zero block: modulated self-attention, cross-attention to the caption, modulated MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = _Mlp(dim, mlp_ratio)
        self.adaln = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Args: x ``(B, N, D)`` patches; c ``(B, D)`` conditioning; text ``(B, L, D)``."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(c).chunk(6, dim=1)
        x = x + gate1[:, None] * self.attn(_modulate(self.norm1(x), shift1, scale1))
        x = x + self.cross_attn(self.norm_cross(x), text)
        return x + gate2[:, None] * self.mlp(_modulate(self.norm2(x), shift2, scale2))


class TextToImageDiT(nn.Module):
    """Noise predictor ``eps(x_t, t, caption)`` for text-to-image diffusion.

    Args:
        **config: fields of :class:`DiTConfig`.
    """

    def __init__(self, **config: int | float) -> None:
        super().__init__()
        self.config = cfg = DiTConfig(**config)  # type: ignore[arg-type]
        d = cfg.dim
        self.text_encoder = TextEncoder(
            cfg.vocab_size, cfg.max_caption_length, d, cfg.text_depth, cfg.heads, cfg.mlp_ratio
        )
        self.patch_embed = nn.Conv2d(cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        grid = cfg.image_size // cfg.patch_size
        self.register_buffer("pos_embed", _sincos_2d(d, grid)[None], persistent=False)  # (1, N, D)
        self.time_embed = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.text_pool = nn.Linear(cfg.max_caption_length * d, d)  # word order matters: red on blue
        self.blocks = nn.ModuleList(DiTBlock(d, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.final_adaln = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.final = nn.Linear(d, cfg.patch_size**2 * cfg.in_channels)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.xavier_uniform_(self.patch_embed.weight.view(self.patch_embed.weight.shape[0], -1))
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.normal_(self.text_encoder.token.weight, std=0.02)
        nn.init.normal_(self.text_encoder.position, std=0.02)
        for m in self.time_embed:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        # adaLN-Zero: every block starts as the identity, the output as zero
        for block in self.blocks:
            nn.init.zeros_(block.adaln[-1].weight)
            nn.init.zeros_(block.adaln[-1].bias)
            nn.init.zeros_(block.cross_attn.proj.weight)
        nn.init.zeros_(self.final_adaln[-1].weight)
        nn.init.zeros_(self.final_adaln[-1].bias)
        nn.init.zeros_(self.final.weight)

    def forward(self, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Predict what the diffusion is trained on (the velocity v by default, or the noise ε).

        Args:
            x: noisy images ``(B, C, S, S)``.
            t: timesteps ``(B,)`` (int or float).
            tokens: caption token ids ``(B, L)``.

        Returns:
            The prediction ``(B, C, S, S)``: v or ε, as set by
            :class:`~flashprobe.t2i.diffusion.GaussianDiffusion`'s ``prediction``.
        """
        cfg = self.config
        if x.dim() != 4 or tuple(x.shape[1:]) != (cfg.in_channels, cfg.image_size, cfg.image_size):
            raise ValueError(
                f"images must be (B, {cfg.in_channels}, {cfg.image_size}, {cfg.image_size}), got "
                f"{tuple(x.shape)}; build the model with image_size matching the data"
            )
        text = self.text_encoder(tokens)  # (B, L, D)
        temb = timestep_embedding(t, cfg.dim).to(self.patch_embed.weight.dtype)  # half-precision weights
        c = self.time_embed(temb) + self.text_pool(text.flatten(1))  # (B, D)
        h = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed  # (B, N, D)
        for block in self.blocks:
            h = block(h, c, text)
        shift, scale = self.final_adaln(c).chunk(2, dim=1)
        h = self.final(_modulate(self.final_norm(h), shift, scale))  # (B, N, p·p·C)
        return self._unpatchify(h)

    def _unpatchify(self, h: torch.Tensor) -> torch.Tensor:
        """``(B, N, p·p·C)`` → ``(B, C, S, S)``."""
        p, c = self.config.patch_size, self.config.in_channels
        g = self.config.image_size // p
        h = h.reshape(h.shape[0], g, g, p, p, c)  # (B, gy, gx, py, px, C)
        return h.permute(0, 5, 1, 3, 2, 4).reshape(h.shape[0], c, g * p, g * p)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self.config).items())


def dit_tiny(**overrides: int | float) -> TextToImageDiT:
    """About 65 k parameters (D=32, 2 blocks, 1 text block); for tests."""
    return TextToImageDiT(
        **{"dim": 32, "depth": 2, "heads": 2, "text_depth": 1, "mlp_ratio": 2.0, **overrides}
    )


def dit_small(**overrides: int | float) -> TextToImageDiT:
    """About 0.5 M parameters (D=64, 4 blocks, 1 text block, 16×16 images in 2×2 patches); learns the
    captioned colours in about a thousand steps on a laptop CPU."""
    return TextToImageDiT(**{"dim": 64, "depth": 4, "heads": 2, "text_depth": 1, **overrides})


#: Size presets by name (DiT's ``DiT_models``); each builds a :class:`TextToImageDiT`.
DIT_MODELS: dict[str, Callable[..., TextToImageDiT]] = {"dit_tiny": dit_tiny, "dit_small": dit_small}
