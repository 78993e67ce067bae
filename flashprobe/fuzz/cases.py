"""The catalogue of adversarial attention inputs behind ``flashprobe fuzz``.

Each :class:`FuzzCase` has a name, what it probes, the semantics the FP64 golden expects, and a
generator ``make(dtype, generator) -> CaseInputs``. Generators build every tensor in float64 and cast
it to the dtype under test; the golden is computed from the *cast* inputs. Cases that need exact
logits build them with :func:`exact_logit_qk` (scales powers of four, so √scale placements are exact
too). Cases whose logits the dtype cannot hold raise
:class:`~flashprobe.fuzz.inputs.UnrepresentableCaseError` (reported ``skip``).
"""

from __future__ import annotations

import fnmatch
import math
import os
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch

from flashprobe.fuzz._tensors import (
    F64,
    additive_mask,
    finfo_max,
    padding_mask,
    rand,
    randn,
    uniform,
)
from flashprobe.fuzz.inputs import CaseInputs, UnrepresentableCaseError, bias_inputs
from flashprobe.fuzz.layouts import LAYOUT_TEXT
from flashprobe.kernels import default_scale, dtype_name
from flashprobe.kernels.reference import meminfo_available_bytes

__all__ = [
    "CATALOGUE",
    "PROFILES",
    "SENTINELS",
    "SIGNED_BIAS",
    "CasePatterns",
    "FuzzCase",
    "case_generator",
    "exact_logit_qk",
    "select_cases",
]

#: The profiles: ``default`` is what a CI gate can afford; ``full`` adds the long-context cases,
#: every head dim flash-attention tests and the (N_q, N_k) pairs up to 2048.
PROFILES = ("default", "full")


#: The property of the cases whose errors are judged for one sign (:attr:`FuzzCase.bias`).
SIGNED_BIAS = "signed bias"

#: Every property the catalogue tests, with what it is; each case names one (``FuzzCase.property``).
PROPERTIES: dict[str, str] = {
    "sentinel": "valid logits below a finite mask value (−1e4, −5e4, −1e5, −max/2) in scaled logits",
    "raw sentinel": "scores q·kᵀ below −5e4 before the scale (a sentinel compared in the raw domain)",
    "large logits": "logits up to ±finfo.max/4",
    "qk overflow": "q·kᵀ beyond fp16's range while the scaled logits fit",
    "extreme scale": "scales 2^-14 and 2^12",
    "scale zero": "scale=0.0 (falsy)",
    "fully masked row": "rows that see no key: 0, never NaN",
    "one valid key": "rows with exactly one valid key",
    "key padding": "a key-padding mask (B, 1, 1, N_k), right-aligned",
    "left padding": "keys masked at the start of a sequence: the first key tile fully masked",
    "additive mask": "additive masks with -inf and a finite bias",
    "causal": "is_causal with N_q = N_k at odd lengths: the diagonal tiles",
    "causal N_q ≠ N_k": "is_causal with N_q ≠ N_k in SDPA's top-left alignment",
    "partial tile": "lengths and head dims that are no multiple of a tile (or a masked tail block)",
    "decode": "one query against many keys",
    "single key": "N_k = 1",
    "rescaling": "a running max that rises, falls and jumps from tile to tile",
    "outliers": "outlier channels and an attention-sink key",
    "GQA": "fewer k/v heads than query heads (GQA, MQA)",
    "strided inputs": "q, k, v as transposed, fused, expanded and offset views",
    "head dim > 128": "head dims 160–256",
    "D_v ≠ D": "v's head dim different from q's",
    "long context": "8192 keys and more",
    "large grid": "B·H past a launch-grid limit of 1024",
    "poisoned memory": "NaN, Inf or huge values in memory next to the inputs that a kernel must not read",
    "NaN inputs": "a NaN in q stays NaN in exactly the rows that depend on it",
    "output-gradient layout": "a non-contiguous output gradient (transposed, expanded)",
    "output-gradient magnitude": "output gradients of 2^-20 and 2^12 (tiny losses, loss scaling)",
    "large offsets": "tensors past 2^24 (and, in the full profile, 2^31) elements",
    "signed bias": "errors of one sign over many heads (truncating rounding; repeated row maxima, "
    "Qiu & Yao), at 16 bits",
}

#: the output gradients a case can ask for: ``""`` the standard one, ``transposed`` (laid out as
#: (B, N, H, D)), ``expanded`` (stride 0 over heads), ``tiny`` (× 2^-20), ``huge`` (× 2^12)
GRAD_FORMS = ("", "transposed", "expanded", "tiny", "huge")


