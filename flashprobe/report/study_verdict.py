"""The study's answer and the ratios it rests on, each with an interval over replicates and over training.

Each ratio divides the kernel pair's distance by a context distance of the same replicate (pairs that
share its seed). An :class:`Interval` is the median and min–max of the replicates' values: with ``N``
replicates the range covers the ratio's median with probability ``1 − 2^(1−N)`` (order statistics;
too few replicates for a bootstrap). The answer (:data:`PASS`, :data:`LOOK_CLOSER`,
:data:`UNDETERMINED`) follows the rule of :func:`verdict`; ``flashprobe study`` exits with its
:data:`EXIT_CODES`. Pairs and kernels are known by what their runs recorded, never by a fixed name.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

__all__ = [
    "EXIT_CODES",
    "FLASH",
    "LOOK_CLOSER",
    "PASS",
    "UNDETERMINED",
    "ContextRatio",
    "ExtraLine",
    "Interval",
    "Verdict",
    "answer",
    "comparison_groups",
    "format_value",
    "kernel_pair",
    "needs_line",
    "no_verdict_line",
    "study_comparisons",
    "verdict",
    "verdict_lines",
    "verdict_subject",
]

FLASH = "flash_vs_baseline"
PASS, LOOK_CLOSER, UNDETERMINED = "PASS", "LOOK CLOSER", "UNDETERMINED"
#: ``flashprobe study``'s exit code for each answer (1, 2 and 130 keep their meanings: a run failed,
#: a usage error, interrupted).
EXIT_CODES = {PASS: 0, LOOK_CLOSER: 3, UNDETERMINED: 4}
#: The paper's finding (§V): flash deviates 2–5× less than FP16-vs-FP32 training, a ratio of 0.2–0.5.
PAPER_RATIO = (0.2, 0.5)
#: Short names of the low precisions in comparison names (``bf16_vs_fp32``).
_LOW_PRECISIONS = {"bf16": "bf16-mixed", "fp16": "16-mixed"}
FP32 = "32-true"


@dataclass(frozen=True)
class Interval:
    """One value per replicate (a distance or a ratio, in replicate order) with each one's replicate
    seed, summarised as median and min–max range."""

    values: tuple[float, ...]
    seeds: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def position(self, x: float = 1.0) -> str:
        """``below`` (every value below ``x``), ``above`` (every value above) or ``straddles``."""
        if self.high < x:
            return "below"
        if self.low > x:
            return "above"
        return "straddles"

    def text(self, unit: str = "") -> str:
        """``0.187× (0.16–0.23)``, or ``0.187× (1 replicate: no interval)``."""
        if self.n == 1:
            return f"{format_value(self.median)}{unit} (1 replicate: no interval)"
        return f"{format_value(self.median)}{unit} ({format_value(self.low)}–{format_value(self.high)})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "values": list(self.values),
            "seeds": list(self.seeds),
        }


class _PlainData:
    def to_dict(self) -> dict[str, Any]:
        """Plain data, in field order (intervals as :meth:`Interval.as_dict`)."""
        return _plain(self)


@dataclass(frozen=True, kw_only=True)
class ContextRatio(_PlainData):
    """One context of the verdict (the seed pair, or a low-precision comparison) and the kernel pair's
    distance over its distance, replicate by replicate."""

    kind: str
    """``seed`` or ``precision``."""
    replicate_seeds: list[int]
    """The seeds of the replicates the ratio should have a value for."""
    pairs: list[str]
    """The context's pairs, at every replicate."""
    isolates: str
    """What its runs differ in, in words."""
    distance: Interval | None
    """Its distance at the verdict's step, over replicates."""
    ratio: Interval | None
    """The kernel pair's distance / its distance at the verdict's step."""
    by_step: dict[int, Interval | None]
    """The ratio at every step the rule reads."""
    over_training: tuple[float, float] | None
    """The lowest and highest replicate's ratio over those steps."""
    in_rule: bool
    """Whether the rule judges it (the seed pair, and the low precision the kernel trains at)."""


