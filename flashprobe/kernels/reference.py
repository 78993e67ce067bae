"""Reference attention in bounded memory: the baseline and the FP64 golden of any call, in blocks.

A reference materialises ``(B, H, N_q, N_k)`` scores (32 GiB in float64 for one 16k-token call of
16 heads), so it runs in **blocks** (:func:`plan_blocks`) that fit a memory budget
(:func:`reference_budget`: a quarter of the device's free memory, clamped to
``[MIN_BUDGET, MAX_BUDGET[device]]``): whole batch entries, else groups of key/value heads, else
query rows of one head group. A block's rows are exactly those of the whole call (up to the rounding
of a differently shaped matmul). Causal calls (top-left) of at least ``2 · CAUSAL_BLOCK_ROWS`` rows
are cut into row blocks, each against only the keys it can see.

Inside :func:`reference_numerics` float32 matmuls are IEEE (no TF32, no bf16 passes), whatever
training set. :func:`reference_outputs` yields each block's output, :func:`reference_attention`
assembles them; :func:`reference_gradients` yields outputs and input gradients per group of heads,
:func:`reference_input_gradients` assembles them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashprobe.kernels._inputs import causal_mask

__all__ = [
    "BYTES_PER_SCORE",
    "CAUSAL_BLOCKS",
    "CAUSAL_BLOCK_ROWS",
    "MAX_BUDGET",
    "MIN_BUDGET",
    "Block",
    "GroupGradients",
    "expand_kv",
    "meminfo_available_bytes",
    "numerics_flags",
    "plan_blocks",
    "reference_attention",
    "reference_budget",
    "reference_gradients",
    "reference_input_gradients",
    "reference_numerics",
    "reference_outputs",
]

#: Query rows per block of a causal call (at least), and the most row blocks one call is cut into.
CAUSAL_BLOCK_ROWS = 128
CAUSAL_BLOCKS = 16
#: Working set per score element of one block, forward and with gradients (float64 temporaries and
#: one byte of mask).
BYTES_PER_SCORE: Mapping[bool, int] = {False: 2 * 8 + 1, True: 4 * 8 + 1}
#: Fraction of the device's available memory one block may use.
BUDGET_FRACTION = 0.25
#: Bounds of the budget (bytes): at least 64 MiB; at most 2 GiB on the CPU (bigger blocks are not
#: faster there) and 16 GiB on an accelerator.
MIN_BUDGET = 64 << 20
MAX_BUDGET: Mapping[str, int] = {"cpu": 2 << 30, "default": 16 << 30}

#: an SDPA-signature attention function (the references pass a call's terms as more keywords)
AttentionKernel = Callable[..., Any]


@dataclass(frozen=True)
class Block:
    """One block of a call's scores: batch entries × key/value heads × query rows × keys ``[0, keys)``.

    ``heads`` are key/value heads (``rep`` query heads each); ``causal``: the block is the whole
    causal call (a causal row block gets an explicit mask from :meth:`mask` instead).
    """

    batch: slice
    heads: slice
    rows: slice
    keys: int
    causal: bool = False

    def q_heads(self, rep: int) -> slice:
        """The query heads of this block's key/value heads."""
        return slice(self.heads.start * rep, self.heads.stop * rep)

    def group(self) -> tuple[int, int, int, int]:
        """``(batch.start, batch.stop, heads.start, heads.stop)``: blocks of one group share them."""
        return (self.batch.start, self.batch.stop, self.heads.start, self.heads.stop)

    def take_q(self, x: torch.Tensor, rep: int) -> torch.Tensor:
        """This block's part of a ``(B, H, N_q, ·)`` tensor with query heads (q, out, dq, grad_out)."""
        return x[self.batch, self.q_heads(rep), self.rows]

    def take_kv(self, x: torch.Tensor) -> torch.Tensor:
        """This block's part of a ``(B, H_kv, N_k, ·)`` tensor (k, v), keys ``[0, keys)``."""
        return x[self.batch, self.heads, : self.keys]

    def mask(
        self, attn_mask: torch.Tensor | None, rep: int, causal: bool, device: torch.device
    ) -> tuple[torch.Tensor | None, bool]:
        """``(attn_mask, is_causal)`` for this block's ``(B_b, H_b, rows, keys)`` scores, from the call's
        mask (broadcastable to ``(B, H, N_q, N_k)``) or top-left causal flag."""
        if causal:
            if self.causal:
                return None, True
            rows = self.rows.stop - self.rows.start
            return causal_mask(0, 0, device, q_start=self.rows.start, q_len=rows, k_len=self.keys), False
        if attn_mask is None:
            return None, False
        m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        if m.shape[0] > 1:
            m = m[self.batch]
        if m.shape[1] > 1:
            m = m[:, self.q_heads(rep)]
        if m.shape[2] > 1:
            m = m[:, :, self.rows]
        if m.shape[3] > 1:
            m = m[..., : self.keys]
        return m, False


