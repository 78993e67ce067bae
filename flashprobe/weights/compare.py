"""Compare the weight snapshots of runs: Wasserstein and max-difference curves over training steps.

For each pair of runs and each step both runs saved, three levels are compared:

* **tensor**: each parameter tensor of run A against the same-named tensor of run B;
* **group**: all parameters under one module path prefix (``blocks.0`` at ``group_depth=2``) as one
  distribution;
* **model**: all parameters as one distribution.

At each level two distances (:mod:`flashprobe.weights.distances`): ``wasserstein`` (the 1-D
Wasserstein-1 distance between the two empirical weight distributions) and ``max_abs``
(``max |W_a − W_b|`` element by element). Non-finite weights are counted (``nonfinite_a``,
``nonfinite_b``) and make that tensor's, group's and model's distances ``NaN`` (``null`` in JSON).

Memory: tensors are read from the snapshot files one pair at a time (:class:`SnapshotStore`);
the group and model distributions need every parameter of a step at once, so the peak is about
three model-sized float64 vectors per run (the tensors, their concatenation and its sorted copy).
Pass ``whole_model=False, group_depth=0`` to keep only one tensor pair in memory.

With ``out_dir``, :func:`compare_runs` writes ``study.json`` and ``study.csv``
(:mod:`flashprobe.formats.study_file`); figures are drawn from those by :mod:`flashprobe.report`
(``flashprobe compare`` does both).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashprobe.formats.study_file import write_study
from flashprobe.weights.distances import _cdf_distance_w1
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


class SnapshotMismatchError(ValueError):
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


def _columns(series: Sequence[Distances]) -> dict[str, Any]:
    return {
        "numel": series[0].numel if series else 0,
        "wasserstein": [d.wasserstein for d in series],
        "max_abs": [d.max_abs for d in series],
        "nonfinite_a": [d.nonfinite_a for d in series],
        "nonfinite_b": [d.nonfinite_b for d in series],
    }


def _row(d: Distances) -> dict[str, Any]:
    return {
        "numel": d.numel,
        "wasserstein": d.wasserstein,
        "max_abs": d.max_abs,
        "nonfinite_a": d.nonfinite_a,
        "nonfinite_b": d.nonfinite_b,
    }


def check_compatible(a: SnapshotStore, b: SnapshotStore) -> list[str]:
    """Check that two runs have the same parameters (names and shapes); return the names in A's order.

    Raises:
        SnapshotMismatchError: naming the first parameter that is missing from one run or whose
            shapes differ.
    """
    names_a, names_b = a.names("parameter"), b.names("parameter")
    set_a, set_b = set(names_a), set(names_b)
    for name in names_a:
        if name not in set_b:
            raise SnapshotMismatchError(
                f"parameter {name!r} of {a.run_dir} is missing from {b.run_dir}; runs compared must have the "
                "same parameter names (the same model architecture)"
            )
    for name in names_b:
        if name not in set_a:
            raise SnapshotMismatchError(
                f"parameter {name!r} of {b.run_dir} is missing from {a.run_dir}; runs compared must have the "
                "same parameter names (the same model architecture)"
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


def _distances(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], max_abs: float, bad_a: int, bad_b: int
) -> Distances:
    """Distances of the concatenations of float64 1-D pieces (``max_abs`` precomputed per piece)."""
    numel = sum(t.numel() for t in a)
    if bad_a or bad_b:
        return Distances(math.nan, math.nan, numel, bad_a, bad_b)
    if numel == 0:
        return Distances(0.0, 0.0, 0)
    flat_a = a[0] if len(a) == 1 else torch.cat(list(a))
    flat_b = b[0] if len(b) == 1 else torch.cat(list(b))
    return Distances(float(_cdf_distance_w1(flat_a, flat_b, None, None)), max_abs, numel)


def compare_pair(
    run_a: str | os.PathLike[str],
    run_b: str | os.PathLike[str],
    *,
    name: str = "a_vs_b",
    group_depth: int = 2,
    whole_model: bool = True,
    per_tensor: bool = True,
) -> PairComparison:
    """Compare the snapshots of two runs at every step both saved.

    Args:
        run_a: run directory (or snapshot directory) of run A.
        run_b: the same for run B.
        name: the comparison's name.
        group_depth: module path depth of the groups (``blocks.0`` at 2); 0 disables groups.
        whole_model: also compare all parameters as one distribution (needs a model-sized float64
            vector per run; see the module docstring).
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
    if group_depth < 0:
        raise ValueError(f"group_depth must be >= 0 (0 = no groups), got {group_depth}")
    a, b = SnapshotStore(run_a), SnapshotStore(run_b)
    names = check_compatible(a, b)
    steps = sorted(set(a.steps) & set(b.steps))
    only_a = sorted(set(a.steps) - set(b.steps))
    only_b = sorted(set(b.steps) - set(a.steps))
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
            stacklevel=2,
        )
    groups: dict[str, list[str]] = {}
    if group_depth:
        for n in names:
            groups.setdefault(group_of(n, group_depth), []).append(n)
    keep = whole_model or bool(groups)

    result = PairComparison(
        name=name,
        run_a=str(a.run_dir),
        run_b=str(b.run_dir),
        steps=steps,
        steps_only_a=only_a,
        steps_only_b=only_b,
        runs={key: _run_info(store) for key, store in (("a", a), ("b", b))},
    )
    tensors: dict[str, list[Distances]] = {n: [] for n in names}
    group_series: dict[str, list[Distances]] = {g: [] for g in groups}
    warned_nonfinite = False
    for step in steps:
        flat: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        per_step: dict[str, Distances] = {}
        for (n, ta), (_, tb) in zip(a.iter_tensors(step, names), b.iter_tensors(step, names), strict=True):
            fa, fb = ta.reshape(-1).to(torch.float64), tb.reshape(-1).to(torch.float64)
            bad_a, bad_b = _count_nonfinite(fa), _count_nonfinite(fb)
            max_abs = float((fa - fb).abs().amax()) if fa.numel() and not (bad_a or bad_b) else 0.0
            per_step[n] = _distances([fa], [fb], max_abs, bad_a, bad_b)
            if (bad_a or bad_b) and not warned_nonfinite:
                warned_nonfinite = True
                warnings.warn(
                    f"{name}: non-finite weights at step {step} in {n!r} ({bad_a} in A, {bad_b} in B); "
                    'their distances are NaN ("nan" in study.json)',
                    UserWarning,
                    stacklevel=2,
                )
            tensors[n].append(per_step[n])
            if keep:
                flat[n] = (fa, fb)
        for g, members in groups.items():
            group_series[g].append(_aggregate([flat[n] for n in members], [per_step[n] for n in members]))
        if whole_model:
            result.model.append(_aggregate([flat[n] for n in names], [per_step[n] for n in names]))
        del flat
    result.groups = group_series
    result.tensors = tensors if per_tensor else {}
    return result


