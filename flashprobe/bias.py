"""Signed bias of a kernel's outputs and gradients, accumulated on the device across calls.

A kernel whose error has the size of the baseline's but always the same sign passes every call, yet
its error adds up over steps instead of averaging out (Qiu & Yao, arXiv 2510.04212, trace BF16
flash-attention loss explosions to such **biased** rounding). :class:`BiasStats` measures it; the
probe keeps one per site (``DeviationStats.bias``) and the judge reads it (``biased``,
:func:`flashprobe.judge.judge_bias`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from flashprobe.deviation import DIRECTIONS

__all__ = [
    "BIAS_FIELDS",
    "BIAS_SAMPLE",
    "BIAS_TOLERANCE",
    "BIAS_Z_LIMIT",
    "COMPONENTS",
    "DIRECTIONS",
    "LOW_PRECISION",
    "BiasStats",
    "bias_dict",
]

#: The two signed statistics kept per direction (:class:`BiasStats`).
COMPONENTS = ("offset", "magnitude")
#: ``|z|`` at or above which a direction reads biased: ``2·exp(−12.5) ≈ 7.5e-6`` per test for a
#: correct kernel.
BIAS_Z_LIMIT = 5.0
#: The mean signed error, in units of the baseline's error RMS, that a direction must exceed to read
#: biased: above the means of torch's correct kernels, below the biases that matter (calibration:
#: docs/calibration.md).
BIAS_TOLERANCE = 0.1
#: The dtypes whose errors the probe's bias accumulates (:class:`BiasStats` ``dtypes``): the bias
#: that matters is low-precision rounding's; at fp32 one-signed errors of fp32's own size are harmless.
LOW_PRECISION: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

#: The probe's cap on the elements read per replicate (:class:`BiasStats` ``sample``): every k-th
#: row of a larger slice (4096 elements resolve a bias of 1/64 of the error RMS at one sigma).
BIAS_SAMPLE = 4096

_N, _S1, _S2 = 0, 1, 2
#: The names of one direction's sums, in :attr:`BiasStats.state` order (``state[d].flatten()``).
BIAS_FIELDS: tuple[str, ...] = tuple(f"bias.{c}.{s}" for c in COMPONENTS for s in ("n", "s1", "s2"))


class BiasStats:
    """Signed error of a primary kernel against the golden value, accumulated per direction.

    Per call and direction each ``(…, N, D)`` slice (one per batch entry and head: a **replicate**)
    gives two signed means of ``e = primary − golden`` over its finite elements, in units of the
    baseline's error RMS on the slice (the primary's where the baseline is exact): ``offset`` =
    ``mean(e) / rms``, and ``magnitude`` = ``mean(e · sign(golden)) / rms`` (negative toward zero).
    Per component it keeps ``n``, ``s1 = Σ r`` and ``s2 = Σ r²``; the self-normalised sum
    ``z = s1 / √s2`` of symmetric independent replicates has ``P(|z| ≥ x) ≤ 2·exp(−x²/2)`` (Efron
    1969), while a consistent sign grows ``|z|`` as ``√n``. Correct kernels carry tiny systematic
    errors too, so the verdict tests the mean's excess over :data:`BIAS_TOLERANCE`
    (:func:`bias_dict`). The state is three sums, so intervals and ranks combine by adding
    (:meth:`merge`, or an ``all_reduce(SUM)`` of :attr:`state`); :meth:`add` is tensor ops only.

    Args:
        directions: the names :meth:`add` accepts (default ``out, dq, dk, dv``).
        device: where the sums live (the device of the tensors given to :meth:`add`).
        limit: the ``|z|`` at which :meth:`verdict` says ``biased``.
        sample: read at most about this many elements of each ``(N, D)`` slice: every k-th row,
            ``k = ⌈N·D / sample⌉`` (None: every element). The rows read are fixed by the shape, not
            by the values, so the sample's mean error is an unbiased estimate of the slice's.
        state: a ``(directions, 2, 3)`` tensor to accumulate into instead of a new one (e.g. a view
            into a larger accumulator that is reduced across ranks with it); its dtype and device
            are used.
        dtypes: accumulate only primaries of these dtypes (the probe: :data:`LOW_PRECISION`); None:
            every dtype.

    Raises:
        ValueError: no or repeated directions, a limit that is not positive, or a ``state`` of
            another shape.
    """

    def __init__(
        self,
        directions: Sequence[str] = DIRECTIONS,
        device: torch.device | str = "cpu",
        *,
        limit: float = BIAS_Z_LIMIT,
        sample: int | None = None,
        state: torch.Tensor | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> None:
        directions = tuple(directions)
        if not directions or len(set(directions)) != len(directions):
            raise ValueError(f"BiasStats: directions must be distinct names, got {directions!r}")
        if not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
            raise ValueError(f"BiasStats: limit={limit!r} must be a positive number such as {BIAS_Z_LIMIT}")
        if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
            raise ValueError(f"BiasStats: sample={sample!r} must be a positive number of elements or None")
        self.sample = sample
        #: only values of these dtypes are accumulated (None: every dtype); the probe's: LOW_PRECISION
        self.dtypes = None if dtypes is None else tuple(dtypes)
        shape = (len(directions), len(COMPONENTS), 3)
        if state is not None and tuple(state.shape) != shape:
            raise ValueError(f"BiasStats: state has shape {tuple(state.shape)}, expected {shape}")
        self.directions = directions
        self.device = torch.device(device) if state is None else state.device
        self.limit = float(limit)
        dtype = torch.float32 if self.device.type == "mps" else torch.float64  # MPS has no float64
        #: ``(directions, components, 3)``: replicates ``n``, ``Σ r`` and ``Σ r²``.
        self.state = torch.zeros(shape, dtype=dtype, device=self.device) if state is None else state

    def _index(self, direction: str) -> int:
        try:
            return self.directions.index(direction)
        except ValueError:
            known = ", ".join(self.directions)
            raise ValueError(
                f"BiasStats: unknown direction {direction!r}; this accumulator has {known}"
            ) from None

    def add(
        self,
        direction: str,
        primary: torch.Tensor,
        golden: torch.Tensor,
        baseline: torch.Tensor,
        *,
        finite: bool = False,
    ) -> None:
        """Add one call's errors (tensor ops only, no host synchronisation).

        Args:
            direction: one of :attr:`directions`.
            primary: ``(…, N, D)`` the kernel's output or gradient (any float dtype).
            golden: the golden value, same shape.
            baseline: the baseline's value, same shape (sets the error scale).
            finite: the caller knows every value of the three is finite (e.g. from the finiteness
                check of :func:`flashprobe.deviation.pair_and_row_sums` on the same tensors): the
                non-finite elements are not looked for, with the same result.

        Raises:
            ValueError: an unknown direction or mismatched shapes.
        """
        row = self._index(direction)
        if self.dtypes is not None and primary.dtype not in self.dtypes:
            return  # not a dtype whose bias is judged (metadata only: no host read)
        if not (primary.shape == golden.shape == baseline.shape):
            raise ValueError(
                f"BiasStats.add({direction!r}): shapes differ: primary {tuple(primary.shape)}, "
                f"golden {tuple(golden.shape)}, baseline {tuple(baseline.shape)}"
            )
        if self.sample is not None and primary.dim() >= 2:
            n, d = primary.shape[-2:]
            k = -(-n * d // self.sample)  # ⌈N·D / sample⌉ rows apart
            if k > 1:
                primary, golden, baseline = (x[..., ::k, :] for x in (primary, golden, baseline))
        dtype = self.state.dtype
        # float32 differences unless the primary is float64: the golden's float32 rounding is
        # symmetric noise far below a 16-bit kernel's error, and it halves the memory traffic.
        work = dtype if primary.dtype == torch.float64 else torch.float32
        g = golden.detach().to(self.device, work)
        e = torch.empty((2, *g.shape), dtype=work, device=self.device)  # primary, baseline − golden
        e[0].copy_(primary.detach())
        e[1].copy_(baseline.detach())
        e = _replicates(e.sub_(g), keep=1)  # (2, R, M)
        g = _replicates(g)
        if finite:  # masking would change nothing: the same bits without it
            count = e.new_full(e.shape[1:2], e.shape[2], dtype=dtype)
            sign = torch.sign(g)
        else:
            mask = torch.isfinite(e.sum(dim=0))
            e = torch.where(mask, e, 0.0)
            count = mask.sum(dim=-1).to(dtype)  # (R,)
            sign = torch.where(mask, torch.sign(g), 0.0)
        per = count.clamp(min=1.0)
        # Reductions in the work dtype, then widened: R sums of at most BIAS_SAMPLE terms each.
        rms_p, rms_b = torch.linalg.vector_norm(e, dim=-1).to(dtype) / per.sqrt()
        scale = torch.where(rms_b > 0, rms_b, torch.where(rms_p > 0, rms_p, 1.0))
        sums = torch.stack([e[0].sum(dim=-1), torch.linalg.vecdot(e[0], sign)]).to(dtype)
        r = sums / (per * scale)  # (2, R)
        valid = (count > 0).to(dtype)
        r = r * valid
        self.state[row] += torch.stack([valid.sum().expand(2), r.sum(dim=-1), r.square().sum(dim=-1)], dim=-1)

    def merge(self, other: BiasStats) -> BiasStats:
        """Add ``other``'s sums into these (another interval or rank); returns ``self``.

        Raises:
            ValueError: the two accumulate different directions.
        """
        if other.directions != self.directions:
            raise ValueError(f"BiasStats.merge: directions differ ({self.directions} vs {other.directions})")
        self.state += other.state.to(self.state.device, self.state.dtype)
        return self

    def reset(self) -> None:
        """Zero the sums (start a new interval)."""
        self.state.zero_()

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """The statistics, read from the device once; see :func:`bias_dict`."""
        values = self.state.cpu().tolist()
        return {
            d: bias_dict([x for c in per for x in c], self.limit)
            for d, per in zip(self.directions, values, strict=True)
        }

    def verdict(self) -> dict[str, str]:
        """Per direction: ``biased`` (a component's mean beyond the tolerance by ``limit`` sigmas:
        ``|excess_z| ≥ limit``), ``unbiased``, or
        ``undetermined`` while fewer than ``limit²`` replicates could not yet reach the limit."""
        return {direction: entry["verdict"] for direction, entry in self.as_dict().items()}


def bias_dict(
    sums: Sequence[float], limit: float = BIAS_Z_LIMIT, tolerance: float = BIAS_TOLERANCE
) -> dict[str, Any]:
    """One direction's statistics from its six sums (:data:`BIAS_FIELDS` order), as plain data.

    Returns:
        ``{"replicates": n, "offset": {"mean": s1/n, "z": s1/√s2, "excess_z": the mean's excess
        over the tolerance, sign(s1)·max(|s1| − tolerance·n, 0)/√s2}, "magnitude": {...}, "z": the
        larger |excess_z| with its sign (the verdict's statistic), "mean": that component's mean,
        "component": its name, "limit": limit, "tolerance": tolerance, "verdict": "biased" |
        "unbiased" | "undetermined"}``; ``mean`` is in units of the baseline's error RMS, ``None``
        before any replicate; ``undetermined`` while fewer than ``limit²`` replicates could not
        reach the limit.
    """
    if len(sums) != len(BIAS_FIELDS):
        raise ValueError(
            f"bias_dict: expected {len(BIAS_FIELDS)} sums ({', '.join(BIAS_FIELDS)}), got {len(sums)}"
        )
    entry: dict[str, Any] = {"replicates": int(sums[_N])}
    for i, name in enumerate(COMPONENTS):
        n, s1, s2 = sums[3 * i : 3 * i + 3]
        root = math.sqrt(s2) if s2 > 0 else 0.0
        over = max(abs(s1) - tolerance * n, 0.0)
        excess = math.copysign(over / root, s1) if over > 0 else 0.0
        entry[name] = {"mean": s1 / n if n else None, "z": s1 / root if root else 0.0, "excess_z": excess}
    entry["component"] = max(COMPONENTS, key=lambda c: (abs(entry[c]["excess_z"]), abs(entry[c]["z"])))
    entry["z"] = entry[entry["component"]]["excess_z"]
    entry["mean"] = entry[entry["component"]]["mean"]
    entry["limit"] = float(limit)
    entry["tolerance"] = float(tolerance)
    enough = entry["replicates"] >= limit**2
    entry["verdict"] = "biased" if abs(entry["z"]) >= limit else ("unbiased" if enough else "undetermined")
    return entry


def _replicates(x: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """``x`` as ``(*lead, R, M)``: one row per ``(…, N, D)`` slice (a 0/1-D tensor is one replicate),
    after its first ``keep`` dimensions ``lead``."""
    lead, rest = x.shape[:keep], x.shape[keep:]
    if len(rest) < 2:
        return x.reshape(*lead, 1, -1)
    return x.reshape(*lead, -1, rest[-2] * rest[-1])
