"""FP8 numerics of the ``tiled`` re-implementation: formats, scales, casts and the Hadamard rotation.

What FP8 attention kernels (FlashAttention-3's FP8 forward, cuDNN's) do, emulated on any device:

* **Q, K, V** are multiplied by a scale (per tensor, per head or per tile of rows; from the amax so
  the largest magnitude maps to the format's largest value, or static) and cast to FP8; the kernel
  multiplies the fp32 GEMM result by the inverse scale (the *descale*).
* **P** is multiplied by a static scale ``S`` and cast to FP8 before the ``P·V`` GEMM; the running
  sum stays fp32, so ``S`` cancels (FA3: ``S = 2^8``).
* **Incoherent processing** (FA3 §3.3): Q and K times one random orthogonal ``diag(±1)·H/√d``
  before quantization; ``(QM)(KM)ᵀ = QKᵀ``, and an outlier channel is spread over all channels.

Every cast saturates (clamps to ``±max`` first, as the GPU's ``cvt.rn.satfinite``; NaN stays NaN)
and rounds to nearest even. An FP8 GEMM multiplies the FP8 *values* in fp32 and the descales
multiply its fp32 result, as the kernels do: descaling the operands first can overflow fp32 partial
sums where the kernel's do not. FP8 is forward only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "AMAX",
    "FP8_DTYPES",
    "FP8_FORMATS",
    "FP8_PRESETS",
    "GRANULARITIES",
    "OFF",
    "ROTATIONS",
    "Fp8Numerics",
    "Fp8Operands",
    "cast_fp8",
    "cast_p",
    "dequantize",
    "fp8_max",
    "fp8_options",
    "hadamard_rotation",
    "is_power_of_two",
    "prepare_operands",
    "quantize",
    "realisation_shifts",
    "resolve_fp8",
]

#: Knob value that turns an FP8 cast or the rotation off (in a spec, ``none`` means "the preset's").
OFF = "off"
#: The FP8 formats and their torch dtypes (``e4m3``: 4 exponent, 3 mantissa bits, no infinity).
FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_FORMATS = tuple(FP8_DTYPES)
#: How many values share one scale: the whole tensor, one (batch, head), or one tile of rows
#: (``block_q`` rows of Q, ``block_k`` rows of K and V, as FA3's "block quantization").
GRANULARITIES = ("tensor", "head", "block")
#: Rotations of Q and K before quantization.
ROTATIONS = (OFF, "hadamard")
#: The value of ``qkv_scale`` that picks scales from the amax.
AMAX = "amax"

#: FP8 presets: the FP8 knobs they set (the tile numerics are in ``tiled.PRESETS``).
FP8_PRESETS: dict[str, dict[str, Any]] = {
    "fa3_fp8": {
        "qkv_fp8": "e4m3",
        "p_fp8": "e4m3",
        "p_scale": 256.0,
        "fp8_scaling": "block",
        "qkv_scale": AMAX,
        "rotation": "hadamard",
    },
}
#: The FP8 knobs' values when no FP8 preset sets them: FP8 off.
_FP8_DEFAULTS: dict[str, Any] = {
    "qkv_fp8": OFF,
    "p_fp8": OFF,
    "p_scale": 1.0,
    "fp8_scaling": "tensor",
    "qkv_scale": AMAX,
    "rotation": OFF,
}


@dataclass(frozen=True)
class Fp8Numerics:
    """The resolved FP8 knobs of one ``tiled`` call (``tiled``'s ``qkv_fp8``, ``p_fp8``, ``p_scale``,
    ``fp8_scaling``, ``qkv_scale``, ``rotation``, ``rotation_seed``; formats ``"off"`` when not cast)."""

    qkv: str = OFF
    p: str = OFF
    p_scale: float = 1.0
    scaling: str = "tensor"
    qkv_scale: str | float = AMAX
    rotation: str = OFF
    rotation_seed: int = 0

    @property
    def active(self) -> bool:
        """True when anything is cast to FP8 or rotated."""
        return self.qkv != OFF or self.p != OFF or self.rotation != OFF

    def labels(self) -> dict[str, Any]:
        """What a result row names: ``fp8_qkv``, ``fp8_scaling``, ``fp8_p``, ``p_scale``, ``rotation``."""
        scale = self.qkv_scale if self.qkv_scale == AMAX else f"static {self.qkv_scale:g}"
        return {
            "fp8_qkv": self.qkv,
            "fp8_scaling": f"{self.scaling} {scale}" if self.qkv != OFF else "-",
            "fp8_p": self.p,
            "p_scale": self.p_scale if self.p != OFF else None,
            "rotation": f"hadamard (seed {self.rotation_seed})" if self.rotation != OFF else OFF,
        }

    def describe(self) -> str:
        """One line such as ``"QKV e4m3 (block amax), P e4m3 ×256, rotation hadamard (seed 0)"``."""
        lab = self.labels()
        qkv = f"QKV {self.qkv}" + (f" ({lab['fp8_scaling']})" if self.qkv != OFF else "")
        p = f"P {self.p}" + (f" ×{self.p_scale:g}" if self.p != OFF else "")
        return f"{qkv}, {p}, rotation {lab['rotation']}"


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError naming them all."""
    if value not in choices:
        quoted = [repr(c) for c in choices]
        raise ValueError(f"tiled: {name}={value!r} must be {', '.join(quoted[:-1])} or {quoted[-1]}")
    return str(value)


