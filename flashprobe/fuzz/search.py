"""The random search of ``flashprobe fuzz --budget N``, and the shrinking of what it finds.

Random failures are shrunk (halving N_q, N_k, D, B, H and making the layout contiguous and GQA
plain while the same failure persists) and, with an output directory, saved as reproducers
(:func:`~flashprobe.fuzz.reproducer.save_reproducer`).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import kernel_label
from flashprobe.fuzz.random_cases import RandomCaseSpec, make_random_case, sample_random_spec
from flashprobe.fuzz.references import references
from flashprobe.fuzz.reproducer import save_reproducer
from flashprobe.fuzz.run import FuzzResult, check_case, kernel_availability
from flashprobe.kernels import Kernel, dtype_name, to_dtype

__all__ = ["random_search", "shrink"]

log = logging.getLogger(__name__)


def shrink(
    kernel: str | Kernel,
    spec: RandomCaseSpec,
    dtype: torch.dtype,
    failure: str,
    *,
    device: str | torch.device = "cpu",
    baseline: str | Kernel = "math",
    max_tries: int = 60,
    backward: bool = True,
) -> tuple[RandomCaseSpec, CaseInputs, FuzzResult]:
    """Halve N_q, N_k, D, B, H (in turn, repeatedly), then try the contiguous layout and plain
    heads, while the kernel fails the same way (``failure``, e.g. ``nonfinite`` or ``dq:values``).

    Args:
        kernel: the failing kernel.
        spec: the failing random sample.
        dtype: its dtype.
        failure: the failure kind to preserve (:attr:`FuzzResult.failure`).
        device: where to run.
        baseline: same-dtype baseline spec.
        max_tries: most candidate cases to evaluate.
        backward: check gradients (as the search that found the failure).

    Returns:
        The smallest failing spec found, its inputs and its result.
    """
    kernel = kernel_label(kernel)
    inputs = make_random_case(spec, dtype).to(device)
    result = check_case(kernel, inputs, case="shrink", baseline=baseline, backward=backward)
    tries, changed = 0, True

    def attempt(smaller: RandomCaseSpec) -> bool:
        nonlocal spec, inputs, result, tries
        tries += 1
        candidate = make_random_case(smaller, dtype).to(device)
        outcome = check_case(kernel, candidate, case="shrink", baseline=baseline, backward=backward)
        if outcome.verdict != "fail" or outcome.failure != failure:
            return False
        spec, inputs, result = smaller, candidate, outcome
        return True

    while changed and tries < max_tries:
        changed = False
        for size in RandomCaseSpec.SIZES:
            while tries < max_tries and (smaller := spec.halved(size)) is not None and attempt(smaller):
                changed = True
        for axis in RandomCaseSpec.SIMPLER:
            if tries < max_tries and (plain := spec.simplified(axis)) is not None and attempt(plain):
                changed = True
    log.info("shrunk %s failure of %s to %s after %d tries", failure, kernel, spec.describe(), tries)
    return spec, inputs, result


@dataclass
class _Search:
    """The settings of one random search and the failures it has shrunk so far."""

    labels: list[str]
    device: torch.device
    baseline: str | Kernel
    out_dir: Path | None
    unavailable: dict[tuple[str, torch.dtype], str | None]
    backward: bool = True
    shrunk: set[tuple[str, torch.dtype, str | None]] = field(default_factory=set)

    def sample(self, name: str, spec: RandomCaseSpec, dtype: torch.dtype) -> list[FuzzResult]:
        """Every kernel on one random sample; the first failure of each kind is shrunk and saved."""
        inputs = make_random_case(spec, dtype).to(self.device)
        refs = references(inputs, self.baseline, backward=self.backward)
        results = []
        for kernel in self.labels:
            if (why := self.unavailable[kernel, dtype]) is not None:
                result = FuzzResult(
                    kernel=kernel, case=name, dtype=dtype_name(dtype), verdict="unsupported", reason=why
                )
            else:
                result = check_case(kernel, inputs, case=name, refs=refs)
            result = replace(result, params=spec.as_dict())
            key = (kernel, dtype, result.failure)
            if result.verdict == "fail" and key not in self.shrunk:
                self.shrunk.add(key)
                result = self._shrink(name, kernel, spec, dtype, result)
            results.append(result)
        return results

    def _shrink(
        self, name: str, kernel: str, spec: RandomCaseSpec, dtype: torch.dtype, result: FuzzResult
    ) -> FuzzResult:
        """Shrink a failure and, with an output directory, save it: ``result`` with ``repro`` set."""
        small, small_inputs, small_result = shrink(
            kernel,
            spec,
            dtype,
            result.failure or "",
            device=self.device,
            baseline=self.baseline,
            backward=self.backward,
        )
        if self.out_dir is None:
            return result
        path = save_reproducer(
            self.out_dir,
            name,
            kernel,
            small_inputs,
            small_result,
            baseline=self.baseline,
            params=small.as_dict(),
            backward=self.backward,
        )
        return replace(result, repro=str(path))


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
) -> list[FuzzResult]:
    """Sample ``budget`` random cases (dtypes in turn) and run every kernel on each.

    ``backward`` checks the gradients too; ``profile`` sets the longest lengths sampled
    (:data:`~flashprobe.fuzz.random_cases.MAX_KEYS`).

    The first failure of each (kernel, dtype, failure kind) is shrunk with :func:`shrink` and, when
    ``out_dir`` is given, saved with :func:`~flashprobe.fuzz.reproducer.save_reproducer`; its row
    carries the path in ``repro``.

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
    search = _Search(
        labels=labels,
        device=device,
        baseline=baseline,
        out_dir=None if out_dir is None else Path(out_dir),
        unavailable=kernel_availability(labels, device, resolved),
        backward=backward,
    )
    rng = random.Random(seed)
    results: list[FuzzResult] = []
    for i in range(budget):
        dtype = resolved[i % len(resolved)]
        results += search.sample(f"random_{i:03d}", sample_random_spec(rng, dtype, profile), dtype)
    return results
