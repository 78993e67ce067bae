"""The inputs of one fuzz case: one attention call in the dtype under test; and the inputs with
repeated row maxima of the signed-bias cases (:func:`bias_inputs`, shared with ``flashprobe bench bias``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from flashprobe.errors import FlashprobeError
from flashprobe.fuzz.layouts import LAYOUTS, apply_layout
from flashprobe.kernels.reference import expand_kv

__all__ = ["POISONS", "TIE_WIDTH", "CaseInputs", "UnrepresentableCaseError", "bias_inputs"]

#: what poisoned memory holds: NaN, +Inf, or half the dtype's largest value (``<value>_after``: the same
#: value only after each tensor's last element, which keeps the tensors contiguous)
POISONS = ("nan", "inf", "huge")
#: rows and channels of poisoned memory past each tensor's view
_POISON_ROWS, _POISON_CHANNELS = 128, 64


def _in_poisoned_memory(x: torch.Tensor, poison: str) -> torch.Tensor:
    """``x`` ``(B, H, N, D)`` as a view into a ``(B, H, N + 128, D + 64)`` buffer filled with ``poison``
    (``<poison>_after``: a contiguous view followed by ``128 · D`` poisoned elements)."""
    name, _, after = poison.partition("_")
    value = {"nan": float("nan"), "inf": float("inf"), "huge": float(torch.finfo(x.dtype).max) / 2}[name]
    b, h, n, d = x.shape
    if after:
        buffer = x.new_full((x.numel() + _POISON_ROWS * d,), value)
        view = buffer[: x.numel()].view(x.shape)
    else:
        view = x.new_full((b, h, n + _POISON_ROWS, d + _POISON_CHANNELS), value)[:, :, :n, :d]
    view.copy_(x)
    return view


class UnrepresentableCaseError(ValueError, FlashprobeError):
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
        layout: the memory layout of ``q``, ``k``, ``v`` (:data:`~flashprobe.fuzz.layouts.LAYOUTS`),
            set with :meth:`with_layout`.
        poison: what fills the memory around ``q``, ``k``, ``v`` (of :data:`POISONS`; ``""``: none);
            ``<value>_after`` poisons only the memory after each tensor (contiguous views).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None = None
    is_causal: bool = False
    scale: float | None = None
    layout: str = "contiguous"
    poison: str = ""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {', '.join(LAYOUTS)}")
        if self.poison and self.poison.removesuffix("_after") not in POISONS:
            allowed = ", ".join(POISONS)
            raise ValueError(f"poison={self.poison!r} must be one of {allowed}, or one of them + '_after'")

    def with_layout(self, layout: str) -> CaseInputs:
        """The same call with ``q``, ``k``, ``v`` laid out as ``layout``
        (:func:`~flashprobe.fuzz.layouts.apply_layout`; ``expanded_kv`` repeats the first k/v head),
        in poisoned memory when :attr:`poison` is set."""
        q, k, v = apply_layout(self.q, self.k, self.v, layout)
        if self.poison:
            q, k, v = (_in_poisoned_memory(t, self.poison) for t in (q, k, v))
        return replace(self, q=q, k=k, v=v, layout=layout)

    def nan_rows(self) -> torch.Tensor | None:
        """Boolean ``(B, H, N_q)``: the rows that depend on a NaN input (a NaN in the row's query, or
        in the key or value of a key the row may attend to); None when no input is NaN."""
        if not any(bool(torch.isnan(t).any()) for t in (self.q, self.k, self.v)):
            return None
        k, v = self.reference_kv()
        bad_keys = torch.isnan(k).any(-1) | torch.isnan(v).any(-1)  # (B, H, N_k)
        seen = (self.valid_keys() & bad_keys.unsqueeze(2)).any(-1)  # (B, H, N_q)
        return seen | torch.isnan(self.q).any(-1)

    def without_nan(self) -> CaseInputs:
        """The same call with every NaN input replaced by 0: the answer of the rows that do not
        depend on a NaN (:meth:`nan_rows`)."""
        q, k, v = (
            torch.nan_to_num(t, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
            for t in (self.q, self.k, self.v)
        )
        return replace(self, q=q, k=k, v=v).with_layout(self.layout)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype under test (that of ``q``)."""
        return self.q.dtype

    def to(self, device: torch.device | str) -> CaseInputs:
        """The same inputs on ``device``."""
        mask = None if self.attn_mask is None else self.attn_mask.to(device)
        moved = replace(self, q=self.q.to(device), k=self.k.to(device), v=self.v.to(device), attn_mask=mask)
        return moved.with_layout(self.layout)

    def clone(self) -> CaseInputs:
        """Copies of every tensor in the same layout, so a kernel that writes to its inputs cannot
        touch these."""
        mask = None if self.attn_mask is None else self.attn_mask.clone()
        q, k, v = (t.contiguous().clone() for t in (self.q, self.k, self.v))
        return replace(self, q=q, k=k, v=v, attn_mask=mask).with_layout(self.layout)

    def reference_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` and ``v`` with their heads repeated to ``H`` (GQA semantics), ``(B, H, N_k, ·)``."""
        return expand_kv(self.k, self.v, self.q.shape[1] // self.k.shape[1])

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

    def axes(self) -> dict[str, int | str]:
        """Where this call lies on each axis the fuzzer covers: ``head_dim``, ``head_dim_v``,
        ``n_q``, ``n_k``, ``batch_heads`` (B·H), ``gqa_ratio`` (H / H_kv), ``layout``, ``mask``
        (``none``, ``causal``, ``bool``, ``additive``)."""
        b, h, n_q, d = self.q.shape
        mask = "causal" if self.is_causal else "none"
        if self.attn_mask is not None:
            mask = "bool" if self.attn_mask.dtype == torch.bool else "additive"
        return {
            "head_dim": d,
            "head_dim_v": self.v.shape[-1],
            "n_q": n_q,
            "n_k": self.k.shape[2],
            "batch_heads": b * h,
            "gqa_ratio": h // max(self.k.shape[1], 1),
            "layout": self.layout,
            "mask": mask,
        }

    def describe(self) -> str:
        """A one-line summary: ``B=2 H=2 Nq=16 Nk=203 D=64 mask=bool(2,1,1,203) scale=1``."""
        b, h, n_q, d = self.q.shape
        parts = [f"B={b} H={h}", f"Nq={n_q} Nk={self.k.shape[2]} D={d}"]
        if self.k.shape[1] != h:
            parts.append(f"H_kv={self.k.shape[1]}")
        if self.is_causal:
            parts.append("causal")
        if self.attn_mask is not None:
            parts.append(f"mask={self.axes()['mask']}{tuple(self.attn_mask.shape)}".replace(" ", ""))
        parts.append(f"scale={'1/sqrt(D)' if self.scale is None else f'{self.scale:g}'}")
        if self.v.shape[-1] != d:
            parts.insert(2, f"Dv={self.v.shape[-1]}")
        if self.layout != "contiguous":
            parts.append(f"layout={self.layout}")
        if self.poison:
            parts.append(f"poison={self.poison}")
        return " ".join(parts)


#: Scores of the tied keys lie this far below the row max at most (Qiu & Yao's 1e-3).
TIE_WIDTH = 1e-3
_NOISE = 0.1  # spread of the similar low-rank rows around their shared vector


def bias_inputs(
    shape: tuple[int, int, int, int], seed: int, *, repeated: bool, ties: int = 16
) -> dict[str, torch.Tensor]:
    """Float64 ``q, k, v, do, x`` (each ``(B, H, N, D)``) with or without repeated row maxima.

    Per (batch entry, head): ``ties`` keys (1 for the control) score within ``TIE_WIDTH`` of the
    row max ``T ~ U(2, 6)`` (0–2 bf16 ulps of the two leading coordinates apart; every value that
    sets a tie is exact in bf16 and fp16); other keys are ``N(0, 0.5²)``; ``v`` (negative), ``do``
    and ``x`` (positive) are a shared vector plus 10 % noise. ``N`` is both query and key length.

    Raises:
        ValueError: ``D < 3``, or ``ties`` is not between 1 and ``N``.
    """
    b, h, n, d = shape
    if d < 3:
        raise ValueError(f"bias inputs need a head dim of at least 3, got {d}")
    ties = ties if repeated else 1
    if not 1 <= ties <= n:
        raise ValueError(f"ties must be between 1 and the sequence length ({n}), got {ties}")
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=f64)

    scale = d**-0.5
    c = 2.0 ** math.floor(math.log2(TIE_WIDTH / 2 * 2**8 / scale))
    q_bar = draw(b, h, 1, d - 2).abs()
    q = torch.cat([torch.full((b, h, n, 2), c, dtype=f64), q_bar + _NOISE * 3 * draw(b, h, n, d - 2)], -1)
    top = 2 + 4 * torch.rand(b, h, 1, 1, generator=gen, dtype=f64)
    rest = q_bar * (top / scale - 2 * c) / q_bar.square().sum(-1, keepdim=True)
    k_star = torch.cat([torch.ones(b, h, 1, 2, dtype=f64), rest], -1)  # (B, H, 1, D)
    k = 0.5 * draw(b, h, n, d)
    ulps = torch.randint(0, 3, (b, h, ties, 2), generator=gen).to(f64)
    ulps[..., 1] = torch.minimum(ulps[..., 1], 2 - ulps[..., 0])
    ulps[:, :, 0] = 0
    tied = k_star.expand(b, h, ties, d).clone()
    tied[..., :2] -= ulps * 2.0**-8
    k[:, :, :ties] = tied

    def similar(sign: float) -> torch.Tensor:
        shared = sign * (0.5 + torch.rand(b, h, 1, d, generator=gen, dtype=f64))
        return shared + _NOISE * draw(b, h, n, d)

    return {"q": q, "k": k, "v": similar(-1.0), "do": similar(1.0), "x": similar(1.0)}
