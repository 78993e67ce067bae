"""The inputs of one fuzz case: one attention call in the dtype under test."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["CaseInputs", "UnrepresentableCaseError"]


class UnrepresentableCaseError(ValueError):
    """The case cannot be posed in this dtype (its logits or inputs do not fit the dtype's range)."""


@dataclass(frozen=True, kw_only=True)
class CaseInputs:
    """One attention call: the inputs of a case in the dtype under test.

    Attributes:
        q: ``(B, H, N_q, D)`` queries.
        k: ``(B, H_kv, N_k, D)`` keys; ``H_kv < H`` (dividing ``H``) is grouped-query attention.
        v: ``(B, H_kv, N_k, D_v)`` values.
        attn_mask: bool (``True`` = attend) or additive mask broadcastable to ``(B, H, N_q, N_k)``.
        is_causal: top-left aligned causal mask (as torch SDPA).
        scale: softmax scale; ``None`` means ``1/sqrt(D)``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None = None
    is_causal: bool = False
    scale: float | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype under test (that of ``q``)."""
        return self.q.dtype

    def to(self, device: torch.device | str) -> CaseInputs:
        """The same inputs on ``device``."""
        mask = None if self.attn_mask is None else self.attn_mask.to(device)
        return replace(self, q=self.q.to(device), k=self.k.to(device), v=self.v.to(device), attn_mask=mask)

    def clone(self) -> CaseInputs:
        """Copies of every tensor, so a kernel that writes to its inputs cannot touch these."""
        mask = None if self.attn_mask is None else self.attn_mask.clone()
        return replace(self, q=self.q.clone(), k=self.k.clone(), v=self.v.clone(), attn_mask=mask)

    def reference_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` and ``v`` with their heads repeated to ``H`` (GQA semantics), ``(B, H, N_k, ·)``."""
        groups = self.q.shape[1] // self.k.shape[1]
        if groups == 1:
            return self.k, self.v
        return self.k.repeat_interleave(groups, dim=1), self.v.repeat_interleave(groups, dim=1)

    def valid_keys(self) -> torch.Tensor:
        """Boolean ``(B, H, N_q, N_k)``: ``True`` where a query may attend to a key."""
        b, h, n_q, _ = self.q.shape
        n_k = self.k.shape[2]
        valid = torch.ones(b, h, n_q, n_k, dtype=torch.bool, device=self.q.device)
        if self.is_causal:
            valid = valid & torch.ones(n_q, n_k, dtype=torch.bool, device=self.q.device).tril()
        if self.attn_mask is not None:
            keep = self.attn_mask if self.attn_mask.dtype == torch.bool else self.attn_mask > float("-inf")
            valid = valid & keep
        return valid

    def describe(self) -> str:
        """A one-line summary: ``B=2 H=2 Nq=16 Nk=203 D=64 mask=bool(2,1,1,203) scale=1``."""
        b, h, n_q, d = self.q.shape
        parts = [f"B={b} H={h}", f"Nq={n_q} Nk={self.k.shape[2]} D={d}"]
        if self.k.shape[1] != h:
            parts.append(f"H_kv={self.k.shape[1]}")
        if self.is_causal:
            parts.append("causal")
        if self.attn_mask is not None:
            kind = "bool" if self.attn_mask.dtype == torch.bool else "additive"
            parts.append(f"mask={kind}{tuple(self.attn_mask.shape)}".replace(" ", ""))
        parts.append(f"scale={'1/sqrt(D)' if self.scale is None else f'{self.scale:g}'}")
        return " ".join(parts)
