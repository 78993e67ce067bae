"""Compare the weight snapshots of runs: Wasserstein and max-difference curves over training steps.

For each pair of runs and each step both saved, :func:`compare_runs` gives the :class:`Distances` of
every parameter tensor, every module group (``blocks.0`` at ``group_depth=2``) and the whole model,
each as one distribution of weights; non-finite weights are counted and make the distances NaN.
Each run's weights are read and sorted once per step for all the pairs that need them (about four
model-sized float64 vectors per run; ``whole_model=False`` and ``group_depth=0`` leave out two).
With ``out_dir`` it writes ``study.json`` and ``study.csv`` (:mod:`flashprobe.formats.study_file`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import torch

from flashprobe.errors import FlashprobeError
from flashprobe.formats.study_file import write_study
from flashprobe.weights.differences import is_like_for_like, run_differences
from flashprobe.weights.distances import sorted_values, wasserstein_sorted
from flashprobe.weights.store import SnapshotStore

__all__ = [
    "Comparison",
    "Distances",
    "PairComparison",
    "SnapshotMismatchError",
    "check_compatible",
    "compare_pair",
    "compare_runs",
    "group_of",
]


class SnapshotMismatchError(ValueError, FlashprobeError):
    """Two runs cannot be compared: their parameters differ in names or shapes, or no step is common."""


@dataclass(frozen=True)
class Distances:
    """Distances between run A's and run B's weights at one level (tensor, group or model) and step.

    Attributes:
        wasserstein: 1-D Wasserstein-1 distance of the two weight distributions (NaN if non-finite).
        max_abs: ``max |W_a − W_b|`` over elements (NaN if non-finite weights are present).
        numel: number of weights compared.
        nonfinite_a: NaN/±inf weights in run A.
        nonfinite_b: NaN/±inf weights in run B.
    """

    wasserstein: float
    max_abs: float
    numel: int
    nonfinite_a: int = 0
    nonfinite_b: int = 0


def group_of(name: str, depth: int) -> str:
    """The module group of a parameter: the first ``depth`` components of its module path.

    ``group_of("blocks.0.attn.qkv.weight", 2) == "blocks.0"``; ``group_of("head.weight", 2) ==
    "head"``. A parameter held by the root module (``pos_embed``) is its own group.
    """
    parts = name.split(".")
    module = parts[:-1] or parts  # the root module's own parameters are named after themselves
    return ".".join(module[:depth])


@dataclass
class PairComparison:
    """Distances between two runs at every common step.

    Attributes:
        name: the comparison's name (e.g. ``flash_vs_baseline``).
        run_a: run A's directory.
        run_b: run B's directory.
        steps: the common steps, ascending.
        steps_only_a: steps saved only by run A (not compared).
        steps_only_b: steps saved only by run B (not compared).
        model: per step, the whole-model distances (empty if ``whole_model=False``).
        groups: group name → per-step distances.
        tensors: parameter name → per-step distances.
        runs: manifest facts of both runs (``run_id``, ``seed``, ``attention``, ``precision``).
        differs: what the two runs differ in, from their records: thing → ``[value_a, value_b]``
            (:func:`flashprobe.weights.differences.run_differences`).
        unrecorded: manifest facts a run did not record (their difference is unknown).
    """

    name: str
    run_a: str
    run_b: str
    steps: list[int]
    steps_only_a: list[int] = field(default_factory=list)
    steps_only_b: list[int] = field(default_factory=list)
    model: list[Distances] = field(default_factory=list)
    groups: dict[str, list[Distances]] = field(default_factory=dict)
    tensors: dict[str, list[Distances]] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    differs: dict[str, list[Any]] = field(default_factory=dict)
    unrecorded: list[str] = field(default_factory=list)

    @property
    def like_for_like(self) -> bool:
        """Whether the runs differ in at most one thing, every fact recorded."""
        return is_like_for_like({"differs": self.differs, "unrecorded": self.unrecorded})

    def curve(
        self, metric: str = "wasserstein", level: str = "model", name: str | None = None
    ) -> list[float]:
        """One metric over ``steps`` at one level (``model``, or ``group``/``tensor`` with ``name``)."""
        if metric not in ("wasserstein", "max_abs"):
            raise ValueError(f"metric must be 'wasserstein' or 'max_abs', got {metric!r}")
        series = {
            "model": lambda: self.model,
            "group": lambda: self.groups[name],
            "tensor": lambda: self.tensors[name],
        }
        if level not in series:
            raise ValueError(f"level must be one of {sorted(series)}, got {level!r}")
        return [getattr(d, metric) for d in series[level]()]

    def as_dict(self) -> dict[str, Any]:
        """Columnar form of ``study.json`` (:mod:`flashprobe.formats.study_file`): every curve is a
        list aligned with ``steps``."""
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "runs": self.runs,
            "differs": self.differs,
            "unrecorded": self.unrecorded,
            "steps": self.steps,
            "steps_only_a": self.steps_only_a,
            "steps_only_b": self.steps_only_b,
            "model": _columns(self.model),
            "groups": {g: _columns(d) for g, d in self.groups.items()},
            "tensors": {t: _columns(d) for t, d in self.tensors.items()},
        }

    def rows(self) -> Iterable[dict[str, Any]]:
        """Flat rows (the CSV): one per step × level × name."""
        levels = [("model", {"model": self.model})] if self.model else []
        levels += [("group", self.groups), ("tensor", self.tensors)]
        for i, step in enumerate(self.steps):
            for level, table in levels:
                for name, series in table.items():
                    d = series[i]
                    yield {"pair": self.name, "step": step, "level": level, "name": name, **_row(d)}


@dataclass
class Comparison:
    """The result of :func:`compare_runs`: one :class:`PairComparison` per named pair.

    Attributes:
        pairs: pair name → its comparison, in the order given.
        group_depth: module path depth of the groups.
        files: the files written (``study.json``, ``study.csv``, figures), empty without ``out_dir``.
    """

    pairs: dict[str, PairComparison]
    group_depth: int
    files: list[Path] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """``study.json``'s fields (without ``format``)."""
        return {
            "group_depth": self.group_depth,
            "pairs": {name: pair.as_dict() for name, pair in self.pairs.items()},
        }

    def rows(self) -> Iterable[dict[str, Any]]:
        for pair in self.pairs.values():
            yield from pair.rows()


