"""A readable numerical re-implementation of FlashAttention's forward pass, at any precision.

The score matrix is never materialised. Keys and values are consumed one tile of ``block_k``
columns at a time; for every query row the kernel keeps a **running max** ``m`` and **running
sum** ``l`` of the softmax, and whenever the max grows it **rescales** the partial output by
``exp(m_old - m_new)``. Those rescalings are the extra arithmetic the paper suspects of adding
numeric deviation. Each step's dtype and the order of the steps are knobs, so one can see which
step of the algorithm causes a deviation.

Every GEMM follows the one rule of the hardware and libraries real kernels call (tensor cores,
oneDNN/MKL): operands in their dtype, products accumulated in at least fp32, the result rounded
**once** to its destination dtype. A tile step, for query rows ``R`` and key tile ``j``:

1. ``s = round_score(q kⱼᵀ · scale)``: the scale is applied *before* any rounding, in the
   accumulator (real kernels never form an unscaled 16-bit ``q kᵀ``, so no fp16 overflow);
2. ``s`` is converted to ``stats_dtype``, masked, and the softmax statistics are updated there;
3. ``P = exp(s − m)`` is rounded to ``dtype`` and ``P vⱼ`` is accumulated into the output in
   ``acc_dtype`` (``update``: FA2 rescales an unnormalised output and divides once at the end;
   FA1 keeps the output normalised after every tile).

===============  ===========================================================================
knob             meaning
===============  ===========================================================================
preset           named set of the numerics knobs below, each overridable in the same spec
                 (``tiled:preset=paper,order=reverse``); plain ``tiled`` is ``fa2``:

                 * ``fa2``: real FlashAttention-2 kernels (Dao-AILab ``flash_fwd_kernel.h``,
                   torch's CPU ``FlashAttentionKernel.cpp``): inputs, ``P`` and the output in
                   ``dtype``; scores, statistics and accumulator in ``opmath`` (fp32, fp64 for
                   fp64 inputs); ``update=fa2``; ``order=reverse`` (FA2's CUDA kernel walks the
                   key tiles from the last to the first);
                 * ``paper``: every step in ``dtype``, as the paper's re-implementation:
                   ``score_dtype = stats_dtype = acc_dtype = dtype``, ``update=fa1`` (FA1's
                   Algorithm 1, where the paper's ``Bc = ⌈M/4d⌉`` comes from),
                   ``order=forward``;
                 * ``fa3_fp8``: FlashAttention-3's FP8 forward as published (Shah et al. 2024,
                   §3.3, and ``hopper/softmax.h``): the ``fa2`` numerics with
                   ``qkv_fp8=e4m3, p_fp8=e4m3, p_scale=256, fp8_scaling=block, qkv_scale=amax,
                   rotation=hadamard``. From the paper: E4M3 Q/K/V, block quantization (one
                   scale per tile of rows), incoherent processing (random Hadamard rotation),
                   fp32 accumulation. From the code: P cast to E4M3 after scaling by ``2^8``
                   (``Max_offset = 8``), key tiles walked last to first. Inferred: amax scales
                   (the kernel takes descales as given), the rotation's seed, tile sizes (ours:
                   64×128; FA3 picks per head dim); the released library's default is
                   ``fp8_scaling=head`` (descale per batch and head) and no rotation inside the
                   kernel (``tiled:preset=fa3_fp8,fp8_scaling=head,rotation=off``).
block_q, block_k Br and Bc, the tile's query and key sizes (default 64 and 128)
sram             the paper's SRAM size M (elements): Bc = ceil(M / 4d), Br = min(Bc, d)
swap_blocks      swap Br and Bc (paper Fig 6a as the tile shape)
square           force square tiles Br = Bc = min(Br, Bc) (paper Fig 6b)
loop             ``"kv"``: all query rows form one batch dimension, a single loop over key
                 tiles (fast); ``"q"``: an outer loop over query tiles of ``block_q`` rows.
                 Per row both apply the same updates in the same order (Br never changes a
                 row's arithmetic); results differ only where the matmul library rounds a
                 slab of rows differently from all rows (fp32: last bit).
order            the order in which a row consumes its key tiles: ``forward`` (first to last,
                 torch's CPU flash kernel), ``reverse`` (last to first, FA2's CUDA kernel) or
                 ``shuffle`` (a random permutation drawn from ``order_seed``); paper Fig 6a
order_seed       seed of the ``shuffle`` permutation (default 0)
update           ``fa2``: deferred normalisation, ``o ← α·o + P v``, ``out = o / l`` once at
                 the end (FlashAttention-2); ``fa1``: the output is renormalised after every
                 tile, ``o ← (l·α·o + β·P̃ v) / l_new`` with ``P̃ = exp(s − rowmax(s))`` and
                 ``β = exp(rowmax(s) − m_new)`` (FlashAttention-1, Algorithm 1)
dtype            dtype of the inputs and of ``P`` in the ``P v`` GEMM; default: inputs' dtype
score_dtype      dtype the scaled scores ``q kᵀ · scale`` are rounded to
stats_dtype      dtype of the running max, the exponentials and the running sum
acc_dtype        dtype of the output accumulator
mask_value       value written into masked logits *and* the initial running max. ``-inf``
                 (default) with exact handling of fully masked rows (they output 0); a finite
                 sentinel such as ``-5e4`` reproduces kernels that use one (FlashInfer, PR 4401):
                 rows whose running max never rises above it, i.e. whose valid logits all lie
                 below it, silently output zeros (FlashInfer: ``d_rcp = m != -inf ? 1/d : 0``).
                 It must be finite in stats_dtype (-1e5 overflows fp16).
max_shift        ``off`` (default) or ``repeated``: the mitigation of Qiu & Yao (arXiv 2510.04212)
                 for biased rounding in low-precision ``P v``. When a tile's row maximum
                 repeats (another score within ``REPEAT_TOLERANCE`` = 1e-3 of it), the tile's
                 max is shifted to ``2·m`` if ``m > 0`` and to ``0`` if ``m < 0`` before the
                 running max is updated, so no probability ``exp(s − m)`` is exactly 1 (``m = 0``
                 stays). The shift cancels in ``o / l``; it costs range: ``P ≤ exp(−|m|)``
                 underflows fp16 for ``|m|`` above ~17 and the row then outputs 0; the bias
                 it removes is measured by ``flashprobe bench bias``.
rescale_threshold FlashAttention-4's lazy rescaling, in log2 units (default 0: off, the max is
                 always updated). A tile that raises a row's max by at most this many powers of
                 two, ``(m_tile − m)·log2(e) ≤ t``, leaves the running max stale: ``α = 1``, no
                 rescaling, and that tile's ``P = exp(s − m)`` reaches up to ``2^t``; a larger rise
                 updates the max as usual, and the first tile that sees a key always sets it. This
                 is ``SoftmaxSm100.update_row_max`` of Dao-AILab ``flash_attn/cute/softmax.py``
                 (keep the old max where ``(m_old − m_new)·scale·log2(e) ≥ −rescale_threshold``),
                 with the thresholds of ``flash_attn/cute/flash_fwd_sm100.py``: 8 for 16-bit
                 inputs, and 4 for FP8 (PR 2109, with ``max_offset = 8``, i.e. ``p_scale=256``)
                 until PR 2731 set it to 0 (flash-attention issue 2716: ``2^(8+4) = 4096``
                 saturates E4M3's 448, ``tiled:preset=fa3_fp8,rescale_threshold=4``). The stale
                 max cancels in ``o / l``: exact in exact arithmetic; it costs range (``P`` up to
                 ``2^t``, the row sum up to ``N·2^t``: a 16-bit ``stats_dtype`` can overflow).
                 Needs ``update=fa2`` (FA1 renormalises every tile).
qkv_fp8          FP8 format of Q, K and V: ``e4m3``, ``e5m2`` or ``off`` (default; in a spec
                 ``none`` means the preset's value, as for every knob)
p_fp8            FP8 format of P in the ``P v`` GEMM: ``e4m3``, ``e5m2`` or ``off``
p_scale          static scale S on P before its FP8 cast (default 1; ``fa3_fp8``: 256); the
                 running sum stays unscaled fp32, so S cancels
fp8_scaling      what shares one Q/K/V scale: ``tensor`` (default), ``head`` (each batch and
                 head) or ``block`` (each tile of ``block_q`` query / ``block_k`` key rows)
qkv_scale        ``amax`` (default: scale = format max / amax of the group) or a static number
rotation         ``hadamard``: Q and K times a random orthogonal ``diag(±1)·H/√d`` before
                 quantization (FA3's incoherent processing; power-of-two head dims), or ``off``
rotation_seed    seed of the rotation's random signs (default 0)
===============  ===========================================================================

The FP8 knobs (:mod:`flashprobe.kernels.fp8`: saturating casts, scales, the rotation) model the
forward only: a spec that uses them declares no backward and refuses inputs that require grad.

The three step dtypes accept a dtype name (``bf16``, ``fp32``, ...), ``opmath`` (at least fp32:
fp32 for 16-bit and fp32 compute, fp64 for fp64, as torch's ``at::opmath_type``) or ``none``
(the preset's value). A dtype *narrower* than the inputs (``stats_dtype=fp32`` on fp64 inputs) is
a precision loss on request; the presets never narrow.

Peak memory is ``O(N_q · block_k)`` per (batch, head): one ``(B, H, rows, block_k)`` tile of
scores at a time. It is differentiable through autograd (the backward then stores every tile);
the gradient of P's rounding for the ``P v`` GEMM stays in P's dtype, as dP does in FlashAttention-2's
fp32 backward (with ``fa2``; with ``paper`` P and so dP are in the dtype).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from flashprobe.kernels import fp8 as fp8_numerics
from flashprobe.kernels._inputs import check_inputs, default_scale, dtype_name, to_dtype
from flashprobe.kernels.fp8 import check_choice, check_seed
from flashprobe.kernels.registry import (
    ANY_CAPABILITIES,
    KernelCapabilities,
    KernelUnavailableError,
    KernelUnsupportedError,
    register_kernel,
)

__all__ = [
    "DEFAULT_PRESET",
    "MAX_SHIFTS",
    "ORDERS",
    "PRESETS",
    "REPEAT_TOLERANCE",
    "UPDATES",
    "TileNumerics",
    "TileSizes",
    "lazy_tile_max",
    "resolve_numerics",
    "spec_numerics",
    "tile_order",
    "tile_sizes",
    "tiled_attention",
]

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 128

#: The order in which a row consumes its key tiles.
ORDERS = ("forward", "reverse", "shuffle")
#: How the output accumulator is updated per tile.
UPDATES = ("fa2", "fa1")
#: ``max_shift`` values: no shift, or shift the row max of tiles where it repeats (Qiu & Yao).
MAX_SHIFTS = ("off", "repeated")
#: Scores within this distance of a tile's row max count as a repeat of it (``max_shift=repeated``).
REPEAT_TOLERANCE = 1e-3
_LOG2E = 1.0 / math.log(2.0)
#: The dtype value meaning "at least fp32" (torch's ``at::opmath_type``).
OPMATH = "opmath"

#: The real FlashAttention-2 kernels' numerics knobs (presets ``fa2`` and ``fa3_fp8``).
_FA2_KNOBS: dict[str, Any] = {
    "score_dtype": OPMATH,
    "stats_dtype": OPMATH,
    "acc_dtype": OPMATH,
    "update": "fa2",
    "order": "reverse",
}
#: Preset name → the numerics knobs it sets (``None``: the compute dtype ``dtype``).
PRESETS: dict[str, dict[str, Any]] = {
    "fa2": dict(_FA2_KNOBS),
    "paper": {
        "score_dtype": None,
        "stats_dtype": None,
        "acc_dtype": None,
        "update": "fa1",
        "order": "forward",
    },
    # FlashAttention-3's FP8 forward: the fa2 numerics; its FP8 knobs are fp8.FP8_PRESETS["fa3_fp8"].
    "fa3_fp8": dict(_FA2_KNOBS),
}
#: What plain ``tiled`` means: the numerics of the kernels people train with.
DEFAULT_PRESET = "fa2"


class TileSizes(NamedTuple):
    """``(block_q, block_k)`` = (Br, Bc)."""

    block_q: int
    block_k: int

    __repr__ = tuple.__repr__  # "(64, 128)"


@dataclass(frozen=True)
class TileNumerics:
    """The resolved numerics of one call: the dtype of every step, the update and the order.

    Attributes:
        compute: dtype of the inputs and of ``P`` in the ``P v`` GEMM.
        score: dtype of the scaled scores.
        stats: dtype of the running max, the exponentials and the running sum.
        acc: dtype of the output accumulator.
        update: ``"fa2"`` or ``"fa1"``.
        order: ``"forward"``, ``"reverse"`` or ``"shuffle"``.
        order_seed: seed of the ``shuffle`` permutation.
        rescale_threshold: FA4's lazy rescaling, in log2 units (0: off; module docstring).
        fp8: the FP8 knobs (:class:`~flashprobe.kernels.fp8.Fp8Numerics`; default: FP8 off).
    """

    compute: torch.dtype
    score: torch.dtype
    stats: torch.dtype
    acc: torch.dtype
    update: str
    order: str
    order_seed: int
    fp8: fp8_numerics.Fp8Numerics = field(default_factory=fp8_numerics.Fp8Numerics)
    rescale_threshold: float = 0.0

    def describe(self) -> str:
        """One line such as ``"scores fp32, stats fp32, acc fp32, P bf16, update fa2, order reverse"``."""
        order = f"shuffle (seed {self.order_seed})" if self.order == "shuffle" else self.order
        line = (
            f"scores {dtype_name(self.score)}, stats {dtype_name(self.stats)}, acc {dtype_name(self.acc)}, "
            f"P {dtype_name(self.compute)}, update {self.update}, order {order}"
        )
        if self.rescale_threshold:
            line += f", lazy rescale (threshold {self.rescale_threshold:g} in log2)"
        return line + (f"; FP8: {self.fp8.describe()}" if self.fp8.active else "")


def _positive_int(name: str, value: Any) -> int:
    integral = (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer()
    )
    if not integral or value < 1:
        raise ValueError(f"tiled: {name}={value!r} must be a positive integer")
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"tiled: {name}={value!r} must be true or false")


def _rescale_threshold(value: Any) -> float:
    """Check ``rescale_threshold``: a finite number ≥ 0."""
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(
            f"tiled: rescale_threshold={value!r} must be a finite number ≥ 0 (log2 units; 0: off, "
            "FA4 uses 8 for 16-bit inputs)"
        )
    return float(number)


def _check_lazy_update(update: str, threshold: Any) -> None:
    """Lazy rescaling (``rescale_threshold`` > 0) is an update of the unnormalised output: fa2 only."""
    if update != "fa2":
        raise ValueError(
            f"tiled: rescale_threshold={threshold!r} needs update=fa2 (FlashAttention-4 defers the "
            f"normalisation; update={update} renormalises the output after every tile)"
        )


def _step_dtype(name: str, value: Any) -> None:
    """Check a step dtype value: a dtype name, ``opmath`` or ``None``."""
    if value is None or (isinstance(value, str) and value.lower() == OPMATH):
        return
    try:
        to_dtype(value)
    except ValueError as err:
        raise ValueError(f"tiled: {name}={value!r}: {err}, or {OPMATH} (at least fp32)") from None


def tile_sizes(
    head_dim: int,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    sram: int | None = None,
    swap_blocks: bool = False,
    square: bool = False,
) -> TileSizes:
    """Resolve the tile sizes (Br, Bc) from the knobs.

    Args:
        head_dim: d, the head dimension.
        block_q: Br, queries per tile.
        block_k: Bc, keys per tile.
        sram: the paper's on-chip memory size M in elements: Bc = ⌈M/4d⌉, Br = min(⌈M/4d⌉, d).
            Exclusive with ``block_q``/``block_k``.
        swap_blocks: swap Br and Bc.
        square: use Br = Bc = min(Br, Bc).

    Returns:
        The resolved :class:`TileSizes`.

    Raises:
        ValueError: a size is not a positive integer, or ``sram`` is combined with block sizes.
    """
    if sram is not None:
        if block_q is not None or block_k is not None:
            raise ValueError("tiled: give either sram=M or block_q/block_k, not both")
        m = _positive_int("sram", sram)
        if m < 4 * head_dim:
            raise ValueError(f"tiled: sram={sram} must be an integer ≥ 4·d = {4 * head_dim}")
        bc = math.ceil(m / (4 * head_dim))
        br = min(bc, head_dim)
    else:
        br = _positive_int("block_q", DEFAULT_BLOCK_Q if block_q is None else block_q)
        bc = _positive_int("block_k", DEFAULT_BLOCK_K if block_k is None else block_k)
    if _flag("swap_blocks", swap_blocks):
        br, bc = bc, br
    if _flag("square", square):
        br = bc = min(br, bc)
    return TileSizes(br, bc)


def tile_order(n_tiles: int, order: str = "forward", seed: int = 0) -> list[int]:
    """The order in which a row consumes ``n_tiles`` key tiles.

    Args:
        n_tiles: the number of key tiles the row visits.
        order: ``"forward"`` (0, 1, …), ``"reverse"`` (…, 1, 0) or ``"shuffle"``.
        seed: seed of the ``shuffle`` permutation (``torch.randperm`` on its own generator).

    Returns:
        A permutation of ``range(n_tiles)``.

    Raises:
        ValueError: an unknown order.
    """
    check_choice("order", order, ORDERS)
    if order == "forward":
        return list(range(n_tiles))
    if order == "reverse":
        return list(range(n_tiles - 1, -1, -1))
    generator = torch.Generator().manual_seed(check_seed("order_seed", seed))
    return torch.randperm(n_tiles, generator=generator).tolist()


def _preset_knobs(preset: str | None) -> Mapping[str, Any]:
    return PRESETS[check_choice("preset", DEFAULT_PRESET if preset is None else preset, tuple(PRESETS))]


#: The ``tiled`` options that set the tile sizes (:func:`tile_sizes`).
_TILE_OPTIONS = ("block_q", "block_k", "sram", "swap_blocks", "square")


def _validate(**options: Any) -> None:
    """Check option values that do not depend on the inputs (called when a spec is parsed, and by
    :func:`tiled_attention`): ``options`` are :func:`tiled_attention`'s, each missing one at its
    default; the FP8 knobs among them go to :func:`~flashprobe.kernels.fp8.resolve_fp8`."""
    get = options.get
    _preset_knobs(get("preset"))
    fp8_numerics.resolve_fp8(get("preset"), **fp8_numerics.fp8_options(options))
    tile_sizes(1, **{key: options[key] for key in _TILE_OPTIONS if key in options})
    check_choice("loop", get("loop", "kv"), ("kv", "q"))
    if get("order") is not None:
        check_choice("order", get("order"), ORDERS)
    check_seed("order_seed", get("order_seed", 0))
    if get("update") is not None:
        check_choice("update", get("update"), UPDATES)
    try:
        to_dtype(get("dtype"))
    except ValueError as err:
        raise ValueError(f"tiled: dtype={get('dtype')!r}: {err}") from None
    for name in ("score_dtype", "stats_dtype", "acc_dtype"):
        _step_dtype(name, get(name))
    _mask_value(get("mask_value", float("-inf")))
    check_choice("max_shift", get("max_shift", "off"), MAX_SHIFTS)
    if _rescale_threshold(get("rescale_threshold", 0.0)):
        _check_lazy_update(get("update") or _preset_knobs(get("preset"))["update"], get("rescale_threshold"))


def _mask_value(value: Any) -> float:
    try:
        mask_value = float(value)
    except (TypeError, ValueError):
        mask_value = math.nan
    if math.isnan(mask_value) or mask_value == float("inf"):
        raise ValueError(f"tiled: mask_value={value!r} must be -inf or a finite number such as -5e4")
    return mask_value


def _step(value: Any, compute: torch.dtype) -> torch.dtype:
    """A step dtype: ``None`` → the compute dtype, ``opmath`` → at least fp32, else the named dtype."""
    if value is None:
        return compute
    if isinstance(value, str) and value.lower() == OPMATH:
        return torch.promote_types(compute, torch.float32)
    return to_dtype(value)  # type: ignore[return-value]


def resolve_numerics(
    input_dtype: torch.dtype,
    *,
    preset: str | None = None,
    dtype: str | torch.dtype | None = None,
    score_dtype: str | torch.dtype | None = None,
    stats_dtype: str | torch.dtype | None = None,
    acc_dtype: str | torch.dtype | None = None,
    update: str | None = None,
    order: str | None = None,
    order_seed: int = 0,
    mask_value: float = float("-inf"),
    rescale_threshold: float = 0.0,
    **fp8_knobs: Any,
) -> TileNumerics:
    """The numerics of a call on inputs of ``input_dtype``: the preset's knobs, overridden by the
    ones given, with the mask value checked against the stats dtype; ``fp8_knobs`` are the FP8
    knobs of :func:`~flashprobe.kernels.fp8.resolve_fp8` (``qkv_fp8``, ``p_fp8``, ...).

    Raises:
        ValueError: a bad knob value, a finite ``mask_value`` that overflows the stats dtype, or
            a ``rescale_threshold`` with ``update=fa1``.
    """
    knobs = _preset_knobs(preset)
    compute = to_dtype(dtype) or input_dtype
    pick = dict(
        score_dtype=score_dtype, stats_dtype=stats_dtype, acc_dtype=acc_dtype, update=update, order=order
    )
    chosen = {key: knobs[key] if value is None else value for key, value in pick.items()}
    for name in ("score_dtype", "stats_dtype", "acc_dtype"):
        _step_dtype(name, chosen[name])
    numerics = TileNumerics(
        compute=compute,
        score=_step(chosen["score_dtype"], compute),
        stats=_step(chosen["stats_dtype"], compute),
        acc=_step(chosen["acc_dtype"], compute),
        update=check_choice("update", chosen["update"], UPDATES),
        order=check_choice("order", chosen["order"], ORDERS),
        order_seed=check_seed("order_seed", order_seed),
        fp8=fp8_numerics.resolve_fp8(preset, **fp8_knobs),
        rescale_threshold=_rescale_threshold(rescale_threshold),
    )
    if numerics.rescale_threshold:
        _check_lazy_update(numerics.update, rescale_threshold)
    stats = numerics.stats
    if math.isfinite(mask_value) and math.isinf(torch.tensor(mask_value, dtype=stats).item()):
        raise ValueError(
            f"tiled: mask_value={mask_value:g} overflows to -inf in the stats dtype {stats} "
            f"(smallest finite: {torch.finfo(stats).min:g}); pick a smaller magnitude or "
            "stats_dtype=fp32"
        )
    return numerics


def _numerics_options(options: Mapping[str, Any]) -> dict[str, Any]:
    keys = (
        "preset", "dtype", "score_dtype", "stats_dtype", "acc_dtype", "update", "order", "order_seed",
        "rescale_threshold",
    )  # fmt: skip
    return {key: options[key] for key in keys if key in options} | fp8_numerics.fp8_options(options)


def spec_numerics(options: Mapping[str, Any], input_dtype: torch.dtype) -> TileNumerics:
    """The numerics a ``tiled`` spec's options resolve to on inputs of ``input_dtype`` (what a
    result row names: step dtypes, order, FP8 knobs).

    Raises:
        ValueError: a bad knob value.
    """
    return resolve_numerics(input_dtype, **_numerics_options(options))


#: The head dims the Hadamard rotation takes: powers of two up to 4096.
_HADAMARD_HEAD_DIMS = frozenset(2**i for i in range(13))


def _capabilities(options: Mapping[str, Any]) -> KernelCapabilities:
    """What a ``tiled`` spec supports: everything, except with FP8 knobs: no backward (FA3's FP8
    attention is forward only), the coarsest FP8 format it rounds to declared (``fp8``), and with
    the rotation a power-of-two head dim up to 4096."""
    try:
        fp8 = fp8_numerics.resolve_fp8(options.get("preset"), **fp8_numerics.fp8_options(options))
    except ValueError:
        return ANY_CAPABILITIES  # a bad value is reported by the spec's validation
    if not fp8.active:
        return ANY_CAPABILITIES
    formats = {fp8.qkv, fp8.p} - {fp8_numerics.OFF}
    coarsest = "e5m2" if "e5m2" in formats else ("e4m3" if formats else None)  # None: rotation only
    rotated = fp8.rotation != fp8_numerics.OFF
    return KernelCapabilities(
        backward_devices=frozenset(), head_dims=_HADAMARD_HEAD_DIMS if rotated else None, fp8=coarsest
    )


def _check(device: torch.device, dtype: torch.dtype, /, **options: Any) -> None:
    """``Kernel.check``: the options must resolve for inputs of ``dtype`` (any device works)."""
    try:
        _validate(**options)
        mask_value = _mask_value(options.get("mask_value", float("-inf")))
        resolve_numerics(dtype, mask_value=mask_value, **_numerics_options(options))
    except ValueError as err:
        raise KernelUnavailableError(f"{err} (inputs {dtype} on {device})") from None


@register_kernel("tiled", check=_check, validate=_validate, capabilities=_capabilities)
def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    sram: int | None = None,
    swap_blocks: bool = False,
    square: bool = False,
    loop: str = "kv",
    preset: str | None = None,
    order: str | None = None,
    order_seed: int = 0,
    update: str | None = None,
    dtype: str | torch.dtype | None = None,
    score_dtype: str | torch.dtype | None = None,
    stats_dtype: str | torch.dtype | None = None,
    acc_dtype: str | torch.dtype | None = None,
    mask_value: float = float("-inf"),
    max_shift: str = "off",
    rescale_threshold: float = 0.0,
    qkv_fp8: str | None = None,
    p_fp8: str | None = None,
    p_scale: float | None = None,
    fp8_scaling: str | None = None,
    qkv_scale: str | float | None = None,
    rotation: str | None = None,
    rotation_seed: int = 0,
) -> torch.Tensor:
    """FlashAttention forward (tiling + online softmax + rescaling); see the module docstring.

    Args:
        q: ``(B, H, N_q, D)`` queries.
        k: ``(B, H, N_k, D)`` keys.
        v: ``(B, H, N_k, D_v)`` values.
        attn_mask: bool (``True`` = attend) or additive mask broadcastable to
            ``(B, H, N_q, N_k)``.
        is_causal: top-left aligned causal mask; key tiles above the diagonal are skipped.
        scale: softmax scale, default ``1/sqrt(D)``.
        block_q, block_k, sram, swap_blocks, square: tile sizes, see :func:`tile_sizes`.
        loop: ``"kv"`` (one loop over key tiles) or ``"q"`` (outer loop over query tiles).
        preset: ``"fa2"`` (default) or ``"paper"``: values of the numerics knobs not given.
        order, order_seed: the order of the key tiles, see :func:`tile_order`.
        update: ``"fa2"`` (deferred normalisation) or ``"fa1"`` (per-tile renormalisation).
        dtype, score_dtype, stats_dtype, acc_dtype: per-step dtypes (module docstring).
        mask_value: masked-logit value and initial running max.
        max_shift: ``"off"`` or ``"repeated"``: shift a tile's row max where it repeats (module
            docstring).
        rescale_threshold: FA4's lazy rescaling in log2 units, 0 (default) for off (module
            docstring).
        qkv_fp8, p_fp8, p_scale, fp8_scaling, qkv_scale, rotation, rotation_seed: the FP8 knobs
            (module docstring, :mod:`flashprobe.kernels.fp8`); forward only.

    Returns:
        ``(B, H, N_q, D_v)`` in the inputs' dtype.

    Raises:
        KernelInputError: malformed inputs.
        KernelUnsupportedError: FP8 knobs on inputs that require grad (no FP8 backward).
        ValueError: a bad option value (a non-power-of-two head dim with ``rotation=hadamard``).
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="tiled")
    options = dict(
        block_q=block_q, block_k=block_k, sram=sram, swap_blocks=swap_blocks, square=square, loop=loop,
        preset=preset, order=order, order_seed=order_seed, update=update, dtype=dtype,
        score_dtype=score_dtype, stats_dtype=stats_dtype, acc_dtype=acc_dtype, mask_value=mask_value,
        max_shift=max_shift, rescale_threshold=rescale_threshold, qkv_fp8=qkv_fp8, p_fp8=p_fp8,
        p_scale=p_scale, fp8_scaling=fp8_scaling, qkv_scale=qkv_scale, rotation=rotation,
        rotation_seed=rotation_seed,
    )
    _validate(**options)
    mask_value = _mask_value(mask_value)
    br, bc = tile_sizes(q.shape[-1], **{key: options[key] for key in _TILE_OPTIONS})
    numerics = resolve_numerics(q.dtype, mask_value=mask_value, **_numerics_options(options))
    _check_fp8_call(numerics.fp8, q, k, v)
    s = default_scale(q.shape[-1], scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*attn_mask.shape[:-2], n_q, n_k)

    # GEMM operands, converted once: scores accumulate in at least fp32, P·V in the accumulator's
    # GEMM dtype; a 16-bit destination is rounded once from the fp32 result.
    gemm_s, gemm_o = _gemm_dtype(numerics.score), _gemm_dtype(numerics.acc)
    # With FP8 knobs the operands are rotated and/or quantized, with descales (kernels.fp8).
    operands = fp8_numerics.prepare_operands(
        q, k, v, numerics.fp8, compute=numerics.compute, gemm_s=gemm_s, gemm_o=gemm_o, block_q=br, block_k=bc
    )
    row_starts = [0] if loop == "kv" else range(0, n_q, br)
    rows = n_q if loop == "kv" else br
    blocks = [
        _attend_rows(
            operands.q[:, :, r0 : r0 + rows], operands.k, operands.v,
            descales=(operands.rows(r0, r0 + rows), operands.k_descale, operands.v_descale),
            mask=None if attn_mask is None else attn_mask[..., r0 : r0 + rows, :],
            causal=is_causal, row_offset=r0, scale=s, block_k=bc, numerics=numerics, mask_value=mask_value,
            shift_repeated=max_shift == "repeated",
        )
        for r0 in row_starts
    ]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-2)
    return out.to(q.dtype)


