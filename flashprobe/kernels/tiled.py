"""A readable numerical re-implementation of FlashAttention's forward pass, at any precision.

The score matrix is never materialised. Keys and values are consumed one block of ``block_k``
columns at a time (FlashAttention-2 style); for every query row the kernel keeps a **running
max** ``m`` and **running sum** ``l`` of the softmax, and whenever the max grows it **rescales**
the partial output by ``exp(m_old - m_new)``. Those rescalings are the extra arithmetic the paper
suspects of adding numeric deviation. Each step's dtype is a separate knob, so one can see which
step of the algorithm causes a deviation:

===============  ===========================================================================
knob             meaning
===============  ===========================================================================
block_q, block_k Br and Bc, the tile's query and key sizes (default 64 and 128)
sram             the paper's SRAM size M (elements): Bc = ceil(M / 4d), Br = min(Bc, d)
swap_blocks      swap Br and Bc (paper Fig 6a)
square           force square tiles Br = Bc = min(Br, Bc) (paper Fig 6b)
loop             ``"kv"``: all query blocks form one batch dimension, a single loop over key
                 blocks (FlashAttention-2, the fast default); ``"q"``: an outer loop over query
                 blocks of ``block_q`` rows (FlashAttention-1 order). Per row both apply the same
                 updates in the same order; results differ only where the matmul library rounds
                 a slab of rows differently from all rows (fp32: last bit).
dtype            dtype of the inputs and both matmuls (q kᵀ and p v); default: inputs' dtype
stats_dtype      dtype of the running max, the exponentials and the running sum; default: dtype
acc_dtype        dtype of the output accumulator; default: dtype
mask_value       value written into masked logits *and* the initial running max. ``-inf``
                 (default) with exact handling of fully masked rows (they output 0); a finite
                 sentinel such as ``-5e4`` reproduces kernels that use one (FlashInfer, PR 4401):
                 rows whose running max never rises above it, i.e. whose valid logits all lie
                 below it, silently output zeros (FlashInfer: ``d_rcp = m != -inf ? 1/d : 0``).
                 It must be finite in stats_dtype (-1e5 overflows fp16).
===============  ===========================================================================

Peak memory is ``O(N_q · block_k)`` per (batch, head): one ``(B, H, rows, block_k)`` tile of
scores at a time. It is differentiable through autograd (the backward then stores every tile).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flashprobe.kernels._inputs import check_inputs, default_scale, to_dtype
from flashprobe.kernels.registry import KernelUnavailableError, register_kernel

__all__ = ["TileSizes", "tile_sizes", "tiled_attention"]

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 128


class TileSizes(tuple):
    """``(block_q, block_k)`` = (Br, Bc)."""

    __slots__ = ()

    def __new__(cls, block_q: int, block_k: int) -> TileSizes:
        return super().__new__(cls, (block_q, block_k))

    @property
    def block_q(self) -> int:
        return self[0]

    @property
    def block_k(self) -> int:
        return self[1]


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


def _validate(
    block_q: int | None = None,
    block_k: int | None = None,
    sram: int | None = None,
    swap_blocks: bool = False,
    square: bool = False,
    loop: str = "kv",
    dtype: str | torch.dtype | None = None,
    stats_dtype: str | torch.dtype | None = None,
    acc_dtype: str | torch.dtype | None = None,
    mask_value: float = float("-inf"),
) -> None:
    """Check option values that do not depend on the inputs (called when a spec is parsed)."""
    tile_sizes(1, block_q=block_q, block_k=block_k, sram=sram, swap_blocks=swap_blocks, square=square)
    if loop not in ("kv", "q"):
        raise ValueError(f"tiled: loop={loop!r} must be 'kv' or 'q'")
    for dt in (dtype, stats_dtype, acc_dtype):
        to_dtype(dt)
    _mask_value(mask_value)


def _mask_value(value: Any) -> float:
    try:
        mask_value = float(value)
    except (TypeError, ValueError):
        mask_value = math.nan
    if math.isnan(mask_value) or mask_value == float("inf"):
        raise ValueError(f"tiled: mask_value={value!r} must be -inf or a finite number such as -5e4")
    return mask_value


def _dtypes(
    input_dtype: torch.dtype,
    dtype: str | torch.dtype | None,
    stats_dtype: str | torch.dtype | None,
    acc_dtype: str | torch.dtype | None,
    mask_value: float,
) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """Resolve (compute, stats, acc) dtypes and check the mask value fits the stats dtype."""
    compute = to_dtype(dtype) or input_dtype
    stats = to_dtype(stats_dtype) or compute
    acc = to_dtype(acc_dtype) or compute
    if math.isfinite(mask_value) and math.isinf(torch.tensor(mask_value, dtype=stats).item()):
        raise ValueError(
            f"tiled: mask_value={mask_value:g} overflows to -inf in the stats dtype {stats} "
            f"(smallest finite: {torch.finfo(stats).min:g}); pick a smaller magnitude or "
            "stats_dtype=fp32"
        )
    return compute, stats, acc


def _check(device: torch.device, dtype: torch.dtype, /, **options: Any) -> None:
    """``Kernel.check``: the options must resolve for inputs of ``dtype`` (any device works)."""
    try:
        _validate(**options)
        mask_value = _mask_value(options.get("mask_value", float("-inf")))
        _dtypes(dtype, options.get("dtype"), options.get("stats_dtype"), options.get("acc_dtype"), mask_value)
    except ValueError as err:
        raise KernelUnavailableError(f"{err} (inputs {dtype} on {device})") from None


@register_kernel("tiled", check=_check, validate=_validate)
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
    dtype: str | torch.dtype | None = None,
    stats_dtype: str | torch.dtype | None = None,
    acc_dtype: str | torch.dtype | None = None,
    mask_value: float = float("-inf"),
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
        dtype, stats_dtype, acc_dtype: per-step dtypes (module docstring).
        mask_value: masked-logit value and initial running max.

    Returns:
        ``(B, H, N_q, D_v)`` in the inputs' dtype.

    Raises:
        KernelInputError: malformed inputs.
        ValueError: a bad option value.
    """
    check_inputs(q, k, v, attn_mask, is_causal, kernel="tiled")
    _validate(block_q, block_k, sram, swap_blocks, square, loop, dtype, stats_dtype, acc_dtype, mask_value)
    mask_value = _mask_value(mask_value)
    br, bc = tile_sizes(
        q.shape[-1],
        block_q=block_q,
        block_k=block_k,
        sram=sram,
        swap_blocks=swap_blocks,
        square=square,
    )
    compute, stats, acc = _dtypes(q.dtype, dtype, stats_dtype, acc_dtype, mask_value)
    s = default_scale(q.shape[-1], scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if attn_mask is not None:
        attn_mask = attn_mask.expand(*attn_mask.shape[:-2], n_q, n_k)

    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    row_starts = [0] if loop == "kv" else range(0, n_q, br)
    rows = n_q if loop == "kv" else br
    blocks = [
        _attend_rows(
            qc[:, :, r0 : r0 + rows],
            kc,
            vc,
            mask=None if attn_mask is None else attn_mask[..., r0 : r0 + rows, :],
            causal=is_causal,
            row_offset=r0,
            scale=s,
            block_k=bc,
            stats=stats,
            acc=acc,
            mask_value=mask_value,
        )
        for r0 in row_starts
    ]
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-2)
    return out.to(q.dtype)


