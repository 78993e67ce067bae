"""Elementwise deviation between two attention outputs, and the error ratio.

Vocabulary (DESIGN.md): for outputs ``a`` and reference ``b`` of the same shape,

* ``max_abs``  = max |a − b| over finite pairs,
* ``mean_abs`` = mean |a − b| over finite pairs,
* ``rel_l2``   = ‖a − b‖₂ / ‖b‖₂ over finite pairs (0 when both are 0),
* ``nonfinite`` = number of positions where ``a`` or ``b`` is NaN/±inf — counted, never
  allowed to turn the maxima into NaN; when *no* pair is finite the other statistics are
  undefined (NaN);
* **error ratio** = ``max_abs(primary, golden) / max(max_abs(baseline, golden), noise floor)``;
  flash-attention's own tests pass a kernel when it is ≤ 2. It is reported, not judged by:
  the verdict's rule is :mod:`flashprobe.judge`. The **noise floor**
  (:func:`noise_floor`) is half a unit in the last place of the largest golden value in the dtype
  the kernels computed in, ``½·eps(dtype)·max|golden|``: the rounding error of merely storing the
  golden output in that dtype, which any baseline error normally exceeds. It only matters when the
  baseline is (nearly) exact, where a bare ratio would be infinite or noise over noise. A ratio
  that is undefined — no finite value compared (every output NaN), or 0/0 — is ``None``.

**Names** used everywhere (probe statistics, bench rows, fuzz results, reports): the three
:data:`PAIRS` ``primary_baseline``, ``primary_golden``, ``baseline_golden`` (``a_b`` = deviation of
``a`` from reference ``b``) and the statistics of :class:`Deviation`. A flat key joins them with an
underscore (``primary_golden_max_abs``), a nested record nests them (``{"primary_golden": {"max_abs":
...}}``).

**One implementation.** :func:`pair_sums` computes the sufficient statistics of up to three pairs
at once with plain tensor ops on the tensors' device, with no host synchronisation and no branch on
the values (one path for the CPU and every accelerator); the probe, the benchmarks and the fuzzer
all use it, through :func:`deviation_tensors` / :func:`deviation` or directly.
:func:`pair_and_row_sums` is the same pass with the L2 norm of every row as well (the verdict's
row statistics, :func:`flashprobe.judge.call_statistics`): each difference is taken once.
Differences are taken in float64 (the float32/bf16/fp16 sides are promoted exactly), so on a
given device the bits do not depend on the inputs' layout; across devices the order of the
reductions (and so the last bits of the sums) may differ.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

__all__ = [
    "DIRECTIONS",
    "FREE_READS",
    "GRADIENTS",
    "PAIRS",
    "PAIR_LABELS",
    "SLICE_ELEMENTS",
    "SUM_ROWS",
    "Deviation",
    "StatsWorkspace",
    "combine_sums",
    "deviation",
    "deviation_tensors",
    "error_ratio",
    "finish_deviation",
    "noise_floor",
    "pair_and_row_sums",
    "pair_sums",
    "reads_are_free",
]

#: The compared pairs, ``a_b`` meaning deviation of ``a`` from reference ``b``.
PAIRS: tuple[str, ...] = ("primary_baseline", "primary_golden", "baseline_golden")
#: Each pair in words, for tables and figures.
PAIR_LABELS: dict[str, str] = {
    "primary_baseline": "primary vs baseline",
    "primary_golden": "primary vs golden",
    "baseline_golden": "baseline vs golden",
}
#: The gradients of the inputs ``q``, ``k``, ``v``, in order.
GRADIENTS: tuple[str, ...] = ("dq", "dk", "dv")
#: The directions of one attention call: its output ``out``, then the input gradients.
DIRECTIONS: tuple[str, ...] = ("out", *GRADIENTS)


@dataclass(frozen=True)
class Deviation:
    """Deviation of ``a`` from a reference ``b`` (see module docstring)."""

    max_abs: float
    mean_abs: float
    rel_l2: float
    nonfinite: int
    numel: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


#: The rows of :func:`pair_sums`, per pair.
SUM_ROWS: tuple[str, ...] = (
    "max_abs", "sum_abs", "sum_sq_diff", "sum_sq_ref", "nonfinite", "count", "max_ref"
)
#: Elements :func:`pair_sums` processes per slice, by device type: cache-sized on the CPU, fewer
#: launches elsewhere. Its scratch memory is ``3 · P + 2`` float64 rows of a slice (``P`` pairs).
SLICE_ELEMENTS: dict[str, int] = {"cpu": 1 << 14, "default": 1 << 20}


#: Device types where reading a value back to the host costs nothing: the CPU, with no device to
#: wait for. Elsewhere a read is a synchronisation, and nothing per attention call reads.
FREE_READS: frozenset[str] = frozenset({"cpu"})


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a value on ``device`` back to the host costs nothing (:data:`FREE_READS`)."""
    return device.type in FREE_READS