def _check_fp8_call(fp8: fp8_numerics.Fp8Numerics, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse what the FP8 knobs do not model, before any work: a backward, and the rotation on
    a head dim that is not a power of two."""
    if not fp8.active:
        return
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise KernelUnsupportedError(
            f"tiled with FP8 ({fp8.describe()}) is forward only (no FP8 backward is modelled); run it "
            "under torch.no_grad(), or compare forward only (backward=False, the fuzzer's --no-backward)"
        )
    if fp8.rotation != fp8_numerics.OFF:
        fp8_numerics.hadamard_rotation(q.shape[-1], fp8.rotation_seed)  # raises for a bad head dim


def _gemm_dtype(destination: torch.dtype) -> torch.dtype:
    """The dtype a GEMM accumulates in for a result held in ``destination``: at least fp32."""
    return torch.promote_types(destination, torch.float32)


def _visited_tiles(n_k: int, block_k: int, causal: bool, row_offset: int, rows: int) -> list[int]:
    """First key index of each key tile these rows attend to, first to last.

    With the causal mask, tiles that lie entirely above the diagonal for every row are skipped.
    """
    last_row = row_offset + rows - 1
    return [j0 for j0 in range(0, n_k, block_k) if not (causal and j0 > last_row)]


@dataclass
class _RowState:
    """The online-softmax state of a slab of R query rows (tensors ``(B, H, R, ·)``)."""

    m: torch.Tensor  # running max, stats dtype, (B, H, R, 1)
    l: torch.Tensor  # running sum, stats dtype, (B, H, R, 1)  # noqa: E741
    o: torch.Tensor  # output accumulator, acc dtype, (B, H, R, D_v)


def _attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    descales: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
    mask: torch.Tensor | None,
    causal: bool,
    row_offset: int,
    scale: float,
    block_k: int,
    numerics: TileNumerics,
    mask_value: float,
    shift_repeated: bool = False,
) -> torch.Tensor:
    """Online softmax of one slab of query rows over its key tiles, in ``numerics.order``.

    The running max only shifts the exponent and cancels between numerator and denominator, so
    it is computed from detached scores: autograd then differentiates only ``exp``, the sums and
    the matmuls. Tile-sized temporaries are updated in place (same values, fewer allocations).

    Args:
        q: ``(B, H, R, D)`` query rows ``row_offset … row_offset+R-1``, in the score GEMM dtype.
        k: ``(B, H, N_k, D)`` keys (score GEMM dtype); v: ``(B, H, N_k, D_v)`` values (output
            GEMM dtype).
        descales: with ``qkv_fp8``, q, k and v hold FP8 values and these are their descales
            (:class:`~flashprobe.kernels.fp8.Fp8Operands`: q's ``(…, R, 1)``, k's and v's
            ``(…, N_k, 1)``, or broadcastable), applied to each tile's fp32 GEMM results as FP8
            kernels do; None: the operands are the values.
        mask: bool or additive mask ``(…, R, N_k)`` for these rows, or None.
        shift_repeated: ``max_shift=repeated``, see :func:`_tile_max`.

    Returns:
        ``(B, H, R, D_v)`` normalised output in the accumulator dtype.
    """
    b, h, r, _ = q.shape
    n_k, d_v = k.shape[-2], v.shape[-1]
    stats, acc = numerics.stats, numerics.acc
    state = _RowState(
        m=torch.full((b, h, r, 1), mask_value, dtype=stats, device=q.device),
        l=torch.zeros((b, h, r, 1), dtype=stats, device=q.device),
        o=torch.zeros((b, h, r, d_v), dtype=acc, device=q.device),
    )
    m_init = torch.tensor(mask_value, dtype=stats).item()  # the mask value as stored (host-side)
    row_index = torch.arange(row_offset, row_offset + r, device=q.device).unsqueeze(-1)  # (R, 1)
    tiles = _visited_tiles(n_k, block_k, causal, row_offset, r)
    step = _fa2_step if numerics.update == "fa2" else _fa1_step
    q_descale, k_descale, v_descale = descales
    for t in tile_order(len(tiles), numerics.order, numerics.order_seed):
        j0 = tiles[t]
        j1 = min(j0 + block_k, n_k)
        scores = torch.matmul(q, k[:, :, j0:j1].transpose(-2, -1))  # (B, H, R, Bc), fp32 or wider
        if q_descale is not None:  # FP8 values: descale the fp32 result, one factor per row
            scores = scores.mul_(q_descale * fp8_numerics.Fp8Operands.tile(k_descale, j0) * scale)
        else:
            scores = scores.mul_(scale)
        scores = scores.to(numerics.score).to(stats)
        if causal:
            if j1 - 1 > row_offset:  # the tile crosses the diagonal
                scores.masked_fill_(torch.arange(j0, j1, device=q.device) > row_index, mask_value)
        elif mask is not None:
            _apply_mask(scores, mask[..., j0:j1], mask_value)
        m_tile = _tile_max(scores, m_init, shift_repeated)
        if numerics.rescale_threshold:
            m_tile = lazy_tile_max(state.m, m_tile, numerics.rescale_threshold, m_init)
        state = step(
            state,
            scores,
            m_tile,
            v[:, :, j0:j1],
            numerics,
            exact=mask_value == float("-inf"),
            v_descale=fp8_numerics.Fp8Operands.tile(v_descale, j0),
        )
    # Rows whose running max never rose above the mask value output 0. With -inf these are the
    # fully masked rows (torch SDPA's safe softmax); with a finite sentinel they also include rows
    # whose valid logits all lie below it, as in FlashInfer (`d_rcp = m != -inf ? 1/d : 0`).
    dead = state.m == m_init
    out = state.o if numerics.update == "fa1" else state.o / state.l.masked_fill(dead, 1.0).to(acc)
    return out.masked_fill(dead, 0.0)


def _apply_mask(scores: torch.Tensor, tile: torch.Tensor, mask_value: float) -> None:
    """Mask ``scores (B, H, R, Bc)`` in place with the mask's tile ``(…, R, Bc)``."""
    if tile.dtype == torch.bool:
        scores.masked_fill_(~tile, mask_value)
        return
    scores.add_(tile.to(scores.dtype))
    if mask_value != float("-inf"):  # a sentinel kernel stores its sentinel, never -inf
        scores.masked_fill_(scores == float("-inf"), mask_value)


def _tile_max(scores: torch.Tensor, m_init: float, shift_repeated: bool) -> torch.Tensor:
    """The row max of a tile of ``scores (B, H, R, Bc)``, ``(B, H, R, 1)``, from detached scores.

    With ``shift_repeated`` (``max_shift=repeated``), a row whose max ``m`` repeats (another score
    within :data:`REPEAT_TOLERANCE` of it) gets ``2·m`` for ``m > 0`` and ``0`` for ``m < 0``, so
    that no ``exp(s − m)`` of the row is exactly 1. Rows whose max is the mask value (every key of
    the tile masked) are left alone.
    """
    m = scores.detach().amax(dim=-1, keepdim=True)
    if not shift_repeated:
        return m
    repeats = (scores.detach() >= m - REPEAT_TOLERANCE).sum(dim=-1, keepdim=True) > 1
    shifted = torch.where(m > 0, 2 * m, torch.zeros_like(m))
    return torch.where(repeats & (m > m_init), shifted, m)


def lazy_tile_max(
    m: torch.Tensor, m_tile: torch.Tensor, threshold: float, m_init: float = float("-inf")
) -> torch.Tensor:
    """FlashAttention-4's lazy rescaling of one tile (``rescale_threshold``).

    ``SoftmaxSm100.update_row_max`` in Dao-AILab ``flash_attn/cute/softmax.py`` keeps the old max
    where ``(m_old − m_new)·scale_log2 ≥ −rescale_threshold``; scores here already carry the softmax
    scale, so ``scale_log2`` is log2(e).

    Args:
        m: ``(…, R, 1)`` the running max of R rows before the tile.
        m_tile: ``(…, R, 1)`` the tile's row max.
        threshold: in log2 units (powers of two).
        m_init: the running max's initial value (the mask value): rows still at it have seen no
            key, and always take the tile's max (FA4's first tile).

    Returns:
        ``m_tile``, replaced by ``m`` in rows where it exceeds ``m`` by at most ``threshold`` powers
        of two, so that ``max(m, ·)`` keeps the stale max (``α = 1``).
    """
    stale = ((m_tile - m) * _LOG2E <= threshold) & (m != m_init)
    return torch.where(stale, m, m_tile)


def _no_neg_inf(x: torch.Tensor, exact: bool) -> torch.Tensor:
    """``x`` with ``-inf`` replaced by 0, so that ``exp(s - x)`` is 0 (not NaN) for masked ``s``.

    With -inf masking a row may have seen only masked keys so far; a finite sentinel never
    produces -inf.
    """
    return x.masked_fill(x == float("-inf"), 0.0) if exact else x


class _RoundedP(torch.autograd.Function):
    """P rounded to the compute dtype for the ``P v`` GEMM, with the gradient dP passed through in
    P's own dtype (the statistics dtype).

    FlashAttention-2's backward recomputes P, rounds it for its GEMMs and accumulates
    ``dP = dO vᵀ`` in fp32 (``acc_dp`` in ``flash_bwd_kernel.h``), forming ``dS = P∘(dP − D)`` in
    fp32 too. Autograd through a plain cast would round dP to the compute dtype instead: with a
    loss-scaled dO in fp16, ``|dP|`` passes 65504 and dq, dk get ±Inf rows where every gradient
    fits fp16. Where P itself is held in the compute dtype (``paper``: every step in the dtype), dP
    is rounded there, as before.
    """

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, compute: torch.dtype, gemm: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.dtype = p.dtype
        return p.to(compute).to(gemm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad.to(ctx.dtype), None, None


def _pv(
    p: torch.Tensor, v: torch.Tensor, numerics: TileNumerics, v_descale: torch.Tensor | None = None
) -> torch.Tensor:
    """``P v``: P rounded to the compute dtype (or cast to FP8 with ``p_fp8``), products
    accumulated in the GEMM dtype of ``v``, the result rounded once to the accumulator dtype.
    ``(B, H, R, Bc) × (B, H, Bc, D_v)``; with ``v_descale`` (``(…, 1, 1)``), v holds FP8 values
    and the fp32 result is descaled. In the backward, dP stays in P's dtype (:class:`_RoundedP`)."""
    if numerics.fp8.p != fp8_numerics.OFF:
        pv = torch.matmul(fp8_numerics.cast_p(p, numerics.fp8).to(v.dtype), v)
    else:
        pv = torch.matmul(_RoundedP.apply(p, numerics.compute, v.dtype), v)
    return (pv if v_descale is None else pv * v_descale).to(numerics.acc)


def _fa2_step(
    state: _RowState,
    scores: torch.Tensor,
    m_tile: torch.Tensor,
    v: torch.Tensor,
    numerics: TileNumerics,
    *,
    exact: bool,
    v_descale: torch.Tensor | None = None,
) -> _RowState:
    """FlashAttention-2's update: rescale the unnormalised output, add ``P v``; divide at the end.

    ``m_new = max(m, m_tile)`` (``m_tile``: the tile's row max, :func:`_tile_max`, or the stale
    running max itself with lazy rescaling, :func:`lazy_tile_max`),
    ``P = exp(s − m_new)``, ``α = exp(m − m_new)``, ``l ← α·l + rowsum(P)``, ``o ← α·o + P v``.
    """
    m_new = torch.maximum(state.m, m_tile)
    m_ref = _no_neg_inf(m_new, exact)
    p = scores.sub_(m_ref).exp_()  # (B, H, R, Bc)
    alpha = torch.exp(state.m - m_ref)  # rescaling of everything accumulated so far
    l = alpha * state.l + p.sum(dim=-1, keepdim=True)  # noqa: E741
    o = state.o.mul_(alpha.to(numerics.acc)).add_(_pv(p, v, numerics, v_descale))
    return _RowState(m=m_new, l=l, o=o)


def _fa1_step(
    state: _RowState,
    scores: torch.Tensor,
    m_tile: torch.Tensor,
    v: torch.Tensor,
    numerics: TileNumerics,
    *,
    exact: bool,
    v_descale: torch.Tensor | None = None,
) -> _RowState:
    """FlashAttention-1's update (Algorithm 1): the output stays normalised after every tile.

    ``m̃ = m_tile`` (the tile's row max, :func:`_tile_max`), ``P̃ = exp(s − m̃)``,
    ``l̃ = rowsum(P̃)``, ``m_new = max(m, m̃)``,
    ``α = exp(m − m_new)``, ``β = exp(m̃ − m_new)``, ``l_new = α·l + β·l̃``,
    ``o ← (l·α·o + β·P̃ v) / l_new``. A row with ``l_new = 0`` (only masked keys so far, or every
    exponential underflowed) keeps ``o = 0``.
    """
    m_new = torch.maximum(state.m, m_tile)
    m_ref = _no_neg_inf(m_new, exact)
    p = scores.sub_(_no_neg_inf(m_tile, exact)).exp_()  # P̃ (B, H, R, Bc)
    alpha = torch.exp(state.m - m_ref)
    beta = torch.exp(m_tile - m_ref)
    l_new = alpha * state.l + beta * p.sum(dim=-1, keepdim=True)
    acc = numerics.acc
    kept = state.o * (state.l * alpha).to(acc)
    o = (kept + _pv(p, v, numerics, v_descale) * beta.to(acc)) / l_new.masked_fill(l_new == 0, 1.0).to(acc)
    return _RowState(m=m_new, l=l_new, o=o)
