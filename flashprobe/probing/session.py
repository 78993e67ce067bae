"""What a training run's probe has seen so far, and the verdict it prints, for the training callbacks
and ``flashprobe report RUN_DIR``.

A probe's statistics are reset at every logging step; :class:`RunTally` carries across intervals
what the run's answer needs (the worst failing call, the non-finite counts, each site and direction's
verdict and worst ``limit_ratio``) and writes it into each summary, so every ``probe.jsonl`` record
agrees with the run's verdict. :func:`verdict_block` and :func:`verdict_line` format the answer;
:func:`nonfinite_weights`, :func:`attention_dropout` and :func:`check_trainable` are the checks the
callbacks run. This module imports no training framework.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashprobe.kernels import KernelUnsupportedError
from flashprobe.probing.routing import model_device_dtype
from flashprobe.probing.stats import site_directions
from flashprobe.probing.summary import Failure, ProbeSummary, bias_words

__all__ = [
    "NONFINITE_ACTIONS",
    "RunTally",
    "SiteVerdict",
    "attention_dropout",
    "attention_record",
    "check_trainable",
    "nonfinite_weights",
    "verdict_block",
    "verdict_line",
]

#: What a training callback does when the weights or the primary's output become non-finite.
NONFINITE_ACTIONS = ("stop", "continue")

_RANK = {"fail": 2, "pass": 1, "undetermined": 0}


def failure_rank(failure: Failure) -> float:
    """How bad a failing call is: its ``limit_ratio`` (else ``value``; non-finite ranks infinite)."""
    value = failure.value if failure.limit_ratio is None else failure.limit_ratio
    if value is None or math.isnan(value):
        return math.inf
    return float(value)


@dataclass(frozen=True)
class SiteVerdict:
    """The run's verdict at one site and direction (a row of the verdict block).

    Attributes:
        site: the attention site.
        direction: ``out``, ``lse``, ``dq``, ``dk`` or ``dv``.
        verdict: ``pass``, ``fail`` or ``undetermined``.
        statistic: the criterion that failed the first failing call, else ``"error/limit"``.
        value: its value (for ``error/limit``: the worst call's, > 1 fails).
        limit: its limit.
        step: the step of the first failing call (None: none failed).
        repro: the first failing call's reproducer, where one was saved.
    """

    site: str
    direction: str
    verdict: str
    statistic: str
    value: float | None
    limit: float | None
    step: int | None = None
    repro: str | None = None


class RunTally:
    """The run's answer so far, carried across the probe's logging intervals.

    Attributes:
        worst: the worst failing call of the run, or None.
        nonfinite: non-finite values counted over the run (inputs, every pair and direction).
        primary_nonfinite: non-finite values the primary returned from finite inputs over the run.
        first_primary_nonfinite: ``{"step", "sites"}`` of the record where the primary's first
            appeared, or None.
        sites: ``{site: {direction: {"verdict", "limit_ratio", "calls"}}}``: the run's verdict and
            worst ``limit_ratio`` per site and direction.
    """

    def __init__(self) -> None:
        self.worst: Failure | None = None
        self.nonfinite = 0
        self.primary_nonfinite = 0
        self.first_primary_nonfinite: dict[str, Any] | None = None
        self.sites: dict[str, dict[str, dict[str, Any]]] = {}

    def add(self, summary: ProbeSummary, stats: Mapping[str, Any]) -> ProbeSummary:
        """Add one interval and write the run's values into ``summary`` (``worst_failure``, the last
        of ``failures`` and the four run fields); returns ``summary``."""
        new = summary.worst_failure
        if new is not None and (self.worst is None or failure_rank(new) > failure_rank(self.worst)):
            self.worst = dataclasses.replace(new, worst=False)
        if self.worst is not None:
            worst = dataclasses.replace(self.worst, worst=True)
            summary.failures = [*summary.first_failures, worst]
            summary.worst_failure = dataclasses.replace(self.worst)
        self.nonfinite += summary.nonfinite
        primary = summary.primary_nonfinite
        if primary and self.first_primary_nonfinite is None:
            sites = list(summary.primary_nonfinite_sites)
            # the step of the call (a failure's), else the record's (the step after it)
            steps = [f.step for f in summary.first_failures if f.kind == "nonfinite" and f.site in sites]
            self.first_primary_nonfinite = {"step": min(steps, default=summary.step), "sites": sites}
        self.primary_nonfinite += primary
        summary.run_nonfinite = self.nonfinite
        summary.run_primary_nonfinite = self.primary_nonfinite
        first = self.first_primary_nonfinite or {}
        summary.first_primary_nonfinite_step = first.get("step")
        summary.first_primary_nonfinite_sites = list(first.get("sites") or [])
        for site, entry in stats.items():
            for d, e in site_directions(entry).items():
                calls = e["calls"] if d == "lse" else entry["forward" if d == "out" else "backward"]["calls"]
                if not calls:
                    continue
                row = self.sites.setdefault(site, {}).setdefault(
                    d, {"verdict": "undetermined", "limit_ratio": None, "calls": 0}
                )
                row["calls"] += int(calls)
                verdict = e.get("verdict") or "undetermined"
                if _RANK[verdict] > _RANK[row["verdict"]]:
                    row["verdict"] = verdict
                ratio = e.get("limit_ratio")
                if isinstance(ratio, int | float) and math.isfinite(ratio):
                    row["limit_ratio"] = (
                        ratio if row["limit_ratio"] is None else max(row["limit_ratio"], ratio)
                    )
        return summary

    def rows(self, failures: Iterable[Failure] = ()) -> list[SiteVerdict]:
        """One row per site and direction, failing ones first; a site and direction in ``failures``
        (a summary's) fails, with its first failure's criterion."""
        firsts = {(f.site, f.direction): f for f in failures if not f.worst}
        rows = []
        keys = [(s, d) for s, ds in self.sites.items() for d in ds]
        keys += [k for k in firsts if k not in set(keys)]
        for site, d in keys:
            row = self.sites.get(site, {}).get(d, {"verdict": "undetermined", "limit_ratio": None})
            f = firsts.get((site, d))
            if f is not None:
                rows.append(SiteVerdict(site, d, "fail", f.kind or "-", f.value, f.limit, f.step, f.repro))
            else:
                rows.append(SiteVerdict(site, d, row["verdict"], "error/limit", row["limit_ratio"], 1.0))
        rows.sort(key=lambda r: r.verdict != "fail")  # failing rows first, otherwise in site order
        return rows

    def state_dict(self) -> dict[str, Any]:
        """The tally as plain data (for a checkpoint)."""
        return {
            "worst": None if self.worst is None else self.worst.to_dict(),
            "nonfinite": self.nonfinite,
            "primary_nonfinite": self.primary_nonfinite,
            "first_primary_nonfinite": self.first_primary_nonfinite,
            "sites": self.sites,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (missing keys: a fresh tally's values)."""
        worst = state.get("worst")
        self.worst = None if worst is None else Failure.from_dict(worst)
        self.nonfinite = int(state.get("nonfinite", 0))
        self.primary_nonfinite = int(state.get("primary_nonfinite", 0))
        self.first_primary_nonfinite = state.get("first_primary_nonfinite")
        self.sites = {s: {d: dict(r) for d, r in ds.items()} for s, ds in (state.get("sites") or {}).items()}


def _g(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def verdict_block(
    summary: ProbeSummary,
    rows: Sequence[SiteVerdict],
    *,
    who: str = "flashprobe",
    path: str | Path | None = None,
    max_rows: int = 12,
    stopped: str | None = None,
) -> str:
    """The run's answer as text (no trailing newline): the verdict line, a per-site table of
    :meth:`RunTally.rows` (at most ``max_rows``), the reproducers and where the records are.

    Args:
        summary: the run's last summary (through a :class:`RunTally`).
        rows: :meth:`RunTally.rows`.
        who: the name the block starts with.
        path: the run's ``probe.jsonl``.
        max_rows: rows shown at most (the rest are counted).
        stopped: why training was stopped, if it was.
    """
    verdict = summary.verdict.upper()
    lines = [f"{who}: verdict {verdict}: {summary.verdict_reason}".rstrip(": ")]
    primary_nf = summary.run_primary_nonfinite or 0
    if primary_nf:
        sites = ", ".join(summary.first_primary_nonfinite_sites or [])
        lines.append(
            f"  the primary returned {primary_nf} non-finite values from finite inputs, first at step "
            f"{summary.first_primary_nonfinite_step} ({sites})"
        )
    bias = bias_words(summary)
    if bias:
        lines.append(f"  {bias}")
    if stopped:
        lines.append(f"  training stopped: {stopped}")
    if rows:
        shown = list(rows[:max_rows])
        columns = ("site", "direction", "verdict", "statistic", "value", "limit", "step")
        table = [("site", "dir", *columns[2:])]
        table += [tuple(_g(getattr(r, c)) for c in columns) for r in shown]
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if len(rows) > len(shown):
            lines.append(f"  ... {len(rows) - len(shown)} more rows (every row: flashprobe report RUN_DIR)")
        lines.append(
            "  error/limit: the verdict's statistic, the worst call's error over its limit (> 1 fails)"
        )
    repros = list(dict.fromkeys(str(r.repro) for r in rows if r.repro))
    for repro in repros:
        lines.append(f"  reproducer: {repro} (flashprobe replay {repro})")
    for note in summary.fallbacks or []:
        lines.append(f"  fallback: {note['reason']}")
    for note in summary.judged or []:
        lines.append(f"  judged: {note['reason']}")
    if path is not None:
        lines.append(f"  records: {path}")
    return "\n".join(lines)


def verdict_line(summary: ProbeSummary, path: Path | None = None, *, who: str = "AttentionProbe") -> str:
    """The run's verdict in one line: verdict, the first failure or the worst error / limit, the bias
    and where the records are."""
    verdict = summary.verdict.upper()
    firsts = summary.first_failures
    if firsts:
        f = firsts[0]
        detail = f"first failure at {f.site} {f.direction}, step {f.step}: {f.reason}" + (
            f"; reproducer {f.repro}" if f.repro else ""
        )
    else:
        ratio = summary.max_limit_ratio
        at = f"{ratio:.3g} at {summary.max_limit_ratio_site}" if ratio is not None else "n/a"
        back = summary.max_backward_limit_ratio
        if back is not None:
            at += f", backward {back:.3g} at {summary.max_backward_limit_ratio_site}"
        detail = f"{summary.sites} sites, worst error / limit {at} (> 1 fails)"
    bias = bias_words(summary)
    detail += f"; {bias}" if bias else ""
    where = f" ({path})" if path is not None else ""
    return f"{who}: verdict {verdict}: {detail}{where}"


def nonfinite_weights(module: nn.Module) -> str | None:
    """The first parameter of ``module`` holding NaN or infinity, in words (``"12 of 96 values of the
    weight proj.weight"``), or None (one host synchronisation)."""
    params = [(n, p.detach()) for n, p in module.named_parameters()]
    if not params:
        return None
    if bool(torch.stack([torch.isfinite(p).all() for _, p in params]).all()):
        return None
    for name, p in params:
        count = int((~torch.isfinite(p)).sum())
        if count:
            return f"{count} of {p.numel()} values of the weight {name}"
    return None  # pragma: no cover (the stack said otherwise)


def attention_record(
    requested: str | None, fallbacks: Sequence[Mapping[str, Any]], sites: Iterable[str], own: str
) -> dict[str, Any]:
    """What computed a run's attention, for its records (the snapshot manifest, ``run.json``).

    Args:
        requested: the primary kernel spec the run asked for (None: the model's own attention).
        fallbacks: the probe's :attr:`~flashprobe.probing.Probe.fallbacks`.
        sites: every attention site the probe saw.
        own: the model's own attention in words (``"own sdpa on cpu"``).

    Returns:
        ``{"attention": ...}``: ``requested`` when it ran every call, ``own`` when every site fell
        back, else both named; with ``"attention_fallback"`` when anything fell back.
    """
    if requested is None:
        return {"attention": own}
    if not fallbacks:
        return {"attention": requested}
    fell = [str(f["site"]) for f in fallbacks]
    every = set(fell) >= set(sites)
    attention = own if every else f"{requested}, and {own} at {', '.join(fell)} (fallback)"
    return {
        "attention": attention,
        "attention_fallback": {
            "requested": requested,
            "kernel": str(fallbacks[0].get("kernel", "torch sdpa")),
            "sites": fell,
            "every_site": every,
            "from_step": min(int(f["from_step"]) for f in fallbacks),
            "reason": str(fallbacks[0]["reason"]),
        },
    }


#: transformers config fields that hold the attention dropout probability.
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def attention_dropout(model: nn.Module) -> dict[str, float]:
    """The attention dropout ``model`` is configured with, before it runs: ``{where: p}`` with
    ``p > 0`` for every ``nn.MultiheadAttention`` (by module path) and transformers config
    (``"<path> config.attn_pdrop"``)."""
    found: dict[str, float] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            found[name or type(model).__name__] = float(module.dropout)
        config = getattr(module, "config", None)
        for key in _DROPOUT_FIELDS:
            value = getattr(config, key, None)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                found[f"{name or type(model).__name__} config.{key}"] = float(value)
    return found


def check_trainable(primary: Any, model: nn.Module, who: str, *, fallback: bool = False) -> None:
    """Refuse, when training begins, a primary the model cannot train through: one without a backward
    on the model's device, or any primary for a model configured with attention dropout
    (:func:`attention_dropout`) unless ``fallback``.

    Args:
        primary: the probe's primary :class:`~flashprobe.kernels.Kernel` (None: the model's own).
        model: the model being trained (a model with no trainable parameter needs no backward).
        who: the callback's name, for the message.

    Raises:
        KernelUnsupportedError: naming the kernel, the device or the dropout, and the fixes.
    """
    if primary is None:
        return
    dropout = {} if fallback else attention_dropout(model)
    if dropout:
        from flashprobe.probing.shadow import dropout_refusal

        where, p = next(iter(dropout.items()))
        more = f" (and {len(dropout) - 1} more: {', '.join(list(dropout)[1:4])})" if len(dropout) > 1 else ""
        raise KernelUnsupportedError(
            f"{who}: " + dropout_refusal(where + more, p, primary.spec).removeprefix("flashprobe: ")
        )
    if not any(p.requires_grad for p in model.parameters()):
        return
    device, _ = model_device_dtype(model)
    if primary.capabilities.has_backward(device):
        return
    raise KernelUnsupportedError(
        f"{who}: the model trains through the primary {primary.spec!r}, which has no backward on "
        f"{device.type}: training would fail in its first backward pass. Train on a device where it has "
        "one (e.g. a GPU), choose a primary with a backward there (`flashprobe kernels` lists them), or "
        "judge its forward alone: flashprobe.probing.probe(model, primary=..., backward=False) under "
        "torch.no_grad(), or `flashprobe fuzz`"
    )
