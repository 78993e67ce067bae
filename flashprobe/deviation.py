"""Elementwise deviation between two attention outputs, and the error ratio.

For an output ``a`` and a reference ``b`` of one shape (:class:`Deviation`): ``max_abs`` and
``mean_abs`` of ``|a − b|`` and ``rel_l2 = ‖a − b‖₂ / ‖b‖₂`` over the finite pairs, and ``nonfinite``,
the positions where either is NaN/±inf (counted, never turning the others into NaN; with no finite
pair they are NaN). The **error ratio** (:func:`error_ratio`, flash-attention's statistic, reported
but not judged by; the verdict is :mod:`flashprobe.judge`) is ``max_abs(primary, golden) /
max(max_abs(baseline, golden), noise floor)``.

The :data:`PAIRS` (``a_b``: deviation of ``a`` from reference ``b``) and the statistics name every
record: a flat key joins them (``primary_golden_max_abs``), a nested record nests them.
:func:`pair_sums` computes the sums of up to three pairs in one pass on the tensors' device, with no
host synchronisation and no branch on the values; differences are taken in float64 (inputs are
promoted exactly), so on one device the bits do not depend on the inputs' layout.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "DIRECTIONS",
    "FREE_READS",
    "GRADIENTS",
    "NORM",
    "PAIR",
    "PAIRS",
    "PAIR_LABELS",
    "SLICE_ELEMENTS",
    "SUM",
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


def _positions(name: str, names: Sequence[str]) -> Any:
    """A named tuple of the positions of ``names`` (``_positions("T", ("a", "b")).b == 1``)."""
    return namedtuple(name, names)(*range(len(names)))


#: The rows of :func:`pair_sums`, per pair.
SUM_ROWS: tuple[str, ...] = ("max_abs", "sum_abs", "sum_sq_diff", "sum_sq_ref", "nonfinite", "count",
                             "max_ref")
#: Where a :func:`pair_sums` result holds what, by name: ``sums[SUM.nonfinite, PAIR.primary_golden]``.
SUM = _positions("SUM", SUM_ROWS)
PAIR = _positions("PAIR", PAIRS)
#: The rows of the row norms of :func:`pair_and_row_sums`: those of each row of ``primary − golden``,
#: ``baseline − golden``, ``golden`` and ``form − golden``.
NORM = _positions("NORM", ("primary_golden", "baseline_golden", "golden", "form"))
#: The rows of :data:`SUM_ROWS` that parts combine by their maximum (:func:`combine_sums`); the rest add.
_MAXIMA = frozenset({"max_abs", "max_ref"})
#: Elements :func:`pair_sums` processes per slice, by device type: cache-sized on the CPU, fewer
#: launches elsewhere. Its scratch memory is ``10`` float64 rows of a slice (:data:`_ROWS`).
SLICE_ELEMENTS: dict[str, int] = {"cpu": 1 << 14, "default": 1 << 20}


#: Device types where reading a value back to the host costs nothing: the CPU, with no device to
#: wait for. Elsewhere a read is a synchronisation, and nothing per attention call reads.
FREE_READS: frozenset[str] = frozenset({"cpu"})


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a value on ``device`` back to the host costs nothing (:data:`FREE_READS`)."""
    return device.type in FREE_READS


