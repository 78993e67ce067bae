"""The findings ledger of ``flashprobe fuzz --ledger FILE``: accepted findings, each with its reason.

A ledger is a YAML file of entries (or a TOML file, ``*.toml``: one ``[[entries]]`` table each).
Each names the kernel(s), the case(s) or property(ies) and the dtype(s) of a finding a team has
accepted, why (``reason``) and where it is tracked (``link``: an issue URL or a doc section)::

    entries:
      - kernel: sdpa_flash
        case: scale_zero_causal
        dtype: [bf16, fp16, fp32]
        device: cpu
        failure: nonfinite
        reason: torch 2.13's CPU flash backend returns NaN for scale=0.0 with is_causal=True
        link: https://github.com/pytorch/pytorch/issues/...

The keys are :data:`KEYS`. The ledger changes the gate, not the judgement: a failure an entry
accepts is reported ``known`` and does not fail the run; a strict entry whose (kernel, case, dtype)
passed in every run is an **unexpected pass** and fails it. Every entry is checked before any case
runs (:func:`load_ledger`). ``--ledger builtin`` is the shipped ledger (:data:`SHIPPED`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib
import torch
import yaml

from flashprobe.errors import FlashprobeError
from flashprobe.fuzz.cases import CATALOGUE, PROPERTIES
from flashprobe.kernels import KernelSpecError, available_kernels, get_kernel

if TYPE_CHECKING:
    from flashprobe.fuzz.run import FuzzResult

__all__ = [
    "KEYS",
    "SHIPPED",
    "Ledger",
    "LedgerEntry",
    "LedgerError",
    "LedgerReport",
    "UnexpectedPass",
    "load_ledger",
]

#: the ledgers shipped with flashprobe, by name: ``--ledger builtin``
SHIPPED: dict[str, Path] = {"builtin": Path(__file__).with_name("ledgers") / "builtin.yaml"}
#: the keys of an entry, with what each holds
KEYS: dict[str, str] = {
    "kernel": "a kernel spec or glob, or a list of them (required)",
    "case": "a case name or glob, or a list (a case or a property is required)",
    "property": "a property of the catalogue, or a list",
    "dtype": "bf16, fp16, fp32, fp64, or a list (default: every dtype)",
    "device": "cpu or cuda (default: any)",
    "failure": "the failure kinds accepted, globs (biased, d?:biased, nonfinite; default: any)",
    "reason": "why the finding is accepted (required)",
    "link": "an issue URL or a doc section, e.g. docs/fuzz.md#signed-bias (required)",
    "quarantine": "true: the kernel is not called on these cases (default false)",
    "strict": "false: the finding fails in some seeds only, a pass is no news (default true)",
}
_DTYPES = ("bf16", "fp16", "fp32", "fp64")
_DEVICES = ("cpu", "cuda")
_LINK = re.compile(r"^(https?://\S+|[\w./-]+\.md(#[\w.-]+)?)$")
_RAN = ("pass", "fail", "no_backward")


class LedgerError(FlashprobeError, ValueError):
    """A ledger file is unusable; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class LedgerEntry:
    """One accepted finding.

    Attributes:
        kernels, cases, properties, dtypes, device, failures, reason, link, quarantine, strict: the
            entry's keys (:data:`KEYS`; an empty value matches any).
        where: ``<file>:<line> (entry <n>)`` (a shipped ledger by its name: ``builtin:12 (entry 1)``).
    """

    kernels: tuple[str, ...]
    cases: tuple[str, ...]
    properties: tuple[str, ...]
    dtypes: tuple[str, ...]
    device: str
    failures: tuple[str, ...]
    reason: str
    link: str
    quarantine: bool = False
    strict: bool = True
    where: str = ""

    @property
    def label(self) -> str:
        """``<where>: <reason> (<link>)``: what a known row carries."""
        return f"{self.where}: {self.reason} ({self.link})"

    def covers(self, kernel: str, case: str, dtype: str, device: str) -> bool:
        """Whether the entry is about this (kernel, case, dtype) on a device of type ``device``."""
        properties = CATALOGUE[case].properties if case in CATALOGUE else ()
        return (
            any(fnmatch.fnmatchcase(kernel, k) for k in self.kernels)
            and (not self.cases or any(fnmatch.fnmatchcase(case, c) for c in self.cases))
            and (not self.properties or bool(set(self.properties) & set(properties)))
            and (not self.dtypes or dtype in self.dtypes)
            and (not self.device or self.device == device)
        )

    def accepts(self, row: FuzzResult) -> bool:
        """Whether every failure kind of ``row`` (output and gradients) is one the entry accepts."""
        kinds = {k for k in (row.failure, row.backward_failure) if k}
        return not self.failures or all(any(fnmatch.fnmatchcase(k, f) for f in self.failures) for k in kinds)


