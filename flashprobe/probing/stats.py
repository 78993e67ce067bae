"""On-device deviation statistics of one attention site: :class:`DeviationStats`.

Per call the shadow compares the **primary**'s output (what the model received), the **baseline**'s
and the FP64 **golden** value in three pairs (``primary_baseline``, ``primary_golden``,
``baseline_golden``), forward (``out``) and for the input gradients (``dq``, ``dk``, ``dv``), keeping
per pair the sufficient statistics of :func:`flashprobe.deviation.deviation_tensors`. Everything lives
in one float64 accumulator per site on the tensors' device; a call adds to it without a host
synchronisation, and :meth:`DeviationStats.as_dict` reads it once. Layout (:data:`FIELDS`)::

    values[:N_MAX]         maxima      -> MAX across ranks  (MAX_FIELDS)
    values[N_MAX:N_SUMS]   sums        -> SUM across ranks  (SUM_FIELDS)
    values[N_SUMS:]        arg fields  -> the value of the rank holding the key's maximum (ARG_FIELDS)

Per direction the maxima hold each pair's ``max_abs``, the worst call's error ratio, the noise floor
and the verdict's statistics (:func:`flashprobe.judge.decide`, applied on the device at every call);
``first_fail`` stores ``FIRST_KEY − step`` so its maximum is the earliest failing step. The sums hold
the pairs' sums, call counts, the non-finite input positions per site, and the signed-bias sums of
:class:`flashprobe.bias.BiasStats` (kept across :meth:`DeviationStats.reset`: the bias is the run's).
An arg field is the value at the call that set its key field (the first failure's criterion code,
value and limit; the steps of the worst L2 and limit ratios). The ``lse`` direction (library calls
that return one: :meth:`DeviationStats.add_lse`) has fields of its own after each region's. Every field
composes: over calls, logging intervals and ranks it gives what one run over all of them would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flashprobe.bias import BIAS_FIELDS, BIAS_SAMPLE, COMPONENTS, LOW_PRECISION, BiasStats, bias_dict
from flashprobe.deviation import (
    DIRECTIONS,
    GRADIENTS,
    PAIR,
    PAIRS,
    SUM,
    StatsWorkspace,
    combine_sums,
    error_ratio,
    finish_deviation,
    pair_sums,
    reads_are_free,
)
from flashprobe.formats.probe_summary import Failure
from flashprobe.judge import (
    CRITERIA,
    LSE_RELATIVE_LIMIT,
    UNDETERMINED,
    decide,
    error_columns,
    limits,
    lse_statistics,
    reason,
)

__all__ = [
    "ARG_FIELDS",
    "DIRECTIONS",
    "FIELDS",
    "FIRST_KEY",
    "GRADIENTS",
    "INPUTS",
    "MAX_FIELDS",
    "N_MAX",
    "N_SUMS",
    "PAIRS",
    "SUM_FIELDS",
    "DeviationStats",
    "StatsWorkspace",
    "call_error_ratio",
    "combine_sums",
    "count_nonfinite_positions",
    "failure_order",
    "pair_sums",
    "reduce_across_ranks",
    "site_directions",
    "stats_dict",
    "worst",
]

#: The directions a site's verdict reads: the output, its LSE (library calls that return one), the gradients.
SITE_DIRECTIONS: tuple[str, ...] = ("out", "lse", *GRADIENTS)
#: The ``lse`` direction's fields, per region (module docstring).
LSE_MAX_FIELDS = tuple(
    f"lse.{n}" for n in ("max_limit_ratio", "max_error", "max_baseline_error", "golden_max", "first_fail")
)
LSE_SUM_FIELDS = tuple(
    f"lse.{n}" for n in ("calls", "fail_calls", "unrepresentable_calls", "nonfinite_rows", "empty_rows")
)
LSE_ARG_FIELDS = {
    f"lse.{n}": f"lse.{key}"
    for n, key in (("first_fail_kind", "first_fail"), ("first_fail_value", "first_fail"),
                   ("first_fail_limit", "first_fail"), ("max_limit_step", "max_limit_ratio"))
}  # fmt: skip
#: The ``lse`` direction's criterion codes beyond :data:`~flashprobe.judge.CRITERIA`: a row that sees
#: no key not holding the empty-row value, a value off the golden.
LSE_CRITERIA = {6: "empty_row", 7: "lse"}

#: Inputs whose non-finite entries are counted per site.
INPUTS: tuple[str, ...] = ("q", "k", "v", "grad_out")
_SUMS: tuple[str, ...] = ("sum_abs", "sum_sq_diff", "sum_sq_ref", "nonfinite", "count")

#: Per direction (``{d}.<name>``): its maxima, its sums, its arg fields ``{name: key field}``.
_MAX_NAMES = (
    *(f"{p}.max_abs" for p in PAIRS),
    *("max_call_error_ratio", "noise_floor", "max_l2_ratio", "max_absolute", "max_row", "max_limit_ratio"),
    "first_fail",
)
_SUM_NAMES = (
    *(f"{p}.{s}" for p in PAIRS for s in _SUMS),
    *("calls", "ratio_calls", "fail_calls"),
    *(f"{kind}_calls" for kind in UNDETERMINED),  # ill_conditioned, unrepresentable
)
_ARG_NAMES = {
    "first_fail_kind": "first_fail", "first_fail_value": "first_fail", "first_fail_limit": "first_fail",
    "max_l2_step": "max_l2_ratio", "max_limit_step": "max_limit_ratio",
}  # fmt: skip

MAX_FIELDS: tuple[str, ...] = (*(f"{d}.{n}" for d in DIRECTIONS for n in _MAX_NAMES), *LSE_MAX_FIELDS)
SUM_FIELDS: tuple[str, ...] = (
    *(f"{d}.{n}" for d in DIRECTIONS for n in _SUM_NAMES),
    *(f"nonfinite_inputs.{i}" for i in INPUTS),
    *(f"{d}.{b}" for d in DIRECTIONS for b in BIAS_FIELDS),
    *LSE_SUM_FIELDS,
)
#: Fields taken at the call that set another field's maximum: ``{field: its key field}``.
ARG_FIELDS: dict[str, str] = {
    f"{d}.{n}": f"{d}.{key}" for d in DIRECTIONS for n, key in _ARG_NAMES.items()
} | LSE_ARG_FIELDS
#: Every field, in accumulator order: maxima, sums, then arg fields.
FIELDS: tuple[str, ...] = MAX_FIELDS + SUM_FIELDS + tuple(ARG_FIELDS)
#: Number of leading max-reduced fields.
N_MAX: int = len(MAX_FIELDS)
#: End of the sum-reduced fields (the arg fields follow).
N_SUMS: int = N_MAX + len(SUM_FIELDS)
#: ``first_fail`` stores ``FIRST_KEY − step`` so that the maximum is the earliest step (exact in
#: float64 for any step below 2**52).
FIRST_KEY: float = float(2**52)

_MAX_BLOCK, _SUM_BLOCK, _ARG_BLOCK = len(_MAX_NAMES), len(_SUM_NAMES), len(_ARG_NAMES)
_DIRECTIONS_MAX = len(DIRECTIONS) * _MAX_BLOCK  # the directions' maxima; then the LSE's
_INPUTS_AT = N_MAX + len(DIRECTIONS) * _SUM_BLOCK
_BIAS_AT = _INPUTS_AT + len(INPUTS)  # the signed-bias sums (flashprobe.bias), kept across resets
_LSE_SUMS_AT = _BIAS_AT + len(DIRECTIONS) * len(BIAS_FIELDS)
_LSE_ARGS_AT = N_SUMS + len(DIRECTIONS) * _ARG_BLOCK
_ARG_KEYS = [FIELDS.index(key) for key in ARG_FIELDS.values()]


def count_nonfinite_positions(x: torch.Tensor) -> torch.Tensor:
    """The number of ``(b, n)`` with a NaN/±inf in ``x[b, :, n, :]`` of a ``(B, H, N, D)`` tensor, as a
    0-d int64 tensor on its device (no host sync).

    The float64 sum over heads and channels of a position is non-finite exactly when one entry is
    (finite float32/bf16/fp16 cannot overflow it; float64 inputs are summed as ``x − x``). On the CPU
    one plain sum is read first: finite means the count is 0.
    """
    x = x.detach()
    if reads_are_free(x.device) and math.isfinite(x.sum().item()):
        return torch.zeros((), dtype=torch.int64, device=x.device)
    if x.dtype == torch.float64:  # finite float64 values can overflow a sum: sum x - x instead
        x = x - x  # 0 where finite, NaN where not
    sums = x.sum(dim=(1, 3), dtype=torch.float64)  # (B, N)
    return torch.count_nonzero(sums - sums)


def call_error_ratio(sums: torch.Tensor, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's error ratio on device (:func:`flashprobe.deviation.error_ratio`):
    ``max_abs(primary, golden) / max(max_abs(baseline, golden), floor)``.

    Args:
        sums: the call's ``(7, 3)`` :func:`pair_sums`, or ``(K, 7, 3)`` for ``K`` directions.
        floor: noise floor ``½·eps(compute dtype)·max|golden|``, 0-d (or ``(K,)``).

    Returns:
        ``(ratio, defined)``, 0-d (or ``(K,)``) float64: where the ratio is 0/0, ``ratio`` and
        ``defined`` are 0; ``inf`` where only the denominator is 0.
    """
    pg, bg = sums[..., SUM.max_abs, PAIR.primary_golden], sums[..., SUM.max_abs, PAIR.baseline_golden]
    denominator = torch.maximum(bg, floor)
    # pg / 0 is inf where the primary is inexact, NaN (undefined: 0) where it is exact as well
    ratio = torch.div(pg, denominator).nan_to_num_(0.0, math.inf)
    defined = (denominator + pg > 0).to(torch.float64)  # (both are >= 0)
    return ratio, defined


