"""``flashprobe fuzz``: run adversarial edge cases against attention kernels and judge each one.

Every case of :data:`~flashprobe.bench.fuzz_cases.CATALOGUE` (and, with ``--budget N``, N random
samples) runs against every kernel at every dtype. Each (kernel, case, dtype) gets a verdict:

``pass``
    the output matches the FP64 golden within the noise floor (the rule below);
``fail``
    with the reason: the kernel raised; NaN/Inf where the golden is finite; a row of zeros where
    the golden is clearly non-zero (the sentinel/underflow signature of FlashInfer PR 4401);
    non-zero output for a fully masked row (expected 0, torch SDPA's convention); or wrong values
    beyond the rule;
``skip``
    the case cannot be posed in this dtype (its logits do not fit the dtype's range);
``unsupported``
    the kernel raised :class:`~flashprobe.KernelUnavailableError` or
    :class:`~flashprobe.KernelInputError` (wrong device, mask kind or GQA not supported): not a
    failure, reported with the kernel's message.

**The rule** (flash-attention's test rule plus a floor): with ``golden`` computed in float64 from
the *cast* inputs and ``baseline`` the ``math`` kernel at the same dtype (``--baseline``),

    max|primary − golden| ≤ 2 · max|baseline − golden| + eps(dtype) · max|v|.

The floor is one unit in the last place of the largest value, the resolution of the output. The
baseline's error is the larger of its two standard scale placements, ``(q·kᵀ)·s`` and
``(q√s)·(k√s)ᵀ`` (torch SDPA's math backend), which round differently. When
the baseline itself is non-finite where the golden is finite (``q·kᵀ`` overflows fp16 before the
scale, ...), it cannot provide a noise floor; the baseline is then recomputed from the logits
rounded to the dtype (``softmax(round(q·kᵀ·scale)) · v``, every step in the dtype): what the dtype
can represent. A kernel is judged against that, and the row reports both (``baseline_vs_golden_max``
is null, ``noise_from`` says which baseline set the floor). A kernel that returns NaN there fails:
the golden is finite, whatever the baseline does.

Random failures are shrunk (halving N_q, N_k, D, B, H while the same failure persists) and saved as
``repro_<case>_<hash>.pt`` plus a ``.py`` snippet that reloads and re-checks them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import math
import os
import random
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flashprobe.bench.fuzz_cases import (
    CaseInputs,
    FuzzCase,
    RandomCaseSpec,
    UnrepresentableCaseError,
    make_random_case,
    sample_random_spec,
    select_cases,
)
from flashprobe.deviation import error_ratio
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.kernels import (
    Kernel,
    KernelInputError,
    KernelSpecError,
    KernelUnavailableError,
    available_kernels,
    default_scale,
    dtype_name,
    get_kernel,
    golden_attention,
    to_dtype,
)

__all__ = [
    "VERDICTS",
    "FuzzResult",
    "References",
    "catalogue_table",
    "check_case",
    "judge",
    "main",
    "markdown_table",
    "random_search",
    "references",
    "run_catalogue",
    "save_reproducer",
    "shrink",
    "terminal_table",
]

log = logging.getLogger(__name__)

VERDICTS = ("pass", "fail", "skip", "unsupported")
DEFAULT_DTYPES = ("bf16", "fp16", "fp32")
ZEROS_REASON = "row returned zeros where golden is non-zero: sentinel/underflow bug"


@dataclass(frozen=True, kw_only=True)
class References:
    """Everything a kernel's output is judged against, computed once per (case, dtype).

    Attributes:
        golden: ``(B, H, N_q, D_v)`` float64 golden from the cast inputs.
        baseline_max: ``max|baseline − golden|``, ``None`` when the baseline is non-finite where
            the golden is finite (or raised).
        noise_max: the baseline error that sets the noise floor: the larger of the baseline's
            errors with the scale applied to the scores and to q and k (``√scale`` each); or,
            when the baseline is non-finite, the error of the baseline on rounded logits.
        baseline_nonfinite: positions where the same-dtype baseline is NaN/Inf.
        noise_from: ``"baseline"`` or ``"rounded-logits baseline"``.
        floor: ``eps(dtype) · max|v|``.
        fully_masked: ``(B, H, N_q)`` bool, rows that see no key.
        note: why the fallback was used (empty otherwise).
        skip: why the case cannot be posed in this dtype (empty otherwise).
    """

    golden: torch.Tensor
    baseline_max: float | None
    baseline_nonfinite: int
    noise_max: float
    noise_from: str
    floor: float
    fully_masked: torch.Tensor
    note: str = ""
    skip: str = ""

    @property
    def tolerance(self) -> float:
        """``2 · noise_max + floor``."""
        return 2.0 * self.noise_max + self.floor


@dataclass(frozen=True, kw_only=True)
class FuzzResult:
    """The verdict for one (kernel, case, dtype); a row of ``fuzz.json``.

    Attributes:
        kernel: the kernel's spec string.
        case: catalogue name or ``random_<i>``.
        dtype: ``bf16``/``fp16``/``fp32``/``fp64``.
        verdict: one of :data:`VERDICTS`.
        reason: why, in words (also on pass: the error and the tolerance).
        failure: kind of the first failed check: ``raised``, ``inplace``, ``shape``, ``nonfinite``,
            ``zeros``, ``masked_nonzero`` or ``values``; ``None`` unless the verdict is ``fail``.
        primary_vs_golden_max: ``max|primary − golden|``; ``None`` when the primary has NaN/Inf
            where the golden is finite, or produced no output.
        baseline_vs_golden_max: ``max|baseline − golden|``; ``None`` when the baseline is non-finite.
        tolerance: ``2 · noise + floor`` the error was held to.
        noise_from: which baseline set the noise floor.
        primary_nonfinite: NaN/Inf count of the output where the golden is finite.
        baseline_nonfinite: NaN/Inf count of the same-dtype baseline.
        shape: the inputs, e.g. ``B=2 H=2 Nq=16 Nk=203 D=64 mask=bool(2,1,1,203) scale=1``.
        params: the random sample's parameters (random cases only).
        repro: path of the saved reproducer (shrunk random failures only).
    """

    kernel: str
    case: str
    dtype: str
    verdict: str
    reason: str
    failure: str | None = None
    primary_vs_golden_max: float | None = None
    baseline_vs_golden_max: float | None = None
    tolerance: float | None = None
    noise_from: str | None = None
    primary_nonfinite: int = 0
    baseline_nonfinite: int = 0
    shape: str = ""
    params: dict[str, Any] | None = None
    repro: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict; non-finite floats become ``None``."""
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()
        }


