"""The probe's typed results, serialised here only: a failing call (:class:`Failure`) and the summary over
sites and intervals (:class:`ProbeSummary`), the ``summary`` of a ``probe.jsonl`` record.

:mod:`flashprobe.probing.summary` computes them; this module holds their fields and their JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, NoReturn

__all__ = ["Failure", "ProbeSummary"]


def _check_keys(cls: type, data: Mapping[str, Any], what: str) -> None:
    """Raise ValueError naming the keys of ``data`` that are not fields of ``cls`` or missing."""
    unknown = sorted(set(data) - {f.name for f in fields(cls)})
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
    problems = [f"{k} keys {', '.join(v)}" for k, v in (("unknown", unknown), ("missing", missing)) if v]
    if problems:
        raise ValueError(f"not a {what}: {'; '.join(problems)}")


def _not_a_mapping(obj: object, key: object) -> NoReturn:
    name = type(obj).__name__
    raise TypeError(f"{name} is typed: read .{key} (or .to_dict()[{key!r}]), not [{key!r}]")


@dataclass(kw_only=True)
class Failure:
    """A failing call of one site and direction.

    Attributes:
        site: the attention site.
        direction: ``out``, ``lse``, ``dq``, ``dk`` or ``dv``.
        step: the probe's step of the call (None: unknown).
        kind: the criterion that decided (:data:`flashprobe.judge.CRITERIA`, ``nonfinite``, or
            ``limit_ratio`` for the worst call by error / limit).
        value: the criterion's statistic.
        limit: its limit.
        reason: the failure in words.
        limit_ratio: ``error / limit`` of the call (> 1 fails; infinite for a non-finite value), where
            known (the worst call).
        repro: the reproducer's path, where one was saved.
        worst: True for the worst failing call where it is listed after the first failures.
    """

    site: str
    direction: str
    step: int | None
    kind: str | None
    value: float | None
    limit: float | None
    reason: str
    limit_ratio: float | None = None
    repro: str | None = None
    worst: bool = False

    __getitem__ = _not_a_mapping

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Failure:
        """A failure from its :meth:`to_dict`.

        Raises:
            ValueError: unknown or missing keys, naming them.
        """
        _check_keys(cls, data, "failure")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The failure as JSON-ready data; ``limit_ratio`` only where known, ``worst`` only where True."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.limit_ratio is None:
            del data["limit_ratio"]
        if not self.worst:
            del data["worst"]
        return data


@dataclass(kw_only=True)
class ProbeSummary:
    """The summary over sites: the verdict and the worst values; :meth:`to_dict` is the JSON of a
    ``probe.jsonl`` record's ``summary``.

    ``limit_ratio``s are ``error / limit`` (the verdict's statistic: > 1 fails); ``error_ratio``s are
    ratios of maxima against the golden (flash-attention's statistic). A site with a direction is
    ``"site:dq"``.

    Attributes:
        sites: sites with statistics in the interval.
        forward_calls: compared forward calls, over sites.
        backward_calls: compared backward calls, over sites.
        limit_ratio: the worse of ``max_limit_ratio`` and ``max_backward_limit_ratio`` (None: nothing judged).
        max_limit_ratio: the worst forward call's error / limit over sites.
        max_limit_ratio_site: its site.
        max_backward_limit_ratio: the worst gradient's error / limit over sites and dq, dk, dv.
        max_backward_limit_ratio_site: its ``"site:dir"``.
        undetermined_calls: calls too ill-conditioned or unrepresentable to judge, all directions.
        max_error_ratio: the worst forward ratio of maxima against the golden (primary's / baseline's).
        max_error_ratio_site: its site.
        max_call_error_ratio: the worst single call's forward ratio of maxima.
        max_backward_error_ratio: the worst gradient's ratio of maxima.
        max_backward_error_ratio_site: its ``"site:dir"``.
        max_abs: ``{pair: max |a - b|}`` of the forward output over sites (None: not computed).
        nonfinite: non-finite values counted: inputs and every pair of every direction.
        nonfinite_sites: the sites where any was counted.
        shadow_errors: comparisons the shadow could not run (the primary's output was kept).
        primary_nonfinite: non-finite values the primary returned from finite inputs where the
            baseline's are finite (a kernel bug).
        primary_nonfinite_sites: the sites where it did.
        max_bias_z: the run's largest signed-bias ``|z|``, with its sign (None before any replicate).
        max_bias_site: its ``"site:dir"``.
        biased: ``{site, direction, z, component, limit}`` of every direction whose ``|z|`` reached its limit.
        verdict: ``fail`` (a call failed or a site is biased, now or before), ``pass`` or ``undetermined``.
        verdict_reason: the verdict in words.
        worst_failure: the worst failing call (largest ``limit_ratio``; non-finite ranks infinite), or None.
        failures: the first failure of each site and direction, in step order, then the worst
            (``worst=True``).
        step: the probe's step counter (a callback's record: the logging step). This and the
            optional fields below are None, and left out of :meth:`to_dict`, in a summary of bare
            statistics (:func:`flashprobe.probing.summarize`).
        dropout_calls: calls with attention dropout.
        fallbacks: ``{site, requested, kernel, from_step, reason}`` where torch's SDPA computed the
            attention instead of the primary (``fallback=True``).
        notes: why values are missing, in words.
        judged: ``{site, trained, judged, gradients, from_step, reason}`` where the verdict judges
            another computation than the one that trained (attention dropout).
        stopped: why a training callback stopped training on non-finite values.
        run_nonfinite: non-finite values counted over the run (a training callback's record, from
            :class:`~flashprobe.probing.session.RunTally`; the four run fields appear together).
        run_primary_nonfinite: ``primary_nonfinite`` over the run.
        first_primary_nonfinite_step: the step where the primary's first non-finite value appeared.
        first_primary_nonfinite_sites: the sites where it appeared.
    """

    sites: int
    forward_calls: int
    backward_calls: int
    limit_ratio: float | None
    max_limit_ratio: float | None
    max_limit_ratio_site: str | None
    max_backward_limit_ratio: float | None
    max_backward_limit_ratio_site: str | None
    undetermined_calls: int
    max_error_ratio: float | None
    max_error_ratio_site: str | None
    max_call_error_ratio: float | None
    max_backward_error_ratio: float | None
    max_backward_error_ratio_site: str | None
    max_abs: dict[str, float | None]
    nonfinite: int
    nonfinite_sites: list[str]
    shadow_errors: int
    primary_nonfinite: int
    primary_nonfinite_sites: list[str]
    max_bias_z: float | None
    max_bias_site: str | None
    biased: list[dict[str, Any]]
    verdict: str
    verdict_reason: str
    worst_failure: Failure | None
    failures: list[Failure]
    step: int | None = None
    dropout_calls: int | None = None
    fallbacks: list[dict[str, Any]] | None = None
    notes: list[str] | None = None
    judged: list[dict[str, Any]] | None = None
    stopped: str | None = None
    run_nonfinite: int | None = None
    run_primary_nonfinite: int | None = None
    first_primary_nonfinite_step: int | None = None
    first_primary_nonfinite_sites: list[str] | None = None

    __getitem__ = _not_a_mapping

    @property
    def first_failures(self) -> list[Failure]:
        """The first failure of each site and direction, in step order (:attr:`failures` less the worst)."""
        return [f for f in self.failures if not f.worst]

    @classmethod
    def from_dict(cls, summary: Mapping[str, Any]) -> ProbeSummary:
        """A summary from its :meth:`to_dict` (e.g. a ``probe.jsonl`` record's ``summary``).

        Raises:
            ValueError: unknown or missing keys, naming them.
        """
        _check_keys(cls, summary, "probe summary")
        data = dict(summary)
        worst = data["worst_failure"]
        data["worst_failure"] = None if worst is None else Failure.from_dict(worst)
        data["failures"] = [Failure.from_dict(f) for f in data["failures"]]
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON-ready data: every field in order, less the optional ones that are None
        and the run's four outside a training callback."""
        run = self.run_nonfinite is not None
        values = {f.name: getattr(self, f.name) for f in fields(self) if run or f.name not in _RUN_FIELDS}
        values = {k: v for k, v in values.items() if v is not None or k not in _OPTIONAL_FIELDS}
        values["worst_failure"] = None if self.worst_failure is None else self.worst_failure.to_dict()
        values["failures"] = [f.to_dict() for f in self.failures]
        return values


#: Fields a summary has only where someone set them (None: left out of ``to_dict``).
_OPTIONAL_FIELDS = frozenset({"step", "dropout_calls", "fallbacks", "notes", "judged", "stopped"})
#: The run's fields (:class:`~flashprobe.probing.session.RunTally`): all or none.
_RUN_FIELDS = frozenset(f.name for f in fields(ProbeSummary) if f.name.startswith(("run_", "first_")))