def check_seed(name: str, value: Any) -> int:
    """``value`` if it is an integer ≥ 0 (a seed), else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"tiled: {name}={value!r} must be an integer ≥ 0")
    return value


def _positive(name: str, value: Any) -> float:
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"tiled: {name}={value!r} must be a finite positive number")
    return float(number)


def resolve_fp8(
    preset: str | None = None,
    *,
    qkv_fp8: str | None = None,
    p_fp8: str | None = None,
    p_scale: float | None = None,
    fp8_scaling: str | None = None,
    qkv_scale: str | float | None = None,
    rotation: str | None = None,
    rotation_seed: int = 0,
) -> Fp8Numerics:
    """The FP8 knobs of a call: the preset's (FP8 off without one), overridden by those not None.

    Raises:
        ValueError: a knob value that is not allowed, naming the allowed ones.
    """
    knobs = {**_FP8_DEFAULTS, **FP8_PRESETS.get(preset or "", {})}
    given = {
        "qkv_fp8": qkv_fp8,
        "p_fp8": p_fp8,
        "p_scale": p_scale,
        "fp8_scaling": fp8_scaling,
        "qkv_scale": qkv_scale,
        "rotation": rotation,
    }
    knobs |= {key: value for key, value in given.items() if value is not None}
    formats = (*FP8_FORMATS, OFF)
    scale = knobs["qkv_scale"]
    if scale != AMAX:
        if isinstance(scale, str):
            raise ValueError(
                f"tiled: qkv_scale={scale!r} must be 'amax' or a positive number (a static scale)"
            )
        scale = _positive("qkv_scale", scale)
    seed = check_seed("rotation_seed", rotation_seed)
    return Fp8Numerics(
        qkv=check_choice("qkv_fp8", knobs["qkv_fp8"], formats),
        p=check_choice("p_fp8", knobs["p_fp8"], formats),
        p_scale=_positive("p_scale", knobs["p_scale"]),
        scaling=check_choice("fp8_scaling", knobs["fp8_scaling"], GRANULARITIES),
        qkv_scale=scale,
        rotation=check_choice("rotation", knobs["rotation"], ROTATIONS),
        rotation_seed=seed,
    )


def fp8_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The FP8 knobs among a ``tiled`` spec's options (for :func:`resolve_fp8`)."""
    return {key: options[key] for key in (*_FP8_DEFAULTS, "rotation_seed") if key in options}


def fp8_max(fmt: str) -> float:
    """The largest finite value of ``fmt``: 448 for E4M3, 57344 for E5M2."""
    return float(torch.finfo(FP8_DTYPES[fmt]).max)


