"""On-device deviation statistics of one attention site: :class:`DeviationStats`.

For every probed call the shadow compares three outputs — the **primary** kernel's (what the
model received), the **baseline**'s and the FP64 **golden** value — in three **pairs**
(``primary_baseline``, ``primary_golden``, ``baseline_golden``), in the forward direction
(``out``) and, with ``backward=True``, for the input gradients (``dq``, ``dk``, ``dv``). Per pair
the site keeps the sufficient statistics of :func:`flashprobe.deviation.deviation_tensors`
(``max_abs``, ``sum_abs``, ``sum_sq_diff``, ``sum_sq_ref``, ``nonfinite``, ``count``), so that
:func:`flashprobe.deviation.finish_deviation` turns them into ``max_abs``, ``mean_abs``,
``rel_l2`` and ``nonfinite`` once they are read.

Everything lives in one float64 tensor per site on the tensors' device; a call adds to it with a
handful of tensor ops and **no host synchronisation**. Reading (:meth:`DeviationStats.as_dict`)
copies it to the host once.

Layout of the accumulator (also what :meth:`Probe.stat_tensors` returns, for DDP reductions)::

    values[:N_MAX]   maxima  -> reduce across ranks with MAX   (names: MAX_FIELDS)
    values[N_MAX:]   sums    -> reduce across ranks with SUM   (names: SUM_FIELDS)

Per direction ``dir`` in ``out, dq, dk, dv``:

* ``MAX_FIELDS``: ``{dir}.{pair}.max_abs``; ``{dir}.max_call_error_ratio``, the worst per-call
  error ratio (:func:`call_error_ratio`; a call whose ratio is undefined adds 0, so it never
  raises or poisons the maximum); ``{dir}.noise_floor``, the largest per-call noise floor
  ``½·eps(compute dtype)·max|golden|`` (:func:`flashprobe.deviation.noise_floor`), which is what
  the accumulated error ratio is floored with.
* ``SUM_FIELDS``: ``{dir}.{pair}.{sum_abs,sum_sq_diff,sum_sq_ref,nonfinite,count}``,
  ``{dir}.calls`` and ``{dir}.ratio_calls`` (calls whose error ratio was defined: when it is 0,
  ``max_call_error_ratio`` reads as None).
* then, per site, ``nonfinite_inputs.{q,k,v,grad_out}``: **positions** (batch entry × token)
  where the input has a NaN/±inf in any head or channel — one NaN token counts once, not once per
  element (:func:`count_nonfinite_positions`).

Every field composes: the maximum or sum over calls, over logging intervals and over ranks is
the same number a single run over all of them would give.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flashprobe.deviation import PAIRS, error_ratio, finish_deviation
from flashprobe.probe import native

__all__ = [
    "DIRECTIONS",
    "FIELDS",
    "GRADIENTS",
    "INPUTS",
    "MAX_FIELDS",
    "N_MAX",
    "PAIRS",
    "SUM_FIELDS",
    "DeviationStats",
    "StatsWorkspace",
    "call_error_ratio",
    "combine_sums",
    "count_nonfinite",
    "count_nonfinite_positions",
    "pair_sums",
    "stats_dict",
    "worst",
]

#: The gradients of the inputs ``q``, ``k``, ``v`` compared with ``backward=True``.
GRADIENTS: tuple[str, ...] = ("dq", "dk", "dv")
#: ``out`` is the forward output; then the input gradients (:data:`GRADIENTS`).
DIRECTIONS: tuple[str, ...] = ("out", *GRADIENTS)
#: Inputs whose non-finite entries are counted per site.
INPUTS: tuple[str, ...] = ("q", "k", "v", "grad_out")
_SUMS: tuple[str, ...] = ("sum_abs", "sum_sq_diff", "sum_sq_ref", "nonfinite", "count")

MAX_FIELDS: tuple[str, ...] = tuple(
    name
    for d in DIRECTIONS
    for name in (*(f"{d}.{p}.max_abs" for p in PAIRS), f"{d}.max_call_error_ratio", f"{d}.noise_floor")
)
SUM_FIELDS: tuple[str, ...] = (
    *(
        name
        for d in DIRECTIONS
        for name in (*(f"{d}.{p}.{s}" for p in PAIRS for s in _SUMS), f"{d}.calls", f"{d}.ratio_calls")
    ),
    *(f"nonfinite_inputs.{i}" for i in INPUTS),
)
#: Every field, in accumulator order: maxima first, then sums.
FIELDS: tuple[str, ...] = MAX_FIELDS + SUM_FIELDS
#: Number of leading max-reduced fields.
N_MAX: int = len(MAX_FIELDS)

_MAX_BLOCK = len(PAIRS) + 2  # per direction: 3 max_abs, max_call_error_ratio, noise_floor
_SUM_BLOCK = len(PAIRS) * len(_SUMS) + 2  # per direction: 15 sums, calls, ratio_calls
_INPUTS_AT = N_MAX + len(DIRECTIONS) * _SUM_BLOCK

#: Elements :func:`pair_sums` processes per slice on CPU (cache-sized) and on other devices
#: (fewer kernel launches); the scratch memory is 9 float64 values per element of a slice
#: (the all-finite path on the CPU: 6 rows of a slice twice as long).
STATS_CHUNK_CPU = 1 << 16
STATS_CHUNK = 1 << 20


def _chunk_size(device: torch.device) -> int:
    return STATS_CHUNK_CPU if device.type == "cpu" else STATS_CHUNK


class StatsWorkspace:
    """Reusable float64 scratch buffers for :func:`pair_sums` (avoids re-allocating per call).

    Holds at most ``9 · STATS_CHUNK`` float64 values per device (``12 · STATS_CHUNK_CPU`` on CPU).
    """

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
    golden: torch.Tensor | None,
    workspace: StatsWorkspace | None = None,
) -> torch.Tensor:
    """Sufficient statistics of the three pairs at once, on the tensors' device (no device sync).

    Equivalent to :func:`flashprobe.deviation.deviation_tensors` applied to
    ``(primary, baseline)``, ``(primary, golden)`` and ``(baseline, golden)``, but batched over
    the pairs, in place in reused buffers and sliced into chunks of ``STATS_CHUNK`` elements
    (their cost, measured by ``flashprobe bench overhead``, is in docs/probe.md "Overhead"). A
    position counts as non-finite for a pair when the float64 difference is non-finite, i.e. when
    either side is NaN or ±inf.

    On the CPU a C kernel (:mod:`flashprobe.probe.native`) reads each input once and computes all
    seven rows in one pass. Where it cannot be built, the all-finite case, by far the common one,
    takes a short path of tensor ops with no masking (:func:`_finite_pair_sums`, about half the
    passes of the masked path); a non-finite input makes its result non-finite and the call is
    redone as on other devices. There (the masked path), per slice of ``m`` elements the
    scratch rows are laid out as ``z (P, m)`` (non-finite markers), ``d (P, m)`` (differences),
    ``r (P, m)`` (references), so that each reduction runs once over two adjacent blocks: ``sum``
    over ``[z; d]``, ``amax`` and the squared norm over ``[d; r]``. The differences are taken in
    float64 (the float32/bf16 sides are promoted on the fly, exactly), the references are masked
    with ``ref + 0·d`` (NaN where the pair is not finite) before one ``nan_to_num`` zeroes every
    masked entry of ``d`` and ``r``.

    Args:
        primary: any shape, any floating dtype.
        baseline: same shape as ``primary``.
        golden: same shape, float64, or None (then only ``primary_baseline`` is computed).
        workspace: scratch buffers to reuse across calls.

    Returns:
        ``(7, P)`` float64 tensor, ``P`` = 3 pairs (1 without golden); rows ``max_abs``,
        ``sum_abs``, ``sum_sq_diff``, ``sum_sq_ref``, ``nonfinite``, ``count`` and ``max_ref``
        (the largest |reference| over the finite pairs: max|golden| for the golden pairs, what the
        noise floor needs).
    """
    p, b = primary.detach(), baseline.detach()
    g = None if golden is None else golden.detach()
    if p.numel() != b.numel() or (g is not None and g.numel() != p.numel()):
        raise ValueError(
            f"pair_sums: shapes differ: primary {tuple(primary.shape)}, baseline {tuple(baseline.shape)}"
            + ("" if golden is None else f", golden {tuple(golden.shape)}")
        )
    if _on_host(p.device):
        sums = native.pair_sums(p, b, g)  # one pass over the inputs (None: no C kernel here)
        if sums is not None:
            return sums
        # Tensor ops: the short path of all-finite inputs first, the call redone masked if
        # anything came out non-finite.
        fast = _finite_pair_sums(p, b, g, workspace or StatsWorkspace())
        if math.isfinite(float(fast.sum())):  # NaN or ±inf anywhere makes the sum so
            return fast
    flat = (None if t is None else t.reshape(-1) for t in (p, b, g))
    return _masked_pair_sums(*flat, workspace or StatsWorkspace())


def _on_host(device: torch.device) -> bool:
    """Whether the statistics may branch on computed values: only where reading one back waits for
    no device (the CPU). There they take shortcuts — the C kernel (:mod:`flashprobe.probe.native`),
    all-finite short paths, accumulation on the host — and elsewhere they stay in tensor ops with no
    host synchronisation (the tests switch this off to run the device path on the CPU)."""
    return device.type == "cpu"


def _finite_layout(pairs: int, device: torch.device) -> torch.Tensor:
    """Where each entry of :func:`pair_sums`' ``(7, P)`` result lies in the vector
    ``[max|r|…, max|d|…, Σr²…, Σd²…, Σ|d|…, 0]`` that :func:`_finite_pair_sums` reduces to (``r``:
    the references, baseline then golden; ``d``: the ``P`` differences)."""
    key = (pairs, device)
    layout = _LAYOUTS.get(key)
    if layout is None:
        refs = 1 if pairs == 1 else 2
        rows = refs + pairs  # per statistic over the rows [r; d]
        ref_of_pair = [0] if pairs == 1 else [0, 1, 1]  # the golden pairs share the golden reference
        zero = 2 * rows + pairs
        d = range(refs, rows)
        table = [
            list(d),  # max_abs
            [2 * rows + j for j in range(pairs)],  # sum_abs
            [rows + i for i in d],  # sum_sq_diff
            [rows + i for i in ref_of_pair],  # sum_sq_ref
            [zero] * pairs,  # nonfinite: none, or the result is not finite
            [zero] * pairs,  # count, filled in by the caller
            ref_of_pair,  # max_ref
        ]
        layout = _LAYOUTS[key] = torch.tensor(table, dtype=torch.long, device=device)
    return layout


_LAYOUTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _finite_pair_sums(
    p: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None, workspace: StatsWorkspace
) -> torch.Tensor:
    """:func:`pair_sums`, correct when every value is finite (no masking).

    Per slice the inputs are copied into contiguous float64 rows ``[p, r; d]`` (exact; a strided
    input is read in place, so a tensor of one slice is never flattened into a copy first), with
    ``r`` the references (baseline, golden) and ``d`` the ``P`` differences; then each statistic
    is one pass over the block ``[r; d]``: the sums of squares (a dot product per row, faster than
    a batched norm on the CPU), ``|·|`` in place, the maxima, and the sums of ``|d|``. A
    non-finite input makes the result non-finite, which is how :func:`pair_sums` knows to redo
    the call masked.
    """
    n, pairs = p.numel(), (1 if g is None else 3)
    inputs = [t for t in (p, b, g) if t is not None]
    chunk = max(1, min(n, 2 * _chunk_size(p.device)))  # 6 scratch rows, not 9: twice the slice
    whole = n <= chunk and all(t.shape == p.shape for t in inputs)  # one slice, no flattening
    if not whole:
        inputs = [t.reshape(-1) for t in inputs]
    height = len(inputs) + pairs
    buf = workspace.get(p.device, height * chunk)
    layout = _finite_layout(pairs, p.device)
    total: torch.Tensor | None = None
    for start in range(0, max(n, 1), chunk):
        m = min(n, start + chunk) - start
        rows = buf[: height * m].view(height, m)
        for i, t in enumerate(inputs):
            if whole:
                rows[i].view(t.shape).copy_(t)
            else:
                rows[i].copy_(t[start : start + m])
        p64, block = rows[0], rows[1:]  # block: [r; d]
        refs, d = block[: len(inputs) - 1], block[len(inputs) - 1 :]
        torch.sub(p64, refs[0], out=d[0])
        if g is not None:
            torch.sub(p64, refs[1], out=d[1])
            torch.sub(refs[0], refs[1], out=d[2])
        squares = torch.stack([torch.dot(row, row) for row in block])  # (R + P,) Σr², Σd²
        block.abs_()
        maxima = block.amax(dim=1) if m else block.new_zeros(block.shape[0])  # (R + P,) max|r|, max|d|
        part = torch.cat((maxima, squares, d.sum(dim=1), block.new_zeros(1)))[layout]  # (7, P)
        total = combine_sums(total, part)
    assert total is not None
    total[5] = n
    return total


def _masked_pair_sums(
    p: torch.Tensor, b: torch.Tensor, g: torch.Tensor | None, workspace: StatsWorkspace
) -> torch.Tensor:
    """:func:`pair_sums` of flat tensors, any values (see its docstring for the layout)."""
    n, pairs, device = p.numel(), (1 if g is None else 3), p.device
    chunk = max(1, min(n, _chunk_size(device)))
    buf = workspace.get(device, 3 * pairs * chunk)
    total: torch.Tensor | None = None
    for start in range(0, max(n, 1), chunk):
        stop = min(n, start + chunk)
        m = stop - start
        rows = buf[: 3 * pairs * m].view(3 * pairs, m)
        z, d, r = rows[:pairs], rows[pairs : 2 * pairs], rows[2 * pairs :]
        zd, dr = rows[: 2 * pairs], rows[pairs:]
        ps = p[start:stop]
        r[0].copy_(b[start:stop])  # the baseline in float64 (its reference row, masked below)
        torch.sub(ps, r[0], out=d[0])
        if g is not None:
            gs = g[start:stop]
            torch.sub(ps, gs, out=d[1])
            torch.sub(r[0], gs, out=d[2])
        torch.mul(d, 0.0, out=z)  # 0 where the pair is finite, NaN where it is not
        r[0].add_(z[0])
        if g is not None:
            torch.add(gs, z[1:], out=r[1:])
        dr.nan_to_num_(0.0, 0.0, 0.0).abs_()  # differences and references over finite pairs only
        z.nan_to_num_(1.0)  # 1 where the pair is non-finite
        sums = zd.sum(dim=1)  # (2P,): non-finite counts, then sum_abs
        maxima = dr.amax(dim=1) if m else dr.new_zeros(2 * pairs)  # (2P,): max_abs, then max_ref
        squares = torch.linalg.vector_norm(dr, dim=1).square()  # (2P,): sum_sq_diff, then sum_sq_ref
        part = torch.stack(
            (
                maxima[:pairs],
                sums[pairs:],
                squares[:pairs],
                squares[pairs:],
                sums[:pairs],
                sums.new_zeros(pairs),  # the count, filled in below
                maxima[pairs:],
            )
        )
        total = combine_sums(total, part)
    assert total is not None
    total[5] = n - total[4]
    return total


#: Rows of :func:`pair_sums` that combine by maximum (``max_abs``, ``max_ref``); the others add.
_MAX_ROWS = (0, 6)


def combine_sums(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """Fold one part's ``(7, P)`` :func:`pair_sums` into the running total: maxima of ``max_abs``
    and ``max_ref``, sums of the rest; ``part`` itself when ``total`` is None. Used over slices and
    over reference chunks."""
    if total is None:
        return part
    return torch.cat(
        (
            torch.maximum(total[:1], part[:1]),
            total[1:6] + part[1:6],
            torch.maximum(total[6:], part[6:]),
        )
    )


def count_nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Number of NaN/±inf entries of ``x`` as a 0-d int64 tensor on its device (no host sync).

    ``x − x`` is 0 where ``x`` is finite and NaN where it is not; NaN counts as non-zero.
    """
    flat = x.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    chunk = _chunk_size(flat.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk]
        total = total + torch.count_nonzero(part - part)
    return total


