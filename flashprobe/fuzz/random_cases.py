"""The random family of ``flashprobe fuzz --budget``: :class:`RandomCaseSpec` samples of shapes,
masks, logit spreads and levels (e.g. below a sentinel), scales and outliers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from flashprobe.fuzz._tensors import F64, additive_mask, finfo_max, padding_mask, rand, randn, uniform
from flashprobe.fuzz.cases import HEAD_DIMS, SENTINELS
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.layouts import LAYOUTS
from flashprobe.kernels import KernelCapabilities, default_scale

__all__ = [
    "MASK_KINDS",
    "MAX_KEYS",
    "MAX_SCORES",
    "RandomCaseSpec",
    "make_random_case",
    "sample_random_spec",
    "shared_limits",
]

#: Most keys a random sample has, per profile (lengths are drawn log-uniformly up to it).
MAX_KEYS = {"default": 8192, "full": 16384}
#: Most scores ``B · H · N_q · N_k`` of one random sample (N_q is redrawn smaller beyond it).
MAX_SCORES = 1 << 20

#: Mask kinds the random search samples, with their weights.
MASK_KINDS: dict[str, float] = {
    "none": 0.15,
    "causal": 0.2,
    "padding": 0.15,
    "random": 0.15,
    "fully_masked_rows": 0.12,
    "one_valid_key": 0.08,
    "additive": 0.15,
}


@dataclass(frozen=True, kw_only=True)
class RandomCaseSpec:
    """One sample of the randomised search; :func:`make_random_case` turns it into inputs.

    Attributes:
        batch, heads, n_q, n_k, head_dim: the shape ``(B, H, N_q|N_k, D)``.
        mask: one of :data:`MASK_KINDS`.
        logit_std: standard deviation of the logits ``q·kᵀ·scale`` (before the level).
        level: a per-row logit offset around this value (e.g. below a sentinel); 0 for none. It
            rides on the last channel of ``q`` and ``k`` (``head_dim ≥ 2``), exact logits.
        scale: the softmax scale, ``None`` for ``1/sqrt(D)``.
        outliers: scale channel 0 of q, k by 8 and of v by 1000.
        kv_heads: key/value heads (a divisor of ``heads``); 0 for ``heads``.
        layout: the inputs' memory layout (:data:`~flashprobe.fuzz.layouts.LAYOUTS`).
        shared_mask: a bool mask is one ``(B, 1, N_q, N_k)`` mask shared by every head.
    """

    batch: int
    heads: int
    n_q: int
    n_k: int
    head_dim: int
    mask: str
    logit_std: float
    level: float
    scale: float | None
    outliers: bool
    seed: int
    kv_heads: int = 0
    layout: str = "contiguous"
    shared_mask: bool = False

    def __post_init__(self) -> None:
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (0: no GQA)")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {', '.join(LAYOUTS)}")
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask={self.mask!r} must be one of {', '.join(MASK_KINDS)}")
        for name in ("batch", "heads", "n_q", "n_k", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be ≥ 1")
        if self.level and self.head_dim < 2:
            raise ValueError("a logit level needs head_dim ≥ 2 (it uses the last channel)")

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        scale = "1/sqrt(D)" if self.scale is None else f"{self.scale:.3g}"
        text = (
            f"B={self.batch} H={self.heads} Nq={self.n_q} Nk={self.n_k} D={self.head_dim} "
            f"mask={self.mask} logit_std={self.logit_std:.3g} scale={scale}"
        )
        if self.level:
            text += f" level={self.level:.3g}"
        if self.kv_heads:
            text += f" H_kv={self.kv_heads}"
        if self.layout != "contiguous":
            text += f" layout={self.layout}"
        if self.shared_mask:
            text += " shared-mask"
        return text + (" outliers" if self.outliers else "")


def _shape(rng: random.Random, profile: str) -> dict[str, int]:
    """Batch, heads (GQA), lengths (log-uniform up to :data:`MAX_KEYS`) of one sample; one in ten
    is a large grid (B·H from 256 to 2048, lengths ≤ 32)."""
    if rng.random() < 0.1:
        batch, heads = rng.randint(2, 8), rng.choice([128, 160, 256])
        n_q, n_k = rng.randint(1, 32), rng.randint(1, 32)
    else:
        batch, heads = rng.randint(1, 3), rng.choice([1, 2, 3, 4, 6, 8])
        n_k = round(10 ** rng.uniform(0, math.log10(MAX_KEYS[profile])))
        most_q = max(1, min(2048, MAX_SCORES // (batch * heads * n_k)))
        n_q = round(10 ** rng.uniform(0, math.log10(most_q)))
    kv_heads = 0
    if heads > 1 and rng.random() < 0.3:  # grouped-query (or multi-query) attention
        kv_heads = rng.choice([d for d in range(1, heads) if heads % d == 0])
    return {"batch": batch, "heads": heads, "n_q": n_q, "n_k": n_k, "kv_heads": kv_heads}


#: the kernel mask kinds (:data:`~flashprobe.kernels.registry.MASK_KINDS`) each sampled mask needs
_NEEDS = {
    "none": (),
    "causal": ("causal",),
    "padding": ("key_padding", "bool", "head_shared"),
    "random": ("bool", "head_shared"),
    "fully_masked_rows": ("bool", "head_shared"),
    "one_valid_key": ("bool", "head_shared"),
    "additive": ("float",),
}


def _mask_kinds(caps: KernelCapabilities) -> frozenset[str]:
    """The mask kinds a kernel takes, with those its kinds include (any bool mask is shared by every
    head when it has one head; a key-padding mask is one)."""
    implied = {"bool": {"head_shared", "key_padding"}, "head_shared": {"key_padding"}}
    return frozenset(caps.masks).union(*(implied.get(m, set()) for m in caps.masks))


def shared_limits(caps: Sequence[KernelCapabilities]) -> KernelCapabilities:
    """What every kernel of ``caps`` takes (lengths' multiples are fitted per kernel later)."""
    if not caps:
        return KernelCapabilities()
    listed = [c.head_dims for c in caps if c.head_dims is not None]
    largest = [c.max_head_dim for c in caps if c.max_head_dim is not None]
    return KernelCapabilities(
        masks=frozenset.intersection(*(_mask_kinds(c) for c in caps)),
        head_dims=frozenset.intersection(*listed) or None if listed else None,
        max_head_dim=min(largest) if largest else None,
        head_dim_multiple=math.lcm(*(c.head_dim_multiple for c in caps)),
        gqa="none" if any(c.gqa == "none" for c in caps) else "native",
        causal_cross=all(c.causal_cross for c in caps),
        same_length=any(c.same_length for c in caps),
        contiguous=any(c.contiguous for c in caps),
    )


def sample_random_spec(
    rng: random.Random,
    dtype: torch.dtype,
    profile: str = "default",
    limits: KernelCapabilities | None = None,
) -> RandomCaseSpec:
    """Draw one random case: shapes, GQA, layout, mask kind, logit spread and level, scale, outliers.

    With probability 0.4 every row's logits sit below one of :data:`SENTINELS` that both the logits
    and the unscaled ``q·kᵀ`` fit in ``dtype``; such samples get a power of four as their scale, so
    their logits are exact. ``limits`` (:func:`shared_limits`) keeps the sample inside what the
    kernels take.
    """
    head_dim = rng.choice(HEAD_DIMS) if rng.random() < 0.5 else rng.randint(2, 256)
    if limits is not None:
        head_dim = _head_dim_within(head_dim, limits)
    u = rng.random()
    scale = None if u < 0.6 else 0.0 if u < 0.65 else default_scale(head_dim, None) * 10 ** rng.uniform(-2, 2)
    level = 0.0
    if rng.random() < 0.4 and scale != 0.0:
        scale = 4.0 ** round(math.log(default_scale(head_dim, scale), 4))  # exact √scale as well
        limit = 0.8 * finfo_max(dtype) * min(1.0, scale) / 1.1
        fitting = [s(dtype) for s in SENTINELS.values() if 1.05 * abs(s(dtype)) < limit]
        if fitting:
            sentinel = rng.choice(fitting)
            level = sentinel * rng.uniform(1.05, min(3.0, limit / abs(sentinel)))
    masks = [m for m in MASK_KINDS if limits is None or not _NEEDS[m] or limits.masks & set(_NEEDS[m])]
    shape = _shape(rng, profile)
    layout = rng.choice(LAYOUTS)
    mask = rng.choices(masks, weights=[MASK_KINDS[m] for m in masks])[0]
    shared = False
    if limits is not None:
        shape["kv_heads"] = 0 if limits.gqa == "none" else shape["kv_heads"]
        if limits.same_length or (mask == "causal" and not limits.causal_cross):
            side = min(shape["n_k"], math.isqrt(MAX_SCORES // (shape["batch"] * shape["heads"])))
            shape["n_q"] = shape["n_k"] = max(side, 1)
        layout = "contiguous" if limits.contiguous else layout
        shared = mask in ("random", "fully_masked_rows", "one_valid_key") and "bool" not in limits.masks
    return RandomCaseSpec(
        **shape,
        layout=layout,
        shared_mask=shared,
        head_dim=head_dim,
        mask=mask,
        logit_std=10 ** rng.uniform(-1, 1.5),
        level=level,
        scale=scale,
        outliers=rng.random() < 0.15,
        seed=rng.randrange(2**31),
    )


def _head_dim_within(d: int, limits: KernelCapabilities) -> int:
    """``d`` moved to a head dim ``limits`` take: one they list, or a multiple up to their largest."""
    if limits.head_dims:
        return sorted(limits.head_dims)[d % len(limits.head_dims)]
    m = limits.head_dim_multiple
    d = -(-d // m) * m
    if limits.max_head_dim is not None and d > limits.max_head_dim:
        d = max(limits.max_head_dim // m * m, m)
    return d


def _level_grid_qk(
    gen: torch.Generator, spec: RandomCaseSpec, dtype: torch.dtype, scale: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """q, k on an integer grid: logits ≈ dense + a per-row level, every dot product exact in ``dtype``.

    Every product ``q_d · k_d`` is a multiple of one unit ``u`` and ``Σ|q_d k_d| ≤ 2^p · u`` (``p``
    the significand bits), so ``q·kᵀ`` is exact in any summation order. The level rides on the last
    channel.

    Returns:
        ``q (B, H, N_q, D)``, ``k (B, H_kv, N_k, D)`` in float64 (exact in ``dtype``) and the logit
        unit ``u · scale``.
    """
    b, h, n_q, n_k, d = spec.batch, spec.heads, spec.n_q, spec.n_k, spec.head_dim
    h_kv = spec.kv_heads or h
    budget = 2.0 ** (1 - round(math.log2(torch.finfo(dtype).eps)))  # 2^p: 256 bf16, 2048 fp16, 2^24 fp32
    shift = spec.level * uniform(gen, 1.0, 1.1, b, h, n_q)  # per-row logit level
    unit = 2.0 ** math.ceil(math.log2(abs(spec.level) * 1.1 / scale / (budget / 4)))  # level ≤ budget/4 units
    e_q = math.floor(math.log2(unit) / 2)
    e_k = round(math.log2(unit)) - e_q
    dense = d - 1
    top = max(1, math.isqrt(int(budget / 2 / max(dense, 1))))  # dense part ≤ budget/2 units
    sigma = math.sqrt(spec.logit_std / (scale * unit * math.sqrt(max(dense, 1))))
    a = (randn(gen, b, h, n_q, dense) * sigma).round().clamp(-top, top)
    c = (randn(gen, b, h_kv, n_k, dense) * sigma).round().clamp(-top, top)
    q = torch.cat([a, (shift.abs() / (scale * unit)).round().unsqueeze(-1)], dim=-1) * 2.0**e_q
    k = torch.cat([c, -torch.ones(b, h_kv, n_k, 1, dtype=F64)], dim=-1) * 2.0**e_k
    return q, k, unit * scale


def _random_qk(
    gen: torch.Generator, spec: RandomCaseSpec, dtype: torch.dtype, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Float64 q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_k, D)`` of a sample, and the unit additive
    biases are snapped to (0: none)."""
    b, h, n_q, n_k, d = spec.batch, spec.heads, spec.n_q, spec.n_k, spec.head_dim
    h_kv = spec.kv_heads or h
    bias_unit = 0.0
    if spec.level and scale > 0:
        q, k, bias_unit = _level_grid_qk(gen, spec, dtype, scale)
    else:
        sigma = math.sqrt(spec.logit_std / (scale * math.sqrt(d))) if scale > 0 else 1.0
        q, k = randn(gen, b, h, n_q, d) * sigma, randn(gen, b, h_kv, n_k, d) * sigma
        if spec.outliers:
            q[..., 0] *= 8.0
            k[..., 0] *= 8.0
    v = randn(gen, b, h_kv, n_k, d)
    if spec.outliers:
        v[..., 0] *= 1000.0
    return q, k, v, bias_unit


def _random_mask(
    gen: torch.Generator, spec: RandomCaseSpec, dtype: torch.dtype, bias_unit: float
) -> torch.Tensor | None:
    """The sample's mask (``None`` for ``none`` and ``causal``), anchored at index 0.

    Returns:
        ``(B, 1, 1, N_k)`` for ``padding``, else ``(B, H, N_q, N_k)``: bool, or additive in ``dtype``.
    """
    b, h, n_q, n_k = spec.batch, 1 if spec.shared_mask else spec.heads, spec.n_q, spec.n_k
    if spec.mask == "padding":
        lengths = torch.randint(0, n_k + 1, (b,), generator=gen)
        if rand(gen, 1).item() < 0.3:
            lengths[0] = 0
        return padding_mask(lengths.tolist(), n_k)
    if spec.mask == "random":
        return rand(gen, b, h, n_q, n_k) < uniform(gen, 0.02, 0.9, 1).item()
    if spec.mask == "fully_masked_rows":
        mask = rand(gen, b, h, n_q, n_k) < 0.5
        mask[..., 0, :] = False
        mask[rand(gen, b, h, n_q) < 0.3] = False
        return mask
    if spec.mask == "one_valid_key":
        return torch.nn.functional.one_hot(torch.randint(0, n_k, (b, h, n_q), generator=gen), n_k).bool()
    if spec.mask == "additive":
        keep = rand(gen, b, h, n_q, n_k) < 0.7
        if rand(gen, 1).item() < 0.5:
            keep[..., 0, :] = False
        bias = uniform(gen, -4.0, 0.0, b, h, n_q, n_k)
        if bias_unit > 0:
            bias = (bias / bias_unit).round() * bias_unit
        return additive_mask(keep, bias, dtype)
    return None


def make_random_case(spec: RandomCaseSpec, dtype: torch.dtype) -> CaseInputs:
    """Build the inputs of a random sample in ``dtype`` (deterministic in ``spec``): q ``(B, H, N_q,
    D)``, k and v ``(B, H_kv, N_k, D)`` laid out as ``spec.layout``. Special structure is anchored at
    index 0 so it survives halving the sizes."""
    gen = torch.Generator().manual_seed(spec.seed)
    q, k, v, bias_unit = _random_qk(gen, spec, dtype, default_scale(spec.head_dim, spec.scale))
    mask = _random_mask(gen, spec, dtype, bias_unit)
    return CaseInputs(
        q=q.to(dtype),
        k=k.to(dtype),
        v=v.to(dtype),
        attn_mask=mask,
        is_causal=spec.mask == "causal",
        scale=spec.scale,
    ).with_layout(spec.layout)