#: The fields of :class:`Distances` that change from step to step, in the order files list them.
_PER_STEP = ("wasserstein", "max_abs", "nonfinite_a", "nonfinite_b")


def _columns(series: Sequence[Distances]) -> dict[str, Any]:
    return {
        "numel": series[0].numel if series else 0,
        **{f: [getattr(d, f) for d in series] for f in _PER_STEP},
    }


def _row(d: Distances) -> dict[str, Any]:
    return {"numel": d.numel, **{f: getattr(d, f) for f in _PER_STEP}}


def check_compatible(a: SnapshotStore, b: SnapshotStore) -> list[str]:
    """Check that two runs have the same parameters (names and shapes); return the names in A's order.

    Raises:
        SnapshotMismatchError: naming the first parameter that is missing from one run or whose
            shapes differ.
    """
    names_a, names_b = a.names("parameter"), b.names("parameter")
    for names, others, run, other in ((names_a, set(names_b), a, b), (names_b, set(names_a), b, a)):
        for name in names:
            if name not in others:
                raise SnapshotMismatchError(
                    f"parameter {name!r} of {run.run_dir} is missing from {other.run_dir}; runs compared "
                    "must have the same parameter names (the same model architecture)"
                )
    for name in names_a:
        shape_a, shape_b = a.specs[name].shape, b.specs[name].shape
        if shape_a != shape_b:
            raise SnapshotMismatchError(
                f"parameter {name!r} has shape {list(shape_a)} in {a.run_dir} but {list(shape_b)} in "
                f"{b.run_dir}; runs compared must have the same model sizes"
            )
    return names_a


def _count_nonfinite(t: torch.Tensor) -> int:
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return 0
    return int((~torch.isfinite(t)).sum())


class _Weights:
    """One run's weights at one step, read once and sorted once for every pair that needs them.

    Args:
        store: the run's snapshots.
        step: the step.
        names: the parameters, in order.

    Attributes:
        flat: name → the tensor flattened to float64 ``(numel,)``.
        nonfinite: name → its count of NaN/±inf values.
    """

    def __init__(self, store: SnapshotStore, step: int, names: Sequence[str]) -> None:
        self.flat = {n: t.reshape(-1).to(torch.float64) for n, t in store.iter_tensors(step, names)}
        self.nonfinite = {n: _count_nonfinite(t) for n, t in self.flat.items()}
        self._sorted: dict[tuple[str, ...], torch.Tensor] = {}

    def sorted(self, members: tuple[str, ...]) -> torch.Tensor:
        """The values of ``members`` (concatenated) in ascending order, sorted on first use."""
        if members not in self._sorted:
            flat = self.flat[members[0]] if len(members) == 1 else torch.cat([self.flat[m] for m in members])
            self._sorted[members] = sorted_values(flat)
        return self._sorted[members]