@dataclass(frozen=True, kw_only=True)
class ExtraLine(_PlainData):
    """A line reported beside the verdict, not part of it: the kernel pair at fp32 (``kernel_fp32``)."""

    distance: float
    """Its distance at the verdict's step."""
    flash: float | None
    """The kernel pair's distance of the same replicate at that step (None: not measured)."""
    seed: int
    """The replicate's seed."""


@dataclass(frozen=True, kw_only=True)
class Verdict(_PlainData):
    """The study's answer and the ratios it rests on (:func:`verdict`)."""

    kernel_pair: str
    """The pair whose runs differ in the attention alone (:func:`kernel_pair`)."""
    attention: list[str]
    """The attention its two runs recorded."""
    step: int
    """The last step every replicate's kernel pair has a finite distance at."""
    steps: list[int]
    """The steps the rule reads (after the warm-up, up to ``step``)."""
    warmup_steps: int | None
    """The learning-rate warm-up the study recorded (None: not recorded)."""
    seeds: list[int]
    """The replicates' seeds."""
    flash: Interval | None
    """The kernel pair's distance at ``step``, over replicates."""
    context: dict[str, ContextRatio]
    """Per context (``seed`` and each low-precision comparison) its ratio."""
    extra: dict[str, ExtraLine]
    """Lines reported beside the verdict (``kernel_fp32``)."""
    noise_floor: float | None
    """The largest distance of the identical runs at ``step`` (None: none trained)."""
    left_out: dict[str, dict[str, Any]]
    """Planned pairs whose runs differ in more than planned → their ``study.json`` entry."""
    precision: str | None
    """The precision the kernel trains at."""
    answer: str
    """:data:`PASS`, :data:`LOOK_CLOSER` or :data:`UNDETERMINED`."""
    reasons: list[str]
    """Why, in words (empty for PASS)."""


def _plain(x: Any) -> Any:
    """A verdict's value as plain data: intervals as :meth:`Interval.as_dict`, dataclasses as dicts of
    their fields in order, tuples as lists."""
    if isinstance(x, Interval):
        return x.as_dict()
    if is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    return [_plain(v) for v in x] if isinstance(x, list | tuple) else x


def format_value(x: float | None) -> str:
    """A distance or ratio in a report: 3 significant digits, ``–`` for none (or NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.3g}"


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def study_comparisons(study: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What each pair of ``study.json`` compares: ``kind``, ``group``, ``replicate``, ``seed``, ``isolates``.

    A study's plan (``study.comparisons``) says so, for the pairs whose runs differ as planned. For a
    plain ``flashprobe compare`` the kind is read from what each pair's runs differ in: the attention
    alone (``kernel``: ``flash_vs_baseline`` if it is such a pair, else the first), the seed, the
    precision, or nothing (``noise``); any other pair has no kind and carries no verdict.
    """
    planned = (study.get("study") or {}).get("comparisons") or {}
    out: dict[str, dict[str, Any]] = {}
    if planned:
        for name, c in planned.items():
            if not _differs_as_planned(study["pairs"].get(name), c.get("kind")):
                continue  # its runs differ in more (or other) things than the plan says: no kind
            out[name] = {
                "kind": c.get("kind"),
                "group": c.get("group") or name,
                "replicate": c.get("replicate", 0),
                "seed": c.get("seed", 0),
                "isolates": c.get("isolates", "–"),
                "run_a": c.get("run_a"),
                "run_b": c.get("run_b"),
            }
        return out
    kernel_pairs = [n for n, p in study["pairs"].items() if _differs_in(p) == ["attention"]]
    kernel_pair = FLASH if FLASH in kernel_pairs else next(iter(kernel_pairs), None)
    # the one replicate's seed: the seed the kernel pair's runs share (a seed pair's runs have two)
    shared = _run_seed(study["pairs"][kernel_pair], "a") if kernel_pair else None
    for name, pair in study["pairs"].items():
        things = _differs_in(pair)
        if things is None:
            continue
        differs = pair["differs"]
        kind = {(): "noise", ("seed",): "seed", ("precision",): "precision"}.get(tuple(things))
        if name == kernel_pair:
            kind = "kernel"
        if kind is None:
            continue
        isolates = "nothing" if not things else f"{things[0]} ({' vs '.join(map(str, differs[things[0]]))})"
        seed = shared if shared is not None else _run_seed(pair, "a")
        out[name] = {"kind": kind, "group": name, "replicate": 0, "seed": seed or 0, "isolates": isolates}
    return out


