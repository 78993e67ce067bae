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

import torch

__all__ = [
    "FREE_READS",
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
    "max_abs",
    "sum_abs",
    "sum_sq_diff",
    "sum_sq_ref",
    "nonfinite",
    "count",
    "max_ref",
)
#: Elements :func:`pair_sums` processes per slice, by device type: cache-sized on the CPU, fewer
#: launches elsewhere. Its scratch memory is ``3 · P + 2`` float64 rows of a slice (``P`` pairs).
SLICE_ELEMENTS: dict[str, int] = {"cpu": 1 << 14, "default": 1 << 20}


def _slice_elements(device: torch.device) -> int:
    return SLICE_ELEMENTS.get(device.type, SLICE_ELEMENTS["default"])


#: Device types where reading a value back to the host costs nothing: the CPU, with no device to
#: wait for. Elsewhere a read is a synchronisation, and nothing per attention call reads.
FREE_READS: frozenset[str] = frozenset({"cpu"})


def reads_are_free(device: torch.device) -> bool:
    """Whether reading a value on ``device`` back to the host costs nothing (:data:`FREE_READS`)."""
    return device.type in FREE_READS


class StatsWorkspace:
    """Reusable float64 scratch for :func:`pair_sums` (no allocation per call); holds at most
    ``11 · SLICE_ELEMENTS[device]`` values per device."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, numel: int) -> torch.Tensor:
        """A flat float64 buffer of at least ``numel`` elements on ``device``."""
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float64, device=device)
            self._buffers[device] = buf
        return buf

    def clear(self) -> None:
        self._buffers.clear()


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
    cache-sized slice of ``m`` elements (:data:`SLICE_ELEMENTS`) the scratch rows are ``z (P, m)``
    (non-finite markers), ``d (P, m)`` (differences) and ``r (P, m)`` (references), so that each
    reduction runs once over adjacent rows: ``sum`` over ``d`` and ``z``, ``amax`` over ``[d; r]``
    and one L2 norm per row (the sums of squares are its squares, to the last bit or two).

    **Masking.** Non-finite pairs are taken out with ``ref + 0·d`` (NaN where the pair is not
    finite) and one ``nan_to_num`` that zeroes every masked entry of ``d`` and ``r``. Where a host
    read is free (:func:`reads_are_free`: the CPU), the call is first reduced unmasked, and its
    norms are read once: when they are finite, no pair is non-finite, masking would change nothing,
    and it is skipped (the two golden pairs then share one reference row, ``golden`` itself, read
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
    width = (g.shape[-1] if g.dim() else 1) if rows and g is not None else 0  # 0: no rows
    if n == 0:
        sums = torch.zeros(len(SUM_ROWS), pairs, dtype=torch.float64, device=device)
        if not rows:
            return sums, None, None, reads_are_free(device)
        return sums, sums.new_zeros(3 if f is None else 4, 0), sums.new_zeros(()), reads_are_free(device)
    sweep = _Sweep(p, b, g, f if rows else None, width, workspace or StatsWorkspace())
    if reads_are_free(device):
        acc = sweep.run(masked=False)
        # one read for the whole call: are the norms finite (no non-finite pair, no overflow)?
        if math.isfinite(acc[:, : 2 * pairs].sum().item()):
            return (*sweep.finish(acc), True)
    return (*sweep.finish(sweep.run(masked=True)), False)


#: Scratch rows start at multiples of this many elements (64 bytes of float64), so that a row's
#: reductions give the same bits whichever row of the buffer holds it.
_ROW_ALIGN = 8


class _Sweep:
    """One pass over ``(primary, baseline[, golden[, form]])`` in slices of whole rows.

    Per slice ``s`` it writes one row of ``acc (S, 6P + 2)``: the L2 norms of the differences and
    of the references, the largest magnitudes of both, the sums of magnitudes of the differences,
    the non-finite positions per pair, and ``max golden``, ``min golden`` (over every position);
    with rows, the L2 norm of each row into :attr:`norms` ``(K, R)``. The unmasked sweep (every
    value finite) and the masked one (non-finite pairs zeroed and counted) run the same reductions
    on equally aligned rows, so on finite data they give the same bits; :meth:`finish` folds the
    slices, the same way for both. Slices are cache-sized (:data:`SLICE_ELEMENTS`) and their
    scratch views are made once per slice length: a slice costs about a dozen tensor operations.
    """

    def __init__(
        self,
        p: torch.Tensor,
        b: torch.Tensor,
        g: torch.Tensor | None,
        f: torch.Tensor | None,
        width: int,
        workspace: StatsWorkspace,
    ) -> None:
        self.n, self.device, self.width = p.numel(), p.device, width
        self.pairs = 1 if g is None else 3
        chunk = max(1, min(self.n, _slice_elements(self.device)))
        if width:
            chunk = max(width, chunk - chunk % width)  # whole rows per slice
        self.whole = self.n <= chunk  # one slice: read the inputs in their own layout (no flattening)
        if self.whole:
            self.p, self.b, self.g, self.f = p, b, g, f
        else:
            self.p, self.b = p.reshape(-1), b.reshape(-1)
            self.g = None if g is None else g.reshape(-1)
            self.f = None if f is None else f.reshape(-1)
        # The golden is read where it lies when it is a float64 row already (no copy), else loaded.
        self.g_flat = (
            g.reshape(-1) if g is not None and g.dtype == torch.float64 and g.is_contiguous() else None
        )
        self.stride = -(-chunk // _ROW_ALIGN) * _ROW_ALIGN  # every row starts equally aligned
        rows = 3 * self.pairs + 2
        self.scratch = workspace.get(self.device, rows * self.stride)[: rows * self.stride].view(
            rows, self.stride
        )
        self.slices = [(a, min(self.n, a + chunk)) for a in range(0, self.n, chunk)]
        self.norms = torch.empty(
            (3 if f is None else 4) if width else 0,
            self.n // max(width, 1),
            dtype=torch.float64,
            device=self.device,
        )

    def _load(self, row: torch.Tensor, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Copy ``x``'s slice into the flat float64 ``row`` (in ``x``'s own layout when whole); ``row``."""
        if self.whole:
            row.view(x.shape).copy_(x)
        else:
            row.copy_(x[start:stop])
        return row

    def _golden(self, spare: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The golden's slice as a float64 row: where it lies when aligned, else loaded into ``spare``."""
        if self.g_flat is not None:
            ref = self.g_flat[start:stop]
            if not ref.data_ptr() % (8 * _ROW_ALIGN):  # misaligned, reductions would change bits
                return ref
        assert self.g is not None
        return self._load(spare, self.g, start, stop)

    def run(self, masked: bool) -> torch.Tensor:
        """``acc (S, 6P + 2)`` (see the class docstring); fills :attr:`norms` with rows."""
        pairs = self.pairs
        acc = torch.empty(len(self.slices), 6 * pairs + 2, dtype=torch.float64, device=self.device)
        views: dict[int, tuple[torch.Tensor, ...]] = {}
        for (start, stop), row in zip(self.slices, acc.unbind(0), strict=True):
            m = stop - start
            if m not in views:
                views[m] = self.scratch[:, :m].unbind(0)
            if masked:
                self._masked_slice(views[m], row, start, stop)
            else:
                self._finite_slice(views[m], row, start, stop)
        if pairs == 1:
            acc[:, 6:].zero_()  # no golden
        if not masked:  # what the masked sweep reads from its own rows: nothing non-finite, g as its refs
            acc[:, 5 * pairs : 6 * pairs].zero_()
            if pairs == 3:
                acc[:, 5].copy_(acc[:, 4])
                top = torch.maximum(acc[:, 6 * pairs], acc[:, 6 * pairs + 1].neg())
                acc[:, 10:12].copy_(top.unsqueeze(1).expand(-1, 2))
        return acc

    def _rows(self, d1: torch.Tensor, ref: torch.Tensor, spare: torch.Tensor, start: int, stop: int) -> None:
        """The L2 norm of each row of ``[p − g; b − g]`` (the two scratch rows from ``d1`` on), of the
        golden ``ref (m,)`` and (with a form) of form − g, into :attr:`norms`."""
        w, m = self.width, stop - start
        at = slice(start // w, stop // w)
        pair = d1.as_strided((2, m // w, w), (self.stride, w, 1))
        torch.linalg.vector_norm(pair, dim=-1, out=self.norms[:2, at])
        torch.linalg.vector_norm(ref.view(-1, w), dim=-1, out=self.norms[2, at])
        if self.f is not None:
            self._load(spare, self.f, start, stop).sub_(ref)
            torch.linalg.vector_norm(spare.view(-1, w), dim=-1, out=self.norms[3, at])

    def _block(self, first: torch.Tensor, count: int) -> torch.Tensor:
        """``(count, m)``: ``count`` consecutive scratch rows from ``first`` on."""
        return first.as_strided((count, first.numel()), (self.stride, 1))

    def _finite_slice(self, x: tuple[torch.Tensor, ...], acc: torch.Tensor, start: int, stop: int) -> None:
        """Rows of ``x``: ``[d (P); r0; spare (2)]``, ``d`` = p − b (, p − g, b − g), ``r0`` = b."""
        pairs = self.pairs
        r0 = x[pairs]
        self._load(x[0] if pairs == 1 else x[1], self.p, start, stop)  # p, until it becomes p − b or p − g
        self._load(r0, self.b, start, stop)
        if pairs == 1:
            x[0].sub_(r0)
        else:
            torch.sub(x[1], r0, out=x[0])
            ref = self._golden(x[4], start, stop)
            x[1].sub_(ref)
            torch.sub(r0, ref, out=x[2])
            if self.width:
                self._rows(x[1], ref, x[5], start, stop)
            torch.linalg.vector_norm(ref, out=acc[4])
            torch.amax(ref, out=acc[6 * pairs])
            torch.amin(ref, out=acc[6 * pairs + 1])
        dr = self._block(x[0], pairs + 1)  # d, then b
        torch.linalg.vector_norm(dr, dim=1, out=acc[: pairs + 1])
        dr.abs_()
        torch.amax(dr, dim=1, out=acc[2 * pairs : 3 * pairs + 1])  # max|d|, then max|b|
        torch.sum(dr[:pairs], dim=1, out=acc[4 * pairs : 5 * pairs])

    def _masked_slice(self, x: tuple[torch.Tensor, ...], acc: torch.Tensor, start: int, stop: int) -> None:
        """Rows of ``x``: ``[z (P); d (P); r (P); spare (2)]``; ``z`` marks non-finite pairs."""
        pairs = self.pairs
        z, d, r = self._block(x[0], pairs), x[pairs : 2 * pairs], x[2 * pairs : 3 * pairs]
        self._load(x[0], self.p, start, stop)  # scratch until masking
        self._load(r[0], self.b, start, stop)
        torch.sub(x[0], r[0], out=d[0])
        if pairs == 3:
            ref = self._golden(r[1], start, stop)
            torch.sub(x[0], ref, out=d[1])
            torch.sub(r[0], ref, out=d[2])
            if self.width:  # before masking: a row with a non-finite difference reads non-finite
                self._rows(d[1], ref, x[3 * pairs], start, stop)
            torch.amax(ref, out=acc[6 * pairs])  # over every position: non-finite where the golden is
            torch.amin(ref, out=acc[6 * pairs + 1])
            if ref.data_ptr() != r[1].data_ptr():
                r[1].copy_(ref)
        dd, dr = self._block(d[0], pairs), self._block(d[0], 2 * pairs)
        torch.mul(dd, 0.0, out=z)  # 0 where the pair is finite, NaN where it is not
        if pairs == 3:
            torch.add(r[1], z[2], out=r[2])
            r[1].add_(z[1])
        r[0].add_(z[0])
        dr.nan_to_num_(0.0, 0.0, 0.0)  # d and r over finite pairs only
        z.nan_to_num_(1.0)  # 1 where the pair is non-finite
        torch.linalg.vector_norm(dr, dim=1, out=acc[: 2 * pairs])
        dr.abs_()
        torch.amax(dr, dim=1, out=acc[2 * pairs : 4 * pairs])  # max|d|, then max|r|
        torch.sum(dd, dim=1, out=acc[4 * pairs : 5 * pairs])
        torch.sum(z, dim=1, out=acc[5 * pairs : 6 * pairs])

    def finish(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(sums (7, P), norms (K, R) or None, max|golden| or None)``: the slices of ``acc`` folded
        (maxima, and sums of the magnitudes, squared norms and counts, over slices)."""
        pairs = self.pairs
        top, total = acc.amax(dim=0), acc.sum(dim=0)
        squares = acc[:, : 2 * pairs].square().sum(dim=0)
        nonfinite = total[5 * pairs : 6 * pairs]
        sums = torch.stack(
            (
                top[2 * pairs : 3 * pairs],
                total[4 * pairs : 5 * pairs],
                squares[:pairs],
                squares[pairs:],
                nonfinite,
                self.n - nonfinite,
                top[3 * pairs : 4 * pairs],
            )
        )
        if not self.width:
            return sums, None, None
        golden_max = torch.maximum(top[6 * pairs], acc[:, 6 * pairs + 1].amin().neg())
        return sums, self.norms, golden_max


def combine_sums(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Fold one part's ``(7, q)`` :func:`pair_sums` into the running total: maxima of ``max_abs``
    and ``max_ref``, sums of the rest; ``part`` itself when ``total`` is None. Used over slices,
    reference blocks and calls."""
    if total is None:
        return part
    return torch.cat(
        (
            torch.maximum(total[:1], part[:1]),
            total[1:6] + part[1:6],
            torch.maximum(total[6:], part[6:]),
        )
    )


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


def _finish(t: dict[str, float]) -> Deviation:
    count, nonfinite = t["count"], int(t["nonfinite"])
    if not count and nonfinite:  # no finite pair compared: every statistic is undefined
        return Deviation(math.nan, math.nan, math.nan, nonfinite, nonfinite)
    rel = (
        math.sqrt(t["sum_sq_diff"] / t["sum_sq_ref"])
        if t["sum_sq_ref"] > 0
        else (0.0 if t["sum_sq_diff"] == 0 else math.inf)
    )
    return Deviation(
        max_abs=t["max_abs"],
        mean_abs=t["sum_abs"] / count if count else 0.0,
        rel_l2=rel,
        nonfinite=nonfinite,
        numel=int(count + nonfinite),
    )


def deviation(a: torch.Tensor, b: torch.Tensor) -> Deviation:
    """Deviation of ``a`` from reference ``b`` as Python floats (one host sync)."""
    t = deviation_tensors(a, b)
    values = torch.stack(list(t.values())).tolist()
    return _finish(dict(zip(t.keys(), values, strict=True)))


def finish_deviation(sums: dict[str, float]) -> Deviation:
    """Turn accumulated sufficient statistics (see :func:`deviation_tensors`) into a :class:`Deviation`."""
    return _finish(sums)


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
