"""The random search of ``flashprobe fuzz --budget N``: samples drawn inside the kernels' shared
limits, posed to each within its own; failures shrunk and saved as reproducers.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from flashprobe.fuzz.fit import NotApplicableError, fit_inputs
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import kernel_label
from flashprobe.fuzz.random_cases import RandomCaseSpec, make_random_case, sample_random_spec, shared_limits
from flashprobe.fuzz.reproducer import ReproducerStore
from flashprobe.fuzz.rule import References
from flashprobe.fuzz.run import FuzzResult, case_references, check_case, kernel_availability
from flashprobe.judge import fp8_baseline
from flashprobe.kernels import Kernel, dtype_name, get_kernel, to_dtype

__all__ = ["random_search"]

log = logging.getLogger(__name__)


def _sample_property(spec: RandomCaseSpec) -> str:
    """What a random sample stands for when its failures are kept: its mask, with a logit level."""
    return f"random {spec.mask}" + (" below a sentinel" if spec.level else "")


@dataclass
class _Search:
    """The settings of one random search and where its failures are kept."""

    labels: list[str]
    device: torch.device
    baseline: str | Kernel
    reproducers: ReproducerStore | None
    unavailable: dict[tuple[str, torch.dtype], str | None]
    backward: bool = True
    shrunk: set[tuple[str, str | None]] = field(default_factory=set)

    def sample(self, name: str, spec: RandomCaseSpec, dtype: torch.dtype) -> list[FuzzResult]:
        """Every kernel on one random sample, posed within its limits; a failure of a new (kernel,
        property, direction) is shrunk and saved."""
        base = make_random_case(spec, dtype).to(self.device)
        refs: dict[tuple[str, str], References] = {}
        results = []
        for kernel in self.labels:
            start = time.perf_counter()
            result = self._check(name, kernel, base, dtype, refs)
            result = replace(result, params=spec.as_dict(), seconds=round(time.perf_counter() - start, 3))
            prop = _sample_property(spec)
            if self.reproducers is not None and self.reproducers.wants(result, prop):
                result = self._keep(name, kernel, spec, base, result, prop)
            results.append(result)
        return results

    def _keep(
        self, name: str, kernel: str, spec: RandomCaseSpec, base: CaseInputs, result: FuzzResult, prop: str
    ) -> FuzzResult:
        """Save a failure's reproducer: shrunk the first time its (kernel, failure kind) fails
        (:func:`~flashprobe.probing.repro.shrink_reproducer`), as sampled after that."""
        from flashprobe.fuzz.reproducer import replay_case
        from flashprobe.probing.repro import shrink_reproducer  # the one shrinker (it imports the probe)

        assert self.reproducers is not None
        inputs = fit_inputs(base, get_kernel(kernel).capabilities).inputs
        call = self.reproducers.reproducer(replace(result, case=name), inputs, prop, params=spec.as_dict())
        if (kernel, result.failure) not in self.shrunk:
            self.shrunk.add((kernel, result.failure))
            try:
                baseline = kernel_label(self.baseline)
                call, tries = shrink_reproducer(call, kernel, baseline=baseline, judge=replay_case)
                log.info("shrunk %s failure of %s after %d tries", result.failure, kernel, tries)
            except ValueError:  # judged again, it did not fail the same way: kept as sampled
                log.info("%s failure of %s did not fail again; saved unshrunk", result.failure, kernel)
        return self.reproducers.keep(result, call, prop)

    def _check(
        self,
        name: str,
        kernel: str,
        base: CaseInputs,
        dtype: torch.dtype,
        refs: dict[tuple[str, str], References],
    ) -> FuzzResult:
        unsupported = {"kernel": kernel, "case": name, "dtype": dtype_name(dtype), "verdict": "unsupported"}
        if (why := self.unavailable[kernel, dtype]) is not None:
            return FuzzResult(reason=why, **unsupported)
        try:
            fitted = fit_inputs(base, get_kernel(kernel).capabilities)
        except NotApplicableError as err:
            return FuzzResult(reason=f"not applicable to this kernel: {err}", **unsupported)
        baseline, precision = fp8_baseline(kernel, self.baseline)  # an FP8 kernel's is FP8 (judge.py)
        key = (fitted.changes, kernel_label(baseline))
        if key not in refs:
            refs[key] = case_references(fitted.inputs, baseline, backward=self.backward)
        result = check_case(kernel, fitted.inputs, case=name, refs=replace(refs[key], precision=precision))
        return replace(result, fitted=fitted.changes)


def random_search(
    kernels: Sequence[str | Kernel],
    dtypes: Sequence[str | torch.dtype],
    *,
    budget: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    baseline: str | Kernel = "math",
    out_dir: str | os.PathLike[str] | None = None,
    backward: bool = True,
    profile: str = "default",
    progress: Callable[[str], None] | None = None,
    reproducers: ReproducerStore | None = None,
) -> list[FuzzResult]:
    """Sample ``budget`` random cases (dtypes in turn) and run every kernel on each.

    Samples are drawn inside what every kernel takes and posed to each within its own limits
    (:func:`~flashprobe.fuzz.fit.fit_inputs`); ``profile`` sets the longest lengths sampled
    (:data:`~flashprobe.fuzz.random_cases.MAX_KEYS`). A failure of a new (kernel, property,
    direction) is saved by ``reproducers`` (or a store in ``out_dir``); its row's ``repro`` says where.

    Args:
        progress: called with one line per sample.

    Returns:
        One :class:`FuzzResult` per (sample, kernel); cases are named ``random_<i>``.

    Raises:
        ValueError: ``budget`` is negative.
    """
    if budget < 0:
        raise ValueError(f"budget={budget} must be ≥ 0")
    labels = [kernel_label(k) for k in kernels]
    device = torch.device(device)
    resolved = [to_dtype(d) for d in dtypes]
    if reproducers is None and out_dir is not None:
        reproducers = ReproducerStore(Path(out_dir), baseline=baseline, backward=backward)
    search = _Search(
        labels, device, baseline, reproducers, kernel_availability(labels, device, resolved), backward
    )
    limits = shared_limits([get_kernel(k).capabilities for k in labels])
    rng = random.Random(seed)
    results: list[FuzzResult] = []
    start = time.perf_counter()
    for i in range(budget):
        dtype = resolved[i % len(resolved)]
        rows = search.sample(f"random_{i:03d}", sample_random_spec(rng, dtype, profile, limits), dtype)
        if progress is not None:
            verdicts = ", ".join(f"{r.kernel} {r.verdict}" for r in rows)
            elapsed = time.perf_counter() - start
            left = elapsed / (i + 1) * (budget - i - 1)  # at the pace so far
            progress(
                f"[{i + 1}/{budget}] random_{i:03d} {dtype_name(dtype)}: {verdicts} "
                f"({elapsed:.0f} s; about {left:.0f} s left)"
            )
        results += rows
    return results