def _distances(a: _Weights, b: _Weights, members: tuple[str, ...], max_abs: dict[str, float]) -> Distances:
    """Distances between the concatenated ``members`` of two runs (same shapes, see check_compatible)."""
    numel = sum(a.flat[m].numel() for m in members)
    bad_a, bad_b = sum(a.nonfinite[m] for m in members), sum(b.nonfinite[m] for m in members)
    if bad_a or bad_b:
        return Distances(math.nan, math.nan, numel, bad_a, bad_b)
    if numel == 0:
        return Distances(0.0, 0.0, 0)
    wasserstein = float(wasserstein_sorted(a.sorted(members), b.sorted(members)))
    return Distances(wasserstein, max(max_abs[m] for m in members), numel)


def _max_abs(a: _Weights, b: _Weights) -> dict[str, float]:
    """Per tensor, ``max |W_a − W_b|`` (0 for empty or non-finite tensors, whose distances are NaN)."""
    return {
        n: float((fa - b.flat[n]).abs().amax())
        if fa.numel() and not (a.nonfinite[n] or b.nonfinite[n])
        else 0.0
        for n, fa in a.flat.items()
    }


def _run_info(store: SnapshotStore) -> dict[str, Any]:
    return {
        "run_id": store.run_id,
        "seed": store.seed,
        "attention": store.attention,
        "precision": store.precision,
        "steps": store.steps,
    }


def _weights_at(cache: dict[str, _Weights], store: SnapshotStore, step: int) -> _Weights:
    key = str(store.run_dir)
    if key not in cache:
        cache[key] = _Weights(store, step, store.names("parameter"))
    return cache[key]


@dataclass
class _PairPlan:
    """What one pair compares (its runs, parameters, groups) and the distances found so far."""

    a: SnapshotStore
    b: SnapshotStore
    names: list[str]
    groups: dict[str, tuple[str, ...]]
    whole_model: bool
    result: PairComparison
    warned: bool = False

    @classmethod
    def of(
        cls, name: str, a: SnapshotStore, b: SnapshotStore, group_depth: int, whole_model: bool
    ) -> _PairPlan:
        """Check the two runs and find their common steps (warning about the others)."""
        names = check_compatible(a, b)
        steps = sorted(set(a.steps) & set(b.steps))
        only_a, only_b = sorted(set(a.steps) - set(b.steps)), sorted(set(b.steps) - set(a.steps))
        if not steps:
            raise SnapshotMismatchError(
                f"{a.run_dir} (steps {a.steps}) and {b.run_dir} (steps {b.steps}) have no snapshot step in "
                "common; save snapshots at the same steps (WeightSnapshot every_n_steps/steps)"
            )
        if only_a or only_b:
            warnings.warn(
                f"comparing {name} on the {len(steps)} steps both runs saved; steps only in {a.run_dir}: "
                f"{only_a}, only in {b.run_dir}: {only_b}",
                UserWarning,
                stacklevel=4,
            )
        groups: dict[str, list[str]] = {}
        for n in names if group_depth else ():
            groups.setdefault(group_of(n, group_depth), []).append(n)
        result = PairComparison(
            name=name,
            run_a=str(a.run_dir),
            run_b=str(b.run_dir),
            steps=steps,
            steps_only_a=only_a,
            steps_only_b=only_b,
            groups={g: [] for g in groups},
            tensors={n: [] for n in names},
            runs={"a": _run_info(a), "b": _run_info(b)},
            **run_differences(a, b),
        )
        return cls(a, b, names, {g: tuple(m) for g, m in groups.items()}, whole_model, result)

    def add(self, a: _Weights, b: _Weights, step: int) -> None:
        """Append the distances of ``step`` (every tensor, group and the whole model)."""
        maxes = _max_abs(a, b)
        for n in self.names:
            self.result.tensors[n].append(_distances(a, b, (n,), maxes))
            if (a.nonfinite[n] or b.nonfinite[n]) and not self.warned:
                self.warned = True
                warnings.warn(
                    f"{self.result.name}: non-finite weights at step {step} in {n!r} ({a.nonfinite[n]} in A, "
                    f'{b.nonfinite[n]} in B); their distances are NaN ("nan" in study.json)',
                    UserWarning,
                    stacklevel=4,
                )
        for g, members in self.groups.items():
            self.result.groups[g].append(_distances(a, b, members, maxes))
        if self.whole_model:
            self.result.model.append(_distances(a, b, tuple(self.names), maxes))


