"""The paper's microbenchmark claims (Figs 3–6) and the criteria that turn measurements into verdicts.

Each ``judge_*`` takes the numbers ``flashprobe bench paper`` measured for one claim and returns a
:class:`Judgement` (a verdict from :data:`VERDICTS` and the reason); the thresholds are module
constants, stated in words in :data:`CRITERIA`. Deviation means ``max |flash − baseline|`` unless a
claim says otherwise; the error ratio is ``max|flash − golden| / max|baseline − golden|``.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "CLAIM_IDS",
    "CRITERIA",
    "PAPER",
    "VERDICTS",
    "Claim",
    "Judgement",
    "Spread",
    "fmt",
    "judge_f3",
    "judge_f4",
    "judge_f5",
    "judge_f6a",
    "judge_f6b",
    "judge_f6c",
    "rank_correlation",
    "safe_ratio",
]

#: The possible verdicts, best first.
VERDICTS = ("reproduced", "partly", "not reproduced")
REPRODUCED, PARTLY, NOT_REPRODUCED = VERDICTS

#: The claims, in the paper's order.
CLAIM_IDS = ("F3", "F4", "F5", "F6a", "F6b", "F6c")

#: What the paper says, per claim.
PAPER: dict[str, str] = {
    "F3": "flash-vs-baseline deviation decreases as mantissa bits increase (BF16 → FP16 → FP32 → FP64)",
    "F4": "against the FP64 golden value, flash at BF16 deviates roughly 10× more than the baseline at BF16",
    "F5": "at a fixed tile size, the deviation grows with the sequence length (more tiles, more rescalings)",
    "F6a": "swapping the block order gives a larger deviation",
    "F6b": "forcing square tiles has no impact on the deviation",
    "F6c": "larger tiles give a smaller deviation (fewer rescalings)",
}

#: F4: the paper's ratio, and the factor around it that still counts as "roughly" that ratio.
F4_PAPER_RATIO = 10.0
F4_TOLERANCE = 2.0
#: flash-attention's own test rule: a kernel passes when its error is at most 2× the baseline's.
ACCEPTANCE_RATIO = 2.0
#: F5 and F6c: the least change end to end, and the least rank correlation, that make a trend.
TREND_FACTOR = 1.5
TREND_CORRELATION = 0.8
#: F6c: the least gain from the smallest to the largest tile for the full verdict.
TILE_GAIN = 2.0
#: F6a and F6b: a change of more than this fraction of the deviation counts as an effect.
EFFECT = 0.10

#: Each claim's criterion, in words (built from the constants above).
CRITERIA: dict[str, str] = {
    "F3": (
        "reproduced: the deviation falls at every step bf16 → fp16 → fp32 → fp64; partly: it falls "
        "from the fewest to the most mantissa bits but not at every step; not reproduced: otherwise"
    ),
    "F4": (
        f"reproduced: the median error ratio over seeds lies within a factor {F4_TOLERANCE:g} of "
        f"{F4_PAPER_RATIO:g}× and every seed exceeds flash-attention's {ACCEPTANCE_RATIO:g}× acceptance "
        f"bound; partly: the median exceeds {ACCEPTANCE_RATIO:g}× (flash clearly worse, but not ≈"
        f"{F4_PAPER_RATIO:g}×); not reproduced: median ≤ {ACCEPTANCE_RATIO:g}×"
    ),
    "F5": (
        f"reproduced: the deviation at the longest sequence is ≥ {TREND_FACTOR:g}× that at the shortest "
        f"and its rank correlation with N is ≥ {TREND_CORRELATION:g}; partly: one of the two, or both "
        "hold only for the relative error ‖flash − golden‖/‖golden‖ (outputs shrink as N grows); "
        "not reproduced: none"
    ),
    "F6a": (
        f"a reading counts when its median deviation is > {EFFECT:.0%} above the default's and every "
        "seed deviates more than every seed of the default: (i) consuming the key tiles in another "
        "order (reverse and shuffled, both), (ii) swapping Br and Bc at a fixed SRAM size; "
        "reproduced: both; partly: one; not reproduced: neither"
    ),
    "F6b": (
        f"reproduced: square and non-square tiles of the same Bc deviate within ±{EFFECT:.0%} of each "
        f"other; partly: within ±{2 * EFFECT:.0%}; not reproduced: otherwise"
    ),
    "F6c": (
        f"reproduced: the deviation at the smallest tile is ≥ {TILE_GAIN:g}× that at the largest and "
        f"its rank correlation with Bc is ≤ −{TREND_CORRELATION:g}; partly: it falls by ≥ "
        f"{TREND_FACTOR:g}× or correlates, not both; not reproduced: otherwise"
    ),
}


class Spread(NamedTuple):
    """A deviation measured over seeds: the median, min and max."""

    median: float
    lo: float
    hi: float


@dataclass(frozen=True)
class Judgement:
    """A verdict (one of :data:`VERDICTS`) and ``why``: the numbers that decided it, in words."""

    verdict: str
    why: str


@dataclass(frozen=True, kw_only=True)
class Claim:
    """One claim as ``flashprobe bench paper`` writes it (``paper.json``'s ``"claims"``)."""

    id: str
    """``F3`` … ``F6c``."""
    measured: Any
    """The number the verdict rests on (a mapping where a claim has several readings)."""
    unit: str
    """What ``measured`` is."""
    display: str
    """``measured`` for a table cell, e.g. ``"10.7× (8.6–13.8)"``."""
    setting: Mapping[str, Any]
    """Where it was measured: kernel, shape, dtype, tile size, seeds, ..."""
    judgement: Judgement
    """The verdict on the paper's re-implementation (the ``paper`` preset)."""
    spread: tuple[float | None, float | None] | None = None
    """Min and max of ``measured`` over seeds, where it is a median over seeds."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """Supporting numbers (e.g. the deviation at each sequence length)."""
    real: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The real kernels at the same setting: spec → ``{"measured", "display", "verdict"}``."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON record: ``id, paper, measured, unit, display, spread, details, setting, criterion,
        verdict, why, real``."""
        spread = None if self.spread is None else {"min": self.spread[0], "max": self.spread[1]}
        return {
            "id": self.id,
            "paper": PAPER[self.id],
            "measured": self.measured,
            "unit": self.unit,
            "display": self.display,
            "spread": spread,
            "details": dict(self.details),
            "setting": dict(self.setting),
            "criterion": CRITERIA[self.id],
            "verdict": self.judgement.verdict,
            "why": self.judgement.why,
            "real": {k: dict(v) for k, v in self.real.items()},
        }


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    ordered = sorted(values)
    return [(bisect.bisect_left(ordered, v) + bisect.bisect_right(ordered, v) + 1) / 2 for v in values]


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation of ``x`` and ``y`` (ties get mean ranks); ``None`` when undefined
    (fewer than 2 points, or a constant series).

    Raises:
        ValueError: ``x`` and ``y`` differ in length.
    """
    if len(x) != len(y):
        raise ValueError(f"rank_correlation: {len(x)} x values but {len(y)} y values")
    if len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def _defined(*values: float | None) -> bool:
    return all(v is not None and not math.isnan(v) for v in values)


def _verdict(full: bool, partial: bool) -> str:
    """``reproduced`` when ``full``, else ``partly`` when ``partial``, else ``not reproduced``."""
    return REPRODUCED if full else PARTLY if partial else NOT_REPRODUCED


def fmt(x: float | None, spec: str = ".3g") -> str:
    """``x`` in a claim's text (``–``: not measured)."""
    return "–" if x is None else format(x, spec)


def safe_ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` with ``x / 0 = inf`` (``0 / 0 = 1``: no change); None when either is None or NaN."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def judge_f3(deviation: Mapping[str, float]) -> Judgement:
    """F3: the deviation falls as mantissa bits increase (``deviation``: dtype name → deviation, from
    the fewest to the most mantissa bits)."""
    names, values = list(deviation), list(deviation.values())
    if len(values) < 2 or not _defined(*values):
        return Judgement(NOT_REPRODUCED, "fewer than two precisions were measured")
    steps = [safe_ratio(a, b) for a, b in itertools.pairwise(values)]
    pairs = zip(itertools.pairwise(names), steps, strict=True)
    text = ", ".join(f"{a} → {b}: {s:.3g}× less" for (a, b), s in pairs)
    if all(s > 1 for s in steps):
        return Judgement(REPRODUCED, f"the deviation falls at every step ({text})")
    if values[0] > values[-1]:
        return Judgement(PARTLY, f"it falls overall but not at every step ({text})")
    return Judgement(NOT_REPRODUCED, f"it does not fall from {names[0]} to {names[-1]} ({text})")


def judge_f4(median: float | None, lo: float | None, hi: float | None) -> Judgement:
    """F4: flash at bf16 deviates ≈10× more from the golden value than the baseline (the error ratio's
    median, min and max over seeds)."""
    if not _defined(median, lo, hi):
        return Judgement(NOT_REPRODUCED, "the error ratio is undefined (no finite output compared)")
    assert median is not None and lo is not None and hi is not None
    spread = f"median {median:.3g}× over seeds, min {lo:.3g}×, max {hi:.3g}×"
    low, high = F4_PAPER_RATIO / F4_TOLERANCE, F4_PAPER_RATIO * F4_TOLERANCE
    if low <= median <= high and lo > ACCEPTANCE_RATIO:
        return Judgement(REPRODUCED, f"{spread}: within a factor {F4_TOLERANCE:g} of ≈{F4_PAPER_RATIO:g}×")
    if median > ACCEPTANCE_RATIO:
        where = "below" if median < low else ("above" if median > high else "around")
        return Judgement(
            PARTLY,
            f"{spread}: beyond flash-attention's {ACCEPTANCE_RATIO:g}× bound, {where} ≈{F4_PAPER_RATIO:g}×"
            + (f", but some seed is within {ACCEPTANCE_RATIO:g}×" if lo <= ACCEPTANCE_RATIO else ""),
        )
    return Judgement(NOT_REPRODUCED, f"{spread}: within flash-attention's {ACCEPTANCE_RATIO:g}× bound")


def _trend(
    xs: Sequence[float], deviation: Sequence[float], *, falling: bool
) -> tuple[float, float | None, str]:
    """End-to-end change (first/last if falling, last/first if rising), rank correlation, text."""
    change = safe_ratio(deviation[0], deviation[-1]) if falling else safe_ratio(deviation[-1], deviation[0])
    rho = rank_correlation(xs, deviation)
    rho_text = "undefined" if rho is None else f"{rho:+.2f}"
    word = "falls" if falling else "grows"
    return change, rho, f"it {word} {change:.3g}× from {xs[0]:g} to {xs[-1]:g} (rank correlation {rho_text})"


def judge_f5(
    seq_lens: Sequence[int], deviation: Sequence[float], relative: Sequence[float] | None = None
) -> Judgement:
    """F5: at a fixed tile size the deviation grows with the sequence length.

    Args:
        seq_lens: the sequence lengths, increasing.
        deviation: the deviation at each length.
        relative: the relative error ``‖flash − golden‖/‖golden‖`` at each length (outputs shrink as
            N grows, which the absolute deviation does not correct for).
    """
    if len(seq_lens) < 2 or not _defined(*deviation):
        return Judgement(NOT_REPRODUCED, "fewer than two sequence lengths were measured")
    growth, rho, text = _trend(seq_lens, deviation, falling=False)
    grows, correlates = growth >= TREND_FACTOR, rho is not None and rho >= TREND_CORRELATION
    why = f"max |flash − baseline|: {text}"
    relative_grows = False
    if relative is not None and len(relative) == len(seq_lens) and _defined(*relative):
        rel_growth, rel_rho, rel_text = _trend(seq_lens, relative, falling=False)
        relative_grows = rel_growth >= TREND_FACTOR and rel_rho is not None and rel_rho >= TREND_CORRELATION
        why += f"; relative error vs golden: {rel_text}"
    return Judgement(_verdict(grows and correlates, grows or correlates or relative_grows), why)


def _effect(variant: Spread | None, reference: Spread | None) -> float | None:
    """The ratio of medians when ``variant`` deviates more than ``reference`` beyond the seeds' noise
    (> :data:`EFFECT` more, every seed above every seed of the reference); 0.0 when not; None: missing."""
    if variant is None or reference is None or not _defined(*variant, *reference):
        return None
    larger = variant.median > (1 + EFFECT) * reference.median and variant.lo > reference.hi
    return safe_ratio(variant.median, reference.median) if larger else 0.0


def judge_f6a(
    forward: Spread | None,
    reordered: Mapping[str, Spread],
    default_tile: Spread | None = None,
    swapped: Spread | None = None,
) -> Judgement:
    """F6a: swapping the block order gives a larger deviation (an effect as :func:`_effect` counts it).

    Args:
        forward: the deviation when the key tiles are consumed first to last.
        reordered: order name (``reverse``, ``shuffle``) → the deviation in that order.
        default_tile: the default tile's deviation at an SRAM size where swapping Br and Bc changes Bc.
        swapped: the deviation with Br and Bc swapped there (``None``: not measured).
    """

    def text(name: str, variant: Spread, reference: Spread | None) -> str:
        ratio = None if reference is None else safe_ratio(variant.median, reference.median)
        apart = _effect(variant, reference)
        noise = "" if apart is None or apart else " (within the seeds' noise)"
        return f"{name} {fmt(ratio)}×{noise}"

    order_parts = [text(name, spread, forward) for name, spread in reordered.items()]
    order_effect = bool(reordered) and all(_effect(s, forward) for s in reordered.values())
    shape_effect = bool(_effect(swapped, default_tile))
    parts = [
        "key-tile order vs forward: " + (", ".join(order_parts) or "not measured"),
        "Br↔Bc swapped vs default tile: "
        + ("not measured" if swapped is None else text("swapped", swapped, default_tile)),
    ]
    count = int(order_effect) + int(shape_effect)
    return Judgement((NOT_REPRODUCED, PARTLY, REPRODUCED)[count], "; ".join(parts))


def judge_f6b(ratio: float | None) -> Judgement:
    """F6b: forcing square tiles has no impact (``ratio``: square over non-square at the same Bc)."""
    if not _defined(ratio):
        return Judgement(NOT_REPRODUCED, "not measured")
    assert ratio is not None
    change = abs(ratio - 1)
    text = f"square / non-square at the same Bc: {ratio:.3g}×"
    if change <= EFFECT:
        return Judgement(REPRODUCED, f"{text}, within ±{EFFECT:.0%}")
    if change <= 2 * EFFECT:
        return Judgement(PARTLY, f"{text}, within ±{2 * EFFECT:.0%}")
    return Judgement(NOT_REPRODUCED, f"{text}, more than ±{2 * EFFECT:.0%} apart")


def judge_f6c(block_ks: Sequence[int], deviation: Sequence[float]) -> Judgement:
    """F6c: larger tiles give a smaller deviation (``deviation`` at each Bc of ``block_ks``, increasing)."""
    if len(block_ks) < 2 or not _defined(*deviation):
        return Judgement(NOT_REPRODUCED, "fewer than two tile sizes were measured")
    gain, rho, text = _trend(block_ks, deviation, falling=True)
    correlates = rho is not None and rho <= -TREND_CORRELATION
    return Judgement(
        _verdict(gain >= TILE_GAIN and correlates, gain >= TREND_FACTOR or correlates), f"with Bc, {text}"
    )