# --------------------------------------------------------------------------------------------
# references and the rule


def _label(kernel: str | Kernel) -> str:
    """The kernel as the user wrote its spec (``tiled:mask_value=-5e4``), validated."""
    get_kernel(kernel)
    return kernel.strip() if isinstance(kernel, str) else kernel.spec


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def _finite_max_abs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """``max|a − b|`` over positions where both are finite, and the count where ``a`` is not."""
    finite = torch.isfinite(a)
    diff = torch.where(finite, a - b, 0.0).abs()
    return (diff.max().item() if diff.numel() else 0.0), int((~finite).sum().item())


def _rounded_logits_baseline(inputs: CaseInputs, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``softmax(round_dtype(q·kᵀ·scale + mask)) · v`` with softmax and ``p·v`` in the dtype.

    Args:
        inputs: the case.
        logits: ``(B, H, N_q, N_k)`` float64 scaled logits (mask added).
        valid: ``(B, H, N_q, N_k)`` bool.

    Returns:
        ``(B, H, N_q, D_v)`` in the dtype.
    """
    _, v = inputs.reference_kv()
    z = logits.to(inputs.dtype).masked_fill(~valid, float("-inf"))
    p = torch.softmax(z, dim=-1).masked_fill(~valid.any(-1, keepdim=True), 0.0)
    return p @ v


def _call(kernel: Callable[..., torch.Tensor], inputs: CaseInputs, k: torch.Tensor, v: torch.Tensor) -> Any:
    with torch.no_grad():
        return kernel(
            inputs.q, k, v, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal, scale=inputs.scale
        )


def _prescaled_baseline_max(
    kernel: Kernel, inputs: CaseInputs, k: torch.Tensor, v: torch.Tensor, golden: torch.Tensor
) -> float:
    """``max|baseline − golden|`` with the scale's other standard placement: ``(q√s)·(k√s)ᵀ``.

    Where the scale is applied is an implementation detail of plain attention (torch SDPA's math
    backend scales q and k by √scale); both placements round differently, so both belong to the
    noise floor. Returns 0 when this placement is non-finite or raises (the plain one decides).
    """
    root = math.sqrt(default_scale(inputs.q.shape[-1], inputs.scale))
    try:
        out = _call(kernel, replace(inputs, q=inputs.q * root, scale=1.0), k * root, v)
    except Exception:  # this placement is only a second opinion on the noise
        return 0.0
    err, bad = _finite_max_abs(out.double(), golden)
    return 0.0 if bad else err


def references(inputs: CaseInputs, baseline: str | Kernel = "math") -> References:
    """Golden, baseline error and noise floor for one case (see the module docstring's rule).

    Args:
        inputs: the case in the dtype under test; GQA inputs are expanded for golden and baseline.
        baseline: spec of the same-dtype baseline kernel.

    Returns:
        The :class:`References`; ``skip`` is set when the valid logits do not fit the dtype.
    """
    dtype = inputs.dtype
    k, v = inputs.reference_kv()
    q64, k64, v64 = inputs.q.double(), k.double(), v.double()
    mask = inputs.attn_mask
    golden = golden_attention(q64, k64, v64, attn_mask=mask, is_causal=inputs.is_causal, scale=inputs.scale)
    if not torch.isfinite(golden).all():
        raise ValueError("the golden output is not finite: the case generator is broken")
    valid = inputs.valid_keys()
    raw = q64 @ k64.transpose(-2, -1)  # (B, H, N_q, N_k)
    logits = raw * default_scale(q64.shape[-1], inputs.scale)
    if mask is not None and mask.is_floating_point():
        logits = logits + torch.where(valid, mask.double(), 0.0)
    fmax = float(torch.finfo(dtype).max)
    largest = logits.abs().masked_fill(~valid, 0.0).max().item() if valid.any() else 0.0
    floor = _eps(dtype) * (v64.abs().max().item() if v64.numel() else 0.0)
    fully_masked = ~valid.any(-1)
    name = dtype_name(dtype)
    if largest > fmax:
        return References(
            golden=golden,
            baseline_max=None,
            baseline_nonfinite=0,
            noise_max=0.0,
            noise_from="",
            floor=floor,
            fully_masked=fully_masked,
            skip=f"valid logits up to {largest:.3g} exceed the {name} range (max {fmax:.6g})",
        )
    baseline_kernel = get_kernel(baseline)
    try:
        base = _call(baseline_kernel, inputs, k, v).double()
        base_max, base_bad = _finite_max_abs(base, golden)
        problem = f"is non-finite at {base_bad} positions" if base_bad else ""
    except Exception as err:  # the baseline cannot serve the case: fall back, and say so
        base_max, base_bad, problem = math.inf, 0, f"raised {type(err).__name__}: {err}"
    if not problem:
        return References(
            golden=golden,
            baseline_max=base_max,
            baseline_nonfinite=0,
            noise_max=max(base_max, _prescaled_baseline_max(baseline_kernel, inputs, k, v, golden)),
            noise_from="baseline",
            floor=floor,
            fully_masked=fully_masked,
        )
    raw_max = raw.abs().masked_fill(~valid, 0.0).max().item() if valid.any() else 0.0
    why = f"q·kᵀ (max {raw_max:.3g}) overflows {name} before the scale is applied; " if raw_max > fmax else ""
    fallback = _rounded_logits_baseline(inputs, logits, valid).double()
    fb_max, fb_bad = _finite_max_abs(fallback, golden)
    skip = f"not representable in {name}: even the baseline on rounded logits is non-finite"
    note = (
        f"baseline {_label(baseline)} at {name} {problem} ({why}noise floor taken from the "
        f"baseline on {name}-rounded logits)"
    )
    return References(
        golden=golden,
        baseline_max=None,
        baseline_nonfinite=base_bad,
        noise_max=fb_max,
        noise_from="rounded-logits baseline",
        floor=floor,
        fully_masked=fully_masked,
        note=note,
        skip=skip if fb_bad else "",
    )


def judge(out: torch.Tensor, refs: References) -> tuple[str, str | None, str, float | None, int]:
    """Apply the rule to one kernel output.

    Args:
        out: ``(B, H, N_q, D_v)`` the primary kernel's output (any floating dtype).
        refs: the case's :class:`References`.

    Returns:
        ``(verdict, failure, reason, primary_vs_golden_max, primary_nonfinite)``; ``failure`` is the
        kind of the first failed check (``shape``, ``nonfinite``, ``zeros``, ``masked_nonzero``,
        ``values``) and ``primary_vs_golden_max`` is ``None`` when the output has NaN/Inf.
    """
    golden, tol = refs.golden, refs.tolerance
    if tuple(out.shape) != tuple(golden.shape):
        return "fail", "shape", f"returned shape {tuple(out.shape)}, expected {tuple(golden.shape)}", None, 0
    o = out.detach().double()
    err, bad = _finite_max_abs(o, golden)
    reasons: list[tuple[str, str]] = []
    if bad:
        n_nan = int(torch.isnan(o).sum().item())
        where = ""
        bad_rows = (~torch.isfinite(o)).any(-1)
        if bool(refs.fully_masked.any()) and bool((bad_rows <= refs.fully_masked).all()):
            where = " (all in fully masked rows: expected 0, torch SDPA's convention)"
        text = f"{n_nan} NaN and {bad - n_nan} ±Inf where golden is finite{where}"
        if refs.baseline_nonfinite:
            text += "; the same-dtype baseline is non-finite here too"
        reasons.append(("nonfinite", text))
    golden_rows = golden.abs().amax(-1)  # (B, H, N_q)
    zero_rows = (o == 0).all(-1) & (golden_rows > 2 * tol)
    if zero_rows.any():
        n_rows = zero_rows.numel()
        reasons.append(
            (
                "zeros",
                f"{ZEROS_REASON} ({int(zero_rows.sum())} of {n_rows} rows; golden row max "
                f"up to {golden_rows[zero_rows].max().item():.3g})",
            )
        )
    out_rows = o.abs().amax(-1)
    masked_nonzero = refs.fully_masked & (out_rows > tol)
    if masked_nonzero.any():
        reasons.append(
            (
                "masked_nonzero",
                f"fully masked rows returned non-zero values ({int(masked_nonzero.sum())} rows, max |out| "
                f"{out_rows[masked_nonzero].max().item():.3g}); expected 0, torch SDPA's convention",
            )
        )
    rule = f"2 × {refs.noise_from} {refs.noise_max:.3g} + floor {refs.floor:.3g}"
    if err > tol:
        reasons.append(("values", f"wrong values: max|primary − golden| = {err:.3g} > {rule}"))
    primary_max = None if bad else err
    if reasons:
        text = "; ".join(r for _, r in reasons)
        return "fail", reasons[0][0], text + (f" [{refs.note}]" if refs.note else ""), primary_max, bad
    ratio = error_ratio(err, refs.noise_max)
    text = f"max|primary − golden| = {err:.3g} ≤ {rule} (ratio {ratio:.2f})"
    return "pass", None, text + (f" [{refs.note}]" if refs.note else ""), primary_max, 0


def _run(kernel: Kernel, inputs: CaseInputs) -> torch.Tensor | tuple[str, str | None, str]:
    """Call the kernel on copies of the inputs.

    Returns:
        The output, or ``(verdict, failure, reason)``: ``unsupported`` when the kernel raised
        KernelUnavailableError/KernelInputError; ``fail`` (``raised``) when it raised anything
        else or returned no tensor; ``fail`` (``inplace``) when it modified its inputs.
    """
    mask = None if inputs.attn_mask is None else inputs.attn_mask.clone()
    copies = replace(inputs, q=inputs.q.clone(), k=inputs.k.clone(), v=inputs.v.clone(), attn_mask=mask)
    try:
        out = _call(kernel, copies, copies.k, copies.v)
    except (KernelUnavailableError, KernelInputError) as err:
        return "unsupported", None, f"{type(err).__name__}: {err}"
    except Exception as err:  # any other exception is a bug the fuzzer reports
        return "fail", "raised", f"raised {type(err).__name__}: {err}"
    if not isinstance(out, torch.Tensor):
        return "fail", "raised", f"returned {type(out).__name__}, not a tensor"
    changed = [
        name
        for name in ("q", "k", "v", "attn_mask")
        if getattr(inputs, name) is not None and not torch.equal(getattr(inputs, name), getattr(copies, name))
    ]
    if changed:
        return "fail", "inplace", f"modified its inputs in place: {', '.join(changed)}"
    return out


def check_case(
    kernel: str | Kernel,
    inputs: CaseInputs,
    *,
    case: str = "custom",
    baseline: str | Kernel = "math",
    refs: References | None = None,
) -> FuzzResult:
    """Run one kernel on one case and judge it.

    Args:
        kernel: spec or :class:`~flashprobe.Kernel`.
        inputs: the case in the dtype under test.
        case: the case's name, for the result.
        baseline: same-dtype baseline spec (ignored when ``refs`` is given).
        refs: precomputed :func:`references` (reused across kernels).

    Returns:
        The :class:`FuzzResult`.
    """
    label, kernel = _label(kernel), get_kernel(kernel)
    refs = references(inputs, baseline) if refs is None else refs
    common = {
        "kernel": label,
        "case": case,
        "dtype": dtype_name(inputs.dtype),
        "shape": inputs.describe(),
        "baseline_vs_golden_max": refs.baseline_max,
        "baseline_nonfinite": refs.baseline_nonfinite,
    }
    if refs.skip:
        return FuzzResult(verdict="skip", reason=refs.skip, **common)
    tol = {"tolerance": refs.tolerance, "noise_from": refs.noise_from}
    out = _run(kernel, inputs)
    if not isinstance(out, torch.Tensor):
        verdict, failure, reason = out
        return FuzzResult(verdict=verdict, reason=reason, failure=failure, **tol, **common)
    verdict, failure, reason, primary_max, bad = judge(out, refs)
    return FuzzResult(
        verdict=verdict,
        reason=reason,
        failure=failure,
        primary_vs_golden_max=primary_max,
        primary_nonfinite=bad,
        **tol,
        **common,
    )


# --------------------------------------------------------------------------------------------
# catalogue run


def _case_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _availability(kernel: Kernel, device: torch.device, dtype: torch.dtype) -> str | None:
    try:
        kernel.check(device, dtype)
    except (KernelUnavailableError, KernelInputError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def run_catalogue(
    kernels: Sequence[str | Kernel],
    dtypes: Sequence[str | torch.dtype],
    *,
    cases: Iterable[FuzzCase] | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    baseline: str | Kernel = "math",
) -> list[FuzzResult]:
    """Run every case against every kernel at every dtype.

    Golden and baseline are computed once per (case, dtype) and shared by the kernels. The inputs
    of a case depend only on ``seed`` and the case's name.

    Returns:
        One :class:`FuzzResult` per (case, dtype, kernel), in that order.
    """
    labels = [_label(k) for k in kernels]
    device = torch.device(device)
    resolved = [to_dtype(d) for d in dtypes]
    unavailable = {(k, d): _availability(get_kernel(k), device, d) for k in labels for d in resolved}
    results: list[FuzzResult] = []
    for case in cases if cases is not None else select_cases():
        for dtype in resolved:
            try:
                inputs = case.make(dtype, _case_generator(seed, case.name)).to(device)
                refs = references(inputs, baseline)
            except UnrepresentableCaseError as err:
                results += [
                    FuzzResult(
                        kernel=k,
                        case=case.name,
                        dtype=dtype_name(dtype),
                        verdict="skip",
                        reason=str(err),
                    )
                    for k in labels
                ]
                continue
            for kernel in labels:
                if (why := unavailable[kernel, dtype]) is not None:
                    results.append(
                        FuzzResult(
                            kernel=kernel,
                            case=case.name,
                            dtype=dtype_name(dtype),
                            verdict="unsupported",
                            reason=why,
                            shape=inputs.describe(),
                        )
                    )
                    continue
                results.append(check_case(kernel, inputs, case=case.name, refs=refs))
                log.debug("%s %s %s: %s", kernel, case.name, dtype_name(dtype), results[-1].verdict)
    return results


# --------------------------------------------------------------------------------------------
# random search, shrinking, reproducers


def shrink(
    kernel: str | Kernel,
    spec: RandomCaseSpec,
    dtype: torch.dtype,
    failure: str,
    *,
    device: str | torch.device = "cpu",
    baseline: str | Kernel = "math",
    max_tries: int = 60,
) -> tuple[RandomCaseSpec, CaseInputs, FuzzResult]:
    """Halve N_q, N_k, D, B, H (in turn, repeatedly) while the kernel fails the same way.

    Args:
        kernel: the failing kernel.
        spec: the failing random sample.
        dtype: its dtype.
        failure: the failure kind to preserve (:attr:`FuzzResult.failure`).
        device: where to run.
        baseline: same-dtype baseline spec.
        max_tries: most candidate cases to evaluate.

    Returns:
        The smallest failing spec found, its inputs and its result.
    """
    kernel = _label(kernel)
    inputs = make_random_case(spec, dtype).to(device)
    result = check_case(kernel, inputs, case="shrink", baseline=baseline)
    tries, changed = 0, True
    while changed and tries < max_tries:
        changed = False
        for size in RandomCaseSpec.SIZES:
            while tries < max_tries and (smaller := spec.halved(size)) is not None:
                tries += 1
                candidate = make_random_case(smaller, dtype).to(device)
                outcome = check_case(kernel, candidate, case="shrink", baseline=baseline)
                if outcome.verdict != "fail" or outcome.failure != failure:
                    break
                spec, inputs, result, changed = smaller, candidate, outcome, True
    log.info("shrunk %s failure of %s to %s after %d tries", failure, kernel, spec.describe(), tries)
    return spec, inputs, result


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` to a unique temporary file next to ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_text(path: Path, text: str) -> None:
    atomic_write_text(path, text)


_SNIPPET = '''"""Reproducer saved by `flashprobe fuzz --budget`: {kernel} fails {case} at {dtype}.

Inputs: {shape}
Reason: {reason}

Run `python {stem}.py`: it exits 1 while the kernel still fails and 0 once it passes.
"""

import importlib
import sys
from pathlib import Path

import torch

from flashprobe import get_kernel, golden_attention
from flashprobe.bench.fuzz import check_case
from flashprobe.bench.fuzz_cases import CaseInputs

KERNEL = {kernel!r}
KERNEL_MODULE = {module!r}  # imported first: it registers the kernel (None: built in)

if KERNEL_MODULE:
    importlib.import_module(KERNEL_MODULE)
saved = torch.load(Path(__file__).with_suffix(".pt"), weights_only=True)
inputs = CaseInputs(
    q=saved["q"],  # (B, H, N_q, D)
    k=saved["k"],  # (B, H_kv, N_k, D)
    v=saved["v"],  # (B, H_kv, N_k, D_v)
    attn_mask=saved["attn_mask"],
    is_causal=saved["is_causal"],
    scale=saved["scale"],
)
k, v = inputs.reference_kv()
out = get_kernel(KERNEL)(inputs.q, inputs.k, inputs.v, attn_mask=inputs.attn_mask,
                         is_causal=inputs.is_causal, scale=inputs.scale)
golden = golden_attention(inputs.q, k, v, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal,
                          scale=inputs.scale)
print(f"{{KERNEL}} on {{inputs.describe()}}")
print(f"non-finite outputs: {{(~torch.isfinite(out)).sum().item()}}, all-zero rows: "
      f"{{(out == 0).all(-1).sum().item()}}, golden all-zero rows: {{(golden == 0).all(-1).sum().item()}}")
result = check_case(KERNEL, inputs, case={case!r}, baseline=saved["baseline"])
print(f"{{result.verdict}}: {{result.reason}}")
sys.exit(1 if result.verdict == "fail" else 0)
'''


def save_reproducer(
    out_dir: str | Path,
    case: str,
    kernel: str | Kernel,
    inputs: CaseInputs,
    result: FuzzResult,
    *,
    baseline: str | Kernel = "math",
    params: dict[str, Any] | None = None,
) -> Path:
    """Save ``repro_<case>_<hash>.pt`` (inputs on CPU, kernel, dtype) and a ``.py`` that re-checks it.

    The snippet imports the module that registered a user kernel (``kernel.fn.__module__``) and
    exits 1 while the failure reproduces.

    Returns:
        Path of the ``.pt`` file.
    """
    label, kernel = _label(kernel), get_kernel(kernel)
    cpu = inputs.to("cpu")
    module = kernel.fn.__module__
    module = None if module.startswith("flashprobe.kernels") or module == "__main__" else module
    digest = hashlib.sha1(
        json.dumps([label, result.dtype, params, inputs.describe()], sort_keys=True, default=str).encode()
    ).hexdigest()[:8]
    stem = f"repro_{case}_{digest}"
    out_dir = Path(out_dir)
    payload = {
        "q": cpu.q,
        "k": cpu.k,
        "v": cpu.v,
        "attn_mask": cpu.attn_mask,
        "is_causal": cpu.is_causal,
        "scale": cpu.scale,
        "kernel": label,
        "kernel_module": module,
        "dtype": result.dtype,
        "baseline": _label(baseline),
        "case": case,
        "reason": result.reason,
        "params": params or {},
    }
    _atomic_write(out_dir / f"{stem}.pt", lambda tmp: torch.save(payload, tmp))
    snippet = _SNIPPET.format(
        kernel=label,
        case=case,
        dtype=result.dtype,
        shape=inputs.describe(),
        reason=result.reason.replace('"""', "'''"),
        stem=stem,
        module=module,
    )
    _write_text(out_dir / f"{stem}.py", snippet)
    return out_dir / f"{stem}.pt"


def random_search(
    kernels: Sequence[str | Kernel],
    dtypes: Sequence[str | torch.dtype],
    *,
    budget: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
    baseline: str | Kernel = "math",
    out_dir: str | Path | None = None,
) -> list[FuzzResult]:
    """Sample ``budget`` random cases (dtypes in turn) and run every kernel on each.

    The first failure of each (kernel, dtype, failure kind) is shrunk with :func:`shrink` and, when
    ``out_dir`` is given, saved with :func:`save_reproducer`; its row carries the path in ``repro``.

    Returns:
        One :class:`FuzzResult` per (sample, kernel); cases are named ``random_<i>``.
    """
    if budget < 0:
        raise ValueError(f"budget={budget} must be ≥ 0")
    labels = [_label(k) for k in kernels]
    device = torch.device(device)
    resolved = [to_dtype(d) for d in dtypes]
    unavailable = {(k, d): _availability(get_kernel(k), device, d) for k in labels for d in resolved}
    rng = random.Random(seed)
    shrunk: set[tuple[str, torch.dtype, str | None]] = set()
    results: list[FuzzResult] = []
    for i in range(budget):
        dtype = resolved[i % len(resolved)]
        spec = sample_random_spec(rng, dtype)
        name = f"random_{i:03d}"
        inputs = make_random_case(spec, dtype).to(device)
        refs = references(inputs, baseline)
        for kernel in labels:
            if (why := unavailable[kernel, dtype]) is not None:
                result = FuzzResult(
                    kernel=kernel, case=name, dtype=dtype_name(dtype), verdict="unsupported", reason=why
                )
            else:
                result = check_case(kernel, inputs, case=name, refs=refs)
            result = replace(result, params=spec.as_dict())
            key = (kernel, dtype, result.failure)
            if result.verdict == "fail" and key not in shrunk:
                shrunk.add(key)
                small, small_inputs, small_result = shrink(
                    kernel, spec, dtype, result.failure or "", device=device, baseline=baseline
                )
                if out_dir is not None:
                    path = save_reproducer(
                        out_dir,
                        name,
                        kernel,
                        small_inputs,
                        small_result,
                        baseline=baseline,
                        params=small.as_dict(),
                    )
                    result = replace(result, repro=str(path))
            results.append(result)
    return results


# --------------------------------------------------------------------------------------------
# output


def _verdict_cell(verdict: str) -> str:
    return {"pass": "pass", "fail": "FAIL", "skip": "skip", "unsupported": "unsup"}[verdict]


def terminal_table(results: Sequence[FuzzResult]) -> str:
    """One block per dtype: a row per case, a column per kernel, a verdict per cell."""
    kernels = list(dict.fromkeys(r.kernel for r in results))
    lines: list[str] = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        rows = [r for r in results if r.dtype == dtype]
        cases = list(dict.fromkeys(r.case for r in rows))
        width = max(len(c) for c in [*cases, dtype])
        cell = {(r.case, r.kernel): _verdict_cell(r.verdict) for r in rows}
        widths = [max(len(k), 5) for k in kernels]
        lines.append(
            "  ".join([f"{dtype:<{width}}", *(f"{k:<{w}}" for k, w in zip(kernels, widths, strict=True))])
        )
        for case in cases:
            cells = (f"{cell.get((case, k), '-'):<{w}}" for k, w in zip(kernels, widths, strict=True))
            lines.append("  ".join([f"{case:<{width}}", *cells]).rstrip())
        lines.append("")
    return "\n".join(lines)


def markdown_table(results: Sequence[FuzzResult]) -> str:
    """A Markdown table: a row per case, a column per kernel, each cell the verdicts per dtype."""
    kernels = list(dict.fromkeys(r.kernel for r in results))
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    verdict = {(r.case, r.kernel, r.dtype): r.verdict for r in results}
    mark = {"pass": "pass", "fail": "**FAIL**", "skip": "skip", "unsupported": "unsup"}
    lines = [
        f"| case ({' / '.join(dtypes)}) | " + " | ".join(f"`{k}`" for k in kernels) + " |",
        "| --- |" + " --- |" * len(kernels),
    ]
    for case in dict.fromkeys(r.case for r in results):
        cells = [" / ".join(mark.get(verdict.get((case, k, d), ""), "-") for d in dtypes) for k in kernels]
        lines.append(f"| `{case}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _summary(results: Sequence[FuzzResult]) -> dict[str, int]:
    return {v: sum(r.verdict == v for r in results) for v in VERDICTS}


# --------------------------------------------------------------------------------------------
# CLI


def _split(values: Iterable[str] | None) -> list[str]:
    return [p.strip() for v in values or [] for p in v.split(",") if p.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashprobe fuzz",
        description="Run adversarial edge cases (sentinel logits, fully masked rows, overflow, odd shapes, "
        "...) against attention kernels; judge each against the FP64 golden with the 2x rule. "
        "Exits 1 when any (kernel, case) fails.",
    )
    p.add_argument(
        "--kernel",
        action="append",
        metavar="SPEC",
        help="kernel spec, repeatable (e.g. --kernel tiled --kernel 'tiled:mask_value=-5e4')",
    )
    p.add_argument(
        "--dtype", action="append", metavar="DTYPE", help="dtypes, repeatable or comma list (bf16,fp16,fp32)"
    )
    p.add_argument("--case", action="append", metavar="PATTERN", help="glob of case names to run, repeatable")
    p.add_argument("--exclude", action="append", metavar="PATTERN", help="glob of case names to leave out")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--out", default="out/fuzz", metavar="DIR", help="output directory (default out/fuzz)")
    p.add_argument(
        "--budget", type=int, default=0, metavar="N", help="random samples after the catalogue (default 0)"
    )
    p.add_argument("--no-catalogue", action="store_true", help="run only the random search")
    p.add_argument("--baseline", default="math", metavar="SPEC", help="same-dtype baseline (default math)")
    p.add_argument("--device", default="cpu", help="device to run on (default cpu)")
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE first (it registers your kernels with flashprobe.register_kernel); repeatable",
    )
    p.add_argument("--list", action="store_true", help="print the catalogue as a Markdown table and exit")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print every (kernel, case, dtype) with its reason"
    )
    return p