def cast_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` (any shape; fp64 is rounded to fp32 first) rounded to the FP8 format ``fmt``, saturating
    at ``±fp8_max(fmt)``, as fp32 values."""
    top = fp8_max(fmt)
    return x.float().clamp(-top, top).to(FP8_DTYPES[fmt]).float()


def _group_amax(x: torch.Tensor, scaling: str, block: int) -> torch.Tensor:
    """amax of ``x (B, H, N, D)`` per scaling group, broadcastable to ``(B, H, N, 1)``; 0 when empty."""
    mag = x.detach().abs()
    if mag.numel() == 0:
        b, h, n, _ = x.shape
        shape = {"tensor": (1, 1, 1, 1), "head": (b, h, 1, 1)}.get(scaling, (b, h, n, 1))
        return mag.new_zeros(shape)
    if scaling == "tensor":
        return mag.amax().reshape(1, 1, 1, 1)
    if scaling == "head":
        return mag.amax(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1)
    n = x.shape[-2]
    per_row = mag.amax(dim=-1, keepdim=True)  # (B, H, N, 1)
    pad = (-n) % block
    if pad:
        per_row = torch.nn.functional.pad(per_row, (0, 0, 0, pad))
    blocks = per_row.unflatten(-2, (-1, block)).amax(dim=-2, keepdim=True)  # (B, H, N/block, 1, 1)
    return blocks.expand(*blocks.shape[:-2], block, 1).flatten(-3, -2)[..., :n, :]


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    scaling: str = "tensor",
    scale: str | float = AMAX,
    block: int = 128,
    shift: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale ``x`` and cast it to FP8, as a kernel's inputs are quantized.

    Args:
        x: ``(B, H, N, D)``, fp32 or narrower.
        fmt: ``"e4m3"`` or ``"e5m2"``.
        scaling: of :data:`GRANULARITIES` (``block``: ``block`` rows share a scale).
        scale: ``"amax"`` (each group's scale ``shift · fp8_max / amax``, 1 for an all-zero group)
            or one static positive number.
        shift: a factor in ``(0, 1]`` on the amax scales (:func:`realisation_shifts`).

    Returns:
        ``(values, descale)``: the FP8 values of ``x · scale`` in fp32 ``(B, H, N, D)`` and the fp32
        descale ``1/scale`` broadcastable to them, so that ``values · descale ≈ x``.
    """
    x32 = x.float()
    if scale == AMAX:
        amax = _group_amax(x32, scaling, block)
        scales = torch.where(amax > 0, shift * fp8_max(fmt) / amax, torch.ones_like(amax))
    else:
        scales = torch.full((1, 1, 1, 1), float(scale), device=x.device)
    return cast_fp8(x32 * scales, fmt), 1.0 / scales


def dequantize(
    x: torch.Tensor, fmt: str, *, scaling: str, scale: str | float, block: int, shift: float = 1.0
) -> torch.Tensor:
    """``x`` after quantization (:func:`quantize`) and descaling: ``values · descale`` in fp32."""
    values, descale = quantize(x, fmt, scaling=scaling, scale=scale, block=block, shift=shift)
    return values * descale


#: ``1/φ₃, 1/φ₃², 1/φ₃³`` (Roberts' R₃ low-discrepancy sequence, ``φ₃⁴ = φ₃ + 1``): the steps of
#: :func:`realisation_shifts` for Q, K and V, spreading their factors evenly and independently.
_SHIFT_STEPS: tuple[float, float, float] = (0.8191725133961644, 0.671043606703789, 0.5497004779019701)


def realisation_shifts(draw: int) -> tuple[float, float, float]:
    """The ``(q, k, v)`` factors in ``(½, 1]`` on the amax scales of the ``draw``-th realisation of
    an FP8 rounding: ``2^-frac(draw · step)``; draw 0 is ``(1, 1, 1)``, the amax scales.

    Any scale that keeps the largest magnitude in range is as valid as the amax one and rounds
    differently; within one octave they cover the distinct roundings (a power of two changes none).
    """
    q, k, v = (2.0 ** -((draw * step) % 1.0) for step in _SHIFT_STEPS)
    return q, k, v


@functools.lru_cache(maxsize=32)
def _hadamard_cpu(d: int, seed: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    return signs.unsqueeze(-1) * h / math.sqrt(d)


def hadamard_rotation(d: int, seed: int = 0, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The ``(d, d)`` CPU matrix ``M = diag(s) · H_d / √d`` of incoherent processing: ``H_d`` the
    Sylvester Hadamard matrix, ``s`` random signs seeded with ``seed``; ``M Mᵀ = I``.

    Raises:
        ValueError: ``d`` is not a power of two.
    """
    if not is_power_of_two(d):
        raise ValueError(
            f"tiled: rotation=hadamard needs a power-of-two head dim, got {d}; use rotation=off "
            "or pad the head dim"
        )
    return _hadamard_cpu(d, seed).to(dtype)


def is_power_of_two(d: int) -> bool:
    """Whether ``d`` is a power of two (a head dim the Hadamard rotation accepts)."""
    return d >= 1 and not d & (d - 1)


class Fp8Operands(NamedTuple):
    """The GEMM operands of a ``tiled`` call with FP8 knobs (:func:`prepare_operands`).

    Attributes:
        q: ``(B, H, N_q, D)``; k: ``(B, H, N_k, D)``; v: ``(B, H, N_k, D_v)``: the FP8 values where
            Q/K/V are quantized, else the (rotated) operands.
        q_descale: ``1/scale`` of Q's rows, broadcastable to ``(B, H, N_q, 1)``; None without
            ``qkv_fp8``; likewise ``k_descale``, ``v_descale`` ``(…, N_k, 1)``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None

    @staticmethod
    def tile(descale: torch.Tensor | None, j0: int, j1: int | None = None) -> torch.Tensor | None:
        """The descale of the key tile starting at row ``j0`` (``(…, 1, 1)``; with ``j1``, of rows
        ``j0 … j1-1``); None or one value for all rows stays as it is."""
        if descale is None or descale.shape[-2] == 1:
            return descale
        return descale[..., j0 : j0 + 1 if j1 is None else j1, :]

    def rows(self, r0: int, r1: int) -> torch.Tensor | None:
        """Q's descales of the query rows ``r0 … r1-1`` (``(…, R, 1)`` or broadcastable)."""
        return self.tile(self.q_descale, r0, r1)


def prepare_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fp8: Fp8Numerics,
    *,
    compute: torch.dtype,
    gemm_s: torch.dtype,
    gemm_o: torch.dtype,
    block_q: int,
    block_k: int,
) -> Fp8Operands:
    """The GEMM operands of a ``tiled`` call with FP8 knobs: ``q (B, H, N_q, D)`` and ``k`` rotated
    (in at least fp32; rounded back to ``compute`` when not quantized), then quantized in blocks of
    ``block_q`` / ``block_k`` rows; ``q, k`` in ``gemm_s``, ``v`` in ``gemm_o``, with the descales."""
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    if fp8.rotation != OFF:
        rotation_dtype = torch.promote_types(compute, torch.float32)
        m = hadamard_rotation(q.shape[-1], fp8.rotation_seed, dtype=rotation_dtype).to(q.device)
        q, k = q.to(m.dtype) @ m, k.to(m.dtype) @ m
        if fp8.qkv == OFF:
            q, k = q.to(compute), k.to(compute)
    if fp8.qkv == OFF:
        return Fp8Operands(q.to(gemm_s), k.to(gemm_s), v.to(gemm_o))
    quant = functools.partial(quantize, fmt=fp8.qkv, scaling=fp8.scaling, scale=fp8.qkv_scale)
    (q8, q_descale), (k8, k_descale) = quant(q, block=block_q), quant(k, block=block_k)
    v8, v_descale = quant(v, block=block_k)
    return Fp8Operands(q8.to(gemm_s), k8.to(gemm_s), v8.to(gemm_o), q_descale, k_descale, v_descale)


def cast_p(p: torch.Tensor, fp8: Fp8Numerics) -> torch.Tensor:
    """``cast_fp8(P · S) / S`` in fp32 for ``p (B, H, R, Bc)``: P as the ``P·V`` GEMM sees it (dividing
    by S here rather than the row sum at the end is exact for a power-of-two S)."""
    return cast_fp8(p * fp8.p_scale, fp8.p) / fp8.p_scale
