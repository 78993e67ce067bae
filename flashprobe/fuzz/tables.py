"""How fuzz results are shown: the terminal grid and Markdown table of verdicts, the catalogue
(``--list``), the skip reasons, the axes and properties covered, and the seconds per case.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from flashprobe.fuzz.cases import CATALOGUE, PROPERTIES, select_cases
from flashprobe.fuzz.rule import VERDICTS
from flashprobe.fuzz.run import FuzzResult

__all__ = [
    "case_seconds",
    "catalogue_table",
    "coverage",
    "coverage_lines",
    "markdown_table",
    "property_coverage",
    "property_lines",
    "property_markdown",
    "reason_lines",
    "summary_counts",
    "terminal_table",
]

_CELL = {
    "pass": "pass",
    "fail": "FAIL",
    "known": "known",
    "skip": "skip",
    "quarantined": "quar",
    "unsupported": "unsup",
    "no_backward": "nobwd",
    "not_declared": "NDECL",
}
_RAN = ("pass", "fail", "no_backward", "not_declared")
#: which verdict a cell shows when several seeds gave different ones: the worst
_WORST = ("fail", "not_declared", "known", "no_backward", "pass", "skip", "quarantined", "unsupported")


def _shown(r: FuzzResult) -> str:
    """The row's verdict as a cell shows it: a failure the ledger accepts is ``known``, a call it
    quarantined ``quarantined``."""
    if r.known:
        if r.verdict in ("fail", "not_declared"):
            return "known"
        return "quarantined" if r.verdict == "skip" else r.verdict
    return r.verdict


def _worst(cells: dict, key: tuple, verdict: str) -> None:
    """Keep the worst verdict of ``key`` in ``cells`` (several seeds share one cell)."""
    old = cells.get(key)
    if old is None or _WORST.index(verdict) < _WORST.index(old):
        cells[key] = verdict


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


def terminal_table(results: Sequence[FuzzResult]) -> str:
    """One block per dtype: a row per case, a column per kernel, a verdict per cell (the worst
    over seeds)."""
    kernels = _unique(r.kernel for r in results)
    widths = [max(len(k), 5) for k in kernels]
    lines: list[str] = []
    for dtype in _unique(r.dtype for r in results):
        rows = [r for r in results if r.dtype == dtype]
        cases = _unique(r.case for r in rows)
        width = max(len(c) for c in [*cases, dtype])
        worst: dict[tuple[str, str], str] = {}
        for r in rows:
            _worst(worst, (r.case, r.kernel), _shown(r))
        cell = {key: _CELL[v] for key, v in worst.items()}
        lines.append(
            "  ".join([f"{dtype:<{width}}", *(f"{k:<{w}}" for k, w in zip(kernels, widths, strict=True))])
        )
        for case in cases:
            cells = (f"{cell.get((case, k), '-'):<{w}}" for k, w in zip(kernels, widths, strict=True))
            lines.append("  ".join([f"{case:<{width}}", *cells]).rstrip())
        lines.append("")
    return "\n".join(lines)


def markdown_table(results: Sequence[FuzzResult]) -> str:
    """A Markdown table: a row per case, a column per kernel, each cell the verdicts per dtype (the
    worst over seeds and layouts; a failure among several shows how many failed: ``**FAIL** 2/20``)."""
    kernels = _unique(r.kernel for r in results)
    dtypes = _unique(r.dtype for r in results)
    verdict: dict[tuple[str, str, str], str] = {}
    runs: dict[tuple[str, str, str], list[str]] = {}
    for r in results:
        _worst(verdict, (r.case, r.kernel, r.dtype), _shown(r))
        runs.setdefault((r.case, r.kernel, r.dtype), []).append(_shown(r))
    mark = {**_CELL, "fail": "**FAIL**"}

    def cell(key: tuple[str, str, str]) -> str:
        text = mark.get(verdict.get(key, ""), "-")
        seen = runs.get(key, [])
        if len(seen) > 1 and verdict.get(key) in ("fail", "known"):
            text += f" {seen.count(verdict[key])}/{len(seen)}"
        return text

    lines = [
        f"| case ({' / '.join(dtypes)}) | " + " | ".join(f"`{k}`" for k in kernels) + " |",
        "| --- |" + " --- |" * len(kernels),
    ]
    for case in _unique(r.case for r in results):
        cells = [" / ".join(cell((case, k, d)) for d in dtypes) for k in kernels]
        lines.append(f"| `{case}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def catalogue_table() -> str:
    """The catalogue as a Markdown table: case, what it probes, what the golden expects, whether its
    gradients are checked and its profiles."""
    lines = [
        "| case | property | what it probes | expected (FP64 golden) | gradients | profile |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| `{c.name}` | {', '.join(c.properties)} | {c.probes} | {c.expected} | "
        f"{'yes' if c.backward else 'no'} | {'default' if 'default' in c.profiles else 'full'} |"
        for c in select_cases(profile="full")
    ]
    return "\n".join(lines)


def coverage(results: Sequence[FuzzResult]) -> dict[str, list[int | str]]:
    """Axis → the sorted distinct values the rows a kernel ran on exercised: those of
    :meth:`CaseInputs.axes`, ``dtype`` and ``gradients`` (``checked`` or ``forward only``)."""
    ran = [r for r in results if r.verdict in _RAN and r.axes]
    axes: dict[str, set[int | str]] = {}
    for r in ran:
        for axis, value in r.axes.items():
            axes.setdefault(axis, set()).add(value)
        axes.setdefault("dtype", set()).add(r.dtype)
        if r.backward not in (None, "no_backward"):  # judged: pass or fail
            axes.setdefault("gradients", set()).add("checked")
        elif r.verdict in ("pass", "no_backward"):  # the output passed; its gradients not asked for, or none
            axes.setdefault("gradients", set()).add("forward only")
    return {axis: sorted(values, key=lambda x: (isinstance(x, str), x)) for axis, values in axes.items()}


def coverage_lines(cover: dict[str, list[int | str]]) -> list[str]:
    """One line per axis: ``n_k: 1, 45, 203, 8192 (4 values)``."""
    return [f"{axis}: {_names([str(v) for v in values], 16)}" for axis, values in cover.items()]


def summary_counts(results: Sequence[FuzzResult]) -> dict[str, int]:
    """How many results got each verdict, for every verdict; ``fail`` counts the failures no ledger
    entry accepts, ``known`` those one does (:mod:`flashprobe.fuzz.ledger`)."""
    counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
    counts["known"] = sum(r.verdict == "fail" and bool(r.known) for r in results)
    counts["fail"] -= counts["known"]
    return counts


def _names(values: Sequence[str], limit: int = 4) -> str:
    """``a, b, c, d (+3 more)``."""
    more = f" (+{len(values) - limit} more)" if len(values) > limit else ""
    return ", ".join(values[:limit]) + more


def reason_lines(
    results: Sequence[FuzzResult], verdicts: Sequence[str] = ("skip", "unsupported")
) -> list[str]:
    """One line per distinct (verdict, reason) among ``verdicts``, most frequent first, e.g.
    ``SKIP  ×2  sentinel_1e5 | fp16 | tiled, math: <reason>``; a kernel's own name in a reason reads
    ``<kernel>``, so kernels that fail the same way share one line."""
    groups: dict[tuple[str, str], list[FuzzResult]] = {}
    for r in results:
        if r.verdict in verdicts:
            groups.setdefault((r.verdict, _generic_reason(r)), []).append(r)
    lines = []
    for (verdict, reason), rows in sorted(groups.items(), key=lambda item: -len(item[1])):
        where = " | ".join(
            _names(_unique(getattr(r, field) for r in rows), limit)
            for field, limit in (("case", 4), ("dtype", 4), ("kernel", 8))
        )
        lines.append(f"{_CELL[verdict].upper():<5} ×{len(rows):<3} {where}: {reason}")
    return lines


def _generic_reason(result: FuzzResult) -> str:
    """The reason with the kernel's own name (``tiled: ...``, as kernels' errors begin) as ``<kernel>``."""
    name = re.escape(result.kernel.partition(":")[0])
    return re.sub(rf"(?<![\w:=]){name}(?=: )", "<kernel>", result.reason)


_NOT_APPLICABLE = "not applicable to this kernel: "


def property_coverage(
    results: Sequence[FuzzResult], contract_cases: Sequence[str] = ()
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per kernel, each property the run's cases test: ``tested`` (a case of it ran at some dtype),
    or ``not applicable``, ``unsupported`` or ``skipped`` with the first reason.

    Args:
        contract_cases: the contract cases the run selected: their properties are reported for
            every kernel of a contract api, posed to it or not.

    Returns:
        ``{kernel: {property: {"status", "cases" (those that ran), "reason" ("" when tested)}}}``.
    """
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for kernel in _unique(r.kernel for r in results):
        rows = [r for r in results if r.kernel == kernel and r.params is None]
        by_property: dict[str, list[FuzzResult]] = {}
        for r in rows:
            # a catalogue case's properties; a sequence's or an invariant's own; none: custom cases
            props = (
                CATALOGUE[r.case].properties if r.case in CATALOGUE else (r.property,) if r.property else ()
            )
            for prop in props:
                lost = r.lost.get(prop)  # the fitted call no longer has it: not applicable, with why
                row = r if lost is None else replace(r, verdict="unsupported", reason=_NOT_APPLICABLE + lost)
                by_property.setdefault(prop, []).append(row)
        entry: dict[str, dict[str, Any]] = {}
        for prop in [
            *(p for p in PROPERTIES if p in by_property),
            *(p for p in by_property if p not in PROPERTIES),
        ]:
            group = by_property[prop]
            ran = _unique(r.case for r in group if r.verdict in _RAN)
            if ran:
                entry[prop] = {"status": "tested", "cases": ran, "reason": ""}
                continue
            na = [r for r in group if r.verdict == "unsupported" and r.reason.startswith(_NOT_APPLICABLE)]
            first = na[0] if na else next((r for r in group if r.verdict == "unsupported"), group[0])
            status = (
                "not applicable" if na else "unsupported" if first.verdict == "unsupported" else "skipped"
            )
            reason = first.reason.removeprefix(_NOT_APPLICABLE)
            entry[prop] = {"status": status, "cases": [], "reason": f"{first.case}: {reason}"}
        entry.update({p: e for p, e in _contract_not_posed(kernel, contract_cases).items() if p not in entry})
        table[kernel] = entry
    return table