def _run_seed(pair: Mapping[str, Any], side: str) -> int | None:
    """The seed run ``side`` (``a`` or ``b``) of a compared pair recorded, or None."""
    seed = ((pair.get("runs") or {}).get(side) or {}).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def _differs_in(pair: Mapping[str, Any]) -> list[str] | None:
    """The things a pair's runs were recorded to differ in, sorted; None when not all recorded."""
    differs = pair.get("differs")
    if not isinstance(differs, Mapping) or pair.get("unrecorded"):
        return None
    return sorted(differs)


def kernel_pair(study: Mapping[str, Any]) -> str | None:
    """The pair the verdict measures the kernel by: replicate 0's pair whose runs differ in the attention
    alone (see :func:`study_comparisons`)."""
    return next(
        (n for n, c in study_comparisons(study).items() if c["kind"] == "kernel" and not c["replicate"]),
        None,
    )


#: What the runs of each kind of planned comparison may differ in: exactly these things.
_PLANNED_DIFFERENCE = {
    "kernel": {"attention"},
    "kernel_fp32": {"attention"},
    "seed": {"seed"},
    "precision": {"precision"},
    "noise": set(),
}


def _differs_as_planned(pair: Mapping[str, Any] | None, kind: str | None) -> bool:
    """Whether a planned pair's runs were recorded to differ in exactly what its kind names (a pair
    without ``differs`` records keeps its planned kind)."""
    if pair is None or "differs" not in pair:
        return True
    differs = pair.get("differs")
    if not isinstance(differs, Mapping) or pair.get("unrecorded"):
        return False
    return set(differs) == _PLANNED_DIFFERENCE.get(kind or "", set(differs))


def comparison_groups(study: Mapping[str, Any]) -> dict[str, list[str]]:
    """Comparison (replicate 0's name) → its pairs at every replicate, for the pairs of ``study.json``."""
    comparisons = study_comparisons(study)
    groups: dict[str, list[str]] = {}
    for name in study["pairs"]:
        groups.setdefault(comparisons.get(name, {}).get("group") or name, []).append(name)
    return groups


def _interval(values: Mapping[int, float | None], seeds: Mapping[int, int]) -> Interval | None:
    """The finite values (replicate → value) as an :class:`Interval`, or None when there are none."""
    kept = [(r, v) for r, v in sorted(values.items()) if _finite(v)]
    if not kept:
        return None
    return Interval(tuple(float(v) for _, v in kept), tuple(seeds[r] for r, _ in kept))


