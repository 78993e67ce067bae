"""The summary over sites: the worst values of a probe's per-site statistics and the verdict, as a
:class:`~flashprobe.formats.probe_summary.ProbeSummary` (:func:`summarize`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from flashprobe.bias import BIAS_TOLERANCE, BIAS_Z_LIMIT
from flashprobe.formats.probe_summary import Failure, ProbeSummary
from flashprobe.probing.stats import GRADIENTS, PAIRS, failure_order, site_directions, worst

__all__ = ["Failure", "ProbeSummary", "add_failure_log", "bias_words", "summarize", "summary_scalars"]


def summarize(stats: Mapping[str, Any]) -> ProbeSummary:
    """The worst values over all sites of ``ShadowAttention.stats()`` (not flattened) and the verdict."""
    fwd = {s: e["forward"]["out"] for s, e in stats.items()}
    bwd = {(s, d): e["backward"][d] for s, e in stats.items() for d in GRADIENTS}
    limit_site = _argworst({s: f.get("limit_ratio") for s, f in fwd.items()})
    limit_bwd = _argworst({k: b.get("limit_ratio") for k, b in bwd.items()})
    ratio_site = _argworst({s: f["error_ratio"] for s, f in fwd.items()})
    bwd_site = _argworst({k: b["error_ratio"] for k, b in bwd.items()})
    nonfinite = {site: _nonfinite(entry) for site, entry in stats.items()}
    primary = {site: _primary_nonfinite(entry) for site, entry in stats.items()}
    forward_limit = None if limit_site is None else fwd[limit_site]["limit_ratio"]
    backward_limit = None if limit_bwd is None else bwd[limit_bwd]["limit_ratio"]
    return ProbeSummary(
        sites=len(stats),
        forward_calls=sum(e["forward"]["calls"] for e in stats.values()),
        backward_calls=sum(e["backward"]["calls"] for e in stats.values()),
        limit_ratio=worst([forward_limit, backward_limit]),
        max_limit_ratio=forward_limit,
        max_limit_ratio_site=limit_site,
        max_backward_limit_ratio=backward_limit,
        max_backward_limit_ratio_site=None if limit_bwd is None else f"{limit_bwd[0]}:{limit_bwd[1]}",
        undetermined_calls=sum(
            sum((e.get("undetermined_calls") or {}).values()) for e in (*fwd.values(), *bwd.values())
        ),
        max_error_ratio=None if ratio_site is None else fwd[ratio_site]["error_ratio"],
        max_error_ratio_site=ratio_site,
        max_call_error_ratio=worst([f["max_call_error_ratio"] for f in fwd.values()]),
        max_backward_error_ratio=None if bwd_site is None else bwd[bwd_site]["error_ratio"],
        max_backward_error_ratio_site=None if bwd_site is None else f"{bwd_site[0]}:{bwd_site[1]}",
        max_abs={
            pair: worst([f[pair]["max_abs"] if f[pair] else None for f in fwd.values()]) for pair in PAIRS
        },
        nonfinite=sum(nonfinite.values()),
        nonfinite_sites=[site for site, n in nonfinite.items() if n],
        shadow_errors=sum(e["shadow_errors"] for e in stats.values()),
        primary_nonfinite=sum(primary.values()),
        primary_nonfinite_sites=[site for site, n in primary.items() if n],
        **_bias(fwd, bwd),
        **_verdict(stats),
    )


def _bias(fwd: Mapping[str, Any], bwd: Mapping[tuple[str, str], Any]) -> dict[str, Any]:
    """The run's signed bias over sites: the largest ``|z|`` and where, and every biased direction."""
    entries = {(s, "out"): f.get("bias") for s, f in fwd.items()}
    entries.update((k, b.get("bias")) for k, b in bwd.items())
    entries = {k: e for k, e in entries.items() if e and e["replicates"]}
    if not entries:
        return {"max_bias_z": None, "max_bias_site": None, "biased": []}
    key = max(entries, key=lambda k: abs(entries[k]["z"]))
    return {
        "max_bias_z": entries[key]["z"],
        "max_bias_site": f"{key[0]}:{key[1]}",
        "biased": [
            {"site": s, "direction": d, "z": e["z"], "component": e["component"], "limit": e["limit"]}
            for (s, d), e in entries.items()
            if e["verdict"] == "biased"
        ],
    }


