"""The fuzzer as one library call: :func:`check_kernel` runs the catalogue (and random search) on
kernels and returns a :class:`KernelCheck` — the rows, the failures, the reproducers' paths.

``flashprobe fuzz`` is this call plus argument checks, printing and ``fuzz.json``::

    from flashprobe import check_kernel

    result = check_kernel("tiled:preset=paper", dtypes=["bf16"], cases=["sentinel_*"], backward=False)
    assert result.passed, result.failures[0].reason
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashprobe.formats import prepare_output_dir
from flashprobe.fuzz.cases import FuzzCase, select_cases
from flashprobe.fuzz.contract_run import dense_dtypes, run_contract_catalogue, split_case_patterns, to_dtypes
from flashprobe.fuzz.invariants import CHECKS, run_checks, select_checks
from flashprobe.fuzz.kernel_call import kernel_label
from flashprobe.fuzz.ledger import Ledger, LedgerReport, UnexpectedPass, load_ledger
from flashprobe.fuzz.reproducer import ReproducerStore
from flashprobe.fuzz.run import FuzzResult, run_catalogue
from flashprobe.fuzz.search import random_search
from flashprobe.fuzz.tables import summary_counts
from flashprobe.kernels import Kernel, to_dtype
from flashprobe.kernels.threads import torch_threads

__all__ = ["KernelCheck", "check_kernel"]


@dataclass
class KernelCheck:
    """What :func:`check_kernel` found.

    Attributes:
        results: one row per (seed, case, dtype, kernel), then one per random sample and kernel.
        catalogue_s, elapsed_s: seconds spent on the catalogue, and in all.
        reproducers: the files saved for the failures (empty without ``out_dir``).
        ledger: the rows judged against the ledger (None without one).
        contract_cases: the contract catalogue's cases the run selected.
    """

    results: list[FuzzResult]
    catalogue_s: float = 0.0
    elapsed_s: float = 0.0
    reproducers: list[Path] = field(default_factory=list)
    ledger: LedgerReport | None = None
    contract_cases: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[FuzzResult]:
        """The rows whose verdict is ``fail`` and that no ledger entry accepts."""
        return [r for r in self.results if r.verdict == "fail" and not r.known]

    @property
    def unexpected_passes(self) -> list[UnexpectedPass]:
        """The ledger's findings that passed in every run (fixed? remove the entry)."""
        return [] if self.ledger is None else self.ledger.unexpected

    @property
    def passed(self) -> bool:
        """No row failed or was ``not_declared`` outside the ledger, and no unexpected pass."""
        return (
            not self.failures
            and not self.unexpected_passes
            and all(r.verdict != "not_declared" or r.known for r in self.results)
        )

    @property
    def summary(self) -> dict[str, int]:
        """How many rows got each verdict."""
        return summary_counts(self.results)