def meminfo_available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _available_bytes(device: torch.device) -> int:
    """Memory free for tensors on ``device`` (bytes)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        unused_reserve = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(unused_reserve, 0))
    available = meminfo_available_bytes()
    if available is not None:
        return available
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def reference_budget(device: torch.device | str, *, available: int | None = None) -> int:
    """Bytes one reference block may use on ``device``, from ``available`` free bytes (default: read
    from the device now)."""
    device = torch.device(device)
    free = _available_bytes(device) if available is None else int(available)
    ceiling = MAX_BUDGET.get(device.type, MAX_BUDGET["default"])
    return int(min(max(free * BUDGET_FRACTION, MIN_BUDGET), ceiling))


def _block_bytes(rows: int, keys: int, heads_q: int, d: int, d_v: int, backward: bool) -> int:
    """Estimated working set of one block of ``heads_q`` query heads (batch entries folded in)."""
    scores = heads_q * rows * keys * BYTES_PER_SCORE[backward]
    io = heads_q * (rows * (d + d_v) + keys * (d + d_v)) * 8  # q, out, expanded k, v in float64
    return scores + io * (2 if backward else 1)


def plan_blocks(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    v_shape: Sequence[int] | None = None,
    *,
    is_causal: bool = False,
    backward: bool = False,
    budget: int,
) -> list[Block]:
    """Blocks covering every score of a call once, each within ``budget`` bytes where possible (one
    query row of one head group is the smallest block), ordered by group, then rows.

    Args:
        q_shape: ``(B, H, N_q, D)``.
        k_shape: ``(B, H_kv, N_k, D)``; ``v_shape``: ``(B, H_kv, N_k, D_v)`` (default: like ``k_shape``).
        is_causal: top-left aligned causal call.
        backward: size for a forward and backward pass.
    """
    b, h, n_q, d = (int(x) for x in q_shape)
    h_kv, n_k = int(k_shape[1]), int(k_shape[2])
    d_v = int((v_shape or k_shape)[3])
    rep = max(1, h // max(h_kv, 1))
    if is_causal and n_q >= 2 * CAUSAL_BLOCK_ROWS and n_k:
        step = max(CAUSAL_BLOCK_ROWS, -(-n_q // CAUSAL_BLOCKS))
        spans = [(r0, min(n_q, r0 + step), min(n_q, r0 + step, n_k)) for r0 in range(0, n_q, step)]
        # a row block past the last key sees every key: rows i >= N_k keep keys [0, N_k)
        causal_whole = False
    else:
        spans = [(0, n_q, n_k)]
        causal_whole = is_causal
    blocks: list[Block] = []
    for r0, r1, keys in spans:
        rows = r1 - r0
        per_head = _block_bytes(rows, keys, rep, d, d_v, backward)  # one key/value head, all its rows
        if h_kv * per_head <= budget:
            step_b = max(1, budget // max(h_kv * per_head, 1))
            parts = [(slice(i, min(b, i + step_b)), slice(0, h_kv), [(r0, r1)]) for i in range(0, b, step_b)]
        elif per_head <= budget:
            step_h = max(1, budget // per_head)
            heads = [slice(j, min(h_kv, j + step_h)) for j in range(0, h_kv, step_h)]
            parts = [(slice(i, i + 1), hs, [(r0, r1)]) for i in range(b) for hs in heads]
        else:
            fixed = _block_bytes(0, keys, rep, d, d_v, backward)  # the keys and values
            per_row = _block_bytes(1, keys, rep, d, d_v, backward) - fixed
            n = max(1, (budget - fixed) // per_row)
            n = -(-rows // -(-rows // n))  # equal spans: 2 × 4096 rows, not 7700 + 492
            row_spans = [(r, min(r1, r + n)) for r in range(r0, r1, n)]
            parts = [(slice(i, i + 1), slice(j, j + 1), row_spans) for i in range(b) for j in range(h_kv)]
        for bs, hs, row_spans in parts:
            for a, z in row_spans:
                whole = causal_whole and (a, z) == (0, n_q)
                blocks.append(Block(bs, hs, slice(a, z), keys if is_causal else n_k, causal=whole))
    if not is_causal:
        return blocks
    # order by group, then rows (the causal row blocks were planned one row span at a time)
    return sorted(blocks, key=lambda blk: (blk.group(), blk.rows.start))


def expand_kv(k: torch.Tensor, v: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k (B, H_kv, N_k, D)`` and ``v`` with each head repeated ``rep`` times (SDPA's ``enable_gqa``)."""
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