@dataclass(frozen=True)
class UnexpectedPass:
    """A (kernel, case, dtype) of a strict entry that ran and passed in every run."""

    entry: LedgerEntry
    kernel: str
    case: str
    dtype: str
    runs: int

    def line(self) -> str:
        """``ledger <where>: <kernel> | <case> | <dtype> passed in all N runs: fixed? remove the entry``."""
        runs = "its run" if self.runs == 1 else f"all {self.runs} runs"
        return (
            f"ledger {self.entry.where}: {self.kernel} | {self.case} | {self.dtype} passed in {runs}: "
            "fixed? remove the entry (or narrow it to what still fails)"
        )


@dataclass(frozen=True)
class LedgerReport:
    """A run's rows judged against a ledger.

    Attributes:
        results: the rows, each failure an entry accepts marked ``known`` (:attr:`FuzzResult.known`).
        unexpected: the strict entries' (kernel, case, dtype) that passed in every run.
    """

    results: list[FuzzResult]
    unexpected: list[UnexpectedPass]
    path: Path

    @property
    def failures(self) -> list[FuzzResult]:
        """The failures no entry accepts."""
        return [r for r in self.results if r.verdict == "fail" and not r.known]

    @property
    def known(self) -> list[FuzzResult]:
        """The failures an entry accepts."""
        return [r for r in self.results if r.verdict == "fail" and r.known]

    @property
    def passed(self) -> bool:
        """No failure outside the ledger and no unexpected pass."""
        return not self.failures and not self.unexpected

    def lines(self) -> list[str]:
        """One line per entry with known or quarantined rows: ``known ×60 kernel | case | dtypes: why``."""
        groups: dict[str, list[FuzzResult]] = {}
        for r in self.results:
            if r.known and r.verdict in ("fail", "skip"):
                groups.setdefault(r.known, []).append(r)
        lines = []
        for label, rows in groups.items():
            word = "known" if rows[0].verdict == "fail" else "quarantined"
            where = " | ".join(
                ", ".join(dict.fromkeys(getattr(r, f) for r in rows)) for f in ("kernel", "case", "dtype")
            )
            lines.append(f"{word} ×{len(rows)} {where}: {label}")
        return lines


@dataclass(frozen=True)
class Ledger:
    """The entries of one ledger file (:func:`load_ledger`)."""

    path: Path
    entries: tuple[LedgerEntry, ...]

    def quarantined(self, kernel: str, case: str, dtype: str, device: str) -> LedgerEntry | None:
        """The entry that quarantines this (kernel, case, dtype) on ``device`` (a device type), or None."""
        return next((e for e in self.entries if e.quarantine and e.covers(kernel, case, dtype, device)), None)

    def apply(self, results: Sequence[FuzzResult], device: str | torch.device = "cpu") -> LedgerReport:
        """Mark the failures the entries accept ``known`` and find the strict entries' unexpected passes
        (entries with a ``device`` apply only where the run ran)."""
        kind = torch.device(device).type
        rows = []
        for r in results:
            if r.verdict == "fail" and not r.known:
                entry = next(
                    (e for e in self.entries if e.covers(r.kernel, r.case, r.dtype, kind) and e.accepts(r)),
                    None,
                )
                r = r if entry is None else replace(r, known=entry.label)
            rows.append(r)
        unexpected = []
        for entry in (e for e in self.entries if e.strict and not e.quarantine):
            groups: dict[tuple[str, str, str], list[FuzzResult]] = {}
            for r in rows:
                if r.verdict in _RAN and entry.covers(r.kernel, r.case, r.dtype, kind):
                    groups.setdefault((r.kernel, r.case, r.dtype), []).append(r)
            for (kernel, case, dtype), group in groups.items():
                if all(r.verdict != "fail" for r in group):
                    unexpected.append(UnexpectedPass(entry, kernel, case, dtype, len(group)))
        return LedgerReport(rows, unexpected, self.path)


def _resolve(source: str | Path) -> Path:
    if isinstance(source, str) and source in SHIPPED:
        return SHIPPED[source]
    path = Path(source)
    if not path.is_file():
        shipped = ", ".join(SHIPPED)
        raise LedgerError(
            f"ledger {str(source)!r}: no such file; give a YAML ledger's path or a shipped ledger ({shipped})"
        )
    return path


def _entry_lines(text: str, toml: bool = False) -> list[int]:
    """The line (1-based) each item of ``entries`` starts on (TOML: each ``[[entries]]`` header)."""
    if toml:
        return [i + 1 for i, line in enumerate(text.splitlines()) if line.strip() == "[[entries]]"]
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    for key, value in getattr(root, "value", []):
        if getattr(key, "value", None) == "entries" and isinstance(value, yaml.SequenceNode):
            return [node.start_mark.line + 1 for node in value.value]
    return []


