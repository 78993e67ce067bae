"""The catalogue of adversarial attention inputs behind ``flashprobe fuzz``, and its random family.

Each :class:`FuzzCase` has a name, a line saying what it probes, the semantics the FP64 golden
expects, and a generator ``make(dtype, generator) -> CaseInputs``. Generators build every tensor in
float64 and cast it to the dtype under test; the golden is then computed in float64 *from the cast
inputs*, so it is the exact answer to the question the kernel was asked.

Where a case needs precise logits (the sentinel cases, huge magnitudes, tiny scales, a running max
that rises tile after tile) it builds them exactly: query ``r`` is ``c·e_r`` (one-hot, ``c`` a power
of two) and key ``j`` carries ``z[r, j] / (c · scale)`` in channel ``r``, so ``q·kᵀ·scale = z`` with a
single non-zero product per dot product: no rounding in any dtype once ``z`` itself is rounded to
the dtype (``c · scale`` is a power of two). This needs ``D ≥ N_q``. Those cases use scales that are
powers of four, so kernels that scale q and k by √scale each (torch SDPA) get the same exact logits
and the baseline's noise floor is not made artificially small for them.

Cases whose logits the dtype cannot hold (valid logits below −1e5 in fp16, whose max is 65504)
raise :class:`UnrepresentableCaseError`; ``flashprobe fuzz`` reports them as ``skip``.

:class:`RandomCaseSpec` describes one sample of the randomised search (``--budget``): shapes, mask
kind, logit spread, a per-row logit level (e.g. below a sentinel), scale and outliers; it can be
halved along each size, which is how failures are shrunk to small reproducers.
"""

from __future__ import annotations

import fnmatch
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

import torch

from flashprobe.kernels import default_scale, dtype_name

__all__ = [
    "CATALOGUE",
    "MASK_KINDS",
    "SENTINELS",
    "CaseInputs",
    "FuzzCase",
    "RandomCaseSpec",
    "UnrepresentableCaseError",
    "exact_logit_qk",
    "make_random_case",
    "sample_random_spec",
    "select_cases",
]

F64 = torch.float64


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
        return self.q.dtype

    def to(self, device: torch.device | str) -> CaseInputs:
        """The same inputs on ``device``."""
        mask = None if self.attn_mask is None else self.attn_mask.to(device)
        return replace(self, q=self.q.to(device), k=self.k.to(device), v=self.v.to(device), attn_mask=mask)

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


@dataclass(frozen=True)
class FuzzCase:
    """One adversarial case of the catalogue.

    Attributes:
        name: short identifier used by ``--case`` patterns, e.g. ``sentinel_5e4``.
        probes: what the case is built to expose, one line.
        expected: the semantics the FP64 golden gives, one line.
        make: ``make(dtype, generator) -> CaseInputs``; raises :class:`UnrepresentableCaseError`
            when the case cannot be posed in ``dtype``.
    """

    name: str
    probes: str
    expected: str
    make: Callable[[torch.dtype, torch.Generator], CaseInputs]


# --------------------------------------------------------------------------------------------
# building blocks


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=gen, dtype=F64)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def _uniform(gen: torch.Generator, lo: float, hi: float, *shape: int) -> torch.Tensor:
    return lo + (hi - lo) * _rand(gen, *shape)