def verdict(study: Mapping[str, Any]) -> Verdict | None:
    """The study's answer and the ratios it rests on, per replicate, at the last step and over training.

    The rule, over the snapshot steps after the learning-rate warm-up (never step 0, always the last):

    * **PASS** when at every such step flash / seed is below 1 in every replicate, flash / the
      low-precision pair at flash's precision (every one when flash trains at fp32) is not above 1 in
      every replicate, and flash's weights stay finite;
    * **LOOK CLOSER** when one of these fails at some step (naming the step and the ratio);
    * **UNDETERMINED** otherwise when a comparison the rule needs is missing, a ratio is undefined in
      some replicate (its context distance 0 or not finite), or a planned pair's runs differ in more
      than the one thing it isolates (that pair is left out).

    Args:
        study: ``study.json`` as read by :func:`flashprobe.formats.study_file.read_study`.

    Returns:
        None when there is no kernel pair (:func:`kernel_pair`: runs that differ in the attention
        alone); otherwise the :class:`Verdict`.
    """
    pairs = study["pairs"]
    comparisons = {n: c for n, c in study_comparisons(study).items() if n in pairs}
    measured = kernel_pair(study)
    if measured is None or measured not in pairs:
        return None
    flash = {c["replicate"]: n for n, c in comparisons.items() if c["kind"] == "kernel"}
    seeds = {c["replicate"]: c["seed"] for c in comparisons.values()}
    seeds.update({c["replicate"]: c["seed"] for c in comparisons.values() if c["kind"] == "kernel"})
    curves = {
        n: dict(zip(pairs[n]["steps"], pairs[n]["model"]["wasserstein"], strict=True)) for n in comparisons
    }
    grid = sorted(set.intersection(*(set(pairs[n]["steps"]) for n in flash.values())))
    finite_at = [s for s in grid if any(_finite(curves[n].get(s)) for n in flash.values())]
    if not finite_at:
        return None
    step = finite_at[-1]
    warmup = (study.get("study") or {}).get("warmup_steps")
    after = [s for s in grid if s > 0 and (warmup is None or s >= warmup) and s <= step] or [step]
    replicate_seeds = [seeds[r] for r in sorted(flash)]
    noise = [curves[n].get(step) for n, c in comparisons.items() if c["kind"] == "noise"]
    members: dict[str, dict[int, list[str]]] = {}  # context label → replicate → its pairs
    for name, c in comparisons.items():
        if c["kind"] in ("seed", "precision") and c["replicate"] in flash:
            label = "seed" if c["kind"] == "seed" else c["group"]
            members.setdefault(label, {}).setdefault(c["replicate"], []).append(name)

    def context_at(label: str, r: int, s: int) -> float | None:
        values = [curves[n].get(s) for n in members[label][r]]
        return statistics.fmean(values) if values and all(_finite(v) for v in values) else None

    def ratio_at(label: str, s: int) -> Interval | None:
        ratios = {}
        for r in members[label]:
            f, c = curves[flash[r]].get(s), context_at(label, r, s)
            if _finite(f) and c is not None and c > 0:
                ratios[r] = f / c
        return _interval(ratios, seeds)

    planned = (study.get("study") or {}).get("comparisons") or {}
    precision = _flash_precision(study, measured)
    context: dict[str, ContextRatio] = {}
    for label, by_replicate in members.items():
        first = comparisons[by_replicate[min(by_replicate)][0]]
        low = _low_precision(pairs[by_replicate[min(by_replicate)][0]], first["group"])
        by_step = {s: ratio_at(label, s) for s in after}
        known = [i for i in by_step.values() if i is not None]
        context[label] = ContextRatio(
            kind=first["kind"],
            replicate_seeds=replicate_seeds,
            pairs=[n for r in sorted(by_replicate) for n in by_replicate[r]],
            isolates="the random seed" if label == "seed" else first["isolates"],
            distance=_interval({r: context_at(label, r, step) for r in by_replicate}, seeds),
            ratio=by_step.get(step),
            by_step=by_step,
            over_training=(min(i.low for i in known), max(i.high for i in known)) if known else None,
            in_rule=label == "seed" or low == precision or precision == FP32,
        )
    extra = {}
    for name, c in comparisons.items():
        if c["kind"] == "kernel_fp32" and _finite(curves[name].get(step)):
            f = curves[flash[c["replicate"]]].get(step) if c["replicate"] in flash else None
            extra[name] = ExtraLine(distance=curves[name][step], flash=f, seed=c["seed"])
    attention = _attention_labels(pairs[measured])
    left_out = {n: pairs[n] for n in planned if n in pairs and n not in comparisons}
    nonfinite = {
        n: min(s for s, x in curves[n].items() if x is not None and not _finite(x))
        for n in flash.values()
        if any(x is not None and not _finite(x) for x in curves[n].values())
    }
    answer, reasons = _answer(_label(measured, attention), context, left_out, precision, nonfinite)
    return Verdict(
        kernel_pair=measured,
        attention=attention,
        step=step,
        steps=after,
        warmup_steps=warmup,
        seeds=replicate_seeds,
        flash=_interval({r: curves[n].get(step) for r, n in flash.items()}, seeds),
        context=context,
        extra=extra,
        noise_floor=max((v for v in noise if _finite(v)), default=None),
        left_out=left_out,
        precision=precision,
        answer=answer,
        reasons=reasons,
    )