class StatsWorkspace:
    """Reusable float64 scratch for :func:`pair_sums` (no allocation per call): per device one
    buffer of at most ``10 · SLICE_ELEMENTS[device]`` values (more only for rows longer than a slice),
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
            count = len(_ROWS) if golden else _ROWS.pb + 1
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

    A position is non-finite for a pair when the float64 difference is (either side NaN or ±inf);
    every other statistic is over the finite positions. The work runs per cache-sized slice
    (:data:`SLICE_ELEMENTS`, :class:`_Sweep`); where a host read is free (:func:`reads_are_free`)
    a call whose unmasked statistics read finite skips the masking, with the same bits.

    Args:
        primary: any shape, any floating dtype.
        baseline: as many elements as ``primary`` (compared in row-major order).
        golden: as many elements, or None (then only ``primary_baseline`` is computed).
        workspace: scratch buffers to reuse across calls.

    Returns:
        ``(7, q)`` float64 tensor, ``q`` = 3 pairs (1 without golden) in :data:`PAIRS` order, rows
        :data:`SUM_ROWS` (read them by name: ``sums[SUM.max_abs, PAIR.primary_golden]``):
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
        (with ``form``, ``K`` = 4) ``form − golden`` (rows :data:`NORM`), non-finite where the row
        holds a non-finite value; ``max|golden|`` over every position (non-finite where ``golden``
        is), 0-d float64; and whether ``primary``, ``baseline`` and ``golden`` were read to be finite
        everywhere (``False`` where that was not read: where host reads are not free,
        :func:`reads_are_free`).

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
        norms = sums.new_zeros(NORM.form if f is None else len(NORM), 0)
        return sums, norms, sums.new_zeros(()), reads_are_free(device)
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

#: The columns of the slices' table (one row per slice): the L2 norms of the rows ``b`` and ``pb``,
#: the largest magnitude of each scratch row from ``b`` to ``g_bg`` (as :attr:`_Slice.magnitudes`),
#: the sums of the differences' magnitudes, the non-finite positions of each pair, and the golden's
#: largest and smallest value; without the golden, those of ``primary_baseline`` alone.
_COLUMNS = _positions("COLUMNS", (
    "norm_b", "norm_pb", "max_b", "max_pb", "max_pg", "max_bg", "max_g", "max_g_bg", "sum_pb", "sum_pg",
    "sum_bg", "nonfinite_pb", "nonfinite_pg", "nonfinite_bg", "golden_max", "golden_min",
))
_PB_COLUMNS = _positions("PB_COLUMNS", ("norm_b", "norm_pb", "max_b", "max_pb", "sum_pb", "nonfinite_pb"))


class _Slice(NamedTuple):
    """One slice's views for one sweep, made once per call shape (:class:`_Layout`): its float64
    scratch rows (``m`` elements each), the runs of adjacent rows its reductions read (``r`` rows of
    ``w``) and where they write, its row of the slices' table (:attr:`_Layout.columns`) and its rows'
    columns of the :data:`NORM` tables. The golden's views are None without it."""

    # The scratch rows in buffer order (_ROWS; without the golden up to pb); reductions read runs of them.
    z_pb: torch.Tensor  # masked sweep: 1 where primary_baseline is non-finite, else 0
    z_pg: torch.Tensor  # the same for primary_golden
    z_bg: torch.Tensor  # and for baseline_golden
    b: torch.Tensor  # the baseline, the reference of primary_baseline
    pb: torch.Tensor  # p − b
    pg: torch.Tensor | None  # p − g
    bg: torch.Tensor | None  # b − g
    g: torch.Tensor | None  # the golden where it is loaded; masked, the reference of primary_golden
    g_bg: torch.Tensor | None  # masked: the golden as the reference of baseline_golden
    form: torch.Tensor | None  # f − g
    own: torch.Tensor  # (2, m) b, pb
    magnitudes: torch.Tensor  # (k, m) b … bg; masked b … g_bg; without the golden b, pb
    differences: torch.Tensor  # (3, m) pb, pg, bg; without the golden pb (m,)
    marks: torch.Tensor  # (3, m) z_pb, z_pg, z_bg; without the golden z_pb (m,)
    golden_rows: torch.Tensor | None  # (2, r, w) pg, bg
    masked_rows: torch.Tensor | None  # (4, r, w) pg, bg, g, g_bg
    form_rows: torch.Tensor | None  # (r, w) form
    norm: torch.Tensor  # (2,) norm_b, norm_pb
    maxima: torch.Tensor  # (k,) from max_b on, one per row of magnitudes
    sums: torch.Tensor  # (3,) from sum_pb on; without the golden sum_pb ()
    nonfinite: torch.Tensor  # (3,) from nonfinite_pb on; without the golden nonfinite_pb ()
    golden_max: torch.Tensor | None  # () golden_max
    golden_min: torch.Tensor | None  # () golden_min
    pair_norms: torch.Tensor | None  # (2, r) NORM rows primary_golden, baseline_golden
    golden_norms: torch.Tensor | None  # (r,) NORM row golden
    form_norms: torch.Tensor | None  # (r,) NORM row form
    squares: torch.Tensor | None  # (4, r) masked: the norms of masked_rows


#: The positions of the scratch rows in a slice's buffer: the first fields of :class:`_Slice`.
_ROWS = _positions("ROWS", _Slice._fields[: _Slice._fields.index("own")])