def _contract_not_posed(kernel: str, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The contract properties among ``names`` that no case of them poses to ``kernel``'s api:
    ``not applicable``, with the apis their cases take (none for an SDPA or unregistered kernel)."""
    from flashprobe.fuzz.contract_cases import CONTRACT_CASES
    from flashprobe.kernels import KernelSpecError, get_kernel

    try:
        api = get_kernel(kernel).api
    except KernelSpecError:
        return {}
    if api == "sdpa":
        return {}
    cases: dict[str, list[Any]] = {}
    for name in names:
        if name in CONTRACT_CASES:
            cases.setdefault(CONTRACT_CASES[name].property, []).append(CONTRACT_CASES[name])
    found = {}
    for prop, group in cases.items():
        if any(api in c.apis for c in group):
            continue
        apis = ", ".join(_unique(a for c in group for a in c.apis))
        reason = f"{group[0].name}: its cases take {apis} kernels, not {api} ones"
        found[prop] = {"status": "not applicable", "cases": [], "reason": reason}
    return found


def property_lines(cover: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Per kernel: ``tiled: 27 of 29 properties tested``, then a line per property not tested."""
    lines = []
    for kernel, entry in cover.items():
        tested = sum(e["status"] == "tested" for e in entry.values())
        lines.append(f"{kernel}: {tested} of {len(entry)} properties tested")
        lines += [
            f"  {e['status']}: {prop}, because {e['reason']}"
            for prop, e in entry.items()
            if e["status"] != "tested"
        ]
    return lines


def property_markdown(cover: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The property coverage as a Markdown table: a row per property, a column per kernel."""
    kernels = list(cover)
    props = _unique(p for entry in cover.values() for p in entry)
    lines = [
        "| property | " + " | ".join(f"`{k}`" for k in kernels) + " |",
        "| --- |" + " --- |" * len(kernels),
    ]
    for prop in props:
        cells = []
        for kernel in kernels:
            e = cover[kernel].get(prop)
            if e is None:
                cells.append("-")
            elif e["status"] == "tested":
                cells.append("tested (" + ", ".join(f"`{c}`" for c in e["cases"]) + ")")
            else:
                cells.append(f"{e['status']}, because {e['reason']}".replace("|", "\\|"))
        lines.append(f"| {prop} | " + " | ".join(cells) + " |")
    totals = [
        f"{sum(e['status'] == 'tested' for e in cover[k].values())} of {len(cover[k])} tested"
        for k in kernels
    ]
    lines.append("| **total** | " + " | ".join(totals) + " |")
    return "\n".join(lines) + "\n"


def case_seconds(results: Sequence[FuzzResult]) -> dict[str, float]:
    """Seconds per case (every kernel, dtype, layout and seed together), slowest first."""
    total: dict[str, float] = {}
    for r in results:
        total[r.case] = total.get(r.case, 0.0) + r.seconds
    return {case: round(s, 3) for case, s in sorted(total.items(), key=lambda item: -item[1])}
