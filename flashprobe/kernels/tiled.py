"""A readable re-implementation of FlashAttention's forward pass, at any precision.

The score matrix is never materialised: keys and values are consumed one tile of ``block_k``
columns at a time; each query row keeps a running max ``m`` and running sum ``l`` and rescales its
partial output by ``exp(m_old − m_new)`` when the max grows. Each step's dtype and the order of the
steps are knobs, so one can see which step causes a deviation.

Every GEMM follows the hardware's rule: operands in their dtype, products accumulated in at least
fp32, the result rounded once to its destination. A tile step, for query rows ``R`` and key tile ``j``:

1. ``s = round_score(q kⱼᵀ · scale)`` (scaled in the accumulator, before any rounding);
2. ``s`` is converted to ``stats_dtype``, masked, and the softmax statistics are updated there;
3. ``P = exp(s − m)`` is rounded to ``dtype`` and ``P vⱼ`` accumulated into the output in ``acc_dtype``.

Knobs (spec options; ``none`` means the preset's value):

* ``preset``: ``fa2`` (default; FlashAttention-2 kernels: scores, statistics and accumulator in
  opmath, ``update=fa2``, ``order=reverse``), ``paper`` (every step in ``dtype``, ``update=fa1``,
  ``order=forward``) or ``fa3_fp8`` (``fa2`` with FlashAttention-3's FP8 forward:
  :data:`~flashprobe.kernels.fp8.FP8_PRESETS`).
* ``block_q``, ``block_k``: Br and Bc (default 64, 128); ``sram``: the paper's M, Bc = ⌈M/4d⌉,
  Br = min(Bc, d); ``swap_blocks``: swap Br and Bc; ``square``: Br = Bc = min(Br, Bc).
* ``loop``: ``kv`` (all rows at once, one loop over key tiles) or ``q`` (an outer loop over query
  tiles); per row both do the same arithmetic.
* ``order``: ``forward``, ``reverse`` or ``shuffle`` (seeded by ``order_seed``) key tiles.
* ``update``: ``fa2`` (``o ← α·o + P v``, divided by ``l`` once at the end) or ``fa1`` (the output
  renormalised after every tile, FlashAttention-1's Algorithm 1).
* ``dtype`` (inputs and ``P``), ``score_dtype``, ``stats_dtype`` (max, exponentials, sum),
  ``acc_dtype``: a dtype name, ``opmath`` (at least fp32, as torch's ``at::opmath_type``) or
  ``none``. A dtype narrower than the inputs is a precision loss on request.
* ``mask_value``: masked logits and the initial running max; ``-inf`` (default) or a finite
  sentinel (e.g. ``-5e4``, as FlashInfer), with which a row whose logits all lie below it outputs
  0. It must be finite in ``stats_dtype``.
* ``max_shift``: ``off`` or ``repeated`` (Qiu & Yao, arXiv 2510.04212): a tile whose row max ``m``
  repeats (within :data:`REPEAT_TOLERANCE`) uses ``2·m`` (``m > 0``) or 0 (``m < 0``) as its max,
  so no ``P`` is exactly 1.
* ``rescale_threshold``: FlashAttention-4's lazy rescaling in log2 units (0: off): a tile that
  raises the max by at most ``t`` powers of two leaves it stale (``α = 1``, ``P`` up to ``2^t``);
  needs ``update=fa2``.
* ``qkv_fp8``, ``p_fp8``, ``p_scale``, ``fp8_scaling``, ``qkv_scale``, ``rotation``,
  ``rotation_seed``: the FP8 knobs (:mod:`flashprobe.kernels.fp8`); forward only.

Peak memory is one ``(B, H, rows, block_k)`` tile of scores. It is differentiable through autograd;
the gradient of P's rounding stays in P's dtype, as dP does in FlashAttention-2's fp32 backward.
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
    """The resolved numerics of one call (the knobs of the module docstring).

    Attributes:
        compute: dtype of the inputs and of ``P`` in the ``P v`` GEMM.
        score: dtype of the scaled scores.
        stats: dtype of the running max, the exponentials and the running sum.
        acc: dtype of the output accumulator.
        fp8: the FP8 knobs (default: FP8 off).
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
    """The tile sizes (Br, Bc) for head dim ``head_dim`` from the tile knobs (module docstring).

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
    """A permutation of ``range(n_tiles)``: ``forward``, ``reverse`` or ``shuffle`` (``torch.randperm``
    on a generator seeded with ``seed``).

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
    """Check :func:`tiled_attention`'s option values that do not depend on the inputs."""
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
    """The numerics of a call on inputs of ``input_dtype``: the preset's knobs overridden by the ones
    given; ``fp8_knobs`` go to :func:`~flashprobe.kernels.fp8.resolve_fp8`.

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
    """The numerics a ``tiled`` spec's options resolve to on inputs of ``input_dtype``.

    Raises:
        ValueError: a bad knob value.
    """
    return resolve_numerics(input_dtype, **_numerics_options(options))


#: The head dims the Hadamard rotation takes: powers of two up to 4096.
_HADAMARD_HEAD_DIMS = frozenset(2**i for i in range(13))


def _capabilities(options: Mapping[str, Any]) -> KernelCapabilities:
    """Everything, except with FP8 knobs: no backward, its coarsest FP8 format declared, and with
    the rotation power-of-two head dims only."""
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

    ``q (B, H, N_q, D)``, ``k (B, H, N_k, D)``, ``v (B, H, N_k, D_v)`` and the mask as SDPA's (key
    tiles above a causal diagonal are skipped); the other arguments are the knobs of the module
    docstring. Returns ``(B, H, N_q, D_v)`` in the inputs' dtype.

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
    """Refuse a backward and a rotation of a head dim that is not a power of two, before any work."""
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
    """First key of each key tile these rows attend to (causal: tiles above the diagonal skipped)."""
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

    The running max cancels between numerator and denominator, so it comes from detached scores.

    Args:
        q: ``(B, H, R, D)`` query rows ``row_offset …`` in the score GEMM dtype; k ``(B, H, N_k, D)``
            likewise; v ``(B, H, N_k, D_v)`` in the output GEMM dtype.
        descales: with ``qkv_fp8``, the descales of the FP8 values in q, k, v
            (:class:`~flashprobe.kernels.fp8.Fp8Operands`), applied to each tile's GEMM results.
        mask: bool or additive mask ``(…, R, N_k)`` for these rows, or None.

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
    # rows whose running max never rose above the mask value output 0 (as FlashInfer)
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
    """The row max ``(B, H, R, 1)`` of ``scores (B, H, R, Bc)``; with ``shift_repeated``, shifted
    where it repeats (``max_shift``, module docstring), except in rows whose every key is masked."""
    m = scores.detach().amax(dim=-1, keepdim=True)
    if not shift_repeated:
        return m
    repeats = (scores.detach() >= m - REPEAT_TOLERANCE).sum(dim=-1, keepdim=True) > 1
    shifted = torch.where(m > 0, 2 * m, torch.zeros_like(m))
    return torch.where(repeats & (m > m_init), shifted, m)


def lazy_tile_max(
    m: torch.Tensor, m_tile: torch.Tensor, threshold: float, m_init: float = float("-inf")
) -> torch.Tensor:
    """FlashAttention-4's lazy rescaling of one tile (``SoftmaxSm100.update_row_max``).

    Args:
        m: ``(…, R, 1)`` the running max before the tile.
        m_tile: ``(…, R, 1)`` the tile's row max.
        threshold: in log2 units.
        m_init: the initial running max: rows still at it have seen no key and take ``m_tile``.

    Returns:
        ``m_tile``, replaced by ``m`` where it exceeds ``m`` by at most ``threshold`` powers of two.
    """
    stale = ((m_tile - m) * _LOG2E <= threshold) & (m != m_init)
    return torch.where(stale, m, m_tile)


def _no_neg_inf(x: torch.Tensor, exact: bool) -> torch.Tensor:
    """``x`` with ``-inf`` replaced by 0 when ``exact``, so ``exp(s - x)`` is 0, not NaN, for masked ``s``."""
    return x.masked_fill(x == float("-inf"), 0.0) if exact else x


class _RoundedP(torch.autograd.Function):
    """P rounded to the compute dtype for the ``P v`` GEMM, its gradient dP kept in P's own dtype,
    as FlashAttention-2 accumulates dP in fp32 (a plain cast would overflow fp16 dP)."""

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
    """``P v`` ``(B, H, R, Bc) × (B, H, Bc, D_v)``: P rounded to the compute dtype (or FP8), accumulated
    in ``v``'s GEMM dtype, descaled by ``v_descale`` when given, rounded once to the accumulator dtype."""
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
    """FlashAttention-2's update: ``m_new = max(m, m_tile)``, ``P = exp(s − m_new)``,
    ``α = exp(m − m_new)``, ``l ← α·l + rowsum(P)``, ``o ← α·o + P v`` (divided by ``l`` at the end)."""
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
    """FlashAttention-1's update (Algorithm 1), the output normalised after every tile:
    ``P̃ = exp(s − m_tile)``, ``m_new = max(m, m_tile)``, ``α = exp(m − m_new)``,
    ``β = exp(m_tile − m_new)``, ``l_new = α·l + β·rowsum(P̃)``, ``o ← (l·α·o + β·P̃ v) / l_new``
    (``o`` stays 0 while ``l_new = 0``)."""
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