def add_failure_log(summary: ProbeSummary, log: Mapping[tuple[str, str], Failure]) -> ProbeSummary:
    """Write a shadow's failure log (the first failure of each site and direction, kept across resets)
    into ``summary``'s ``verdict``, ``verdict_reason`` and ``failures``: a failure before the interval
    still reads ``fail``. Returns ``summary``."""
    if not log:
        return summary
    listed = [dataclasses.replace(f) for f in sorted(log.values(), key=failure_order)]
    if summary.worst_failure is not None:
        listed.append(dataclasses.replace(summary.worst_failure, worst=True))
    if summary.verdict != "fail":  # the failure came earlier: the reason says so
        first = listed[0]
        summary.verdict_reason = (
            f"failed at step {first.step} ({first.site} {first.direction}: {first.reason}); "
            f"since the last record: {summary.verdict_reason or summary.verdict}"
        )
    summary.verdict, summary.failures = "fail", listed
    return summary


def bias_words(summary: ProbeSummary) -> str:
    """The run's signed bias in words (``"biased: out of blocks.1.attn z=-12 (limit 5)"``,
    ``"bias |z| ≤ 1.3 (limit 5)"``, ``"bias within tolerance: ..."``); ``""`` before any replicate."""
    biased = summary.biased
    if biased:
        b = max(biased, key=lambda b: abs(b["z"]))
        more = f" and {len(biased) - 1} more" if len(biased) > 1 else ""
        return f"biased: {b['direction']} of {b['site']} z={b['z']:.3g} (limit {b['limit']:g}){more}"
    z = summary.max_bias_z
    if z is None:
        return ""
    if z == 0:  # no mean exceeds the tolerance ("bias |z| ≤ 0" read as if nothing were measured)
        return f"bias within tolerance: every mean ≤ {BIAS_TOLERANCE:g} of the baseline's error RMS"
    return f"bias |z| ≤ {abs(z):.2g} (limit {BIAS_Z_LIMIT:g})"


def _verdict(stats: Mapping[str, Any]) -> dict[str, Any]:
    verdicts = {site: e.get("verdict", "undetermined") for site, e in stats.items()}
    failed = [s for s, v in verdicts.items() if v == "fail"]
    open_ = [s for s, v in verdicts.items() if v == "undetermined"]
    biased = [s for s in failed if stats[s].get("verdict_reason", "").startswith("biased")]
    if failed:
        calls = [s for s in failed if s not in biased]
        parts = [f"failed at {', '.join(calls)}"] if calls else []
        parts += [stats[s]["verdict_reason"].replace("biased: ", f"biased at {s}: ", 1) for s in biased]
        verdict, reason = "fail", "; ".join(parts)
    elif not verdicts:
        verdict, reason = "undetermined", "no site recorded"
    elif open_:
        reasons = "; ".join(f"{s}: {stats[s].get('verdict_reason', '')}" for s in open_)
        verdict, reason = "undetermined", f"not judged at {reasons}"
    else:
        verdict, reason = "pass", f"every site passed ({len(verdicts)})"
    directions = {site: site_directions(entry) for site, entry in stats.items()}
    calls = [_failing_call(s, d, e) for s, entries in directions.items() for d, e in entries.items()]
    worst_failure = max((c for c in calls if c is not None), key=lambda c: c.limit_ratio, default=None)
    failures = [
        Failure(site=s, direction=d, **e["first_failure"])
        for s, entries in directions.items()
        for d, e in entries.items()
        if e.get("first_failure")
    ]
    failures.sort(key=failure_order)
    if worst_failure is not None:
        failures.append(dataclasses.replace(worst_failure, worst=True))
    return {
        "verdict": verdict,
        "verdict_reason": reason,
        "worst_failure": worst_failure,
        "failures": failures,
    }