_FP32_BACKENDS = ("cuda", "mkldnn")


def _fp32_backends() -> dict[str, Any]:
    """The backends whose ``fp32_precision`` torch lets one set, by name."""
    found = {}
    for name in _FP32_BACKENDS:
        try:
            matmul = getattr(torch.backends, name).matmul
            matmul.fp32_precision  # noqa: B018 (raises where this torch has no such setting)
        except Exception:
            continue
        found[name] = matmul
    return found


@contextlib.contextmanager
def reference_numerics() -> Iterator[None]:
    """Inside the block float32 matmuls are IEEE on every backend; the previous settings are restored."""
    backends = _fp32_backends()
    if not backends:  # a torch before the per-backend setting: the global one
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(previous)
        return
    saved = [(m, m.fp32_precision) for m in backends.values()]
    saved = [(m, value) for m, value in saved if value != "ieee"]
    try:
        for matmul, _ in saved:
            matmul.fp32_precision = "ieee"
        yield
    finally:
        for matmul, value in reversed(saved):
            matmul.fp32_precision = value


def numerics_flags() -> dict[str, Any]:
    """What the training's matmuls run with: float32 precision per backend (``none`` = IEEE) and
    whether fp16/bf16 matmuls on CUDA may reduce in 16 bits (which applies to a 16-bit baseline too)."""
    flags: dict[str, Any] = {}
    backends = _fp32_backends()
    for name, matmul in backends.items():
        flags[f"{name}_matmul_fp32_precision"] = matmul.fp32_precision
    if not backends:
        flags["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    for kind in ("fp16", "bf16"):
        with contextlib.suppress(Exception):
            value = getattr(torch.backends.cuda.matmul, f"allow_{kind}_reduced_precision_reduction")
            flags[f"cuda_{kind}_reduced_precision_reduction"] = bool(value)
    return flags


def _plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, budget: int | None,
    blocks: Sequence[Block] | None, backward: bool = False,
) -> Sequence[Block]:
    """``blocks`` if given, else :func:`plan_blocks` of the call within ``budget``."""
    if blocks is not None:
        return blocks
    budget = reference_budget(q.device) if budget is None else budget
    return plan_blocks(q.shape, k.shape, v.shape, is_causal=is_causal, backward=backward, budget=budget)


def reference_outputs(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    budget: int | None = None,
    blocks: Sequence[Block] | None = None,
    grad: bool = False,
    terms: Any = None,
    lse: bool = False,
) -> Iterator[tuple[Block, Any]]:
    """Run ``kernel`` block by block and yield each block with its output.

    Args:
        kernel: SDPA-signature attention on tensors of equal head counts (heads are expanded here).
        q: ``(B, H, N_q, D)``; k: ``(B, H_kv, N_k, D)``; v: ``(B, H_kv, N_k, D_v)``; the mask and
            top-left causal flag as SDPA's.
        dtype: cast each block's inputs (and a floating mask) to this dtype first.
        budget: bytes per block (default :func:`reference_budget`); ``blocks``: a plan to use instead.
        grad: record autograd history (every block's saved tensors are kept until the backward).
        terms: a logical :class:`~flashprobe.kernels.call.AttentionCall` whose ``score_terms`` each
            block passes to ``kernel`` (:func:`~flashprobe.kernels.math.plain_attention`).
        lse: ask ``kernel`` for the LSE too.

    Yields:
        ``(block, out)``, ``out`` ``(B_b, H_b, rows, D_v)`` (:meth:`Block.take_q` of the call's
        output); with ``lse``, ``(out, lse)`` with ``lse`` ``(B_b, H_b, rows)``.
    """
    rep = q.shape[1] // max(k.shape[1], 1)
    # (no context is held across a yield: the caller runs in its own modes)
    for blk in _plan(q, k, v, is_causal, budget, blocks):
        qb, kb, vb = blk.take_q(q, rep), blk.take_kv(k), blk.take_kv(v)
        mask, causal = blk.mask(attn_mask, rep, is_causal, q.device)
        if dtype is not None:
            qb, kb, vb = qb.to(dtype), kb.to(dtype), vb.to(dtype)
            if mask is not None and mask.is_floating_point():
                mask = mask.to(dtype)
        extra = _NO_TERMS
        if terms is not None or lse:
            extra = _block_terms(terms, blk, rep, dtype or q.dtype, lse)
        with torch.set_grad_enabled(grad), reference_numerics():
            kb, vb = expand_kv(kb, vb, rep)
            out = kernel(qb, kb, vb, attn_mask=mask, is_causal=causal, scale=scale, **extra)
        yield blk, out