def _aggregate(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]], parts: Sequence[Distances]) -> Distances:
    bad_a = sum(d.nonfinite_a for d in parts)
    bad_b = sum(d.nonfinite_b for d in parts)
    max_abs = max((d.max_abs for d in parts), default=0.0)
    return _distances([p[0] for p in pieces], [p[1] for p in pieces], max_abs, bad_a, bad_b)


def _run_info(store: SnapshotStore) -> dict[str, Any]:
    return {
        "run_id": store.run_id,
        "seed": store.seed,
        "attention": store.attention,
        "precision": store.precision,
        "steps": store.steps,
    }


def compare_runs(
    pairs: Mapping[str, tuple[str | os.PathLike[str], str | os.PathLike[str]]],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    group_depth: int = 2,
    whole_model: bool = True,
) -> Comparison:
    """Compare named pairs of runs and (with ``out_dir``) write ``study.json`` and ``study.csv``.

    Args:
        pairs: comparison name → ``(run_a, run_b)`` directories, e.g.
            ``{"flash_vs_baseline": ("runs/flash", "runs/baseline"), "seed": ("runs/baseline",
            "runs/baseline_seed1")}``.
        out_dir: where to write the outputs; ``None`` only computes.
        group_depth: module path depth of the groups (0 disables groups).
        whole_model: also compare all parameters as one distribution.

    Returns:
        The comparison; ``files`` lists what was written.

    Raises:
        ValueError: ``pairs`` is empty.
        SnapshotMismatchError: see :func:`compare_pair`.
    """
    if not pairs:
        raise ValueError("compare_runs needs at least one pair: {name: (run_a, run_b)}")
    result = Comparison(
        pairs={
            name: compare_pair(a, b, name=name, group_depth=group_depth, whole_model=whole_model)
            for name, (a, b) in pairs.items()
        },
        group_depth=group_depth,
    )
    if out_dir is not None:
        result.files += write_study(out_dir, result.as_dict(), result.rows())
    return result