def _attention_labels(pair: Mapping[str, Any]) -> list[str]:
    """The attention of the kernel pair's two runs, as they recorded it (``["tiled", "sdpa_flash"]``)."""
    runs = pair.get("runs") or {}
    recorded = [(runs.get(side) or {}).get("attention") for side in ("a", "b")]
    differs = (pair.get("differs") or {}).get("attention") or [None, None]
    return [str(r or d or "not recorded") for r, d in zip(recorded, differs, strict=True)]


def kernel_label(v: Verdict) -> str:
    """The label of the kernel pair's distance in report text: the attention its first run recorded
    (``"tiled"``), else the pair's name."""
    return _label(v.kernel_pair, v.attention)


def _label(kernel_pair: str, attention: Sequence[str]) -> str:
    recorded = (attention or ["not recorded"])[0]
    return str(kernel_pair) if recorded == "not recorded" else str(recorded)


def _flash_precision(study: Mapping[str, Any], pair: str) -> str | None:
    """The precision the kernel trains at: the study's, or what the kernel pair's runs recorded."""
    runs = (study["pairs"][pair].get("runs") or {}).get("a") or {}
    return (study.get("study") or {}).get("precision") or runs.get("precision")


def _low_precision(pair: Mapping[str, Any], group: str) -> str | None:
    """The low precision a precision pair measures (its run that is not fp32), from the runs' records
    or else its name (``bf16_vs_fp32``)."""
    runs = pair.get("runs") or {}
    recorded = [(runs.get(side) or {}).get("precision") for side in ("a", "b")]
    low = [p for p in recorded if p is not None and p != FP32]
    return low[0] if len(low) == 1 else _LOW_PRECISIONS.get(group.split("_vs_")[0])


