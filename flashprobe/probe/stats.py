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

from flashprobe.deviation import PAIRS, StatsWorkspace, combine_sums, error_ratio, finish_deviation, pair_sums

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
    "count_nonfinite_positions",
    "pair_sums",
    "reduce_across_ranks",
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


def count_nonfinite_positions(x: torch.Tensor) -> torch.Tensor:
    """Positions of a ``(B, H, N, D)`` tensor with a NaN/±inf in any head or channel, as a 0-d
    int64 tensor on its device (no host sync): one NaN token counts once, whatever ``H·D`` is.

    One pass: the float64 sum over heads and channels of a position is non-finite exactly when one
    of its entries is (finite float32/bf16/fp16 values cannot overflow a float64 sum; float64
    inputs are summed as ``x − x``, 0 or NaN, for the same reason), and ``s − s`` is NaN (non-zero)
    there and 0 elsewhere.

    Args:
        x: ``(B, H, N, D)``.

    Returns:
        The number of ``(b, n)`` with a non-finite ``x[b, :, n, :]``.
    """
    x = x.detach()
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


def reduce_across_ranks(
    tensors: Mapping[str, torch.Tensor], device: torch.device | str, group: Any = None
) -> dict[str, torch.Tensor]:
    """All-reduce per-site accumulators over the ranks of ``torch.distributed``: the maxima
    (``[:N_MAX]``) with MAX and the sums (``[N_MAX:]``) with SUM, so the result is what one probe
    over every rank's calls would hold. Sites are matched by name; a site a rank did not see counts
    as zeros there. A no-op (the tensors themselves) outside an initialised process group.

    Every rank must call it (it is a collective: one ``all_gather_object`` of the site names, then
    two ``all_reduce`` of one ``(sites, len(FIELDS))`` table each).

    Args:
        tensors: ``{site: accumulator}`` of this rank (e.g. :meth:`ShadowAttention.stat_tensors`).
        device: where the reduction runs (the process group's device: CPU for gloo, the rank's GPU
            for NCCL).
        group: the process group (default: the world).

    Returns:
        ``{site: reduced accumulator}`` over the union of the ranks' sites, sorted by name.
    """
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return dict(tensors)
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(gathered, sorted(tensors), group=group)
    sites = sorted({s for names in gathered for s in names})
    zeros = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
    rows = [tensors[s].detach().to(device, torch.float64) if s in tensors else zeros for s in sites]
    table = torch.stack(rows) if rows else zeros.new_zeros(0, len(FIELDS))
    maxima, sums = table[:, :N_MAX].contiguous(), table[:, N_MAX:].contiguous()
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    reduced = torch.cat([maxima, sums], dim=1)
    return {s: reduced[i] for i, s in enumerate(sites)}


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