def case_generator(seed: int, name: str) -> torch.Generator:
    """The generator of a case's inputs: they depend only on ``seed`` and the case's name."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


@dataclass(frozen=True)
class FuzzCase:
    """One adversarial case of the catalogue.

    Attributes:
        name: identifier matched by ``--case`` patterns, e.g. ``sentinel_5e4``.
        probes: what the case is built to expose; expected: what the FP64 golden gives.
        make: ``make(dtype, generator) -> CaseInputs``; raises :class:`UnrepresentableCaseError`
            when the case cannot be posed in ``dtype``.
        backward: its gradients are checked too (not where logits reach the dtype's range).
        profiles: the :data:`PROFILES` that run it.
        property: the property it tests (a key of :data:`PROPERTIES`); also: those it tests as well.
        fixed: what fitting to a kernel's limits must not change (:data:`~flashprobe.fuzz.fit.FIXED`).
        grad: the form of the output gradient, of :data:`GRAD_FORMS`.
        bias: the sign of the errors is judged too (:func:`~flashprobe.fuzz.rule.signed_bias`).
    """

    # (defined before the field ``property``, which hides the builtin in the class body)
    @property
    def properties(self) -> tuple[str, ...]:
        """Every property the case tests: its own, then those it tests as well."""
        return (self.property, *self.also) if self.property else self.also

    name: str
    probes: str
    expected: str
    make: Callable[[torch.dtype, torch.Generator], CaseInputs]
    backward: bool = True
    profiles: tuple[str, ...] = ("default", "full")
    property: str = ""
    also: tuple[str, ...] = ()
    fixed: tuple[str, ...] = ()
    grad: str = ""
    bias: bool = False

    def __post_init__(self) -> None:
        for name in (self.property, *self.also):
            if name and name not in PROPERTIES:
                raise ValueError(
                    f"case {self.name}: unknown property {name!r}; known: {', '.join(PROPERTIES)}"
                )
        if self.grad not in GRAD_FORMS:
            raise ValueError(f"case {self.name}: grad={self.grad!r} must be one of {', '.join(GRAD_FORMS)}")

    def build(self, dtype: torch.dtype, *, seed: int = 0) -> CaseInputs:
        """The case's inputs in ``dtype`` for ``seed`` (:func:`case_generator`), on the CPU.

        Raises:
            UnrepresentableCaseError: the case cannot be posed in ``dtype``.
        """
        return self.make(dtype, case_generator(seed, self.name))


def exact_logit_qk(
    z: torch.Tensor, dtype: torch.dtype, *, head_dim: int, c: float, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys whose scaled logits are exactly ``z`` rounded to ``dtype``.

    Query ``r`` is ``c · e_r`` and key ``j`` holds ``z[..., r, j] / (c · scale)`` in channel ``r``,
    so every dot product has one non-zero term and is exact in any dtype.

    Args:
        z: ``(B, H, N_q, N_k)`` float64 target logits ``q·kᵀ·scale``.
        head_dim: ``D ≥ N_q``.
        c: query magnitude; ``c · scale`` must be a power of two.

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
            f"(max {finfo_max(dtype):.6g})"
        )
    q = torch.zeros(b, h, n_q, head_dim, dtype=F64)
    q[..., torch.arange(n_q), torch.arange(n_q)] = c  # (B, H, N_q, D): row r = c·e_r
    k = torch.zeros(b, h, n_k, head_dim, dtype=F64)
    k[..., :n_q] = (zr / unit).transpose(-2, -1)  # (B, H, N_k, N_q)
    k_cast = k.to(dtype)
    if not torch.equal(k_cast.to(F64), k):
        raise UnrepresentableCaseError(f"key entries z/(c·scale) are not exact in {dtype_name(dtype)}")
    return q.to(dtype), k_cast


# --- the catalogue ---

#: Sentinel name → its value for a dtype: a finite "minus infinity" some kernels mask with.
SENTINELS: dict[str, Callable[[torch.dtype], float]] = {
    "1e4": lambda dtype: -1e4,
    "5e4": lambda dtype: -5e4,
    "1e5": lambda dtype: -1e5,
    "halfmax": lambda dtype: -finfo_max(dtype) / 2,
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
        hi = min(3.0, 0.9 * finfo_max(dtype) / abs(sentinel))
        if hi <= 1.05:
            raise UnrepresentableCaseError(
                f"valid logits below {sentinel:g} do not fit {dtype_name(dtype)} (max {finfo_max(dtype):g})"
            )
        b, h, n_q, n_k, d = 2, 2, 16, 203, 64
        level = sentinel * uniform(gen, 1.05, hi, b, h, n_q, 1)  # every valid logit below the sentinel
        z = level - uniform(gen, 0.0, 8.0, b, h, n_q, n_k)
        q, k = exact_logit_qk(z, dtype, head_dim=d, c=16.0, scale=1.0)
        mask = padding_mask([n_k, 150], n_k)  # batch 0 decode-like (no masked key), batch 1 padded
        return CaseInputs(q=q, k=k, v=randn(gen, b, h, n_k, d).to(dtype), attn_mask=mask, scale=1.0)

    return FuzzCase(
        f"sentinel_{key}",
        f"every valid logit 1.05–3× (as the dtype allows) below the sentinel {_SENTINEL_TEXT[key]}; "
        "one batch decode-like (no masked key), one padded",
        "the exact softmax over the valid keys: neither zeros nor the masked keys' values",
        make,
        backward=key != "halfmax",
    )


def _large_logits(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 3, 32, 203, 64
    big = finfo_max(dtype) / 4  # any difference of two logits stays finite
    z = torch.empty(b, h, n_q, n_k, dtype=F64)
    z[:, 0] = big * uniform(gen, 0.5, 1.0, b, n_q, 1) - uniform(gen, 0, 8, b, n_q, n_k)  # huge, ≈ equal
    magnitude = 10 ** (math.log10(big) * rand(gen, b, n_q, n_k))  # log-uniform in [1, big]
    z[:, 1] = torch.where(rand(gen, b, n_q, n_k) < 0.5, magnitude, -magnitude)
    z[:, 2] = -big * uniform(gen, 0.5, 1.0, b, n_q, 1) - uniform(gen, 0, 8, b, n_q, n_k)
    q, k = exact_logit_qk(z, dtype, head_dim=d, c=16.0, scale=1.0)
    return CaseInputs(q=q, k=k, v=randn(gen, b, h, n_k, d).to(dtype), scale=1.0)


def _qk_overflow(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 2, 2, 64, 203, 64
    q, k, v = randn(gen, b, h, n_q, d), randn(gen, b, h, n_k, d), randn(gen, b, h, n_k, d)
    raw = (q @ k.transpose(-2, -1)).abs().max().item()
    f = math.sqrt(4 * finfo_max(torch.float16) / raw)  # q·kᵀ peaks at 4 × 65504, logits at 32752
    return CaseInputs(q=(q * f).to(dtype), k=(k * f).to(dtype), v=v.to(dtype))


def _scale_tiny(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 32, 203, 64
    scale = 2.0**-14
    level = uniform(gen, 4, 12, b, h, n_q, 1) * torch.where(rand(gen, b, h, n_q, 1) < 0.5, 1.0, -1.0)
    z = level - uniform(gen, 0, 4, b, h, n_q, n_k)  # q·kᵀ = z · 2^14 reaches 2e5
    q, k = exact_logit_qk(z, dtype, head_dim=d, c=256.0, scale=scale)
    return CaseInputs(q=q, k=k, v=randn(gen, b, h, n_k, d).to(dtype), scale=scale)


def _scale_huge(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 64, 203, 64
    small = 2.0**-7
    q, k, v = randn(gen, b, h, n_q, d) * small, randn(gen, b, h, n_k, d) * small, randn(gen, b, h, n_k, d)
    return CaseInputs(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), scale=2.0**12)


def _fully_masked(additive: bool) -> Callable[[torch.dtype, torch.Generator], CaseInputs]:
    def make(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
        b, h, n_q, n_k, d = 2, 2, 37, 150, 40
        inputs = _dense_case(b, h, n_q, n_k, d)(dtype, gen)
        keep = rand(gen, b, h, n_q, n_k) < 0.5
        keep[:, :, ::4] = False  # every 4th row sees no key
        keep[-1, -1] = False  # one whole (batch, head) fully masked
        bias = uniform(gen, -3.0, 0.0, b, h, n_q, n_k) if additive else None  # ALiBi-like, on valid keys
        return replace(inputs, attn_mask=keep if bias is None else additive_mask(keep, bias, dtype))

    return make


def _one_valid_key(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 29, 257, 64
    inputs = _dense_case(b, h, n_q, n_k, d)(dtype, gen)
    index = torch.randint(0, n_k, (b, h, n_q), generator=gen)
    index[..., :3] = torch.tensor([n_k - 1, 0, 128])  # the only key in the last tile, first, mid
    keep = torch.nn.functional.one_hot(index, n_k).bool()  # (B, H, N_q, N_k)
    return replace(inputs, attn_mask=keep)


def _rising_max(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 1, 2, 16, 517, 16  # default scale 1/4: √scale is exact too
    j = torch.arange(n_k, dtype=F64)
    z = uniform(gen, 0.0, 0.5, b, h, n_q, n_k)
    z[..., 0::4, :] += 0.05 * j  # rises: a new running max in every tile
    z[..., 1::4, :] -= 0.05 * j  # falls: the max is in the first tile
    z[..., 2::4, -1] += 40.0  # one jump in the last tile rescales everything before by e^-40
    z[..., 3::4, :] += 20.0 * torch.div(j, 128, rounding_mode="floor")  # steps at tile boundaries
    q, k = exact_logit_qk(z, dtype, head_dim=d, c=4.0, scale=default_scale(d, None))
    return CaseInputs(q=q, k=k, v=randn(gen, b, h, n_k, d).to(dtype))


def _outliers(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n, d = 2, 2, 150, 64
    q, k, v = randn(gen, b, h, n, d), randn(gen, b, h, n, d), randn(gen, b, h, n, d)
    q[..., 3] *= 20.0  # an outlier channel in q and k
    k[..., 3] *= 20.0
    k[..., 0, 3] = 30.0  # key 0 is an attention sink for rows with q[3] > 0
    v[..., 7] *= 1000.0  # a massive-activation channel in v
    return CaseInputs(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), is_causal=True)


def _left_padding(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 3, 2, 64, 300, 64
    inputs = _dense_case(b, h, n_q, n_k, d)(dtype, gen)
    starts = torch.tensor([150, 1, 0]).view(b, 1, 1, 1)  # batch 0: the first 128-key tile fully masked
    return replace(inputs, attn_mask=torch.arange(n_k) >= starts)  # (B, 1, 1, N_k)


def _raw_sentinel(d: int) -> Callable[[torch.dtype, torch.Generator], CaseInputs]:
    def make(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
        b, h, n_q, n_k = 2, 2, 16, 203
        scale = default_scale(d, None)  # 1/8 at D=64, 1/16 at D=256: c · scale is a power of two
        hi = min(3.0, 0.9 * finfo_max(dtype) / 5e4)  # q·kᵀ itself must fit the dtype
        raw = -5e4 * uniform(gen, 1.05, hi, b, h, n_q, 1) - uniform(gen, 0.0, 64.0, b, h, n_q, n_k)
        q, k = exact_logit_qk(raw * scale, dtype, head_dim=d, c=2 / scale, scale=scale)
        mask = padding_mask([n_k, 150], n_k)
        return CaseInputs(q=q, k=k, v=randn(gen, b, h, n_k, d).to(dtype), attn_mask=mask)

    return make


def _nan_inputs(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    b, h, n_q, n_k, d = 2, 2, 150, 150, 64
    inputs = _dense_case(b, h, n_q, n_k, d, lengths=[n_k, 100])(dtype, gen)
    inputs.q[0, 0, 3, 5] = float("nan")  # one query: only its row depends on it
    inputs.q[1, 1, 140] = float("nan")
    inputs.k[1, 0, 20, 0] = float("nan")  # a key every query of (batch 1, head 0) sees: the whole head
    return inputs


def _int32_offsets(elements: int) -> Callable[[torch.dtype, torch.Generator], CaseInputs]:
    def make(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
        n, d = 128, 128
        b = -(-elements // (n * d)) + 1  # just past ``elements`` per tensor
        need = b * n * d * (4 * dtype.itemsize + 4 * 8)  # q, k, v, out in the dtype; float64 golden
        have = _available_memory()
        if need > 0.8 * have:
            raise UnrepresentableCaseError(
                f"{b * n * d:.3g} elements per tensor need about {need / 2**30:.0f} GiB here, "
                f"{have / 2**30:.0f} GiB are available"
            )
        q = torch.randn(b, 1, n, d, generator=gen, dtype=dtype)
        k = torch.randn(b, 1, n, d, generator=gen, dtype=dtype)
        v = torch.randn(b, 1, n, d, generator=gen, dtype=dtype)
        return CaseInputs(q=q, k=k, v=v, is_causal=True)

    return make


def _available_memory() -> int:
    """Bytes of memory available to this process (``MemAvailable``; the physical total elsewhere)."""
    available = meminfo_available_bytes()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if available is None else available


#: The shape of the signed-bias cases: 256 (batch, head) replicates of 8192 elements.
_BIAS_SHAPE = (8, 32, 128, 64)  # (B, H, N, D)


def _bias_repeated_max(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
    seed = int(torch.randint(2**31 - 1, (1,), generator=gen))
    x = bias_inputs(_BIAS_SHAPE, seed, repeated=True)
    return CaseInputs(q=x["q"].to(dtype), k=x["k"].to(dtype), v=x["v"].to(dtype))


_SOFTMAX = "the exact softmax"


def _dense_case(
    b: int,
    h: int,
    n_q: int,
    n_k: int,
    d: int,
    *,
    d_v: int | None = None,
    h_kv: int | None = None,
    causal: bool = False,
    lengths: list[int] | None = None,
    additive: bool = False,
    layout: str = "contiguous",
    scale: float | None = None,
    poison: str = "",
) -> Callable[[torch.dtype, torch.Generator], CaseInputs]:
    """A generator of standard normal inputs of one shape (``lengths``: a key-padding mask, bool or
    ``additive`` 0/-inf; ``poison``: what fills the memory around q, k, v)."""

    def make(dtype: torch.dtype, gen: torch.Generator) -> CaseInputs:
        kv = h if h_kv is None else h_kv
        q = randn(gen, b, h, n_q, d).to(dtype)
        k = randn(gen, b, kv, n_k, d).to(dtype)
        v = randn(gen, b, kv, n_k, d if d_v is None else d_v).to(dtype)
        mask = None if lengths is None else padding_mask(lengths, n_k)
        if additive and mask is not None:
            mask = additive_mask(mask, torch.zeros(mask.shape, dtype=F64), dtype)
        inputs = CaseInputs(q=q, k=k, v=v, attn_mask=mask, is_causal=causal, scale=scale, poison=poison)
        return inputs.with_layout(layout)

    return make


#: head dims flash-attention's tests use; those of the default profile, the rest in ``full``
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
_DEFAULT_HEAD_DIMS = (160, 192, 224, 256)
#: (N_q, N_k) pairs of the full profile's shape sweep: odd sizes, N_q ≠ N_k both ways, up to 2048
SHAPE_PAIRS = ((113, 203), (203, 113), (1, 2048), (2047, 1023), (257, 2048), (2048, 2048))
_FULL = ("full",)


def _shape_cases() -> list[FuzzCase]:
    cases = [
        FuzzCase(
            f"layout_{layout}",
            f"inputs as {LAYOUT_TEXT[layout]}; causal, B=2 H=3 N=77 D=40",
            "the same answer as for contiguous inputs",
            _dense_case(2, 3, 77, 77, 40, causal=True, layout=layout),
        )
        for layout in LAYOUT_TEXT
    ]
    cases += [
        FuzzCase(
            f"head_dim_{d}",
            f"head dim {d} > 128 (channels past 128 must count), N_q=33, N_k=77",
            _SOFTMAX,
            _dense_case(1, 2, 33, 77, d),
        )
        for d in _DEFAULT_HEAD_DIMS
    ]
    cases += [
        FuzzCase(
            "head_dim_qk192_v128",
            "q, k head dim 192, v head dim 128 (as DeepSeek's MLA); padded",
            f"{_SOFTMAX} (unsupported where the kernel needs D_v = D)",
            _dense_case(2, 2, 45, 131, 192, d_v=128, lengths=[131, 70]),
        ),
        FuzzCase(
            "head_dim_qk128_v64",
            "q, k head dim 128, v head dim 64 (D_v ≠ D at head dims most kernels take); causal",
            f"{_SOFTMAX} (unsupported where the kernel needs D_v = D)",
            _dense_case(1, 2, 130, 130, 128, d_v=64, causal=True),
        ),
        FuzzCase(
            "keys_mod128_64",
            "N_k=320 (N_k % 128 == 64: a half tile at the end), N_q=61",
            _SOFTMAX,
            _dense_case(1, 2, 61, 320, 64),
        ),
        FuzzCase(
            "long_context_8k",
            "N_k=8192 keys (past 4096), N_q=32, D=16, padded lengths 5000, 8192",
            f"{_SOFTMAX}; the golden in bounded memory",
            _dense_case(2, 1, 32, 8192, 16, lengths=[5000, 8192]),
        ),
        FuzzCase(
            "large_grid",
            "B·H = 1280 (B=8, H=160): heads past a launch-grid limit of 1024",
            _SOFTMAX,
            _dense_case(8, 160, 16, 16, 16, causal=True),
        ),
        FuzzCase(
            "mqa",
            "multi-query attention: 6 query heads share 1 k/v head, padded",
            "attention with the k/v head repeated for every query head (unsupported if rejected)",
            _dense_case(2, 6, 45, 203, 64, h_kv=1, lengths=[203, 100]),
        ),
        FuzzCase(
            "long_context_16k",
            "N_k=16384 keys, N_q=1024, D=64 (full profile)",
            f"{_SOFTMAX}; the golden in bounded memory",
            _dense_case(1, 1, 1024, 16384, 64),
            profiles=_FULL,
        ),
        FuzzCase(
            "decode_32k",
            "decode: N_q=1 against 32768 keys, H=2, D=128, padded (full profile)",
            f"{_SOFTMAX}; the golden in bounded memory",
            _dense_case(2, 2, 1, 32768, 128, lengths=[32768, 20000]),
            profiles=_FULL,
        ),
    ]
    for i, d in enumerate(HEAD_DIMS):
        n_q, n_k = SHAPE_PAIRS[i % len(SHAPE_PAIRS)]
        cases.append(
            FuzzCase(
                f"shape_d{d}_{n_q}x{n_k}",
                f"head dim {d}, N_q={n_q}, N_k={n_k}, causal (full profile)",
                _SOFTMAX,
                _dense_case(1, 1, n_q, n_k, d, causal=True),
                profiles=_FULL,
            )
        )
    return cases


_GRAD_TEXT = {
    "transposed": "laid out as (B, N, H, D) (a transposed view, as a model's projection hands it back)",
    "expanded": "one head's, expanded to every head with stride 0",
    "tiny": "× 2^-20 (a tiny loss: dS underflows in 16 bits)",
    "huge": "× 2^12 (loss scaling)",
}


#: case name (a glob) → (property, properties it tests as well, what fitting must not change)
_CASE_PROPERTIES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "sentinel_*": ("sentinel", (), ()),
    "raw_sentinel_*": ("raw sentinel", (), ()),
    "large_logits": ("large logits", (), ()),
    "qk_overflow": ("qk overflow", (), ()),
    "scale_tiny": ("extreme scale", (), ()),
    "scale_huge": ("extreme scale", (), ()),
    "scale_zero*": ("scale zero", (), ()),
    "fully_masked_rows": ("fully masked row", (), ()),
    "fully_masked_additive": ("fully masked row", ("additive mask",), ()),
    "one_valid_key": ("one valid key", (), ()),
    "causal_nq_*": ("causal N_q ≠ N_k", (), ("lengths",)),
    "padding_mask": ("key padding", ("fully masked row", "one valid key"), ()),
    "padding_mask_additive": ("additive mask", ("key padding",), ()),
    "left_padding": ("left padding", ("key padding",), ()),
    "odd_shapes": ("partial tile", (), ("tail",)),
    "odd_shapes_causal": ("causal", (), ()),
    "keys_mod128_64": ("partial tile", (), ("tail",)),
    "single_query": ("decode", (), ("lengths",)),
    "decode_32k": ("decode", ("long context",), ("lengths",)),
    "single_key": ("single key", (), ()),
    "rising_max": ("rescaling", (), ()),
    "outliers": ("outliers", (), ()),
    "gqa_broadcast": ("GQA", (), ("gqa",)),
    "mqa": ("GQA", (), ("gqa",)),
    "layout_*": ("strided inputs", (), ()),
    "head_dim_qk192_v128": ("D_v ≠ D", (), ("head_dim",)),
    "head_dim_qk128_v64": ("D_v ≠ D", (), ()),
    "head_dim_*": ("head dim > 128", (), ("head_dim",)),
    "long_context_*": ("long context", (), ()),
    "large_grid": ("large grid", (), ()),
    "shape_d256_2048x2048": ("causal", (), ()),  # every size a power of two: no partial tile
    "shape_d*": ("partial tile", (), ()),
    "poisoned_*": ("poisoned memory", (), ()),
    "nan_*": ("NaN inputs", (), ()),
    "grad_out_transposed": ("output-gradient layout", (), ()),
    "grad_out_expanded": ("output-gradient layout", (), ()),
    "grad_out_tiny": ("output-gradient magnitude", (), ()),
    "grad_out_huge": ("output-gradient magnitude", (), ()),
    "offsets_*": ("large offsets", (), ()),
    "bias_*": ("signed bias", (), ()),
}


def _with_property(case: FuzzCase) -> FuzzCase:
    """``case`` with the property of the first matching entry of :data:`_CASE_PROPERTIES`."""
    for pattern, (prop, also, fixed) in _CASE_PROPERTIES.items():
        if fnmatch.fnmatchcase(case.name, pattern):
            return replace(case, property=prop, also=also, fixed=fixed)
    raise ValueError(f"case {case.name} names no property: add it to _CASE_PROPERTIES")


#: Every case, by name, in the order ``flashprobe fuzz`` runs them.
CATALOGUE: dict[str, FuzzCase] = {
    c.name: _with_property(c)
    for c in [
        *(_sentinel_case(key) for key in SENTINELS),
        FuzzCase(
            "large_logits",
            "logits up to ±finfo.max/4: huge equal positives, log-uniform magnitudes, huge negatives",
            f"{_SOFTMAX}; a kernel must subtract the row max before exp()",
            _large_logits,
            backward=False,
        ),
        FuzzCase(
            "qk_overflow",
            "dense q, k without QK-norm: q·kᵀ reaches 4 × 65504 (overflows fp16), scaled logits fit",
            f"{_SOFTMAX} of finite logits (fp16 kernels must not form q·kᵀ unscaled in fp16)",
            _qk_overflow,
            backward=False,
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
            _dense_case(2, 2, 33, 203, 64, lengths=[203, 77], scale=0.0),
        ),
        FuzzCase(
            "scale_zero_causal",
            "scale=0.0 with is_causal (0 · -inf is NaN if the mask is applied before the scale)",
            "query i averages the values of keys 0..i",
            _dense_case(1, 2, 67, 67, 64, causal=True, scale=0.0),
        ),
        FuzzCase(
            "fully_masked_rows",
            "bool mask with rows (and one whole head) where every key is masked",
            "0 for fully masked rows (torch SDPA's convention), never NaN",
            _fully_masked(additive=False),
        ),
        FuzzCase(
            "fully_masked_additive",
            "additive mask: -inf rows plus a finite bias on the valid keys",
            "0 for fully masked rows, never NaN; the bias is added to the valid logits",
            _fully_masked(additive=True),
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
            _dense_case(1, 2, 45, 203, 64, causal=True),
        ),
        FuzzCase(
            "causal_nq_gt_nk",
            "is_causal with N_q=203 > N_k=45",
            "top-left aligned: queries i ≥ 45 see every key",
            _dense_case(1, 2, 203, 45, 64, causal=True),
        ),
        FuzzCase(
            "padding_mask",
            "key-padding mask (B, 1, 1, N_k) with lengths 0, 1, 129, 203",
            "softmax over each sequence's first `length` keys; a length-0 sequence gives 0",
            _dense_case(4, 2, 64, 203, 64, lengths=[0, 1, 129, 203]),
        ),
        FuzzCase(
            "padding_mask_additive",
            "additive 0/-inf key-padding mask (B, 1, 1, N_k) with lengths 203, 77, 1, 128",
            "softmax over each sequence's first `length` keys",
            _dense_case(4, 2, 64, 203, 64, lengths=[203, 77, 1, 128], additive=True),
        ),
        FuzzCase(
            "odd_shapes",
            "D=59, N_q=113, N_k=203: no size is a multiple of a tile",
            _SOFTMAX,
            _dense_case(2, 3, 113, 203, 59),
        ),
        FuzzCase(
            "odd_shapes_causal",
            "causal, D=111, N_q=N_k=131",
            _SOFTMAX,
            _dense_case(1, 2, 131, 131, 111, causal=True),
        ),
        FuzzCase(
            "single_query",
            "decode: N_q=1, N_k=259, D=80, padded lengths 259, 130, 1",
            _SOFTMAX,
            _dense_case(3, 2, 1, 259, 80, lengths=[259, 130, 1]),
        ),
        FuzzCase("single_key", "N_k=1", "v of the only key, for every query", _dense_case(2, 2, 33, 1, 64)),
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
            "left_padding",
            "left-padded keys (B, 1, 1, N_k): batch 0 masks keys 0–149 (its first 128-key tile), batch 1 "
            "key 0, batch 2 none",
            "softmax over each sequence's keys from its start on; no NaN from a fully masked first tile",
            _left_padding,
        ),
        *(
            FuzzCase(
                f"raw_sentinel_5e4{'' if d == 64 else f'_d{d}'}",
                f"scores q·kᵀ 1.05–3× below −5e4 before the scale 1/√{d} (scaled logits about "
                f"{-5e4 / math.sqrt(d):.0f} and below), padded",
                "the exact softmax: a sentinel compared with the unscaled scores must not zero the rows",
                _raw_sentinel(d),
            )
            for d in (64, 256)
        ),
        *(
            FuzzCase(
                f"poisoned_{value}",
                f"{value} in the memory around q, k, v (a key tail of 128 rows past N_k, 64 channels past "
                "D): the views are correct, the storage beside them is not; key padding, D=40",
                "the exact softmax: a kernel never reads memory past its tensors' views",
                _dense_case(2, 2, 77, 203, 40, lengths=[203, 130], poison=value),
            )
            for value in ("nan", "huge")
        ),
        FuzzCase(
            "nan_inputs",
            "NaN in two query rows and in one key every query of a head sees; key padding",
            "NaN in exactly the rows that depend on a NaN (the two rows, the whole head), exact elsewhere",
            _nan_inputs,
            backward=False,
        ),
        *(
            FuzzCase(
                f"grad_out_{form}",
                f"causal, B=2 H=3 N=150 D=64, output gradient {_GRAD_TEXT[form]}",
                "the exact gradients dq, dk, dv for that output gradient",
                _dense_case(2, 3, 150, 150, 64, causal=True),
                grad=form,
            )
            for form in GRAD_FORMS
            if form
        ),
        FuzzCase(
            "offsets_2e24",
            "q, k, v of just over 2^24 elements each (B=1025, N=128, D=128, causal): element offsets "
            "past fp32's exact integers",
            _SOFTMAX,
            _int32_offsets(2**24),
            backward=False,
        ),
        FuzzCase(
            "offsets_2e31",
            "q, k, v of just over 2^31 elements each: int32 element offsets overflow (full profile; "
            "skipped with the memory it needs where the machine lacks it)",
            _SOFTMAX,
            _int32_offsets(2**31),
            backward=False,
            profiles=_FULL,
        ),
        FuzzCase(
            "bias_dense",
            "B={} H={} N={} D={} standard normal: 256 heads whose signed mean errors must not share a sign "
            "(a rounding toward zero passes every per-call limit)".format(*_BIAS_SHAPE),
            f"{_SOFTMAX}; errors of either sign: z within ±5 (bf16, fp16)",
            _dense_case(*_BIAS_SHAPE[:3], *_BIAS_SHAPE[2:]),  # N_q = N_k, no mask
            bias=True,
        ),
        FuzzCase(
            "bias_repeated_max",
            "repeated row maxima: 16 keys within 1e-3 of each row's max, similar low-rank rows "
            "(Qiu & Yao; the inputs of `bench bias`), 256 heads",
            f"{_SOFTMAX}; errors of either sign: z within ±5 (bf16, fp16)",
            _bias_repeated_max,
            bias=True,
        ),
        FuzzCase(
            "gqa_broadcast",
            "grouped-query attention: 8 query heads share 2 k/v heads (causal)",
            "attention with each k/v head repeated for its 4 query heads (unsupported if rejected)",
            _dense_case(2, 8, 97, 97, 64, h_kv=2, causal=True),
        ),
        *_shape_cases(),
    ]
}


@dataclass(frozen=True)
class CasePatterns:
    """``--case`` globs: those that select names, and those given with a ``-`` or ``!`` prefix, which
    remove the names they match, e.g. ``["*", "-gqa_*"]``.

    Attributes:
        given: the non-empty patterns, in the order given.
        include: the selecting globs (none: every name is selected).
        exclude: the removing globs, prefix stripped.
    """

    given: list[str]
    include: list[str]
    exclude: list[str]

    @classmethod
    def parse(cls, patterns: Iterable[str] | None) -> CasePatterns:
        """Split ``patterns`` (None: none); empty strings are ignored."""
        given = [p for p in patterns or [] if p]
        include = [p for p in given if not p.startswith(("-", "!"))]
        return cls(given, include, [p[1:] for p in given if p.startswith(("-", "!"))])

    @property
    def removals(self) -> list[str]:
        """The removing patterns as given (prefix kept)."""
        return [p for p in self.given if p.startswith(("-", "!"))]

    def selects(self, name: str) -> bool:
        """Whether ``name`` matches a selecting glob (any name when there is none) and no removing one."""
        included = not self.include or any(fnmatch.fnmatchcase(name, p) for p in self.include)
        return included and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)


def select_cases(patterns: Iterable[str] | None = None, *, profile: str = "default") -> list[FuzzCase]:
    """The catalogue cases of ``profile`` matching any of the glob ``patterns`` (all when none).

    A pattern starting with ``-`` or ``!`` removes the cases it matches, e.g. ``["*", "-gqa_*"]``;
    a case named exactly runs whatever its profile.

    Raises:
        ValueError: a positive pattern matches no case, or an unknown profile.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r} must be one of {', '.join(PROFILES)}")
    chosen = CasePatterns.parse(patterns)
    for pattern in chosen.include:
        if not fnmatch.filter(CATALOGUE, pattern):
            raise ValueError(f"case pattern {pattern!r} matches no case; cases: {', '.join(CATALOGUE)}")
    return [
        case
        for name, case in CATALOGUE.items()
        if (profile in case.profiles or name in chosen.include) and chosen.selects(name)
    ]