def catalogue_table() -> str:
    """The catalogue as a Markdown table: case, what it probes, what the golden expects."""
    lines = ["| case | what it probes | expected (FP64 golden) |", "| --- | --- | --- |"]
    lines += [f"| `{c.name}` | {c.probes} | {c.expected} |" for c in select_cases()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe fuzz``: 0 when nothing fails, 1 when a (kernel, case) fails, 2 on bad usage."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as stop:  # --help (0) or a usage error (2)
        return int(stop.code or 0)
    if args.list:
        print(catalogue_table())
        return 0
    for module in args.imports or []:
        try:
            importlib.import_module(module)
        except ImportError as err:
            print(f"flashprobe fuzz: --import {module}: {err}", file=sys.stderr)
            return 2
    if not args.kernel:
        print(
            "flashprobe fuzz: give at least one --kernel SPEC; available: " + ", ".join(available_kernels()),
            file=sys.stderr,
        )
        return 2
    try:
        kernels = [_label(k) for k in args.kernel]
        baseline = _label(args.baseline)
        dtypes = [to_dtype(d) for d in (_split(args.dtype) or DEFAULT_DTYPES)]
        patterns = _split(args.case) + ["!" + p for p in _split(args.exclude)]
        cases = [] if args.no_catalogue else select_cases(patterns)
        if args.budget < 0:
            raise ValueError(f"--budget {args.budget} must be ≥ 0")
        device = torch.device(args.device)
    except (KernelSpecError, ValueError, RuntimeError) as err:
        print(f"flashprobe fuzz: {err}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    start = time.perf_counter()
    results = run_catalogue(kernels, dtypes, cases=cases, seed=args.seed, device=device, baseline=baseline)
    catalogue_s = time.perf_counter() - start
    random_results = random_search(
        kernels, dtypes, budget=args.budget, seed=args.seed, device=device, baseline=baseline, out_dir=out_dir
    )
    elapsed = time.perf_counter() - start
    results += random_results
    summary = _summary(results)
    names = ", ".join(dtype_name(d) for d in dtypes)
    print(
        f"flashprobe fuzz: {len(cases)} cases + {args.budget} random × {len(kernels)} kernels × {names} "
        f"(seed {args.seed}, baseline {baseline}) in {elapsed:.1f} s\n"
    )
    if cases:
        print(terminal_table([r for r in results if r.params is None]))
    if random_results:
        failed = [r for r in random_results if r.verdict == "fail"]
        print(f"random search: {args.budget} samples, {len(failed)} failing (kernel, sample) pairs")
    for r in results:
        if r.verdict == "fail" or args.verbose:
            print(f"{r.verdict.upper():<5} {r.kernel} | {r.case} | {r.dtype}: {r.reason}")
            if r.repro:
                print(f"      shrunk reproducer: {r.repro} (run: python {Path(r.repro).with_suffix('.py')})")
    payload = {
        "command": "flashprobe fuzz " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "device": str(device),
        "seed": args.seed,
        "baseline": baseline,
        "dtypes": [dtype_name(d) for d in dtypes],
        "kernels": kernels,
        "cases": [c.name for c in cases],
        "budget": args.budget,
        "rule": "max|primary - golden| <= 2 * max|baseline - golden| + eps(dtype) * max|v|; golden = fp64 "
        "from the cast inputs; baseline error = max over scale placements (q k^T) s and (q sqrt(s)) "
        "(k sqrt(s))^T; a non-finite baseline is replaced by the baseline on dtype-rounded logits",
        "elapsed_s": round(elapsed, 3),
        "catalogue_s": round(catalogue_s, 3),
        "summary": summary,
        "rows": [r.as_dict() for r in results],
    }
    _write_text(out_dir / "fuzz.json", json.dumps(payload, indent=1, allow_nan=False) + "\n")
    if cases:
        _write_text(out_dir / "fuzz.md", markdown_table([r for r in results if r.params is None]))
    print(
        f"\n{summary['pass']} pass, {summary['fail']} fail, {summary['skip']} skip, "
        f"{summary['unsupported']} unsupported; wrote {out_dir / 'fuzz.json'}"
    )
    return 1 if summary["fail"] else 0