class StatsWorkspace:
    """Reusable float64 scratch for :func:`pair_sums` (no allocation per call): per device one
    buffer of at most ``11 · SLICE_ELEMENTS[device]`` values (more only for rows longer than a slice),
    and the views of the last call shapes' sweeps (:class:`_Layout`, a few small tables each)."""

    #: Bytes of per-call-shape tables (:class:`_Layout`) kept; beyond them the oldest shapes are
    #: dropped (a new shape costs its views once more, about a hundred view operations).
    KEPT_BYTES = 32 << 20

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._layouts: dict[tuple[object, ...], _Layout] = {}

    def get(self, device: torch.device, numel: int) -> torch.Tensor:
        """A flat float64 buffer of at least ``numel`` elements on ``device``."""
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float64, device=device)
            self._buffers[device] = buf
            self._layouts = {k: v for k, v in self._layouts.items() if k[0] != device}  # views of the old
        return buf

    def layout(
        self, device: torch.device, n: int, chunk: int, width: int, golden: bool, form: bool
    ) -> _Layout:
        """The :class:`_Layout` of a sweep over ``n`` elements in slices of ``chunk``."""
        key = (device, n, chunk, width, golden, form)
        found = self._layouts.get(key)
        if found is None:
            stride = -(-chunk // _ROW_ALIGN) * _ROW_ALIGN  # every row starts equally aligned
            count = 11 if golden else 3
            scratch = self.get(device, count * stride)[: count * stride].view(count, stride)
            found = _Layout(scratch, stride, n, chunk, width, golden, form)
            if found.nbytes > self.KEPT_BYTES:  # a call this large costs far more than its views
                return found
            while (
                self._layouts
                and sum(x.nbytes for x in self._layouts.values()) + found.nbytes > self.KEPT_BYTES
            ):
                self._layouts.pop(next(iter(self._layouts)))  # the oldest shape
            self._layouts[key] = found
        return found

    def clear(self) -> None:
        self._buffers.clear()
        self._layouts.clear()


def pair_sums(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor | None = None,
    workspace: StatsWorkspace | None = None,
) -> torch.Tensor:
    """Sufficient statistics of the pairs ``(primary, baseline)``, ``(primary, golden)``,
    ``(baseline, golden)`` at once, on the tensors' device (no host synchronisation).

    A position counts as non-finite for a pair when the float64 difference is non-finite, i.e.
    when either side is NaN or ±inf; every other statistic is over the finite positions. Per
    cache-sized slice of ``m`` elements (:data:`SLICE_ELEMENTS`) the scratch rows are the
    references and the differences side by side (:class:`_Layout`), so that each reduction runs once
    over adjacent rows: ``amax`` of the magnitudes, ``sum`` of the differences' and an L2 norm per
    row. The golden pairs' sums of squares are folded from the L2 norms of rows (the golden's last
    dimension, or whole slices): squares of norms, so to the last bit or two.

    **Masking.** Non-finite pairs are taken out with ``ref + 0·d`` (NaN where the pair is not
    finite) and one ``nan_to_num`` that zeroes every masked entry of ``d`` and ``r``. Where a host
    read is free (:func:`reads_are_free`: the CPU), the call is first reduced unmasked, and its
    statistics are read once: when they are finite, no pair is non-finite, masking would change
    nothing, and it is skipped (the two golden pairs then share one reference row, ``golden`` itself, read
    where it lies when it is float64 and contiguous). Both ways give the same bits on finite data,
    so the statistics do not depend on whether the read was made; on an accelerator every slice is
    masked, without a read.

    Args:
        primary: any shape, any floating dtype.
        baseline: as many elements as ``primary`` (compared in row-major order).
        golden: as many elements, or None (then only ``primary_baseline`` is computed).
        workspace: scratch buffers to reuse across calls.

    Returns:
        ``(7, q)`` float64 tensor, ``q`` = 3 pairs (1 without golden), rows :data:`SUM_ROWS`:
        ``max_abs``, ``sum_abs``, ``sum_sq_diff``, ``sum_sq_ref``, ``nonfinite``, ``count`` and
        ``max_ref`` (the largest |reference| over the finite positions: max|golden| for the golden
        pairs, what the noise floor needs).

    Raises:
        ValueError: the tensors have different numbers of elements.
    """
    return _pair_pass(primary, baseline, golden, workspace)[0]


def pair_and_row_sums(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor,
    workspace: StatsWorkspace | None = None,
    form: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """:func:`pair_sums` and the deviation of every row, from one pass over the tensors (each
    difference is taken once and serves both; no host synchronisation).

    A **row** is the last dimension of ``golden`` (a query's output row, a key's gradient row).

    Args:
        primary: ``(..., D)`` any floating dtype.
        baseline: as many elements.
        golden: ``(..., D)``, the reference.
        workspace: scratch buffers to reuse across calls.
        form: as many elements, a second form of the baseline compared with the golden only (its
            row norms only), or None.

    Returns:
        ``(sums, norms, golden_max, finite)``: the ``(7, 3)`` :func:`pair_sums`; ``(K, R)`` float64
        L2 norms of the ``R`` rows of ``primary − golden``, ``baseline − golden``, ``golden`` and
        (with ``form``, ``K`` = 4) ``form − golden``, non-finite where the row holds a non-finite
        value; ``max|golden|`` over every position (non-finite where ``golden`` is), 0-d float64;
        and whether ``primary``, ``baseline`` and ``golden`` were read to be finite everywhere
        (``False`` where that was not read: where host reads are not free, :func:`reads_are_free`).

    Raises:
        ValueError: the tensors have different numbers of elements.
    """
    sums, norms, golden_max, finite = _pair_pass(primary, baseline, golden, workspace, rows=True, form=form)
    assert norms is not None and golden_max is not None
    return sums, norms, golden_max, finite


def _pair_pass(
    primary: torch.Tensor,
    baseline: torch.Tensor,
    golden: torch.Tensor | None,
    workspace: StatsWorkspace | None,
    *,
    rows: bool = False,
    form: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """The pass behind :func:`pair_sums` and (``rows=True``, with golden) :func:`pair_and_row_sums`."""
    p, b = primary.detach(), baseline.detach()
    g = None if golden is None else golden.detach()
    f = None if form is None else form.detach()
    if (
        p.numel() != b.numel()
        or (g is not None and g.numel() != p.numel())
        or (f is not None and f.numel() != p.numel())
    ):
        raise ValueError(
            f"pair_sums: shapes differ: primary {tuple(primary.shape)}, baseline {tuple(baseline.shape)}"
            + ("" if golden is None else f", golden {tuple(golden.shape)}")
            + ("" if form is None else f", form {tuple(form.shape)}")
        )
    rows = rows and g is not None
    pairs = 1 if g is None else 3
    n, device = p.numel(), p.device
    if n == 0:
        sums = torch.zeros(len(SUM_ROWS), pairs, dtype=torch.float64, device=device)
        if not rows:
            return sums, None, None, reads_are_free(device)
        return sums, sums.new_zeros(3 if f is None else 4, 0), sums.new_zeros(()), reads_are_free(device)
    # Rows are the golden's last dimension where they are asked for; else each slice is one row.
    width = (g.shape[-1] if g.dim() else 1) if rows and g is not None else 0
    sweep = _Sweep(p, b, g, f if rows else None, width, workspace or StatsWorkspace())
    if reads_are_free(device):
        sums, norms, golden_max = sweep.run(masked=False)
        # one read for the whole call: is every statistic finite (no non-finite pair, no overflow)?
        if math.isfinite(sums.sum().add(golden_max).item()):
            return sums, norms, golden_max if width else None, True
    sums, norms, golden_max = sweep.run(masked=True)
    return sums, norms, golden_max if width else None, False


#: Scratch rows start at multiples of this many elements (64 bytes of float64), so that a row's
#: reductions give the same bits whichever row of the buffer holds it.
_ROW_ALIGN = 8


class _Views(NamedTuple):
    """One slice's scratch rows, their blocks and its outputs (see :class:`_Layout`)."""

    x: tuple[torch.Tensor, ...]
    blocks: dict[str, torch.Tensor]
    acc: dict[str, torch.Tensor]
    norms: tuple[torch.Tensor, ...]
    squares: torch.Tensor | None


class _Layout:
    """Everything a call shape's sweep writes through, made once and kept by a
    :class:`StatsWorkspace`: the slices, each slice's scratch rows and the blocks its reductions run
    over, and its outputs — a row of the slices' table ``acc (S, C)`` and its columns of the row
    norms — for the unmasked and the masked sweep. A slice then costs its arithmetic alone.

    Scratch rows of a slice: ``[z (P);] b; p − b[; p − g; b − g[; g; g]]`` (``z`` marks
    non-finite pairs; the golden pairs get references of their own only when masked), then spares.
    Columns of ``acc``: ``‖b‖, ‖p − b‖``, the largest magnitudes of ``b`` and of each difference
    (then, masked, of the two goldens), at 8 the sums of the differences' magnitudes, at 11 the
    non-finite positions per pair, at 14 and 15 ``max g`` and ``min g``; without golden ``‖b‖,
    ‖p − b‖, max|b|, max|p − b|, Σ|p − b|`` and the non-finite positions.
    """

    def __init__(
        self, scratch: torch.Tensor, stride: int, n: int, chunk: int, width: int, golden: bool, form: bool
    ) -> None:
        self.scratch, self.stride, self.width, self.golden, self.form = scratch, stride, width, golden, form
        self.sizes = [min(chunk, n - a) for a in range(0, n, chunk)]
        self.rows = [m // width for m in self.sizes] if width else [1] * len(self.sizes)
        self.tables: dict[bool, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        rows = sum(self.rows)
        #: the most its tables take (both sweeps): the slices' table, the row norms, the masked squares
        self.nbytes = 8 * (
            2 * len(self.sizes) * 16 + (2 * 4 + 4) * rows if golden else 2 * len(self.sizes) * 6
        )
        self._views: dict[bool, list[_Views]] = {}

    def views(self, masked: bool) -> list[_Views]:
        """Each slice's :class:`_Views` for the masked or the unmasked sweep (made on first use)."""
        found = self._views.get(masked)
        if found is None:
            found = self._views[masked] = self._make(masked)
        return found

    def _block(self, first: torch.Tensor, count: int, width: int = 0) -> torch.Tensor:
        """``count`` consecutive scratch rows from ``first`` on: ``(count, m)``, or with ``width``
        ``(count, m // width, width)``."""
        m = first.numel()
        if not width:
            return first.as_strided((count, m), (self.stride, 1))
        return first.as_strided((count, m // width, width), (self.stride, width, 1))

    def _make(self, masked: bool) -> list[_Views]:
        device, f64 = self.scratch.device, torch.float64
        total = sum(self.rows)
        acc = torch.zeros(len(self.sizes), 16 if self.golden else 6, dtype=f64, device=device)
        norms = squares = None
        if self.golden:
            norms = torch.empty(4 if self.form else 3, total, dtype=f64, device=device)
            squares = torch.empty(4, total, dtype=f64, device=device) if masked else None
        self.tables[masked] = (acc, norms, squares)
        made, start = [], 0
        for i, m in enumerate(self.sizes):
            x = self.scratch[:, :m].unbind(0)
            w = self.width or m
            at = slice(start, start + self.rows[i])
            start += self.rows[i]
            a = acc[i]
            if not self.golden:
                first = 1 if masked else 0  # b
                blocks = {"b": self._block(x[first], 2)}
                outs = {"norm": a[0:2], "max": a[2:4], "sum": a[4], "nonfinite": a[5]}
                made.append(_Views(x, blocks, outs, (), None))
                continue
            first = 3 if masked else 0  # b
            count = 6 if masked else 4  # magnitudes: b, the differences (and the masked goldens)
            blocks = {
                "b": self._block(x[first], 2),
                "magnitudes": self._block(x[first], count),
                "differences": self._block(x[first + 1], 3),
                "rows": self._block(x[first + 2], 2, w),
                "form_row": x[9 if masked else 5],
                "form": x[9 if masked else 5].view(-1, w),
            }
            if masked:
                blocks["z"] = self._block(x[0], 3)
                blocks["masked"] = self._block(x[first], 6)
                blocks["squares"] = self._block(x[first + 2], 4, w)
            outs = {
                "norm": a[0:2],
                "max": a[2 : 2 + count],
                "sum": a[8:11],
                "nonfinite": a[11:14],
                "gmax": a[14],
                "gmin": a[15],
            }
            assert norms is not None
            row_norms = (norms[0:2, at], norms[2, at], norms[3, at] if self.form else norms[2, at])
            made.append(_Views(x, blocks, outs, row_norms, None if squares is None else squares[:, at]))
        return made


class _Sweep:
    """One pass over ``(primary, baseline[, golden[, form]])`` in slices of whole rows.

    Per slice it writes one row of the slices' table and, with the golden, the L2 norm of every row
    of ``p − g``, ``b − g``, ``g`` (and ``f − g``) (:class:`_Layout`). The golden pairs' sums of
    squares are folded from row norms (of the golden's last dimension, or of whole slices where rows
    are not asked for). Every reduction runs once over adjacent scratch rows, and the unmasked sweep
    (every value finite) and the masked one (non-finite pairs zeroed and counted) reduce the same
    values in the same row shapes: on finite data they give the same bits. Slices are cache-sized
    (:data:`SLICE_ELEMENTS`).
    """

    def __init__(
        self, p: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None, f: torch.Tensor | None, width: int,
        workspace: StatsWorkspace,
    ) -> None:
        self.n, self.width = p.numel(), width
        self.golden = g is not None
        chunk = max(1, min(self.n, SLICE_ELEMENTS.get(p.device.type, SLICE_ELEMENTS["default"])))
        if width:
            chunk = max(width, chunk - chunk % width)  # whole rows per slice
        self.layout = workspace.layout(p.device, self.n, chunk, width, self.golden, f is not None)
        self.inputs: list[tuple[torch.Tensor | None, ...]]
        if self.n <= chunk:  # one slice: read the inputs in their own layout (no flattening)
            self.inputs = [(p, b, g, f)]
        else:
            parts = [None if x is None else x.reshape(-1).split(chunk) for x in (p, b, g, f)]
            self.inputs = [
                tuple(None if x is None else x[i] for x in parts) for i in range(len(self.layout.sizes))
            ]
        # The golden is read where it lies when it is float64 and contiguous already (no copy).
        self.golden_in_place = g is not None and g.dtype == torch.float64 and g.is_contiguous()

    @staticmethod
    def _load(row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Copy ``x`` into the flat float64 scratch ``row``, in ``x``'s row-major order; ``row``."""
        if x.dim() == 1:
            return row.copy_(x)
        row.view(x.shape).copy_(x)
        return row

    def _golden(self, spare: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The golden's slice as a flat float64 row: where it lies when aligned, else loaded."""
        if self.golden_in_place:
            ref = g if g.dim() == 1 else g.reshape(-1)
            if not ref.data_ptr() % (8 * _ROW_ALIGN):  # misaligned, reductions would change bits
                return ref
        return self._load(spare, g)

    def run(self, masked: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(sums (7, P), norms (K, R) or None, max|golden|)``: the sweep, folded (:meth:`_fold`)."""
        views = self.layout.views(masked)
        for v, (p, b, g, f) in zip(views, self.inputs, strict=True):
            assert p is not None and b is not None
            if g is None:
                self._pair_slice(v, p, b, masked)
            elif masked:
                self._masked_slice(v, p, b, g, f)
            else:
                self._finite_slice(v, p, b, g, f)
        return self._fold(*self.layout.tables[masked])

    def _pair_slice(self, v: _Views, p: torch.Tensor, b: torch.Tensor, masked: bool) -> None:
        """Without golden. Scratch rows: ``[z;] b; p − b``."""
        x, block, out = v.x, v.blocks["b"], v.acc
        z, r, d = (x[0], x[1], x[2]) if masked else (None, x[0], x[1])
        self._load(d, p)
        self._load(r, b)
        d.sub_(r)
        if z is not None:
            torch.mul(d, 0.0, out=z)  # 0 where the pair is finite, NaN where it is not
            r.add_(z)
            block.nan_to_num_(0.0, 0.0, 0.0)  # b and d over finite pairs only
            z.nan_to_num_(1.0)  # 1 where the pair is non-finite
            torch.sum(z, dim=0, out=out["nonfinite"])
        torch.linalg.vector_norm(block, dim=1, out=out["norm"])
        block.abs_()
        torch.amax(block, dim=1, out=out["max"])
        torch.sum(d, dim=0, out=out["sum"])

    def _differences(
        self, v: _Views, at: int, p: torch.Tensor, b: torch.Tensor, g: torch.Tensor, f: torch.Tensor | None
    ) -> torch.Tensor:
        """Scratch rows from ``at`` on: ``b; p − b; p − g; b − g``, then a spare for the golden; the
        row norms of ``p − g`` and ``b − g``, of the golden and of the form's ``f − g`` (before any
        masking: a row with a non-finite value reads non-finite), ``max g`` and ``min g`` over every
        position (non-finite where the golden is). Returns the golden's slice as a flat row."""
        x, out, norms = v.x, v.acc, v.norms
        self._load(x[at + 2], p)  # p, until it becomes p − g
        self._load(x[at], b)
        torch.sub(x[at + 2], x[at], out=x[at + 1])
        ref = self._golden(x[at + 4], g)
        x[at + 2].sub_(ref)
        torch.sub(x[at], ref, out=x[at + 3])
        torch.linalg.vector_norm(v.blocks["rows"], dim=-1, out=norms[0])
        torch.linalg.vector_norm(ref.view(-1, self.width or ref.numel()), dim=-1, out=norms[1])
        if f is not None:
            self._load(v.blocks["form_row"], f).sub_(ref)
            torch.linalg.vector_norm(v.blocks["form"], dim=-1, out=norms[2])
        torch.amax(ref, dim=0, out=out["gmax"])
        torch.amin(ref, dim=0, out=out["gmin"])
        return ref

    def _finite_slice(
        self, v: _Views, p: torch.Tensor, b: torch.Tensor, g: torch.Tensor, f: torch.Tensor | None
    ) -> None:
        """Scratch rows: ``b; p − b; p − g; b − g; spare (2)``."""
        self._differences(v, 0, p, b, g, f)
        self._magnitudes(v)

    def _masked_slice(
        self, v: _Views, p: torch.Tensor, b: torch.Tensor, g: torch.Tensor, f: torch.Tensor | None
    ) -> None:
        """Scratch rows: ``z (3); b; p − b; p − g; b − g; g (of p − g); g (of b − g); spare (2)``."""
        x, blocks, out = v.x, v.blocks, v.acc
        ref = self._differences(v, 3, p, b, g, f)
        if ref.data_ptr() != x[7].data_ptr():
            x[7].copy_(ref)
        z = blocks["z"]
        torch.mul(blocks["differences"], 0.0, out=z)  # 0 where the pair is finite, NaN where it is not
        torch.add(x[7], x[2], out=x[8])  # the golden of b − g
        x[7].add_(x[1])  # of p − g
        x[3].add_(x[0])  # b, of p − b
        blocks["masked"].nan_to_num_(0.0, 0.0, 0.0)  # over finite pairs only
        z.nan_to_num_(1.0)  # 1 where the pair is non-finite
        torch.sum(z, dim=1, out=out["nonfinite"])
        # the golden pairs' differences and references over their finite positions, by rows
        torch.linalg.vector_norm(blocks["squares"], dim=-1, out=v.squares)
        self._magnitudes(v)

    @staticmethod
    def _magnitudes(v: _Views) -> None:
        """``‖b‖, ‖p − b‖``, the largest magnitudes and the differences' sums of magnitudes."""
        blocks, out = v.blocks, v.acc
        torch.linalg.vector_norm(blocks["b"], dim=1, out=out["norm"])
        blocks["magnitudes"].abs_()
        torch.amax(blocks["magnitudes"], dim=1, out=out["max"])
        torch.sum(blocks["differences"], dim=1, out=out["sum"])

    def _fold(
        self, acc: torch.Tensor, norms: torch.Tensor | None, squares: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(sums (7, P), norms, max|golden|)`` from the slices' table ``acc`` (maxima, and sums of
        the magnitudes, squares and counts, over slices) and the row norms (a copy: the layout's
        table is written again by the next call)."""
        top, total = acc.amax(dim=0), acc.sum(dim=0)
        own = acc[:, 0:2].square().sum(dim=0)  # ‖b‖², ‖p − b‖²
        if not self.golden:
            nonfinite = total[5:6]
            sums = torch.stack(
                (top[3:4], total[4:5], own[1:2], own[0:1], nonfinite, self.n - nonfinite, top[2:3])
            )
            return sums, None, top.new_zeros(())
        assert norms is not None
        golden_max = torch.maximum(top[14], acc[:, 15].amin().neg())
        if squares is None:  # unmasked: the golden pairs share the golden's rows
            squares = torch.cat((norms[0:3], norms[2:3]))
            refs = golden_max.expand(2)
        else:
            refs = top[6:8]
        folded = squares.square().sum(dim=1)  # ‖p − g‖², ‖b − g‖², ‖g‖² twice (each pair's finite)
        nonfinite = total[11:14]
        sums = torch.stack(
            (
                top[3:6],
                total[8:11],
                torch.cat((own[1:2], folded[0:2])),
                torch.cat((own[0:1], folded[2:4])),
                nonfinite,
                self.n - nonfinite,
                torch.cat((top[2:3], refs)),
            )
        )
        return sums, norms.clone() if self.width else None, golden_max


def combine_sums(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Fold one part's ``(7, q)`` :func:`pair_sums` into the running total: maxima of ``max_abs``
    and ``max_ref``, sums of the rest; ``part`` itself when ``total`` is None. Used over slices,
    reference blocks and calls."""
    if total is None:
        return part
    top = torch.maximum(total, part)
    return torch.cat((top[:1], total[1:6] + part[1:6], top[6:]))


def deviation_tensors(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sufficient statistics of ``a − b`` as 0-d float64 tensors on the inputs' device.

    Args:
        a: any shape.
        b: the reference, same shape as ``a``.

    Returns:
        ``max_abs``, ``sum_abs``, ``sum_sq_diff``, ``sum_sq_ref``, ``nonfinite`` (count of
        positions where either is non-finite) and ``count`` (finite positions): the
        ``primary_baseline`` column of :func:`pair_sums`. Reductions of several calls: max of
        ``max_abs``, sums of the rest.
    """
    if a.shape != b.shape:
        raise ValueError(f"deviation: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    column = pair_sums(a, b)[:, 0]
    return {name: column[i] for i, name in enumerate(SUM_ROWS[:6])}


def finish_deviation(sums: dict[str, float]) -> Deviation:
    """Turn accumulated sufficient statistics (see :func:`deviation_tensors`) into a :class:`Deviation`."""
    count, nonfinite = sums["count"], int(sums["nonfinite"])
    if not count and nonfinite:  # no finite pair compared: every statistic is undefined
        return Deviation(math.nan, math.nan, math.nan, nonfinite, nonfinite)
    rel = (
        math.sqrt(sums["sum_sq_diff"] / sums["sum_sq_ref"])
        if sums["sum_sq_ref"] > 0
        else (0.0 if sums["sum_sq_diff"] == 0 else math.inf)
    )
    return Deviation(
        max_abs=sums["max_abs"],
        mean_abs=sums["sum_abs"] / count if count else 0.0,
        rel_l2=rel,
        nonfinite=nonfinite,
        numel=int(count + nonfinite),
    )


def deviation(a: torch.Tensor, b: torch.Tensor) -> Deviation:
    """Deviation of ``a`` from reference ``b`` as Python floats (one host sync)."""
    t = deviation_tensors(a, b)
    values = torch.stack(list(t.values())).tolist()
    return finish_deviation(dict(zip(t.keys(), values, strict=True)))


def noise_floor(golden_max_abs: float, dtype: torch.dtype) -> float:
    """The error ratio's noise floor: ``½ · eps(dtype) · max|golden|``.

    Args:
        golden_max_abs: the largest magnitude of the golden output.
        dtype: the dtype the kernels computed in.
    """
    return 0.5 * float(torch.finfo(dtype).eps) * golden_max_abs


def error_ratio(primary_golden: float, baseline_golden: float, *, floor: float = 0.0) -> float | None:
    """The error ratio ``primary_golden / max(baseline_golden, floor)`` of two ``max_abs`` deviations.

    Args:
        primary_golden: ``max_abs`` of the primary kernel against the golden value.
        baseline_golden: ``max_abs`` of the baseline against the golden value.
        floor: the noise floor (:func:`noise_floor`); with the default 0 an exact baseline gives
            an infinite ratio.

    Returns:
        The ratio; ``inf`` when the denominator is 0 and the primary is not exact; ``None`` when it
        is undefined: 0/0, or a NaN deviation (nothing finite was compared).

    Raises:
        ValueError: a deviation or the floor is negative (they are absolute differences).
    """
    if primary_golden < 0 or baseline_golden < 0 or floor < 0:
        raise ValueError(
            f"error_ratio: deviations and the floor are absolute differences and cannot be negative, got "
            f"{primary_golden}, {baseline_golden} and floor {floor}"
        )
    if math.isnan(primary_golden) or math.isnan(baseline_golden):
        return None
    denominator = max(baseline_golden, floor)
    if denominator == 0:
        return None if primary_golden == 0 else math.inf
    return primary_golden / denominator