def _strings(value: Any, key: str, where: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise LedgerError(f"{where}: {key} must be a non-empty string or list of strings, got {value!r}")
    return tuple(v.strip() for v in items)


def _check_kernel(pattern: str, where: str) -> None:
    if any(c in pattern for c in "*?["):
        names = available_kernels()
        if not fnmatch.filter(names, pattern.partition(":")[0]):
            raise LedgerError(
                f"{where}: kernel {pattern!r} matches no registered kernel ({', '.join(names)})"
            )
        return
    try:
        get_kernel(pattern)
    except KernelSpecError as err:
        raise LedgerError(
            f"{where}: kernel {pattern!r}: {err}; register it first (--import MODULE) or fix the spec"
        ) from None


def _entry(raw: Any, where: str) -> LedgerEntry:
    if not isinstance(raw, dict):
        raise LedgerError(f"{where}: an entry must be a mapping of {', '.join(KEYS)}, got {raw!r}")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise LedgerError(f"{where}: unknown key {unknown[0]!r}; an entry's keys are {', '.join(KEYS)}")
    for key in ("kernel", "reason", "link"):
        if not raw.get(key):
            raise LedgerError(
                f"{where}: missing {key} ({KEYS[key]}); every accepted finding says why and where"
            )
    if "case" not in raw and "property" not in raw:
        raise LedgerError(f"{where}: give case or property: which cases the finding is about")
    kernels = _strings(raw["kernel"], "kernel", where)
    for k in kernels:
        _check_kernel(k, where)
    cases = _strings(raw["case"], "case", where) if "case" in raw else ()
    names = [*CATALOGUE, "random_000"]
    for c in cases:
        if not fnmatch.filter(names, c):
            raise LedgerError(f"{where}: case {c!r} matches no case; flashprobe fuzz --list lists them")
    properties = _strings(raw["property"], "property", where) if "property" in raw else ()
    for p in properties:
        if p not in PROPERTIES:
            raise LedgerError(f"{where}: unknown property {p!r}; properties: {', '.join(PROPERTIES)}")
    dtypes = _strings(raw["dtype"], "dtype", where) if "dtype" in raw else ()
    for d in dtypes:
        if d not in _DTYPES:
            raise LedgerError(f"{where}: dtype {d!r}: use {', '.join(_DTYPES)}")
    device = str(raw.get("device", ""))
    if device and device not in _DEVICES:
        raise LedgerError(f"{where}: device {device!r}: use {' or '.join(_DEVICES)}, or leave it out for any")
    reason, link = str(raw["reason"]).strip(), str(raw["link"]).strip()
    if not _LINK.match(link):
        raise LedgerError(
            f"{where}: link {link!r} must be an issue URL (https://...) or a doc section (docs/x.md#y)"
        )
    flags = {}
    for key, default in (("quarantine", False), ("strict", True)):
        flags[key] = raw.get(key, default)
        if not isinstance(flags[key], bool):
            raise LedgerError(f"{where}: {key} must be true or false, got {flags[key]!r}")
    failures = _strings(raw["failure"], "failure", where) if "failure" in raw else ()
    return LedgerEntry(
        kernels, cases, properties, dtypes, device, failures, reason, link, where=where, **flags
    )


def load_ledger(source: str | Path) -> Ledger:
    """Read and check a ledger: a shipped one by name (:data:`SHIPPED`), a YAML file, or a TOML file
    (``*.toml``). Kernels are checked against the registry: register yours first.

    Raises:
        LedgerError: the file is missing or not YAML/TOML, or an entry is unusable (the message names
            the file, the entry's line and the fix).
    """
    path = _resolve(source)
    text = path.read_text(encoding="utf-8")
    toml = path.suffix == ".toml"
    try:
        data = tomllib.loads(text) if toml else yaml.safe_load(text)
        lines = _entry_lines(text, toml)
    except tomllib.TOMLDecodeError as err:
        raise LedgerError(f"{path}: not valid TOML ({err}); fix the syntax") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        raise LedgerError(
            f"{path}{at}: not valid YAML ({getattr(err, 'problem', err)}); fix the syntax"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise LedgerError(
            f"{path}: a ledger is a mapping with a list of entries ('entries:', in TOML '[[entries]]'), "
            "see docs/fuzz.md"
        )
    extra = [k for k in data if k != "entries"]
    if extra:
        raise LedgerError(f"{path}: unknown top-level key {extra[0]!r}; a ledger has only 'entries:'")
    name = next((n for n, p in SHIPPED.items() if p == path), str(path))
    if len(lines) != len(data["entries"]):  # entries written inline (TOML ``entries = [{...}]``)
        lines = [0] * len(data["entries"])
    entries = tuple(
        _entry(raw, f"{name}{f':{line}' if line else ''} (entry {i + 1})")
        for i, (raw, line) in enumerate(zip(data["entries"], lines, strict=True))
    )
    return Ledger(path, entries)