#: the keywords an SDPA call's blocks add (none; never written to)
_NO_TERMS: Mapping[str, Any] = {}


def _block_terms(terms: Any, blk: Block, rep: int, dtype: torch.dtype, lse: bool = False) -> dict[str, Any]:
    """The keyword arguments a block adds for a call's terms (none for SDPA's calls)."""
    extra = {} if terms is None else terms.score_terms(blk.batch, blk.q_heads(rep), blk.rows, blk.keys, dtype)
    if lse:
        extra["lse"] = True
    return extra


def reference_attention(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    budget: int | None = None,
    terms: Any = None,
    lse: bool = False,
) -> Any:
    """The whole output ``(B, H, N_q, D_v)`` of ``kernel`` computed in blocks (arguments as
    :func:`reference_outputs`); with ``lse``, ``(out, lse)``, ``lse`` ``(B, H, N_q)``. Differentiable
    when an input requires grad (for gradients in bounded memory use :func:`reference_gradients`)."""
    rep = q.shape[1] // max(k.shape[1], 1)
    out: torch.Tensor | None = None
    row_lse: torch.Tensor | None = None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    parts = reference_outputs(
        kernel, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dtype=dtype, budget=budget,
        grad=grad, terms=terms, lse=lse,
    )
    for blk, part in parts:
        if lse:
            part, part_lse = part
            if row_lse is None:
                row_lse = part_lse.new_empty(q.shape[:3])
            row_lse[blk.batch, blk.q_heads(rep), blk.rows] = part_lse
        if out is None:
            out = part.new_empty(*q.shape[:3], v.shape[3])
        out[blk.batch, blk.q_heads(rep), blk.rows] = part
    if out is None:  # no blocks: an empty call
        out = q.new_empty(*q.shape[:3], v.shape[3], dtype=dtype or q.dtype)
    if not lse:
        return out
    if row_lse is None:
        row_lse = q.new_empty(q.shape[:3], dtype=torch.promote_types(dtype or q.dtype, torch.float32))
    return out, row_lse


def _groups(blocks: Sequence[Block]) -> list[list[Block]]:
    """Runs of consecutive blocks of one group."""
    return [list(run) for _, run in itertools.groupby(blocks, key=Block.group)]


@dataclass(frozen=True)
class GroupGradients:
    """The reference's results for one group of heads (the blocks sharing batch entries and heads).

    Attributes:
        blocks: the group's row blocks, in row order.
        outs: each block's detached output ``(B_b, H_b, rows, D_v)``.
        dq: each block's ``dq`` ``(B_b, H_b, rows, D)`` (empty when not requested).
        dk: ``(B_b, H_kv_b, N_k, D)`` summed over the row blocks (None when not requested); ``dv`` likewise.
    """

    blocks: list[Block]
    outs: list[torch.Tensor]
    dq: list[torch.Tensor]
    dk: torch.Tensor | None
    dv: torch.Tensor | None