def _attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    row_offset: int,
    scale: float,
    block_k: int,
    stats: torch.dtype,
    acc: torch.dtype,
    mask_value: float,
) -> torch.Tensor:
    """Online softmax of one slab of query rows over all key tiles.

    The running max only shifts the exponent and cancels between numerator and denominator, so
    it is computed from detached scores: autograd then differentiates only ``exp``, the sums and
    the matmuls. Tile-sized temporaries are updated in place (same values, fewer allocations).

    Args:
        q: ``(B, H, R, D)`` query rows ``row_offset … row_offset+R-1``, in the compute dtype.
        k: ``(B, H, N_k, D)`` keys; v: ``(B, H, N_k, D_v)`` values (compute dtype).
        mask: bool or additive mask ``(…, R, N_k)`` for these rows, or None.

    Returns:
        ``(B, H, R, D_v)`` normalised output in the accumulator dtype.
    """
    b, h, r, _ = q.shape
    n_k, d_v = k.shape[-2], v.shape[-1]
    exact = mask_value == float("-inf")
    m = torch.full((b, h, r, 1), mask_value, dtype=stats, device=q.device)  # running max
    m_init = torch.tensor(mask_value, dtype=stats).item()  # the mask value as stored (host-side)
    l = torch.zeros((b, h, r, 1), dtype=stats, device=q.device)  # running sum  # noqa: E741
    o = torch.zeros((b, h, r, d_v), dtype=acc, device=q.device)  # unnormalised output
    last_row = row_offset + r - 1
    row_index = torch.arange(row_offset, row_offset + r, device=q.device).unsqueeze(-1)  # (R, 1)
    for j0 in range(0, n_k, block_k):
        if causal and j0 > last_row:
            break  # every later key tile lies above the diagonal for all these rows
        j1 = min(j0 + block_k, n_k)
        scores = torch.matmul(q, k[:, :, j0:j1].transpose(-2, -1))  # (B, H, R, Bc)
        scores = scores.mul_(scale).to(stats)
        if causal:
            if j1 - 1 > row_offset:  # the tile crosses the diagonal
                scores.masked_fill_(torch.arange(j0, j1, device=q.device) > row_index, mask_value)
        elif mask is not None:
            tile = mask[..., j0:j1]
            if tile.dtype == torch.bool:
                scores.masked_fill_(~tile, mask_value)
            else:
                scores.add_(tile.to(stats))
                if not exact:  # a sentinel kernel stores its sentinel, never -inf
                    scores.masked_fill_(scores == float("-inf"), mask_value)
        m_new = torch.maximum(m, scores.detach().amax(dim=-1, keepdim=True))
        # With -inf masking a row may have seen only masked keys so far: subtract 0, not -inf,
        # so exp() gives exactly 0 for masked logits instead of NaN.
        m_ref = m_new.masked_fill(m_new == float("-inf"), 0.0) if exact else m_new
        p = scores.sub_(m_ref).exp_()  # (B, H, R, Bc)
        alpha = torch.exp(m - m_ref)  # rescaling of everything accumulated so far
        l = alpha * l + p.sum(dim=-1, keepdim=True)  # noqa: E741
        pv = torch.matmul(p.to(v.dtype), v[:, :, j0:j1])  # (B, H, R, D_v)
        o = o.mul_(alpha.to(acc)).add_(pv.to(acc))
        m = m_new
    # Rows whose running max never rose above the mask value output 0. With -inf these are the
    # fully masked rows (torch SDPA's safe softmax); with a finite sentinel they also include rows
    # whose valid logits all lie below it, as in FlashInfer (`d_rcp = m != -inf ? 1/d : 0`).
    dead = m == m_init
    out = o / l.masked_fill(dead, 1.0).to(acc)
    return out.masked_fill(dead, 0.0)