def _failing_call(site: str, direction: str, e: Mapping[str, Any]) -> Failure | None:
    """The worst failing call of one site and direction (None if none failed): the largest
    ``limit_ratio`` when > 1, else the first failure (non-finite ranks infinite)."""
    if e.get("verdict") != "fail":
        return None
    ratio = e.get("limit_ratio")
    first = e.get("first_failure") or {}
    where = {"site": site, "direction": direction}
    if first.get("kind") != "nonfinite" and isinstance(ratio, int | float) and ratio > 1:
        return Failure(
            **where,
            step=e.get("limit_ratio_step"),
            kind="limit_ratio",
            value=ratio,
            limit=1.0,
            limit_ratio=ratio,
            reason=f"worst call: {direction}: {ratio:.3g}x its limit (relative L2 error "
            f"{e.get('absolute_error') or 0.0:.3g} against the golden, worst row "
            f"{e.get('worst_row_error') or 0.0:.3g}, "
            f"{e.get('l2_error_ratio') or 0.0:.3g}x the baseline's)",
        )
    nonfinite = first.get("kind") == "nonfinite" or not isinstance(ratio, int | float)
    return Failure(
        **where,
        **{k: first.get(k) for k in ("step", "kind", "value", "limit")},
        limit_ratio=math.inf if nonfinite or not math.isfinite(ratio) else ratio,
        reason=f"worst call: {direction}: {first.get('reason', 'failed')}",
    )


def _primary_nonfinite(entry: Mapping[str, Any]) -> int:
    """Non-finite forward outputs of the primary at one site that its inputs and the baseline do
    not explain: with finite ``q, k, v``, ``primary_baseline``'s count less ``baseline_golden``'s."""
    inputs = entry.get("nonfinite_inputs", {})
    if any(inputs.get(i, 0) for i in ("q", "k", "v")):
        return 0
    out = entry["forward"]["out"]
    mine = out["primary_baseline"]["nonfinite"] if out.get("primary_baseline") else 0
    theirs = out["baseline_golden"]["nonfinite"] if out.get("baseline_golden") else 0
    return max(0, mine - theirs)


def _nonfinite(entry: Mapping[str, Any]) -> int:
    """Non-finite values counted at one site: its inputs and every pair of every direction."""
    pairs = (d[p]["nonfinite"] for d in site_directions(entry).values() for p in PAIRS if d[p])
    return sum(entry["nonfinite_inputs"].values()) + sum(pairs)


def _argworst(values: Mapping[Any, float | None]) -> Any:
    """The key of the worst value (as :func:`~flashprobe.probing.stats.worst`), None if all are None."""
    best = worst(list(values.values()))
    if best is None:
        return None
    return next(k for k, v in values.items() if v is best or v == best)


#: The summary's headline statistics that the training callbacks log as ``probe/<name>``.
SUMMARY_SCALARS = (
    "limit_ratio",
    "max_limit_ratio",
    "max_backward_limit_ratio",
    "undetermined_calls",
    "max_error_ratio",
    "max_call_error_ratio",
    "max_backward_error_ratio",
    "nonfinite",
    "max_bias_z",
)


def summary_scalars(summary: ProbeSummary) -> dict[str, float]:
    """The summary's finite scalars as the training callbacks log them (``probe/<statistic>``,
    ``probe/failed``, ``probe/failures``, ``probe/max_abs/<pair>``)."""
    metrics: dict[str, float] = {}
    for key in SUMMARY_SCALARS:
        value = getattr(summary, key)
        if value is not None:
            metrics[f"probe/{key}"] = float(value)
    metrics["probe/failed"] = float(summary.verdict == "fail")
    metrics["probe/failures"] = float(len(summary.first_failures))
    for pair, value in (summary.max_abs or {}).items():
        if value is not None:
            metrics[f"probe/max_abs/{pair}"] = float(value)
    return {k: v for k, v in metrics.items() if math.isfinite(v)}
