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
#: launches elsewhere. Its scratch memory is ``3 · P`` float64 rows of a slice (``P`` pairs).
SLICE_ELEMENTS: dict[str, int] = {"cpu": 1 << 17, "default": 1 << 20}


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
    ``9 · SLICE_ELEMENTS[device]`` values per device."""

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
    when either side is NaN or ±inf; every other statistic is over the finite positions. Per slice
    of ``m`` elements (:data:`SLICE_ELEMENTS`) the scratch rows are ``z (P, m)`` (non-finite
    markers), ``d (P, m)`` (differences) and ``r (P, m)`` (references), so that each reduction runs
    once over adjacent rows: ``sum`` over ``[z; d]``, ``amax`` over ``[d; r]`` and the squared norms
    as one dot product per row (exact sums of squares, no square root).

    **Masking.** Non-finite pairs are taken out with ``ref + 0·d`` (NaN where the pair is not
    finite) and one ``nan_to_num`` that zeroes every masked entry of ``d`` and ``r``. Where a host
    read is free (:func:`reads_are_free`: the CPU), a slice is first reduced unmasked, and its
    sums of squares are read: when they are finite, no pair of the slice is non-finite, masking
    would change nothing, and it is skipped (the two golden pairs then share one reference row,
    ``golden`` itself, read where it lies when it is float64 and contiguous). Both ways give the
    same bits on finite data, so the statistics do not depend on whether the read was made; on an
    accelerator every slice is masked, without a read.

    Args:
        primary: any shape, any floating dtype.
        baseline: as many elements as ``primary`` (compared in row-major order).
        golden: as many elements, or None (then only ``primary_baseline`` is computed).
        workspace: scratch buffers to reuse across calls.

    Returns:
        ``(7, P)`` float64 tensor, ``P`` = 3 pairs (1 without golden), rows :data:`SUM_ROWS`:
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
    workspace = workspace or StatsWorkspace()
    n, pairs, device = p.numel(), (1 if g is None else 3), p.device
    chunk = max(1, min(n, _slice_elements(device)))
    width = 1
    if rows:
        assert g is not None
        width = g.shape[-1] if g.dim() else 1
        chunk = max(width, chunk - chunk % width) if width else chunk  # whole rows per slice
    stride = -(-chunk // _ROW_ALIGN) * _ROW_ALIGN  # every row starts equally aligned (same-bit dots)
    buf = workspace.get(device, 3 * pairs * stride)
    whole = n <= chunk  # one slice: read the inputs in their own layout (no flattening copy)
    if not whole:
        p, b = p.reshape(-1), b.reshape(-1)
        g = None if g is None else g.reshape(-1)
        f = None if f is None else f.reshape(-1)
    # The golden is read where it lies when it is a float64 row already (no copy), else loaded.
    in_place = g is not None and g.dtype == torch.float64 and g.is_contiguous()
    check = finite = reads_are_free(device)
    total: torch.Tensor | None = None
    norms: list[torch.Tensor] = []
    golden_max: torch.Tensor | None = None
    for start in range(0, max(n, 1), chunk):
        stop = min(n, start + chunk)
        m = stop - start
        scratch = buf[: 3 * pairs * stride].view(3 * pairs, stride)[:, :m]
        z, d, r = scratch[:pairs], scratch[pairs : 2 * pairs], scratch[2 * pairs :]

        def load(row: torch.Tensor, x: torch.Tensor, start: int = start, stop: int = stop) -> None:
            (row.view(x.shape) if whole else row).copy_(x if whole else x[start:stop])

        # In float64: the primary into z[0] (scratch until masking), the baseline into r[0] and
        # the golden into r[1] (or read where it lies); then the differences.
        load(z[0], p)
        load(r[0], b)
        torch.sub(z[0], r[0], out=d[0])
        ref, loaded = None, False
        if g is not None:
            ref = g.reshape(-1)[start:stop] if in_place else None
            if ref is None or ref.data_ptr() % (8 * _ROW_ALIGN):  # misaligned, dots would change bits
                ref, loaded = r[1], True
                load(r[1], g)
            torch.sub(z[0], ref, out=d[1])
            torch.sub(r[0], ref, out=d[2])
            if rows and m:  # before any masking: a row with a non-finite difference reads non-finite
                if f is not None:  # the form's difference in z[1] (scratch until masking)
                    load(z[1], f)
                    z[1].sub_(ref)
                norms.append(_row_norms(d[1:3], ref, z[1] if f is not None else None, width))
        part = None
        if check:  # unmasked: d, then r[0] and (with golden) the golden, shared by the golden pairs
            used = [*d, r[0]] + ([] if ref is None else [ref])
            squares = torch.stack([torch.dot(row, row) for row in used])
            if math.isfinite(squares.sum().item()):  # no non-finite pair in this slice
                part = _reduce_finite(scratch[pairs : 2 * pairs + 1], ref, squares, pairs)
                if rows:
                    golden_max = _max(golden_max, part[6, 1])
        if part is None:
            finite = False
            if ref is not None and not loaded:
                load(r[1], g)
            if rows:  # every position, non-finite ones included
                assert ref is not None
                top = torch.linalg.vector_norm(ref, float("inf"), dtype=torch.float64)
                golden_max = _max(golden_max, top)
            torch.mul(d, 0.0, out=z)  # 0 where the pair is finite, NaN where it is not
            if g is not None:
                torch.add(r[1], z[2], out=r[2])
                r[1].add_(z[1])
            r[0].add_(z[0])
            scratch[pairs:].nan_to_num_(0.0, 0.0, 0.0)  # d and r over finite pairs only
            z.nan_to_num_(1.0)  # 1 where the pair is non-finite
            part = _reduce(scratch[pairs:], _squares(scratch[pairs:]), pairs, z)
        total = combine_sums(total, part)
    assert total is not None
    total[5] = n - total[4]
    if not rows:
        return total, None, None, finite
    if n == 0:
        k = 3 if f is None else 4
        return total, total.new_zeros(k, 0), total.new_zeros(()), finite
    assert golden_max is not None
    return total, norms[0] if len(norms) == 1 else torch.cat(norms, dim=1), golden_max, finite


#: Scratch rows start at multiples of this many elements (64 bytes of float64), so that a row's
#: reductions give the same bits whichever row of the buffer holds it.
_ROW_ALIGN = 8


def _max(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else torch.maximum(total, part)


def _row_norms(
    diffs: torch.Tensor, golden: torch.Tensor, form: torch.Tensor | None, width: int
) -> torch.Tensor:
    """``(K, rows)`` L2 norms of the rows of ``diffs (2, m)``, ``golden (m,)`` and ``form (m,)``."""
    found = [
        torch.linalg.vector_norm(diffs.view(2, -1, width), dim=-1),
        torch.linalg.vector_norm(golden.view(1, -1, width), dim=-1),
    ]
    if form is not None:
        found.append(torch.linalg.vector_norm(form.view(1, -1, width), dim=-1))
    return torch.cat(found)


def _squares(rows: torch.Tensor) -> torch.Tensor:
    """The squared norm of each row of ``rows (R, m)``, one dot product per row: ``(R,)``."""
    return torch.stack([torch.dot(row, row) for row in rows])


def _reduce_finite(
    dr: torch.Tensor, golden: torch.Tensor | None, squares: torch.Tensor, pairs: int
) -> torch.Tensor:
    """One finite slice's ``(7, P)`` sums (:func:`_reduce` where no pair is non-finite).

    Args:
        dr: ``[d (P, m); r[0] (1, m)]``, overwritten with their magnitudes.
        golden: ``(m,)`` the golden row shared by the golden pairs (read only), or None (``P`` = 1).
        squares: the squared norms of ``dr``'s rows, then of ``golden``.
        pairs: ``P``.
    """
    dr.abs_()
    maxima = dr.amax(dim=1) if dr.shape[1] else dr.new_zeros(dr.shape[0])  # max_abs, then max|r[0]|
    if golden is not None:  # max|golden| = max(max g, −min g): exact, and the golden stays as it is
        top = torch.maximum(golden.amax(), golden.amin().neg()) if golden.numel() else maxima[:1]
        maxima = torch.cat((maxima, top.reshape(1)))
    sum_abs = dr[:pairs].sum(dim=1)
    ref_sq, ref_max = squares[pairs:], maxima[pairs:]
    if len(ref_sq) != pairs:  # r[0], then the golden twice
        ref_sq = torch.cat((ref_sq[:1], ref_sq[1:].expand(2)))
        ref_max = torch.cat((ref_max[:1], ref_max[1:].expand(2)))
    zeros = sum_abs.new_zeros(pairs)
    return torch.stack((maxima[:pairs], sum_abs, squares[:pairs], ref_sq, zeros, zeros, ref_max))


def _reduce(dr: torch.Tensor, squares: torch.Tensor, pairs: int, z: torch.Tensor) -> torch.Tensor:
    """One masked slice's ``(7, P)`` sums from its scratch rows (overwritten with their magnitudes).

    Args:
        dr: ``[d (P, m); r (P, m)]``: differences, then references, zero where the pair is not finite.
        squares: ``(2P,)`` squared norms of ``dr``'s rows.
        pairs: ``P``.
        z: ``(P, m)`` non-finite markers (1 where the pair is non-finite, else 0).
    """
    dr.abs_()
    maxima = dr.amax(dim=1) if dr.shape[1] else dr.new_zeros(dr.shape[0])  # max_abs, then max_ref
    sum_abs = dr[:pairs].sum(dim=1)
    nonfinite = z.sum(dim=1)
    count = nonfinite.new_zeros(pairs)  # set from the total
    return torch.stack(
        (maxima[:pairs], sum_abs, squares[:pairs], squares[pairs:], nonfinite, count, maxima[pairs:])
    )


def combine_sums(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Fold one part's ``(7, P)`` :func:`pair_sums` into the running total: maxima of ``max_abs``
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