class _Layout:
    """Everything a call shape's sweeps write through, made once and kept by a :class:`StatsWorkspace`:
    per sweep (unmasked, masked) each slice's :class:`_Slice` and the tables they write, the slices'
    table ``(S, len(columns))`` (zero where a sweep writes nothing) and with the golden the
    :data:`NORM` rows ``(K, R)`` and, masked, the squares ``(4, R)``. A slice costs its arithmetic alone."""

    def __init__(
        self, scratch: torch.Tensor, stride: int, n: int, chunk: int, width: int, golden: bool, form: bool
    ) -> None:
        self.scratch, self.stride, self.width, self.golden, self.form = scratch, stride, width, golden, form
        self.sizes = [min(chunk, n - a) for a in range(0, n, chunk)]
        self.rows = [m // width for m in self.sizes] if width else [1] * len(self.sizes)
        self.columns = _COLUMNS if golden else _PB_COLUMNS  # of the slices' table
        self.tables: dict[bool, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        #: the most its tables take (both sweeps): the slices' tables, the row norms, the masked squares
        norms = (2 * len(NORM) + 4) * sum(self.rows) if golden else 0
        self.nbytes = 8 * (2 * len(self.sizes) * len(self.columns) + norms)
        self._views: dict[bool, list[_Slice]] = {}

    def views(self, masked: bool) -> list[_Slice]:
        """Each slice's :class:`_Slice` for the masked or the unmasked sweep (made on first use)."""
        if masked not in self._views:
            self._views[masked] = self._make(masked)
        return self._views[masked]

    def _block(self, first: torch.Tensor, count: int, width: int = 0) -> torch.Tensor:
        """``count`` scratch rows from ``first`` on: ``(count, m)``, or ``(count, m // width, width)``."""
        m = first.numel()
        if not width:
            return first.as_strided((count, m), (self.stride, 1))
        return first.as_strided((count, m // width, width), (self.stride, width, 1))

    def _make(self, masked: bool) -> list[_Slice]:
        device, f64, golden, row, col = self.scratch.device, torch.float64, self.golden, _ROWS, self.columns
        table = torch.zeros(len(self.sizes), len(col), dtype=f64, device=device)
        norms = squares = None
        if golden:
            rows = sum(self.rows)
            norms = torch.empty(len(NORM) if self.form else NORM.form, rows, dtype=f64, device=device)
            squares = torch.empty(4, rows, dtype=f64, device=device) if masked else None
        self.tables[masked] = (table, norms, squares)
        k = (row.g_bg if masked else row.bg) - row.b + 1 if golden else 2
        made, start = [], 0
        for i, m in enumerate(self.sizes):
            x = self.scratch[:, :m].unbind(0)
            w = self.width or m
            at = slice(start, start + self.rows[i])
            start += self.rows[i]
            t = table[i]
            made.append(
                _Slice(
                    **{name: x[j] if j < len(x) else None for j, name in enumerate(_ROWS._fields)},
                    own=self._block(x[row.b], 2),
                    magnitudes=self._block(x[row.b], k),
                    differences=self._block(x[row.pb], len(PAIRS)) if golden else x[row.pb],
                    marks=self._block(x[row.z_pb], len(PAIRS)) if golden else x[row.z_pb],
                    golden_rows=self._block(x[row.pg], 2, w) if golden else None,
                    masked_rows=self._block(x[row.pg], 4, w) if golden else None,
                    form_rows=x[row.form].view(-1, w) if golden else None,
                    norm=t[col.norm_b : col.norm_pb + 1],
                    maxima=t[col.max_b : col.max_b + k],
                    sums=t[col.sum_pb : col.sum_bg + 1] if golden else t[col.sum_pb],
                    nonfinite=t[col.nonfinite_pb : col.nonfinite_bg + 1] if golden else t[col.nonfinite_pb],
                    golden_max=t[col.golden_max] if golden else None,
                    golden_min=t[col.golden_min] if golden else None,
                    pair_norms=None if norms is None else norms[: NORM.baseline_golden + 1, at],
                    golden_norms=None if norms is None else norms[NORM.golden, at],
                    form_norms=norms[NORM.form, at] if norms is not None and self.form else None,
                    squares=None if squares is None else squares[:, at],
                )
            )
        return made


class _Sweep:
    """One pass over ``(primary, baseline[, golden[, form]])`` in cache-sized slices of whole rows
    (:data:`SLICE_ELEMENTS`), unmasked or masked: on finite data both reduce the same values in the
    same row shapes, so they give the same bits. Masked, non-finite pairs are taken out with
    ``ref + 0·d`` (NaN where the pair is not finite) and one ``nan_to_num``; unmasked, the golden
    pairs share ``golden`` itself as their reference. The golden pairs' sums of squares are folded
    from the L2 norms of rows."""

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
        for v, (p, b, g, f) in zip(self.layout.views(masked), self.inputs, strict=True):
            assert p is not None and b is not None
            self._slice(v, p, b, g, f, masked)
        return self._fold(*self.layout.tables[masked])

    def _slice(
        self, v: _Slice, p: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None, f: torch.Tensor | None,
        masked: bool,
    ) -> None:
        """One slice into its row of the slices' table and its rows' norms: the differences, then
        (with the golden, before any masking, so that a row with a non-finite value reads non-finite)
        the rows' norms and the golden's extremes, then (masked) the non-finite pairs taken out, then
        the norms, largest magnitudes and sums of magnitudes."""
        if g is None:
            self._load(v.pb, p)
            self._load(v.b, b)
            v.pb.sub_(v.b)
        else:
            self._load(v.pg, p)  # p, until it becomes p − g
            self._load(v.b, b)
            torch.sub(v.pg, v.b, out=v.pb)
            g = self._golden(v.g, g)
            v.pg.sub_(g)
            torch.sub(v.b, g, out=v.bg)
            torch.linalg.vector_norm(v.golden_rows, dim=-1, out=v.pair_norms)
            torch.linalg.vector_norm(g.view(-1, self.width or g.numel()), dim=-1, out=v.golden_norms)
            if f is not None:
                self._load(v.form, f).sub_(g)
                torch.linalg.vector_norm(v.form_rows, dim=-1, out=v.form_norms)
            torch.amax(g, dim=0, out=v.golden_max)
            torch.amin(g, dim=0, out=v.golden_min)
        if masked:
            torch.mul(v.differences, 0.0, out=v.marks)  # 0 where the pair is finite, NaN where it is not
            if g is not None:
                if g.data_ptr() != v.g.data_ptr():
                    v.g.copy_(g)
                torch.add(v.g, v.z_bg, out=v.g_bg)  # the reference of b − g
                v.g.add_(v.z_pg)  # of p − g
            v.b.add_(v.z_pb)  # of p − b
            v.magnitudes.nan_to_num_(0.0, 0.0, 0.0)  # references and differences over finite pairs only
            v.marks.nan_to_num_(1.0)  # 1 where the pair is non-finite
            torch.sum(v.marks, dim=-1, out=v.nonfinite)
            if g is not None:  # the golden pairs' differences and references over their finite pairs
                torch.linalg.vector_norm(v.masked_rows, dim=-1, out=v.squares)
        torch.linalg.vector_norm(v.own, dim=1, out=v.norm)
        v.magnitudes.abs_()
        torch.amax(v.magnitudes, dim=1, out=v.maxima)
        torch.sum(v.differences, dim=-1, out=v.sums)

    def _fold(
        self, table: torch.Tensor, norms: torch.Tensor | None, squares: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(sums (7, P), norms, max|golden|)`` from the slices' table (maxima over slices, sums of
        the rest) and the row norms (a copy: the layout's tables are written again by the next call)."""
        col, pairs = self.layout.columns, len(PAIRS) if self.golden else 1
        top, total = table.amax(dim=0), table.sum(dim=0)
        own = table[:, col.norm_b : col.norm_pb + 1].square().sum(dim=0)
        nonfinite = total[col.nonfinite_pb : col.nonfinite_pb + pairs]
        found = {
            "max_abs": top[col.max_pb : col.max_pb + pairs],
            "sum_abs": total[col.sum_pb : col.sum_pb + pairs],
            "sum_sq_diff": own[1:2],  # ‖p − b‖²
            "sum_sq_ref": own[0:1],  # ‖b‖²
            "nonfinite": nonfinite,
            "count": self.n - nonfinite,
            "max_ref": top[col.max_b : col.max_b + 1],
        }
        if not self.golden:
            return torch.stack([found[name] for name in SUM_ROWS]), None, top.new_zeros(())
        assert norms is not None
        golden_max = torch.maximum(top[col.golden_max], table[:, col.golden_min].amin().neg())
        if squares is None:  # unmasked: the golden pairs share the golden as their reference
            squares = torch.cat((norms[: NORM.golden + 1], norms[NORM.golden : NORM.golden + 1]))
            refs = golden_max.expand(2)
        else:
            refs = top[col.max_g : col.max_g_bg + 1]
        folded = squares.square().sum(dim=1)  # ‖p − g‖², ‖b − g‖², then their references' ‖·‖²
        found["sum_sq_diff"] = torch.cat((found["sum_sq_diff"], folded[0:2]))
        found["sum_sq_ref"] = torch.cat((found["sum_sq_ref"], folded[2:4]))
        found["max_ref"] = torch.cat((found["max_ref"], refs))
        sums = torch.stack([found[name] for name in SUM_ROWS])
        return sums, norms.clone() if self.width else None, golden_max


def combine_sums(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Fold one part's ``(7, q)`` :func:`pair_sums` into the running total: maxima of ``max_abs``
    and ``max_ref``, sums of the rest; ``part`` itself when ``total`` is None. Used over slices,
    reference blocks and calls."""
    if total is None:
        return part
    top, added = torch.maximum(total, part), total + part
    return torch.stack([(top if name in _MAXIMA else added)[i] for i, name in enumerate(SUM_ROWS)])


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
    column = pair_sums(a, b)[:, PAIR.primary_baseline]
    return {name: column[i] for i, name in enumerate(SUM_ROWS) if name != "max_ref"}


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
    """The error ratio's noise floor: ``½ · eps(dtype) · max|golden|``, the rounding of merely storing
    the golden in the dtype; it matters only where the baseline is (nearly) exact.

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