def reference_gradients(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    need: Sequence[str] = ("q", "k", "v"),
    budget: int | None = None,
    blocks: Sequence[Block] | None = None,
    terms: Any = None,
) -> Iterator[GroupGradients]:
    """Outputs and input gradients of ``kernel`` for ``grad_out`` ``(B, H, N_q, D_v)``, one
    :class:`GroupGradients` per group of heads, in plan order.

    Each block runs forward and backward on its own leaves, so memory stays within the budget; a
    group's ``dk``/``dv`` are summed over its row blocks in at least float32 and rounded once to the
    compute dtype ``dtype`` (default: the inputs'). ``need`` names which of ``q``, ``k``, ``v`` get
    gradients; the other arguments are :func:`reference_outputs`'s (``blocks`` planned with
    ``backward=True``).
    """
    rep = q.shape[1] // max(k.shape[1], 1)
    compute = dtype or q.dtype
    acc_dtype = torch.promote_types(compute, torch.float32)
    plan = _plan(q, k, v, is_causal, budget, blocks, backward=True)
    for group in _groups(plan):  # (no context is held across a yield)
        first = group[0]
        k_all, v_all = k[first.batch, first.heads], v[first.batch, first.heads]
        whole = len(group) == 1 and first.keys == k.shape[2]  # one block: its grads are the group's
        acc: dict[str, torch.Tensor | None] = {n: None for n in ("k", "v") if n in need}
        outs: list[torch.Tensor] = []
        dqs: list[torch.Tensor] = []
        for blk in group:
            qb = blk.take_q(q, rep).detach().to(compute).requires_grad_("q" in need)
            kb = k_all[:, :, : blk.keys].detach().to(compute).requires_grad_("k" in need)
            vb = v_all[:, :, : blk.keys].detach().to(compute).requires_grad_("v" in need)
            mask, causal = blk.mask(attn_mask, rep, is_causal, q.device)
            if mask is not None and mask.is_floating_point():
                mask = mask.to(compute)
            wanted = {n: t for n, t in (("q", qb), ("k", kb), ("v", vb)) if n in need}
            extra = _NO_TERMS if terms is None else _block_terms(terms, blk, rep, compute)
            with torch.enable_grad(), reference_numerics():
                ke, ve = expand_kv(kb, vb, rep)
                out = kernel(qb, ke, ve, attn_mask=mask, is_causal=causal, scale=scale, **extra)
                g = blk.take_q(grad_out, rep).to(out.dtype)
                parts = torch.autograd.grad(out, list(wanted.values()), g, allow_unused=True)
            outs.append(out.detach())
            for n, part in zip(wanted, parts, strict=True):
                part = torch.zeros_like(wanted[n]) if part is None else part
                if n == "q":
                    dqs.append(part)
                    continue
                if whole:
                    acc[n] = part
                    continue
                total = acc[n]
                if total is None:
                    shape = (*part.shape[:2], (k if n == "k" else v).shape[2], part.shape[3])
                    total = acc[n] = part.new_zeros(shape, dtype=acc_dtype)
                total[:, :, : blk.keys] += part
        if not whole:
            acc = {n: None if t is None else t.to(compute) for n, t in acc.items()}
        yield GroupGradients(group, outs, dqs, acc.get("k"), acc.get("v"))


def reference_input_gradients(
    kernel: AttentionKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype | None = None,
    budget: int | None = None,
    terms: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, dq, dk, dv)`` of ``kernel``: ``(B, H, N_q, D_v)`` and the shapes of q, k, v, in the
    compute dtype (:func:`reference_gradients` assembled)."""
    rep = q.shape[1] // max(k.shape[1], 1)
    compute = dtype or q.dtype
    out = q.new_zeros(*q.shape[:3], v.shape[3], dtype=compute)
    dq = q.new_zeros(q.shape, dtype=compute)
    dk = k.new_zeros(k.shape, dtype=compute)
    dv = v.new_zeros(v.shape, dtype=compute)
    groups = reference_gradients(
        kernel, q, k, v, grad_out, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dtype=compute,
        budget=budget, terms=terms,
    )
    for g in groups:
        for blk, part, dq_part in zip(g.blocks, g.outs, g.dq, strict=True):
            out[blk.batch, blk.q_heads(rep), blk.rows] = part
            dq[blk.batch, blk.q_heads(rep), blk.rows] = dq_part
        first = g.blocks[0]
        dk[first.batch, first.heads] = g.dk
        dv[first.batch, first.heads] = g.dv
    return out, dq, dk, dv