def _steps_text(steps: Sequence[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"


def _answer(
    kernel: str,
    context: Mapping[str, ContextRatio],
    left_out: Mapping[str, Mapping[str, Any]],
    precision: str | None,
    nonfinite: Mapping[str, int],
) -> tuple[str, list[str]]:
    """The rule of :func:`verdict`: the answer and its reasons (``nonfinite``: pair → the first step
    where the kernel pair's distance is not finite)."""
    from flashprobe.weights.differences import describe_differences

    look: list[str] = []
    missing = [
        f"{name} is left out: its runs differ in {describe_differences(pair)}"
        for name, pair in left_out.items()
    ]
    for name, step in nonfinite.items():
        look.append(f"{name}'s distance is not finite from step {step} on (non-finite weights)")
    seed = context.get("seed")
    if seed is None:
        missing.append(
            "no seed pair (runs that differ in the seed alone, e.g. run seed1): the seed bound is unknown"
        )
    else:
        not_below = [s for s, i in seed.by_step.items() if i is not None and i.position() != "below"]
        unknown = _undefined(seed)
        if not_below:
            above = all(seed.by_step[s].position() == "above" for s in not_below)
            where = "above 1 in every replicate" if above else "not below 1 in every replicate"
            look.append(f"{kernel} / seed is {where} at {_steps_text(not_below)}")
        elif unknown:
            missing.append(f"{kernel} / seed is undefined {unknown}")
    lows = {label: c for label, c in context.items() if c.kind == "precision" and c.in_rule}
    if not lows:
        missing.append(
            f"no low-precision pair at {precision}, the precision {kernel} trains at (runs that differ "
            f"in the precision alone, one at {precision} and one at fp32: run fp32)"
        )
    for label, c in lows.items():
        every = len(c.replicate_seeds)  # "above in every replicate" needs each replicate's ratio
        above = [
            s for s, i in c.by_step.items() if i is not None and i.n == every and i.position() == "above"
        ]
        if above:
            look.append(f"{kernel} / {label} is above 1 in every replicate at {_steps_text(above)}")
        unknown = _undefined(c)
        if unknown:
            missing.append(f"{kernel} / {label} is undefined {unknown}")
    if look:
        return LOOK_CLOSER, look
    if missing:
        return UNDETERMINED, missing
    return PASS, []


def _undefined(c: ContextRatio) -> str:
    """Where a context's ratio is undefined in some replicate (``"in replicate seed 2 at step 100"``);
    empty when every replicate has it at every rule step."""
    gaps: dict[tuple[int, ...], list[int]] = {}
    for s, i in c.by_step.items():
        lacking = tuple(x for x in c.replicate_seeds if i is None or x not in i.seeds)
        if lacking:
            gaps.setdefault(lacking, []).append(s)
    return "; ".join(
        f"in replicate{'s' * (len(lack) > 1)} seed {', '.join(map(str, lack))} at {_steps_text(steps)}"
        for lack, steps in gaps.items()
    )


def _paper(ratio: Interval) -> str:
    """Where the paper's 0.2–0.5 (flash 2–5× below FP16 vs FP32) lies against this interval."""
    low, high = PAPER_RATIO
    if ratio.low > high:
        where = "above the paper's range in every replicate"
    elif ratio.high < low:
        where = "below the paper's range in every replicate"
    else:
        where = "consistent with the paper's range"
    return f"paper: 2–5× below FP16 vs FP32, a ratio of {low}–{high}; here {where}"


def _over(c: ContextRatio, steps: Sequence[int]) -> str:
    if c.over_training is None or len(steps) < 2:
        return ""
    low, high = c.over_training
    return f"; {format_value(low)}–{format_value(high)} over steps {steps[0]}–{steps[-1]}"


def answer_line(v: Verdict) -> str:
    """The verdict's first line: the answer and, for PASS, what held; otherwise the reasons."""
    answer = v.answer
    if answer == PASS:
        steps, n = v.steps, len(v.seeds)
        where = (
            f"step {steps[0]}" if len(steps) == 1 else f"every snapshot step from {steps[0]} to {steps[-1]}"
        )
        seeds = ", ".join(map(str, v.seeds))
        reps = (
            f"its one replicate (seed {seeds})" if n == 1 else f"each of the {n} replicates (seeds {seeds})"
        )
        lows = [n for n, c in v.context.items() if c.kind == "precision" and c.in_rule]
        return (
            "**PASS**: the kernel's weight deviation is within the seed bound and not above low precision "
            f"({', '.join(lows)}) — at {where}, in {reps}."
        )
    if answer == LOOK_CLOSER:
        return f"**LOOK CLOSER**: {'; '.join(v.reasons)}."
    return f"**UNDETERMINED**: {'; '.join(v.reasons)}."


def verdict_subject(study: Mapping[str, Any], v: Verdict | None) -> tuple[str, str]:
    """The precision and the kernel a verdict speaks of: the study's settings, else (a comparison) what
    the kernel pair's first run recorded."""
    meta = study.get("study") or {}
    runs = (study["pairs"].get(v.kernel_pair if v else FLASH) or {}).get("runs") or {}
    precision = meta.get("precision") or (runs.get("a") or {}).get("precision") or "?"
    kernel = meta.get("kernel") or (runs.get("a") or {}).get("attention") or "the kernel under test"
    return str(precision), str(kernel)


def answer(study: Mapping[str, Any]) -> tuple[list[str], int]:
    """The verdict of a study or comparison as ``flashprobe study``, ``compare`` and ``report`` print it:
    plain-text lines, the answer first (then, for UNDETERMINED, :func:`needs_line`), and the answer's
    exit code (:data:`EXIT_CODES`; no kernel pair is UNDETERMINED)."""
    v = verdict(study)
    lines = [no_verdict_line(study)] if v is None else verdict_lines(v, *verdict_subject(study, v))
    code = EXIT_CODES[v.answer if v else UNDETERMINED]
    if code == EXIT_CODES[UNDETERMINED]:
        lines.append(needs_line(study))
    return [line.replace("**", "") for line in lines], code


def needs_line(study: Mapping[str, Any]) -> str:
    """One paragraph: the pairs a verdict needs, by what their runs differ in, and which of them this
    comparison has (by name) or misses."""
    comparisons = study_comparisons(study)
    measured = kernel_pair(study)
    seeds = [n for n, c in comparisons.items() if c["kind"] == "seed"]
    lows = [n for n, c in comparisons.items() if c["kind"] == "precision"]
    needed = [
        ("a kernel pair (runs that differ in the attention alone)", [measured] if measured else []),
        ("a seed pair (in the seed alone)", seeds),
        ("a low-precision pair (in the precision alone, the kernel's precision vs fp32)", lows),
    ]
    have = "; ".join(f"{what}: {', '.join(names) if names else 'MISSING'}" for what, names in needed)
    missing = [what.split(" (")[0] for what, names in needed if not names]
    return f"A verdict needs three pairs, named anything — {have}." + (
        f" To get one, add {' and '.join(missing)}." if missing else ""
    )


def no_verdict_line(study: Mapping[str, Any]) -> str:
    """The answer when :func:`verdict` has none: no pair whose runs differ in the attention alone."""
    from flashprobe.weights.differences import describe_differences

    pairs = study["pairs"]
    planned = (study.get("study") or {}).get("comparisons") or {}
    if planned:  # a study: its kernel pair of replicate 0
        candidates = [
            n
            for n, c in planned.items()
            if n in pairs and c.get("kind") == "kernel" and not c.get("replicate")
        ]
    else:
        candidates = [
            n
            for n, p in pairs.items()
            if {"attention", "attention fallback"} & set(p.get("differs") or {})
            or "attention" in (p.get("unrecorded") or [])
        ]
    if candidates:
        why = "no pair's runs differ in the attention alone: " + "; ".join(
            f"those of {n} differ in {describe_differences(pairs[n])}" for n in candidates
        )
    else:
        why = f"no pair's runs differ in the attention (compared: {', '.join(pairs) or 'none'})"
    return f"**UNDETERMINED**: {why}, so no distance here measures the kernel."


def verdict_lines(v: Verdict, precision: str, kernel: str = "sdpa_flash") -> list[str]:
    """The verdict in a few sentences, the answer first; ``kernel`` names the first run's attention
    where that run recorded none."""
    n, step, steps, kernel = len(v.seeds), v.step, v.steps, kernel_label(v)
    attention = [kernel if v.attention[0] == "not recorded" else v.attention[0], v.attention[1]]
    reps = f"{n} replicate{'s' * (n != 1)}, seed{'s' * (n != 1)} {', '.join(map(str, v.seeds))}"
    lines = [
        answer_line(v),
        f"{v.kernel_pair} ({' vs '.join(attention)} attention, both at {precision}, same seed): "
        "whole-model "
        f"Wasserstein distance **{v.flash.text()}** at step {step} ({reps}; median (min–max) over "
        "replicates, each ratio below computed within one replicate).",
    ]
    floor = v.noise_floor
    if floor is not None:
        lines.append(
            "Noise floor: 0 — identical runs give bit-identical weights, so every distance here is real."
            if floor == 0
            else f"Noise floor: identical runs differ by {format_value(floor)}; distances near it are noise."
        )
    seed = v.context.get("seed")
    if seed is not None and seed.ratio is not None:
        finding = {
            "below": "below 1 in every replicate — within the bound set by random initialisation, as in the "
            "paper",
            "straddles": "the interval straddles 1 — not distinguishable from the seed bound: look closer",
            "above": "above 1 in every replicate — above the bound set by random initialisation, unlike the "
            "paper: look closer",
        }[seed.ratio.position()]
        ratio = seed.ratio.text("×")
        lines.append(
            f"Seed: {kernel} / seed-to-seed = {ratio} at step {step}{_over(seed, steps)}: {finding}."
        )
    for name, c in v.context.items():
        if c.kind != "precision" or c.ratio is None:
            continue
        finding = {
            "below": f"below {name} in every replicate",
            "straddles": f"not distinguishable from {name} (the interval straddles 1)",
            "above": f"above {name} in every replicate",
        }[c.ratio.position()]
        ratio = c.ratio.text("×")
        role = "the rule's low-precision pair" if c.in_rule else "reported, not in the rule"
        lines.append(
            f"Low precision: {kernel} / {name} = {ratio} at step {step}{_over(c, steps)}: {finding} "
            f"({c.isolates}; {role}; {_paper(c.ratio)})."
        )
    for name, e in v.extra.items():
        at = (
            f", against {format_value(e.flash)} at {precision} from the same seed"
            if e.flash is not None
            else ""
        )
        lines.append(
            f"Without low precision ({name}, both at fp32; seed {e.seed} only, not part of the answer): "
            f"{format_value(e.distance)}{at}."
        )
    return lines