def _finfo_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def exact_logit_qk(
    z: torch.Tensor, dtype: torch.dtype, *, head_dim: int, c: float, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys whose scaled logits are exactly ``z`` rounded to ``dtype``.

    Query ``r`` is ``c · e_r`` and key ``j`` holds ``z[..., r, j] / (c · scale)`` in channel ``r``,
    so every dot product has one non-zero term and is exact in any dtype.

    Args:
        z: ``(B, H, N_q, N_k)`` float64 target logits ``q·kᵀ·scale``.
        dtype: the dtype under test.
        head_dim: ``D ≥ N_q``.
        c: query magnitude; ``c · scale`` must be a power of two.
        scale: the softmax scale the case passes to the kernel.

    Returns:
        ``q`` ``(B, H, N_q, D)`` and ``k`` ``(B, H, N_k, D)`` in ``dtype``.

    Raises:
        UnrepresentableCaseError: a logit or key entry does not fit ``dtype``.
    """
    b, h, n_q, n_k = z.shape
    if head_dim < n_q:
        raise ValueError(f"exact logits need head_dim ≥ N_q, got D={head_dim}, N_q={n_q}")
    unit = c * scale
    if unit <= 0 or math.frexp(unit)[0] != 0.5:
        raise ValueError(f"c · scale = {unit} must be a power of two for exact logits")
    zr = z.to(dtype).to(F64)
    if not torch.isfinite(zr).all():
        raise UnrepresentableCaseError(
            f"logits up to {z.abs().max().item():.3g} overflow {dtype_name(dtype)} "
            f"(max {_finfo_max(dtype):.6g})"
        )
    q = torch.zeros(b, h, n_q, head_dim, dtype=F64)
    q[..., torch.arange(n_q), torch.arange(n_q)] = c  # (B, H, N_q, D): row r = c·e_r
    k = torch.zeros(b, h, n_k, head_dim, dtype=F64)
    k[..., :n_q] = (zr / unit).transpose(-2, -1)  # (B, H, N_k, N_q)
    k_cast = k.to(dtype)
    if not torch.equal(k_cast.to(F64), k):
        raise UnrepresentableCaseError(f"key entries z/(c·scale) are not exact in {dtype_name(dtype)}")
    return q.to(dtype), k_cast


def _padding_mask(lengths: Iterable[int], n_k: int) -> torch.Tensor:
    """``(B, 1, 1, N_k)`` boolean key-padding mask keeping the first ``length`` keys of each batch."""
    lengths = torch.tensor(list(lengths))
    return (torch.arange(n_k) < lengths[:, None]).view(len(lengths), 1, 1, n_k)


def _additive(keep: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float mask: ``bias`` where ``keep``, ``-inf`` elsewhere, in ``dtype``."""
    return torch.where(keep, bias, float("-inf")).to(dtype)


def _dense(
    gen: torch.Generator, dtype: torch.dtype, b: int, h: int, n_q: int, n_k: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard normal q ``(b, h, n_q, d)``, k and v ``(b, h, n_k, d)`` cast to ``dtype``."""
    q, k, v = _randn(gen, b, h, n_q, d), _randn(gen, b, h, n_k, d), _randn(gen, b, h, n_k, d)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --------------------------------------------------------------------------------------------
# the catalogue

#: Sentinel name → its value for a dtype. Kernels that use a finite "minus infinity" as the masked
#: logit and as the initial running max return zeros for rows whose valid logits lie below it.
SENTINELS: dict[str, Callable[[torch.dtype], float]] = {
    "1e4": lambda dtype: -1e4,
    "5e4": lambda dtype: -5e4,
    "1e5": lambda dtype: -1e5,
    "halfmax": lambda dtype: -_finfo_max(dtype) / 2,
}

_SENTINEL_TEXT = {
    "1e4": "−1e4",
    "5e4": "−5e4 (FlashInfer before PR 4401)",
    "1e5": "−1e5 (TransformerLens)",
    "halfmax": "−finfo(dtype).max/2",
}


def _sentinel_case(key: str) -> FuzzCase:
    def make(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
        sentinel = SENTINELS[key](dtype)
        hi = min(3.0, 0.9 * _finfo_max(dtype) / abs(sentinel))
        if hi <= 1.05:
            raise UnrepresentableCaseError(
                f"valid logits below {sentinel:g} do not fit {dtype_name(dtype)} (max {_finfo_max(dtype):g})"
            )
        b, h, n_q, n_k, d = 2, 2, 16, 203, 64
        level = sentinel * _uniform(gen, 1.05, hi, b, h, n_q, 1)  # every valid logit below the sentinel
        z = level - _uniform(gen, 0.0, 8.0, b, h, n_q, n_k)
        q, k = exact_logit_qk(z, dtype, head_dim=d, c=16.0, scale=1.0)
        mask = _padding_mask([n_k, 150], n_k)  # batch 0 decode-like (no masked key), batch 1 padded
        return CaseInputs(q=q, k=k, v=_randn(gen, b, h, n_k, d).to(dtype), attn_mask=mask, scale=1.0)

    return FuzzCase(
        f"sentinel_{key}",
        f"every valid logit 1.05–3× (as the dtype allows) below the sentinel {_SENTINEL_TEXT[key]}; "
        "one batch decode-like (no masked key), one padded",
        "the exact softmax over the valid keys: neither zeros nor the masked keys' values",
        make,
    )


def _large_logits(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 3, 32, 203, 64
    big = _finfo_max(dtype) / 4  # any difference of two logits stays finite
    z = torch.empty(b, h, n_q, n_k, dtype=F64)
    z[:, 0] = big * _uniform(gen, 0.5, 1.0, b, n_q, 1) - _uniform(gen, 0, 8, b, n_q, n_k)  # huge, ≈ equal
    magnitude = 10 ** (math.log10(big) * _rand(gen, b, n_q, n_k))  # log-uniform in [1, big]
    z[:, 1] = torch.where(_rand(gen, b, n_q, n_k) < 0.5, magnitude, -magnitude)
    z[:, 2] = -big * _uniform(gen, 0.5, 1.0, b, n_q, 1) - _uniform(gen, 0, 8, b, n_q, n_k)
    q, k = exact_logit_qk(z, dtype, head_dim=d, c=16.0, scale=1.0)
    return CaseInputs(q=q, k=k, v=_randn(gen, b, h, n_k, d).to(dtype), scale=1.0)


def _qk_overflow(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 2, 2, 64, 203, 64
    q, k, v = _randn(gen, b, h, n_q, d), _randn(gen, b, h, n_k, d), _randn(gen, b, h, n_k, d)
    raw = (q @ k.transpose(-2, -1)).abs().max().item()
    f = math.sqrt(4 * _finfo_max(torch.float16) / raw)  # q·kᵀ peaks at 4 × 65504, logits at 32752
    return CaseInputs(q=(q * f).to(dtype), k=(k * f).to(dtype), v=v.to(dtype))


def _scale_tiny(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 32, 203, 64
    scale = 2.0**-14
    level = _uniform(gen, 4, 12, b, h, n_q, 1) * torch.where(_rand(gen, b, h, n_q, 1) < 0.5, 1.0, -1.0)
    z = level - _uniform(gen, 0, 4, b, h, n_q, n_k)  # q·kᵀ = z · 2^14 reaches 2e5
    q, k = exact_logit_qk(z, dtype, head_dim=d, c=256.0, scale=scale)
    return CaseInputs(q=q, k=k, v=_randn(gen, b, h, n_k, d).to(dtype), scale=scale)


def _scale_huge(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 64, 203, 64
    small = 2.0**-7
    q, k, v = _randn(gen, b, h, n_q, d) * small, _randn(gen, b, h, n_k, d) * small, _randn(gen, b, h, n_k, d)
    return CaseInputs(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), scale=2.0**12)


def _scale_zero(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 2, 2, 33, 203, 64
    q, k, v = _dense(gen, dtype, b, h, n_q, n_k, d)
    return CaseInputs(q=q, k=k, v=v, attn_mask=_padding_mask([n_k, 77], n_k), scale=0.0)


def _scale_zero_causal(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    q, k, v = _dense(gen, dtype, 1, 2, 67, 67, 64)
    return CaseInputs(q=q, k=k, v=v, is_causal=True, scale=0.0)


def _fully_masked_keep(gen: torch.Generator, b: int, h: int, n_q: int, n_k: int) -> torch.Tensor:
    keep = _rand(gen, b, h, n_q, n_k) < 0.5
    keep[:, :, ::4] = False  # every 4th row sees no key
    keep[-1, -1] = False  # one whole (batch, head) fully masked
    return keep


def _fully_masked_rows(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 2, 2, 37, 150, 40
    q, k, v = _dense(gen, dtype, b, h, n_q, n_k, d)
    return CaseInputs(q=q, k=k, v=v, attn_mask=_fully_masked_keep(gen, b, h, n_q, n_k))


def _fully_masked_additive(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 2, 2, 37, 150, 40
    q, k, v = _dense(gen, dtype, b, h, n_q, n_k, d)
    keep = _fully_masked_keep(gen, b, h, n_q, n_k)
    bias = _uniform(gen, -3.0, 0.0, b, h, n_q, n_k)  # an ALiBi-like bias on the valid keys
    return CaseInputs(q=q, k=k, v=v, attn_mask=_additive(keep, bias, dtype))


def _one_valid_key(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 29, 257, 64
    q, k, v = _dense(gen, dtype, b, h, n_q, n_k, d)
    index = torch.randint(0, n_k, (b, h, n_q), generator=gen)
    index[..., :3] = torch.tensor([n_k - 1, 0, 128])  # the only key in the last tile, first, mid
    keep = torch.nn.functional.one_hot(index, n_k).bool()  # (B, H, N_q, N_k)
    return CaseInputs(q=q, k=k, v=v, attn_mask=keep)


def _causal(n_q: int, n_k: int) -> Callable[[torch.dtype, torch.Generator], CaseInputs]:
    def make(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
        q, k, v = _dense(gen, dtype, 1, 2, n_q, n_k, 64)
        return CaseInputs(q=q, k=k, v=v, is_causal=True)

    return make


def _padding(lengths: list[int], additive: bool) -> Callable[[torch.dtype, torch.Generator], CaseInputs]:
    def make(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
        n_k = 203
        q, k, v = _dense(gen, dtype, len(lengths), 2, 64, n_k, 64)
        keep = _padding_mask(lengths, n_k)
        mask = _additive(keep, torch.zeros(keep.shape, dtype=F64), dtype) if additive else keep
        return CaseInputs(q=q, k=k, v=v, attn_mask=mask)

    return make


def _odd_shapes(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    q, k, v = _dense(gen, dtype, 2, 3, 113, 203, 59)
    return CaseInputs(q=q, k=k, v=v)


def _odd_shapes_causal(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    q, k, v = _dense(gen, dtype, 1, 2, 131, 131, 111)
    return CaseInputs(q=q, k=k, v=v, is_causal=True)


def _single_query(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    n_k = 259
    q, k, v = _dense(gen, dtype, 3, 2, 1, n_k, 80)
    return CaseInputs(q=q, k=k, v=v, attn_mask=_padding_mask([n_k, 130, 1], n_k))


def _single_key(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    q, k, v = _dense(gen, dtype, 2, 2, 33, 1, 64)
    return CaseInputs(q=q, k=k, v=v)


def _rising_max(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 16, 517, 16  # default scale 1/4: √scale is exact too
    j = torch.arange(n_k, dtype=F64)
    z = _uniform(gen, 0.0, 0.5, b, h, n_q, n_k)
    z[..., 0::4, :] += 0.05 * j  # rises: a new running max in every tile
    z[..., 1::4, :] -= 0.05 * j  # falls: the max is in the first tile
    z[..., 2::4, -1] += 40.0  # one jump in the last tile rescales everything before by e^-40
    z[..., 3::4, :] += 20.0 * torch.div(j, 128, rounding_mode="floor")  # steps at tile boundaries
    q, k = exact_logit_qk(z, dtype, head_dim=d, c=4.0, scale=default_scale(d, None))
    return CaseInputs(q=q, k=k, v=_randn(gen, b, h, n_k, d).to(dtype))


def _outliers(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n, d = 2, 2, 150, 64
    q, k, v = _randn(gen, b, h, n, d), _randn(gen, b, h, n, d), _randn(gen, b, h, n, d)
    q[..., 3] *= 20.0  # an outlier channel in q and k
    k[..., 3] *= 20.0
    k[..., 0, 3] = 30.0  # key 0 is an attention sink for rows with q[3] > 0
    v[..., 7] *= 1000.0  # a massive-activation channel in v
    return CaseInputs(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), is_causal=True)


def _gqa_broadcast(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, h_kv, n, d = 2, 8, 2, 97, 64
    q, k, v = _randn(gen, b, h, n, d), _randn(gen, b, h_kv, n, d), _randn(gen, b, h_kv, n, d)
    return CaseInputs(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), is_causal=True)


_SOFTMAX = "the exact softmax"

#: Every case, by name, in the order ``flashprobe fuzz`` runs them.
CATALOGUE: dict[str, FuzzCase] = {
    c.name: c
    for c in [
        *(_sentinel_case(key) for key in SENTINELS),
        FuzzCase(
            "large_logits",
            "logits up to ±finfo.max/4: huge equal positives, log-uniform magnitudes, huge negatives",
            f"{_SOFTMAX}; a kernel must subtract the row max before exp()",
            _large_logits,
        ),
        FuzzCase(
            "qk_overflow",
            "dense q, k without QK-norm: q·kᵀ reaches 4 × 65504 (overflows fp16), scaled logits fit",
            f"{_SOFTMAX} of finite logits (fp16 kernels must not form q·kᵀ unscaled in fp16)",
            _qk_overflow,
        ),
        FuzzCase(
            "scale_tiny",
            "scale 2^-14 with large q, k: logits in ±12 but q·kᵀ up to 2e5",
            f"{_SOFTMAX}; apply the scale before q·kᵀ leaves the dtype's range",
            _scale_tiny,
        ),
        FuzzCase(
            "scale_huge",
            "scale 2^12 with tiny q, k (entries ~2^-7, products near fp16's smallest normal)",
            _SOFTMAX,
            _scale_huge,
        ),
        FuzzCase(
            "scale_zero",
            "scale=0.0 (falsy: `scale or 1/sqrt(d)` silently uses the default)",
            "the plain average of the valid values",
            _scale_zero,
        ),
        FuzzCase(
            "scale_zero_causal",
            "scale=0.0 with is_causal (0 · -inf is NaN if the mask is applied before the scale)",
            "query i averages the values of keys 0..i",
            _scale_zero_causal,
        ),
        FuzzCase(
            "fully_masked_rows",
            "bool mask with rows (and one whole head) where every key is masked",
            "0 for fully masked rows (torch SDPA's convention), never NaN",
            _fully_masked_rows,
        ),
        FuzzCase(
            "fully_masked_additive",
            "additive mask: -inf rows plus a finite bias on the valid keys",
            "0 for fully masked rows, never NaN; the bias is added to the valid logits",
            _fully_masked_additive,
        ),
        FuzzCase(
            "one_valid_key",
            "exactly one valid key per row, some in the last tile after fully masked tiles",
            "exactly v of that key",
            _one_valid_key,
        ),
        FuzzCase(
            "causal_nq_lt_nk",
            "is_causal with N_q=45 < N_k=203",
            "top-left aligned causal mask (query i sees keys j ≤ i), as torch SDPA",
            _causal(45, 203),
        ),
        FuzzCase(
            "causal_nq_gt_nk",
            "is_causal with N_q=203 > N_k=45",
            "top-left aligned: queries i ≥ 45 see every key",
            _causal(203, 45),
        ),
        FuzzCase(
            "padding_mask",
            "key-padding mask (B, 1, 1, N_k) with lengths 0, 1, 129, 203",
            "softmax over each sequence's first `length` keys; a length-0 sequence gives 0",
            _padding([0, 1, 129, 203], additive=False),
        ),
        FuzzCase(
            "padding_mask_additive",
            "additive 0/-inf key-padding mask (B, 1, 1, N_k) with lengths 203, 77, 1, 128",
            "softmax over each sequence's first `length` keys",
            _padding([203, 77, 1, 128], additive=True),
        ),
        FuzzCase(
            "odd_shapes",
            "D=59, N_q=113, N_k=203: no size is a multiple of a tile",
            _SOFTMAX,
            _odd_shapes,
        ),
        FuzzCase(
            "odd_shapes_causal",
            "causal, D=111, N_q=N_k=131",
            _SOFTMAX,
            _odd_shapes_causal,
        ),
        FuzzCase(
            "single_query",
            "decode: N_q=1, N_k=259, D=80, padded lengths 259, 130, 1",
            _SOFTMAX,
            _single_query,
        ),
        FuzzCase("single_key", "N_k=1", "v of the only key, for every query", _single_key),
        FuzzCase(
            "rising_max",
            "logits that set a new running max in every tile, fall, step at tile edges, jump by 40",
            f"{_SOFTMAX}; stresses the online-softmax rescaling",
            _rising_max,
        ),
        FuzzCase(
            "outliers",
            "outlier channels (q, k ×20; v ×1000) and an attention-sink key, causal",
            _SOFTMAX,
            _outliers,
        ),
        FuzzCase(
            "gqa_broadcast",
            "grouped-query attention: 8 query heads share 2 k/v heads (causal)",
            "attention with each k/v head repeated for its 4 query heads (unsupported if rejected)",
            _gqa_broadcast,
        ),
    ]
}


def select_cases(patterns: Iterable[str] | None = None) -> list[FuzzCase]:
    """The catalogue cases matching any of the glob ``patterns`` (all when none are given).

    A pattern starting with ``-`` or ``!`` removes the cases it matches, e.g. ``["*", "-gqa_*"]``.

    Raises:
        ValueError: a positive pattern matches no case; the message lists the case names.
    """
    patterns = [p for p in (patterns or []) if p]
    include = [p for p in patterns if not p.startswith(("-", "!"))] or ["*"]
    exclude = [p[1:] for p in patterns if p.startswith(("-", "!"))]
    for pattern in include:
        if not fnmatch.filter(CATALOGUE, pattern):
            raise ValueError(f"case pattern {pattern!r} matches no case; cases: {', '.join(CATALOGUE)}")
    return [
        case
        for name, case in CATALOGUE.items()
        if any(fnmatch.fnmatchcase(name, p) for p in include)
        and not any(fnmatch.fnmatchcase(name, p) for p in exclude)
    ]


# --------------------------------------------------------------------------------------------
# randomised search

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
        level: a per-row logit offset around this value (e.g. below a sentinel); 0 for none.
            Carried by the last channel of ``q`` and ``k``, so it needs ``head_dim ≥ 2``; q and k
            then lie on an integer grid that makes every logit exact in the dtype.
        scale: the softmax scale, ``None`` for ``1/sqrt(D)``.
        outliers: scale channel 0 of q, k by 8 and of v by 1000.
        seed: seed of the tensors.
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

    def __post_init__(self) -> None:
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask={self.mask!r} must be one of {', '.join(MASK_KINDS)}")
        for name in ("batch", "heads", "n_q", "n_k", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be ≥ 1")
        if self.level and self.head_dim < 2:
            raise ValueError("a logit level needs head_dim ≥ 2 (it uses the last channel)")

    #: the sizes that shrinking halves, in the order it tries them
    SIZES = ("n_q", "n_k", "head_dim", "batch", "heads")

    def halved(self, size: str) -> RandomCaseSpec | None:
        """This spec with ``size`` halved, or ``None`` when it cannot shrink further."""
        value = getattr(self, size)
        smallest = 2 if (size == "head_dim" and self.level) else 1
        if value // 2 < smallest:
            return None
        return replace(self, **{size: value // 2})

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
        return text + (" outliers" if self.outliers else "")


def sample_random_spec(rng: random.Random, dtype: torch.dtype) -> RandomCaseSpec:
    """Draw one random case: shapes, mask kind, logit spread and level, scale, outliers.

    The scale is the default with probability 0.6, zero with 0.05, else log-uniform within 10^±2
    of the default. With probability 0.4 every row's logits sit below one of :data:`SENTINELS`
    (×1.05 … ×3, and ×1 … ×1.1 per row), among those for which both the logits and the unscaled
    ``q·kᵀ`` fit ``dtype``: the level is a construct of the search, so it must not overflow by
    itself (the catalogue's ``qk_overflow`` and ``scale_tiny`` test that); such samples get the
    nearest power of four as their scale, so their logits are exact (:func:`make_random_case`).
    """
    head_dim = rng.randint(2, 128)
    u = rng.random()
    scale = None if u < 0.6 else 0.0 if u < 0.65 else default_scale(head_dim, None) * 10 ** rng.uniform(-2, 2)
    level = 0.0
    if rng.random() < 0.4 and scale != 0.0:
        scale = 4.0 ** round(math.log(default_scale(head_dim, scale), 4))  # exact √scale as well
        limit = 0.8 * _finfo_max(dtype) * min(1.0, scale) / 1.1
        fitting = [s(dtype) for s in SENTINELS.values() if 1.05 * abs(s(dtype)) < limit]
        if fitting:
            sentinel = rng.choice(fitting)
            level = sentinel * rng.uniform(1.05, min(3.0, limit / abs(sentinel)))
    return RandomCaseSpec(
        batch=rng.randint(1, 3),
        heads=rng.randint(1, 4),
        n_q=round(10 ** rng.uniform(0, math.log10(160))),
        n_k=round(10 ** rng.uniform(0, math.log10(300))),
        head_dim=head_dim,
        mask=rng.choices(list(MASK_KINDS), weights=list(MASK_KINDS.values()))[0],
        logit_std=10 ** rng.uniform(-1, 1.5),
        level=level,
        scale=scale,
        outliers=rng.random() < 0.15,
        seed=rng.randrange(2**31),
    )


def _level_grid_qk(
    gen: torch.Generator, spec: RandomCaseSpec, dtype: torch.dtype, scale: float
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """q, k on an integer grid: logits ≈ dense + a per-row level, every dot product exact in ``dtype``.

    Every entry is an integer times a power of two and ``q_d · k_d`` a multiple of one unit ``u``;
    with ``Σ|q_d k_d| ≤ 2^p · u`` (``p`` the significand bits) every partial sum is representable,
    so ``q·kᵀ`` is exact in any summation order, in every kernel. The level rides on the last
    channel (``q = n_r · 2^e``, ``k = −2^e'``); the scale is a power of four (see
    :func:`sample_random_spec`), so ``q·kᵀ·scale`` and torch's ``(q√s)·(k√s)`` are exact too.

    Returns:
        ``q (B, H, N_q, D)``, ``k (B, H, N_k, D)`` in float64 (exact in ``dtype``) and the logit
        unit ``u · scale``.
    """
    b, h, n_q, n_k, d = spec.batch, spec.heads, spec.n_q, spec.n_k, spec.head_dim
    budget = 2.0 ** (1 - round(math.log2(torch.finfo(dtype).eps)))  # 2^p: 256 bf16, 2048 fp16, 2^24 fp32
    shift = spec.level * _uniform(gen, 1.0, 1.1, b, h, n_q)  # per-row logit level
    unit = 2.0 ** math.ceil(math.log2(abs(spec.level) * 1.1 / scale / (budget / 4)))  # level ≤ budget/4 units
    e_q = math.floor(math.log2(unit) / 2)
    e_k = round(math.log2(unit)) - e_q
    dense = d - 1
    top = max(1, math.isqrt(int(budget / 2 / max(dense, 1))))  # dense part ≤ budget/2 units
    sigma = math.sqrt(spec.logit_std / (scale * unit * math.sqrt(max(dense, 1))))
    a = (_randn(gen, b, h, n_q, dense) * sigma).round().clamp(-top, top)
    c = (_randn(gen, b, h, n_k, dense) * sigma).round().clamp(-top, top)
    q = torch.cat([a, (shift.abs() / (scale * unit)).round().unsqueeze(-1)], dim=-1) * 2.0**e_q
    k = torch.cat([c, -torch.ones(b, h, n_k, 1, dtype=F64)], dim=-1) * 2.0**e_k
    return q, k, unit * scale


def make_random_case(spec: RandomCaseSpec, dtype: torch.dtype) -> CaseInputs:
    """Build the inputs of a random sample in ``dtype`` (deterministic in ``spec``).

    Samples with a logit level use :func:`_level_grid_qk` (exact logits, so the verdict does not
    hinge on how each kernel rounds a sum dominated by the level; outliers then only scale v);
    the others use normal q, k scaled to ``logit_std``. Special structure is anchored at index 0
    (row 0 fully masked, batch 0 of length 0, ...) so it survives halving the sizes.
    """
    gen = torch.Generator().manual_seed(spec.seed)
    b, h, n_q, n_k, d = spec.batch, spec.heads, spec.n_q, spec.n_k, spec.head_dim
    scale = default_scale(d, spec.scale)
    bias_unit = 0.0  # additive biases snap to multiples of this (exact logits), when positive
    if spec.level and scale > 0:
        q, k, bias_unit = _level_grid_qk(gen, spec, dtype, scale)
    else:
        sigma = math.sqrt(spec.logit_std / (scale * math.sqrt(d))) if scale > 0 else 1.0
        q, k = _randn(gen, b, h, n_q, d) * sigma, _randn(gen, b, h, n_k, d) * sigma
        if spec.outliers:
            q[..., 0] *= 8.0
            k[..., 0] *= 8.0
    v = _randn(gen, b, h, n_k, d)
    if spec.outliers:
        v[..., 0] *= 1000.0
    mask: torch.Tensor | None = None
    causal = spec.mask == "causal"
    if spec.mask == "padding":
        lengths = torch.randint(0, n_k + 1, (b,), generator=gen)
        if _rand(gen, 1).item() < 0.3:
            lengths[0] = 0
        mask = _padding_mask(lengths.tolist(), n_k)
    elif spec.mask == "random":
        mask = _rand(gen, b, h, n_q, n_k) < _uniform(gen, 0.02, 0.9, 1).item()
    elif spec.mask == "fully_masked_rows":
        mask = _rand(gen, b, h, n_q, n_k) < 0.5
        mask[..., 0, :] = False
        mask[_rand(gen, b, h, n_q) < 0.3] = False
    elif spec.mask == "one_valid_key":
        mask = torch.nn.functional.one_hot(torch.randint(0, n_k, (b, h, n_q), generator=gen), n_k).bool()
    elif spec.mask == "additive":
        keep = _rand(gen, b, h, n_q, n_k) < 0.7
        if _rand(gen, 1).item() < 0.5:
            keep[..., 0, :] = False
        bias = _uniform(gen, -4.0, 0.0, b, h, n_q, n_k)
        if bias_unit > 0:
            bias = (bias / bias_unit).round() * bias_unit
        mask = _additive(keep, bias, dtype)
    return CaseInputs(
        q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), attn_mask=mask, is_causal=causal, scale=spec.scale
    )
