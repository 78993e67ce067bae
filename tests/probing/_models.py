"""Tiny models for the probe tests: stock torch attention layers plus a custom SDPA caller."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa

__all__ = ["GQAAttention", "ImportedNameAttention", "TinyTransformer", "train"]


class GQAAttention(nn.Module):
    """Causal self-attention with grouped-query heads, calling ``F.scaled_dot_product_attention``."""

    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)  # (B, H, N, D)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, Hkv, N, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class ImportedNameAttention(nn.Module):
    """Calls SDPA through a name imported with ``from torch.nn.functional import ...``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return imported_sdpa(q, k, v)


class TinyTransformer(nn.Module):
    """Embedding → ``nn.TransformerEncoderLayer`` → pre-norm GQA block → head, with dropout.

    ``dropout`` applies outside attention (after the embedding and the GQA block);
    ``attn_dropout`` is the ``TransformerEncoderLayer``'s (attention and feed-forward) dropout.
    """

    def __init__(self, d: int = 16, heads: int = 4, dropout: float = 0.1, attn_dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=attn_dropout, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.block = GQAAttention(d, heads, kv_heads=2)
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(x))
        h = self.encoder(h)
        h = h + self.drop(self.block(self.norm(h)))
        return self.head(h)


def train(model: nn.Module, steps: int = 3, *, autocast: bool = False, seed: int = 0) -> dict[str, list]:
    """AdamW steps on fixed random data; returns outputs, grads per step and the final weights.

    The global RNG is seeded once before the loop, so dropout masks depend on every random
    number drawn in between (a probe that drew one would change them).
    """
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, 2, 6, 4, generator=gen)
    y = torch.randn(steps, 2, 6, 1, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed + 1)
    outputs, grads = [], []
    for i in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x[i])
        loss = F.mse_loss(out.float(), y[i])
        loss.backward()
        outputs.append(out.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return {
        "outputs": outputs,
        "grads": grads,
        "weights": [p.detach().clone() for p in model.parameters()],
        "rng": [torch.get_rng_state()],
    }
