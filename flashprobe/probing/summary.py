"""The summary over sites: the worst values of a probe's per-site statistics, in one dict.

:func:`summarize` reads what :meth:`ShadowAttention.stats <flashprobe.probing.ShadowAttention.stats>`
returns (plain Python data, already on the host) and reports the worst error ratios and the sites
they occurred at, the worst ``max_abs`` per pair, call counts, every non-finite value counted, and
the verdict over sites (``verdict``, ``verdict_reason``, ``worst_failure``).
It is what :meth:`ShadowAttention.summary <flashprobe.probing.ShadowAttention.summary>` and
:meth:`Probe.summary <flashprobe.probing.Probe.summary>` return.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flashprobe.bias import BIAS_Z_LIMIT
from flashprobe.probing.stats import GRADIENTS, PAIRS, worst

_ORDER = ("out", "dq", "dk", "dv")  # failures sort by step, site, then this

__all__ = ["bias_words", "summarize", "summary_scalars"]


def summarize(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Worst values over all sites, as plain Python data.

    Args:
        stats: per-site statistics, ``{site: entry}`` as returned by ``ShadowAttention.stats()``
            (not flattened).

    Returns:
        ``sites``, ``forward_calls``, ``backward_calls``; ``limit_ratio``, the worse of
        ``max_limit_ratio`` (forward) and
        ``max_limit_ratio_site``, ``max_backward_limit_ratio`` and its site (``"site:dq"``): the
        verdict's statistic (:data:`flashprobe.judge.SCORE`: the worst call's statistic / limit over
        the criteria, > 1 fails), shown first; ``undetermined_calls`` (ill-conditioned or
        unrepresentable, all directions); the ratio of maxima against the golden (flash-attention's
        statistic, not the verdict's): ``max_error_ratio`` (forward) and ``max_error_ratio_site``,
        ``max_call_error_ratio``, ``max_backward_error_ratio`` and its site; ``max_abs`` per pair
        (forward), ``nonfinite`` (all pairs,
        directions and inputs), ``nonfinite_sites``, ``shadow_errors``,
        ``primary_nonfinite_sites``: the sites where the **primary** returned non-finite values
        from finite inputs where the baseline did not (a kernel bug, not the data), with
        ``primary_nonfinite`` the number of such values; the run's signed bias
        (:mod:`flashprobe.bias`): ``max_bias_z`` (the largest ``|z|``, with its sign) and
        ``max_bias_site`` (``"site:dir"``), ``biased`` (``{site, direction, z, component, limit}``
        of every direction whose ``|z|`` reached its limit); ``verdict``: ``fail`` when a site
        failed (a call failed, or it is biased), ``pass`` when every site passed, else
        ``undetermined`` (no site, or a site with nothing judged), with ``verdict_reason``;
        ``worst_failure``: the worst failing call, ``{site, direction, step, kind, value, limit,
        limit_ratio, reason}``: the largest ``limit_ratio`` over failing directions, where a direction
        that failed without a ratio above its limit (a non-finite output) gives its failing call,
        ranked infinite; None when nothing failed;
        ``failures``: the first failure of each site and direction, in step order, then the worst
        (``"worst": True``).
    """
    fwd = {s: e["forward"]["out"] for s, e in stats.items()}
    bwd = {(s, d): e["backward"][d] for s, e in stats.items() for d in GRADIENTS}
    limit_site = _argworst({s: f.get("limit_ratio") for s, f in fwd.items()})
    limit_bwd = _argworst({k: b.get("limit_ratio") for k, b in bwd.items()})
    ratio_site = _argworst({s: f["error_ratio"] for s, f in fwd.items()})
    bwd_site = _argworst({k: b["error_ratio"] for k, b in bwd.items()})
    nonfinite = {site: _nonfinite(entry) for site, entry in stats.items()}
    primary = {site: _primary_nonfinite(entry) for site, entry in stats.items()}
    return {
        "sites": len(stats),
        "forward_calls": sum(e["forward"]["calls"] for e in stats.values()),
        "backward_calls": sum(e["backward"]["calls"] for e in stats.values()),
        "limit_ratio": worst(
            [
                None if limit_site is None else fwd[limit_site]["limit_ratio"],
                None if limit_bwd is None else bwd[limit_bwd]["limit_ratio"],
            ]
        ),
        "max_limit_ratio": None if limit_site is None else fwd[limit_site]["limit_ratio"],
        "max_limit_ratio_site": limit_site,
        "max_backward_limit_ratio": None if limit_bwd is None else bwd[limit_bwd]["limit_ratio"],
        "max_backward_limit_ratio_site": None if limit_bwd is None else f"{limit_bwd[0]}:{limit_bwd[1]}",
        "undetermined_calls": sum(
            sum((e.get("undetermined_calls") or {}).values()) for e in (*fwd.values(), *bwd.values())
        ),
        "max_error_ratio": None if ratio_site is None else fwd[ratio_site]["error_ratio"],
        "max_error_ratio_site": ratio_site,
        "max_call_error_ratio": worst([f["max_call_error_ratio"] for f in fwd.values()]),
        "max_backward_error_ratio": None if bwd_site is None else bwd[bwd_site]["error_ratio"],
        "max_backward_error_ratio_site": None if bwd_site is None else f"{bwd_site[0]}:{bwd_site[1]}",
        "max_abs": {
            pair: worst([f[pair]["max_abs"] if f[pair] else None for f in fwd.values()]) for pair in PAIRS
        },
        "nonfinite": sum(nonfinite.values()),
        "nonfinite_sites": [site for site, n in nonfinite.items() if n],
        "shadow_errors": sum(e["shadow_errors"] for e in stats.values()),
        "primary_nonfinite": sum(primary.values()),
        "primary_nonfinite_sites": [site for site, n in primary.items() if n],
        **_bias(fwd, bwd),
        **_verdict(stats),
    }