#: The accumulator's sums as columns of a :func:`pair_sums` result flattened to ``row · 3 + pair``.
_SUM_COLUMNS = [getattr(SUM, s) * len(PAIRS) + j for j in range(len(PAIRS)) for s in _SUMS]


class DeviationStats:
    """Accumulated deviation statistics of one attention site, on the site's device.

    Attributes:
        values: the ``(len(FIELDS),)`` float64 accumulator (layout in the module docstring).
        golden: whether golden pairs are recorded (else they read as None).
    """

    def __init__(
        self, device: torch.device | str, *, golden: bool = True, precision: torch.dtype | None = None
    ) -> None:
        self.values = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
        self.golden = golden
        #: the FP8 dtype whose limits judge an FP8 primary (None: the call's dtype)
        self.precision = precision
        self._limit_cache: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        # Per-direction views of the accumulator: maxima, sums (without the input counts), arg fields.
        self._maxima = self.values[:_DIRECTIONS_MAX].view(len(DIRECTIONS), _MAX_BLOCK)
        self._sums = self.values[N_MAX:_INPUTS_AT].view(len(DIRECTIONS), _SUM_BLOCK)
        self._args = self.values[N_SUMS:_LSE_ARGS_AT].view(len(DIRECTIONS), _ARG_BLOCK)
        self._lse = (  # the LSE's maxima, sums and arg fields
            self.values[_DIRECTIONS_MAX:N_MAX],
            self.values[_LSE_SUMS_AT : _LSE_SUMS_AT + len(LSE_SUM_FIELDS)],
            self.values[_LSE_ARGS_AT:],
        )
        # The key field of each arg field, in a direction's maxima.
        self._arg_keys = torch.tensor([_MAX_NAMES.index(k) for k in _ARG_NAMES.values()], device=device)
        self._sum_columns = torch.tensor(_SUM_COLUMNS, device=device)
        #: The signed bias of each direction, in this accumulator's sums, kept across :meth:`reset`.
        self.bias = BiasStats(
            DIRECTIONS,
            sample=BIAS_SAMPLE,
            dtypes=LOW_PRECISION,
            state=self.values[_BIAS_AT : _BIAS_AT + len(DIRECTIONS) * len(BIAS_FIELDS)].view(
                len(DIRECTIONS), len(COMPONENTS), 3
            ),
        )

    def add(
        self,
        direction: str,
        sums: torch.Tensor,
        dtype: torch.dtype,
        step: int = 0,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fold one call's ``(7, P)`` :func:`pair_sums` (``P`` = 3 with golden, else 1) into
        ``direction``; ``dtype`` is the compute dtype (limits, noise floor), ``rows`` the call's
        ``(3,)`` :func:`flashprobe.judge.row_statistics` (None: no row criterion). Returns the call's
        criterion code (:meth:`add_many`)."""
        row = None if rows is None else {direction: rows}
        return self.add_many({direction: sums}, dtype, step, row)[1][0]

    def add_many(
        self,
        sums: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        step: int = 0,
        rows: Mapping[str, torch.Tensor] | None = None,
        noise: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[tuple[str, ...], torch.Tensor]:
        """:meth:`add` for several directions of one call, one set of tensor ops per run of adjacent
        directions; ``noise`` is the :func:`~flashprobe.judge.noise_statistics` of the flash form.

        Returns:
            ``(directions, codes)``: the directions in :data:`DIRECTIONS` order and their
            :data:`~flashprobe.judge.CRITERIA` codes, ``(K,)`` float64 on the device (0: passed or no
            golden; > 0 failed; < 0 undetermined).
        """
        order = tuple(sorted(sums, key=DIRECTIONS.index))
        if not order:  # e.g. a backward with nothing to compare (an empty batch)
            return order, torch.zeros(0, dtype=torch.float64, device=self.values.device)
        runs: list[list[str]] = []
        for direction in order:
            i = DIRECTIONS.index(direction)
            if runs and DIRECTIONS.index(runs[-1][-1]) == i - 1:
                runs[-1].append(direction)
            else:
                runs.append([direction])
        zeros = torch.zeros(3, dtype=torch.float64, device=self.values.device)
        rows, noise = rows or {}, noise or {}
        codes = [
            self._add_run(
                DIRECTIONS.index(run[0]),
                torch.stack([sums[d] for d in run]),
                torch.stack([rows.get(d, zeros).to(zeros) for d in run]),
                torch.stack([noise.get(d, zeros[:2]).to(zeros) for d in run]),
                dtype,
                step,
            )
            for run in runs
        ]
        return order, codes[0] if len(codes) == 1 else torch.cat(codes)

    def _add_run(
        self,
        first: int,
        sums: torch.Tensor,
        rows: torch.Tensor,
        noise: torch.Tensor,
        dtype: torch.dtype,
        step: int,
    ) -> torch.Tensor:
        """Fold ``(K, 7, P)`` sums into the ``K`` directions from ``DIRECTIONS[first]``; ``(K,)`` codes."""
        sums = sums.to(self.values.device)
        k, _, pairs = sums.shape
        maxima = self._maxima[first : first + k]
        args = self._args[first : first + k]
        if pairs < len(PAIRS):
            sums = torch.cat((sums, sums.new_zeros(k, sums.shape[1], len(PAIRS) - pairs)), dim=2)
        flat = sums.reshape(k, -1)  # (K, 21): columns row · 3 + pair
        if pairs == len(PAIRS):
            max_ref = sums[:, SUM.max_ref]  # (K, 3)
            floor = torch.maximum(max_ref[:, PAIR.primary_golden], max_ref[:, PAIR.baseline_golden])
            floor.mul_(0.5 * torch.finfo(dtype).eps)  # (K,)
            ratio, defined = call_error_ratio(sums, floor)
            errors = error_columns(sums, rows.to(sums), noise.to(sums))
            code, value, bound, judged = decide(errors, dtype, self._limits(first, k, dtype))
            score, absolute, _, l2, row = judged.unbind(1)
            failed = (code > 0).to(torch.float64)
            key = failed * (FIRST_KEY - step)  # float64: exact steps
            at = l2.new_full((k,), float(step))
            # The arg fields change where this call sets a new maximum of their key field.
            new = torch.stack((code, value, bound, at, at), dim=1)  # (K, 5)
            now = torch.stack((key, key, key, l2, score), dim=1) > maxima.index_select(1, self._arg_keys)
            torch.where(now, new, args, out=args)
            extra = torch.stack((ratio, floor, l2, absolute, row, score, key), dim=1)  # (K, 7)
            counts = torch.stack(
                (torch.ones_like(defined), defined, failed, (code == -1).to(failed), (code == -2).to(failed)),
                dim=1,
            )
        else:
            extra, code = sums.new_zeros(k, 7), sums.new_zeros(k)
            counts = torch.cat((sums.new_ones(k, 1), sums.new_zeros(k, 4)), dim=1)
        torch.maximum(maxima, torch.cat((sums[:, SUM.max_abs], extra), dim=1), out=maxima)
        sums_now = torch.cat((flat.index_select(1, self._sum_columns), counts), dim=1)
        self._sums[first : first + k].add_(sums_now)
        return code

    def _limits(self, first: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``(K, 3)`` :func:`~flashprobe.judge.limits` from ``DIRECTIONS[first]`` (cached)."""
        key = (first, k, dtype)
        cached = self._limit_cache.get(key)
        if cached is None:
            cached = limits(self.precision or dtype, DIRECTIONS[first : first + k]).to(self.values.device)
            self._limit_cache[key] = cached
        return cached

    def add_lse(
        self,
        primary: torch.Tensor,
        baseline: torch.Tensor,
        golden: torch.Tensor,
        dtype: torch.dtype,
        step: int = 0,
    ) -> torch.Tensor:
        """Fold one call's ``(B, H, N_q)`` LSEs (``−inf`` for a row that sees no key; baseline and
        golden in the primary's base) into the ``lse`` direction, on the device.

        Returns:
            The criterion code, 0-d float64 (0 pass, 1 ``nonfinite``, 6 ``empty_row``, 7 ``lse``,
            −2 ``unrepresentable``).
        """
        ratio, err, base, nonfinite, empty, golden_max = lse_statistics(
            primary, baseline, golden, self.precision or dtype
        ).unbind()
        huge = golden_max > torch.finfo(torch.float32).max
        code = torch.where(
            nonfinite > 0,
            1.0,
            torch.where(empty > 0, 6.0, torch.where(huge, -2.0, torch.where(ratio > 1, 7.0, 0.0))),
        )
        value = torch.where(
            code == 1, nonfinite, torch.where(code == 6, empty, torch.where(huge, golden_max, ratio))
        )
        bound = torch.where(code == 7, 1.0, torch.where(huge, torch.finfo(torch.float32).max, 0.0)).to(value)
        ratio = torch.where(huge, 0.0, ratio)
        failed = (code > 0).to(torch.float64)
        key = failed * (FIRST_KEY - step)
        maxima, sums, args = self._lse
        now = torch.stack((key > maxima[4], ratio > maxima[0]))
        at = torch.full((), float(step), dtype=torch.float64, device=code.device)
        torch.where(now[0], torch.stack((code, value, bound)), args[:3], out=args[:3])
        torch.where(now[1], at, args[3], out=args[3])
        torch.maximum(maxima, torch.stack((ratio, err, base, golden_max, key)), out=maxima)
        sums.add_(torch.stack((torch.ones_like(failed), failed, huge.to(failed), nonfinite, empty)))
        return code

    def add_nonfinite_inputs(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Add the non-finite positions (:func:`count_nonfinite_positions`) of :data:`INPUTS`."""
        counts = {n: count_nonfinite_positions(t) for n, t in inputs.items()}
        names = sorted(counts, key=INPUTS.index)
        at = [_INPUTS_AT + INPUTS.index(n) for n in names]
        if at and at == list(range(at[0], at[0] + len(at))):  # adjacent fields: one add
            self.values[at[0] : at[0] + len(at)].add_(torch.stack([counts[n] for n in names]).to(self.values))
            return
        for name, j in zip(names, at, strict=True):
            self.values[j : j + 1].add_(counts[name].to(self.values))

    def reset(self) -> None:
        """Zero the accumulator in place, except the bias sums (:attr:`bias`, a statistic of the run)."""
        self.values[:_BIAS_AT].zero_()
        self.values[_BIAS_AT + self.bias.state.numel() :].zero_()

    def as_dict(self) -> dict[str, Any]:
        """Read the accumulator (one host copy) as plain Python data; see :func:`stats_dict`."""
        return stats_dict(self.values.tolist(), golden=self.golden, precision=self.precision)


def reduce_across_ranks(
    tensors: Mapping[str, torch.Tensor], device: torch.device | str, group: Any = None
) -> dict[str, torch.Tensor]:
    """All-reduce per-site accumulators over the ranks (a collective: every rank calls it), so the
    result is what one probe over every rank's calls would hold (layout: module docstring). Sites are
    matched by name, zeros where a rank did not see one; a no-op outside a process group.

    Args:
        tensors: ``{site: accumulator}`` of this rank (:meth:`ShadowAttention.stat_tensors`).
        device: where the reduction runs (CPU for gloo, the rank's GPU for NCCL).
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
    maxima, sums = table[:, :N_MAX].contiguous(), table[:, N_MAX:N_SUMS].contiguous()
    local_keys = table[:, _ARG_KEYS]
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    won = local_keys == maxima[:, _ARG_KEYS]  # this rank holds the key's maximum
    args = torch.where(won, table[:, N_SUMS:], -math.inf).contiguous()
    dist.all_reduce(args, op=dist.ReduceOp.MAX, group=group)
    reduced = torch.cat([maxima, sums, args], dim=1)
    return {s: reduced[i] for i, s in enumerate(sites)}


def _pair(fields: Mapping[str, float], prefix: str) -> dict[str, float | int]:
    sums = {s: fields[f"{prefix}.{s}"] for s in _SUMS}
    sums["max_abs"] = fields[f"{prefix}.max_abs"]
    return finish_deviation(sums).as_dict()


def stats_dict(
    values: Sequence[float], *, golden: bool = True, precision: torch.dtype | None = None
) -> dict[str, Any]:
    """One site's accumulator values (layout :data:`FIELDS`) as plain Python data.

    Returns:
        ``{"forward": {"calls", "out", "lse"}, "backward": {"calls", "dq", "dk", "dv"},
        "nonfinite_inputs": {"q", "k", "v", "grad_out"}}``. Each direction maps every pair to
        ``{max_abs, mean_abs, rel_l2, nonfinite, numel}`` (None without golden or calls), plus
        ``error_ratio``, ``max_call_error_ratio``, ``noise_floor``, the verdict's entries
        (``verdict``: None when nothing was judged; ``limit_ratio``, the worst call's statistic /
        limit, > 1 fails, and its step; ``absolute_error``, ``worst_row_error``, ``l2_error_ratio``
        and its step; ``failed_calls``; ``undetermined_calls``; ``first_failure``:
        ``{step, kind, value, limit, reason}`` or None) and ``bias`` (:func:`flashprobe.bias.bias_dict`).
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
        entry.update(_judged(fields, d, recorded and golden, precision))
        entry["bias"] = bias_dict([fields[f"{d}.{b}"] for b in BIAS_FIELDS]) if golden else None
        return entry

    return {
        "forward": {"calls": int(fields["out.calls"]), "out": direction("out"), "lse": _lse_entry(fields)},
        "backward": {
            "calls": int(max(fields[f"{d}.calls"] for d in GRADIENTS)),
            **{d: direction(d) for d in GRADIENTS},
        },
        "nonfinite_inputs": {i: int(fields[f"nonfinite_inputs.{i}"]) for i in INPUTS},
    }


def site_directions(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A site's :func:`stats_dict` entry per direction (``lse`` only where a call returned one)."""
    lse = entry["forward"].get("lse")
    return {
        "out": entry["forward"]["out"],
        **({"lse": lse} if lse else {}),
        **{d: entry["backward"][d] for d in GRADIENTS},
    }


def failure_order(failure: Failure) -> tuple[Any, Any, int]:
    """The sort key of a failure: by step, site, then direction."""
    return failure.step, failure.site, SITE_DIRECTIONS.index(failure.direction)


def lse_reason(kind: str, value: float, error: float, baseline: float) -> str:
    """A failing LSE call in words (``kind`` of :data:`LSE_CRITERIA` or ``nonfinite``)."""
    if kind == "nonfinite":
        return f"LSE non-finite in {int(value)} row(s) that see keys, where the FP64 golden is finite"
    if kind == "empty_row":
        return f"LSE of {int(value)} row(s) that see no key is not -inf (the empty-row value)"
    return (
        f"LSE off the golden by up to {error:.3g} (the same-dtype baseline by {baseline:.3g}): {value:.3g}x "
        f"its limit (max({LSE_RELATIVE_LIMIT:g}x the baseline's, the floor))"
    )


def _lse_entry(fields: Mapping[str, float]) -> dict[str, Any] | None:
    """The ``lse`` direction of a site (None when no call returned an LSE), shaped as a direction's."""
    calls = int(fields["lse.calls"])
    if not calls:
        return None
    failed = int(fields["lse.fail_calls"])
    undetermined = dict.fromkeys(UNDETERMINED, 0) | {
        "unrepresentable": int(fields["lse.unrepresentable_calls"])
    }
    first = None
    if failed and fields["lse.first_fail"] > 0:
        code = int(fields["lse.first_fail_kind"])
        kind = LSE_CRITERIA.get(code) or CRITERIA.get(code, "lse")
        value, limit = fields["lse.first_fail_value"], fields["lse.first_fail_limit"]
        why = lse_reason(kind, value, fields["lse.max_error"], fields["lse.max_baseline_error"])
        step = int(FIRST_KEY - fields["lse.first_fail"])
        first = {"step": step, "kind": kind, "value": value, "limit": limit, "reason": why}
    verdict = "fail" if failed else ("undetermined" if undetermined["unrepresentable"] >= calls else "pass")
    return {
        "calls": calls, **dict.fromkeys(PAIRS), "error_ratio": None, "max_call_error_ratio": None,
        "noise_floor": None, "verdict": verdict, "limit_ratio": fields["lse.max_limit_ratio"],
        "limit_ratio_step": int(fields["lse.max_limit_step"]), "absolute_error": fields["lse.max_error"],
        "baseline_error": fields["lse.max_baseline_error"], "worst_row_error": None,
        "l2_error_ratio": None, "l2_error_ratio_step": None,
        "nonfinite_rows": int(fields["lse.nonfinite_rows"]), "empty_rows": int(fields["lse.empty_rows"]),
        "failed_calls": failed, "undetermined_calls": undetermined, "first_failure": first, "bias": None,
    }  # fmt: skip


def _judged(
    fields: Mapping[str, float], d: str, judged: bool, precision: torch.dtype | None = None
) -> dict[str, Any]:
    """The verdict's entries of direction ``d`` (:func:`stats_dict`)."""
    if not judged:
        return {
            "verdict": None,
            "limit_ratio": None,
            "limit_ratio_step": None,
            "absolute_error": None,
            "worst_row_error": None,
            "l2_error_ratio": None,
            "l2_error_ratio_step": None,
            "failed_calls": 0,
            "undetermined_calls": dict.fromkeys(UNDETERMINED, 0),
            "first_failure": None,
        }
    calls = int(fields[f"{d}.calls"])
    failed = int(fields[f"{d}.fail_calls"])
    undetermined = {kind: int(fields[f"{d}.{kind}_calls"]) for kind in UNDETERMINED}
    first = None
    if failed and fields[f"{d}.first_fail"] > 0:
        kind = CRITERIA.get(int(fields[f"{d}.first_fail_kind"]), "relative")
        value, limit = fields[f"{d}.first_fail_value"], fields[f"{d}.first_fail_limit"]
        first = {
            "step": int(FIRST_KEY - fields[f"{d}.first_fail"]),
            "kind": kind,
            "value": value,
            "limit": limit,
            "reason": reason(kind, value, limit, precision),
        }
    verdict = "fail" if failed else ("undetermined" if sum(undetermined.values()) >= calls else "pass")
    return {
        "verdict": verdict,
        "limit_ratio": fields[f"{d}.max_limit_ratio"],
        "limit_ratio_step": int(fields[f"{d}.max_limit_step"]),
        "absolute_error": fields[f"{d}.max_absolute"],
        "worst_row_error": fields[f"{d}.max_row"],
        "l2_error_ratio": fields[f"{d}.max_l2_ratio"],
        "l2_error_ratio_step": int(fields[f"{d}.max_l2_step"]),
        "failed_calls": failed,
        "undetermined_calls": undetermined,
        "first_failure": first,
    }


def worst(values: Sequence[float | None]) -> float | None:
    """Largest value ignoring None (NaN counts as largest); None when there is none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return max(present, key=lambda v: math.inf if math.isnan(v) else v)