def count_nonfinite_positions(x: torch.Tensor) -> torch.Tensor:
    """Positions of a ``(B, H, N, D)`` tensor with a NaN/±inf in any head or channel, as a 0-d
    int64 tensor on its device (no host sync): one NaN token counts once, whatever ``H·D`` is.

    One pass: the float64 sum over heads and channels of a position is non-finite exactly when one
    of its entries is (finite float32/bf16/fp16 values cannot overflow a float64 sum; float64
    inputs are summed as ``x − x``, 0 or NaN, for the same reason), and ``s − s`` is NaN (non-zero)
    there and 0 elsewhere. On the CPU one plain sum of the whole tensor comes first: when it is
    finite nothing is (an overflow only sends a finite tensor on to the exact count).

    Args:
        x: ``(B, H, N, D)``.

    Returns:
        The number of ``(b, n)`` with a non-finite ``x[b, :, n, :]``.
    """
    x = x.detach()
    if _on_host(x.device):  # one plain sum first: a NaN/±inf makes it non-finite (an overflow
        # only sends a finite tensor to the exact count below)
        total = x.sum(dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        if math.isfinite(float(total)):
            return torch.zeros((), dtype=torch.int64, device=x.device)
    if x.dtype == torch.float64:  # finite float64 values can overflow a sum: sum x - x instead
        x = x - x  # 0 where finite, NaN where not
    sums = x.sum(dim=(1, 3), dtype=torch.float64)  # (B, N)
    return torch.count_nonzero(sums - sums)


def call_error_ratio(sums: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's error ratio on device, as :func:`flashprobe.deviation.error_ratio` defines it.

    ``max_abs(primary, golden) / max(max_abs(baseline, golden), floor)``; ``inf`` when the
    denominator is 0 and the primary is not exact (golden exactly 0 where the primary is not).

    Args:
        sums: the call's ``(7, 3)`` :func:`pair_sums` (with the golden pairs), or ``(K, 7, 3)``
            for ``K`` directions at once.
        floor: noise floor ``½·eps(compute dtype)·max|golden|``, 0-d (or ``(K,)``).

    Returns:
        ``(ratio, defined)``: 0-d (or ``(K,)``) float64 tensors. Where the ratio is undefined (0/0: primary,
        baseline and the floor all 0, which includes "nothing finite was compared") ``ratio`` is 0,
        so it never raises a maximum, and ``defined`` is 0 (else 1).
    """
    pg, bg = sums[..., 0, 1], sums[..., 0, 2]
    denominator = torch.maximum(bg, floor)
    inexact = torch.where(pg > 0, torch.full_like(pg, math.inf), torch.zeros_like(pg))
    positive = denominator > 0
    ratio = torch.where(positive, pg / torch.where(positive, denominator, 1.0), inexact)
    defined = ((denominator > 0) | (pg > 0)).to(torch.float64)
    return ratio, defined


class DeviationStats:
    """Accumulated deviation statistics of one attention site, on the site's device.

    ``add(direction, sums)`` folds one call's :func:`pair_sums` into the accumulator without a
    host synchronisation; :meth:`as_dict` reads everything once and returns plain Python data.

    Attributes:
        values: the ``(len(FIELDS),)`` float64 accumulator (layout in the module docstring).
        golden: whether golden pairs are recorded (else they read as None).
    """

    def __init__(self, device: torch.device | str, *, golden: bool = True) -> None:
        self.values = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
        self.golden = golden

    def add(self, direction: str, sums: torch.Tensor, dtype: torch.dtype) -> None:
        """Fold one call's ``(7, P)`` :func:`pair_sums` into ``direction`` (``out``/``dq``/``dk``/``dv``).

        Args:
            direction: ``out``, ``dq``, ``dk`` or ``dv``.
            sums: the call's :func:`pair_sums` (``P`` = 3 with golden, else 1).
            dtype: the dtype the kernels computed in (sets the noise floor's ``eps``).
        """
        self.add_many({direction: sums}, dtype)

    def add_many(self, sums: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        """:meth:`add` for several directions of one call (e.g. ``out``, ``dq``, ``dk``, ``dv``), with
        one set of small tensor ops per run of adjacent directions instead of one per direction."""
        runs: list[list[str]] = []
        for direction in sorted(sums, key=DIRECTIONS.index):
            i = DIRECTIONS.index(direction)
            if runs and DIRECTIONS.index(runs[-1][-1]) == i - 1:
                runs[-1].append(direction)
            else:
                runs.append([direction])
        for run in runs:
            self._add_run(DIRECTIONS.index(run[0]), torch.stack([sums[d] for d in run]), dtype)

    def _add_run(self, first: int, sums: torch.Tensor, dtype: torch.dtype) -> None:
        """Fold ``(K, 7, P)`` sums into the ``K`` adjacent directions from ``DIRECTIONS[first]``."""
        if _on_host(self.values.device) and _on_host(sums.device):
            self._add_run_on_host(first, sums, dtype)
            return
        sums = sums.to(self.values.device)
        k, _, pairs = sums.shape
        if pairs == len(PAIRS):
            floor = (0.5 * torch.finfo(dtype).eps) * torch.maximum(sums[:, 6, 1], sums[:, 6, 2])  # (K,)
            ratio, defined = call_error_ratio(sums, floor)
            extra = torch.stack((ratio, floor), dim=1)  # (K, 2)
        else:
            sums = torch.cat((sums, sums.new_zeros(k, sums.shape[1], len(PAIRS) - pairs)), dim=2)
            extra, defined = sums.new_zeros(k, 2), sums.new_zeros(k)
        maxima = self.values[:N_MAX].view(len(DIRECTIONS), _MAX_BLOCK)[first : first + k]
        torch.maximum(maxima, torch.cat((sums[:, 0], extra), dim=1), out=maxima)
        block = self.values[N_MAX:_INPUTS_AT].view(len(DIRECTIONS), _SUM_BLOCK)[first : first + k]
        block[:, :-2].add_(sums[:, 1:6].transpose(1, 2).reshape(k, -1))  # pair-major, as SUM_FIELDS
        block[:, -2:].add_(torch.stack((torch.ones_like(defined), defined), dim=1))

    def _add_run_on_host(self, first: int, sums: torch.Tensor, dtype: torch.dtype) -> None:
        """:meth:`_add_run` for CPU tensors, in Python floats: the same float64 operations on the
        same values as the tensor ops (bit for bit, tested), without their dozens of tiny
        dispatches per call; the error ratio is :func:`flashprobe.deviation.error_ratio`'s."""
        values = self.values.numpy()  # shares the accumulator's memory
        half_eps = 0.5 * torch.finfo(dtype).eps
        for k, rows in enumerate(sums.tolist()):  # rows: 7 lists of P values
            d = first + k
            pairs = len(rows[0])
            if pairs == len(PAIRS):
                floor = half_eps * _maximum(rows[6][1], rows[6][2])
                ratio = error_ratio(rows[0][1], rows[0][2], floor=floor)
                new_max = [*rows[0], 0.0 if ratio is None else ratio, floor]
                defined = 0.0 if ratio is None else 1.0
            else:
                new_max = [*rows[0], *[0.0] * (len(PAIRS) - pairs), 0.0, 0.0]
                defined = 0.0
            at = d * _MAX_BLOCK
            for i, value in enumerate(new_max):
                values[at + i] = _maximum(values[at + i], value)
            at = N_MAX + d * _SUM_BLOCK
            for j in range(pairs):
                for i in range(len(_SUMS)):
                    values[at + j * len(_SUMS) + i] += rows[1 + i][j]
            values[at + _SUM_BLOCK - 2] += 1.0
            values[at + _SUM_BLOCK - 1] += defined

    def add_nonfinite_inputs(self, counts: Mapping[str, torch.Tensor]) -> None:
        """Add non-finite counts (0-d tensors) of inputs named in :data:`INPUTS`."""
        names = sorted(counts, key=INPUTS.index)
        at = [_INPUTS_AT + INPUTS.index(n) for n in names]
        if at and at == list(range(at[0], at[0] + len(at))):  # adjacent fields: one add
            self.values[at[0] : at[0] + len(at)].add_(torch.stack([counts[n] for n in names]).to(self.values))
            return
        for name, j in zip(names, at, strict=True):
            self.values[j : j + 1].add_(counts[name].to(self.values))

    def reset(self) -> None:
        """Zero the accumulator in place."""
        self.values.zero_()

    def as_dict(self) -> dict[str, Any]:
        """Read the accumulator (one host copy) as plain Python data; see :func:`stats_dict`."""
        return stats_dict(self.values.tolist(), golden=self.golden)


def _maximum(a: float, b: float) -> float:
    """``torch.maximum`` of two floats: NaN if either is NaN."""
    return a if a > b or a != a else b


def _pair(fields: Mapping[str, float], prefix: str) -> dict[str, float | int]:
    sums = {s: fields[f"{prefix}.{s}"] for s in _SUMS}
    sums["max_abs"] = fields[f"{prefix}.max_abs"]
    return finish_deviation(sums).as_dict()


def stats_dict(values: Sequence[float], *, golden: bool = True) -> dict[str, Any]:
    """Turn one site's accumulator values (layout :data:`FIELDS`) into plain Python data.

    Returns:
        ``{"forward": {"calls", "out"}, "backward": {"calls", "dq", "dk", "dv"},
        "nonfinite_inputs": {"q", "k", "v", "grad_out"}}`` where each of ``out``/``dq``/``dk``/``dv``
        maps every pair to ``{max_abs, mean_abs, rel_l2, nonfinite, numel}`` (None without
        golden, or when nothing was recorded), plus ``error_ratio`` (the accumulated ``max_abs`` of
        ``primary_golden`` over that of ``baseline_golden`` floored at ``noise_floor``, as
        :func:`flashprobe.deviation.error_ratio`; None when undefined), ``max_call_error_ratio``
        (the worst single call; None when no call's ratio was defined) and ``noise_floor``.
    """
    if len(values) != len(FIELDS):
        raise ValueError(f"expected {len(FIELDS)} accumulator values, got {len(values)}")
    fields = dict(zip(FIELDS, (float(v) for v in values), strict=True))

    def direction(d: str) -> dict[str, Any]:
        recorded = fields[f"{d}.calls"] > 0
        entry: dict[str, Any] = {}
        for p in PAIRS:
            has = recorded and (golden or p == "primary_baseline")
            entry[p] = _pair(fields, f"{d}.{p}") if has else None
        if recorded and golden:
            floor = fields[f"{d}.noise_floor"]
            entry["error_ratio"] = error_ratio(
                fields[f"{d}.primary_golden.max_abs"], fields[f"{d}.baseline_golden.max_abs"], floor=floor
            )
            defined = fields[f"{d}.ratio_calls"] > 0
            entry["max_call_error_ratio"] = fields[f"{d}.max_call_error_ratio"] if defined else None
            entry["noise_floor"] = floor
        else:
            entry["error_ratio"] = entry["max_call_error_ratio"] = entry["noise_floor"] = None
        return entry

    return {
        "forward": {"calls": int(fields["out.calls"]), "out": direction("out")},
        "backward": {
            "calls": int(max(fields[f"{d}.calls"] for d in GRADIENTS)),
            **{d: direction(d) for d in GRADIENTS},
        },
        "nonfinite_inputs": {i: int(fields[f"nonfinite_inputs.{i}"]) for i in INPUTS},
    }


def worst(values: Sequence[float | None]) -> float | None:
    """Largest value ignoring None (NaN counts as largest); None when there is none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return max(present, key=lambda v: math.inf if math.isnan(v) else v)