def _bias(fwd: Mapping[str, Any], bwd: Mapping[tuple[str, str], Any]) -> dict[str, Any]:
    """The run's signed bias over sites: the largest ``|z|`` (with its sign) and where, and every
    biased site and direction (:mod:`flashprobe.bias`)."""
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


def bias_words(summary: Mapping[str, Any]) -> str:
    """The run's signed bias in words, for a verdict line or a figure title: the most biased
    direction (``"biased: out of blocks.1.attn z=-12 (limit 5)"``), else the largest ``|z|``
    (``"bias |z| ≤ 1.3 (limit 5)"``); ``""`` before any replicate."""
    biased = summary.get("biased") or []
    if biased:
        b = max(biased, key=lambda b: abs(b["z"]))
        more = f" and {len(biased) - 1} more" if len(biased) > 1 else ""
        return f"biased: {b['direction']} of {b['site']} z={b['z']:.3g} (limit {b['limit']:g}){more}"
    z = summary.get("max_bias_z")
    return "" if z is None else f"bias |z| ≤ {abs(z):.2g} (limit {BIAS_Z_LIMIT:g})"


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
    candidates = [
        _failing_call(site, d, entry["forward"]["out"] if d == "out" else entry["backward"][d])
        for site, entry in stats.items()
        for d in ("out", *GRADIENTS)
    ]
    candidates = [c for c in candidates if c is not None]
    worst_failure = max(candidates, key=lambda c: c["limit_ratio"], default=None)
    failures = [
        {"site": site, "direction": d, **e["first_failure"]}
        for site, entry in stats.items()
        for d, e in (("out", entry["forward"]["out"]), *((g, entry["backward"][g]) for g in GRADIENTS))
        if e.get("first_failure")
    ]
    failures.sort(key=lambda f: (f["step"], f["site"], _ORDER.index(f["direction"])))
    if worst_failure is not None:
        failures.append({**worst_failure, "worst": True})
    return {
        "verdict": verdict,
        "verdict_reason": reason,
        "worst_failure": worst_failure,
        "failures": failures,
    }


def _failing_call(site: str, direction: str, e: Mapping[str, Any]) -> dict[str, Any] | None:
    """The worst failing call of one site and direction in the interval, or None if none failed: the
    call with the largest ``limit_ratio`` when that is a failure (> 1), else the first failure itself
    (a non-finite output, whose ratio is not a number, ranks as infinite)."""
    if e.get("verdict") != "fail":
        return None
    ratio = e.get("limit_ratio")
    first = e.get("first_failure") or {}
    if first.get("kind") != "nonfinite" and isinstance(ratio, int | float) and ratio > 1:
        return {
            "site": site,
            "direction": direction,
            "step": e.get("limit_ratio_step"),
            "kind": "limit_ratio",
            "value": ratio,
            "limit": 1.0,
            "limit_ratio": ratio,
            "reason": f"worst call: {direction}: {ratio:.3g}x its limit (relative L2 error "
            f"{e.get('absolute_error') or 0.0:.3g} against the golden, worst row "
            f"{e.get('worst_row_error') or 0.0:.3g}, "
            f"{e.get('l2_error_ratio') or 0.0:.3g}x the baseline's)",
        }
    nonfinite = first.get("kind") == "nonfinite" or not isinstance(ratio, int | float)
    return {
        "site": site,
        "direction": direction,
        "step": first.get("step"),
        "kind": first.get("kind"),
        "value": first.get("value"),
        "limit": first.get("limit"),
        "limit_ratio": math.inf if nonfinite or not math.isfinite(ratio) else ratio,
        "reason": f"worst call: {direction}: {first.get('reason', 'failed')}",
    }


def _primary_nonfinite(entry: Mapping[str, Any]) -> int:
    """Non-finite forward outputs of the primary at one site that its inputs and the baseline explain not.

    ``primary_baseline.nonfinite`` counts positions where either output is non-finite and
    ``baseline_golden.nonfinite`` those of the baseline (or golden); with finite ``q``, ``k``, ``v``
    the excess is the primary's own.
    """
    inputs = entry.get("nonfinite_inputs", {})
    if any(inputs.get(i, 0) for i in ("q", "k", "v")):
        return 0
    out = entry["forward"]["out"]
    mine = out["primary_baseline"]["nonfinite"] if out.get("primary_baseline") else 0
    theirs = out["baseline_golden"]["nonfinite"] if out.get("baseline_golden") else 0
    return max(0, mine - theirs)


def _nonfinite(entry: Mapping[str, Any]) -> int:
    """Non-finite values counted at one site: its inputs and every pair of every direction."""
    n = sum(entry["nonfinite_inputs"].values())
    for d in (entry["forward"]["out"], *(entry["backward"][g] for g in GRADIENTS)):
        n += sum(d[p]["nonfinite"] for p in PAIRS if d[p])
    return n


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


def summary_scalars(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's finite scalars as the training callbacks log them: ``probe/<statistic>``,
    ``probe/failed`` (0/1), ``probe/failures`` (first failures seen) and ``probe/max_abs/<pair>``."""
    metrics: dict[str, float] = {}
    for key in SUMMARY_SCALARS:
        value = summary.get(key)
        if value is not None:
            metrics[f"probe/{key}"] = float(value)
    metrics["probe/failed"] = float(summary.get("verdict") == "fail")
    metrics["probe/failures"] = float(sum(not f.get("worst") for f in summary.get("failures", [])))
    for pair, value in (summary.get("max_abs") or {}).items():
        if value is not None:
            metrics[f"probe/max_abs/{pair}"] = float(value)
    return {k: v for k, v in metrics.items() if math.isfinite(v)}