def compare_pair(
    run_a: str | os.PathLike[str],
    run_b: str | os.PathLike[str],
    *,
    name: str = "a_vs_b",
    group_depth: int = 2,
    whole_model: bool = True,
    per_tensor: bool = True,
) -> PairComparison:
    """Compare the snapshots of two runs at every step both saved (:func:`compare_runs` of one pair).

    Args:
        run_a: run directory (or snapshot directory) of run A.
        run_b: the same for run B.
        name: the comparison's name.
        group_depth: module path depth of the groups (``blocks.0`` at 2); 0 disables groups.
        whole_model: also compare all parameters as one distribution.
        per_tensor: keep the per-tensor distances in the result (they are always computed).

    Returns:
        The per-step distances.

    Raises:
        SnapshotMismatchError: the runs' parameters differ in names or shapes (naming the first such
            parameter) or the runs share no snapshot step.
        FileNotFoundError: a run directory has no snapshot manifest.

    Warns:
        UserWarning: the runs saved different steps; only the common steps are compared.
    """
    result = compare_runs({name: (run_a, run_b)}, group_depth=group_depth, whole_model=whole_model).pairs[
        name
    ]
    if not per_tensor:
        result.tensors = {}
    return result


@overload
def compare_runs(
    pairs: Mapping[str, tuple[str | os.PathLike[str], str | os.PathLike[str]]],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    group_depth: int = 2,
    whole_model: bool = True,
) -> Comparison: ...


@overload
def compare_runs(
    pairs: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    group_depth: int = 2,
    whole_model: bool = True,
) -> PairComparison: ...


def compare_runs(
    pairs: Mapping[str, tuple[str | os.PathLike[str], str | os.PathLike[str]]] | str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    group_depth: int = 2,
    whole_model: bool = True,
) -> Comparison | PairComparison:
    """Compare named pairs of runs and (with ``out_dir``) write ``study.json`` and ``study.csv``;
    or, called as ``compare_runs(run_a, run_b)`` with two run directories, return that one pair's
    distances (:func:`compare_pair`).

    Args:
        pairs: comparison name → ``(run_a, run_b)`` directories, e.g.
            ``{"flash_vs_baseline": ("runs/flash", "runs/baseline"), "seed": ("runs/baseline",
            "runs/baseline_seed1")}``; or run A's directory.
        out_dir: where to write the outputs; ``None`` only computes. Run B's directory when
            ``pairs`` is run A's.
        group_depth: module path depth of the groups (0 disables groups).
        whole_model: also compare all parameters as one distribution.

    Returns:
        The comparison (``files`` lists what was written); for two run directories, their
        :class:`PairComparison` (named ``a_vs_b``).

    Raises:
        ValueError: ``pairs`` is empty, or run A is given without run B.
        SnapshotMismatchError: see :func:`compare_pair`.
    """
    if isinstance(pairs, str | os.PathLike):  # compare_runs(run_a, run_b): the one pair's distances
        if out_dir is None:
            raise ValueError(
                f"compare_runs({str(pairs)!r}) needs a second run directory: compare_runs(run_a, run_b), "
                "or named pairs: compare_runs({name: (run_a, run_b)})"
            )
        return compare_pair(pairs, out_dir, group_depth=group_depth, whole_model=whole_model)
    if not pairs:
        raise ValueError("compare_runs needs at least one pair: {name: (run_a, run_b)}")
    if group_depth < 0:
        raise ValueError(f"group_depth must be >= 0 (0 = no groups), got {group_depth}")
    stores = {str(run): SnapshotStore(run) for pair in pairs.values() for run in pair}
    plans = {
        name: _PairPlan.of(name, stores[str(a)], stores[str(b)], group_depth, whole_model)
        for name, (a, b) in pairs.items()
    }
    for step in sorted({s for plan in plans.values() for s in plan.result.steps}):
        cache: dict[str, _Weights] = {}  # each run's weights at this step, read and sorted once
        for plan in plans.values():
            if step in plan.result.steps:
                plan.add(_weights_at(cache, plan.a, step), _weights_at(cache, plan.b, step), step)
    result = Comparison(pairs={name: plan.result for name, plan in plans.items()}, group_depth=group_depth)
    if out_dir is not None:
        result.files += write_study(out_dir, result.as_dict(), result.rows())
    return result