def check_kernel(
    kernels: str | Kernel | Sequence[str | Kernel],
    *,
    dtypes: Sequence[str | torch.dtype] = ("bf16", "fp16", "fp32"),
    cases: Iterable[str] | Sequence[FuzzCase] | None = None,
    checks: Sequence[str] | None = None,
    profile: str = "default",
    seed: int = 0,
    seeds: int = 1,
    budget: int = 0,
    backward: bool = True,
    layouts: Sequence[str] = ("contiguous",),
    baseline: str | Kernel = "math",
    device: str | torch.device = "cpu",
    out_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    ledger: Ledger | str | os.PathLike[str] | None = None,
    contract_cases: Sequence[str] | None = None,
    threads: int | None = None,
) -> KernelCheck:
    """Run the fuzzer's catalogue for ``seeds`` seeds, then ``budget`` random samples, on
    ``kernels``, each judged by the one rule (:mod:`flashprobe.judge`) against the FP64 golden.

    Args:
        kernels: a kernel (spec or :class:`~flashprobe.kernels.Kernel`) or several.
        cases: case names or globs (``"sentinel_*"``, also selecting sequences and invariants), or
            :class:`FuzzCase` objects; None: the ``profile``'s catalogue.
        checks: the sequences and invariants to run, by name (None: those ``cases`` selects).
        seed, seeds: the first seed and how many.
        budget: random samples after the catalogue (0: none).
        layouts: memory layouts every case runs in (:data:`~flashprobe.fuzz.layouts.LAYOUTS`).
        baseline: the same-dtype baseline (FP8 kernels get ``math:fp8=<format>`` in place of ``math``).
        out_dir: where failures' reproducers are saved; None saves none.
        progress: called with one line per (case, dtype) and random sample.
        ledger: accepted findings (a :class:`~flashprobe.fuzz.ledger.Ledger`, a file, or a shipped
            ledger's name such as ``"builtin"``).
        contract_cases: the contract cases to run; None: those ``cases``' patterns name.
        threads: torch's intra-op CPU threads during the run (None: the process's; restored after).

    Raises:
        ValueError: ``seeds`` < 1, ``budget`` < 0, a case pattern that matches no case, or an
            unknown check.
        OutputPathError: ``out_dir`` is a file, a system directory or not writable.
        LedgerError: the ledger is missing or unusable.
    """
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: must be >= 1 (the catalogue runs for seeds seed ... seed+seeds-1)")
    if budget < 0:
        raise ValueError(f"budget={budget}: must be >= 0 (random samples; 0 runs only the catalogue)")
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads}: must be >= 1 (torch intra-op CPU threads), or None")
    labels = [kernel_label(k) for k in ([kernels] if isinstance(kernels, str | Kernel) else kernels)]
    if ledger is not None and not isinstance(ledger, Ledger):
        ledger = load_ledger(ledger)
    given = [] if cases is None else list(cases)
    named = [c for c in given if isinstance(c, str)]
    chosen = [c for c in given if isinstance(c, FuzzCase)]
    if checks is not None or (cases is not None and not named):  # named, or case objects only
        unknown = [c for c in checks or () if c not in CHECKS]
        if unknown:
            raise ValueError(f"checks: no sequence or invariant {unknown[0]!r}; known: {', '.join(CHECKS)}")
        extra, rest = [CHECKS[name] for name in checks or ()], named
    else:
        extra, rest = select_checks(named if cases is not None else None, profile=profile)
    contract_names: list[str] = []
    if rest is not None:  # the contract apis' cases: contract_run
        dense_named, contract_names = split_case_patterns(rest)
        if dense_named is not None and (rest or cases is None):  # no cases given: the profile's catalogue
            chosen += select_cases(dense_named, profile=profile)
        contract_names = contract_names if cases is None or rest else []
    if contract_cases is not None:
        contract_names = list(contract_cases)
    store = None
    if out_dir is not None:  # checked as the command checks --out (no system directory, writable)
        store = ReproducerStore(prepare_output_dir(out_dir, flag="out_dir"), baseline, backward)
    common = {"device": device, "baseline": baseline, "backward": backward, "reproducers": store}
    with contextlib.nullcontext() if threads is None else torch_threads(threads):
        start = time.perf_counter()
        results: list[FuzzResult] = []
        for s in range(seed, seed + seeds):
            results += run_catalogue(
                labels,
                dense_dtypes(dtypes),
                cases=chosen,
                seed=s,
                layouts=layouts,
                progress=progress,
                ledger=ledger,
                **common,
            )
            resolved = [to_dtype(d) for d in dense_dtypes(dtypes)]
            results += run_checks(labels, resolved, extra, seed=s, progress=progress, **common)
            results += run_contract_catalogue(
                labels, to_dtypes(dtypes), seed=s, device=device, backward=backward, names=contract_names,
                progress=progress, reproducers=store,
            )  # fmt: skip
        catalogue_s = time.perf_counter() - start
        if budget and progress is not None and results:
            # up front: the catalogue's pace per (case, dtype) call of every kernel, for the samples
            calls = len({(r.seed, r.case, r.dtype, r.layout) for r in results})
            progress(
                f"random search: {budget} samples of {len(labels)} kernel(s), about "
                f"{catalogue_s / max(calls, 1) * budget:.0f} s at the catalogue's pace"
            )
        if budget:
            results += random_search(
                labels, dtypes, budget=budget, seed=seed, profile=profile, progress=progress, **common
            )
    saved = sorted(set(store.saved.values())) if store is not None else []
    report = None if ledger is None else ledger.apply(results, device)
    results = results if report is None else report.results
    elapsed = time.perf_counter() - start
    return KernelCheck(results, catalogue_s, elapsed, saved, report, list(contract_names))
