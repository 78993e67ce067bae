"""Invariants: relations a correct kernel keeps, oracles where a tolerance is blind; and whether a
kernel computes at the precision it declares. Beside them, the one place ``flashprobe fuzz`` runs the
sequences and invariants (:data:`CHECKS`, :func:`select_checks`, :func:`run_checks`).

Each invariant of :data:`INVARIANTS` (its ``probes`` says what it checks) is judged exactly where the
relation is exact in floating point (``inv_value_scaling``, ``inv_batch``, ``inv_determinism``: bit
for bit) and with the rule's limits (:mod:`flashprobe.judge`) where it holds up to rounding.
``inv_forward_backward`` compares the kernel's gradients with central differences of its own forward,
the golden's finite-difference error removed, against the baseline's. ``inv_declared_precision``
reports a kernel that declares an FP8 format (``KernelCapabilities.fp8``) and is more than twice as
accurate as the best rounding of that format (of Q, K, V or of P alone) as ``not_declared``.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from flashprobe.fuzz.cases import CATALOGUE, CasePatterns, case_generator
from flashprobe.fuzz.fit import NotApplicableError
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import REFUSALS, kernel_label
from flashprobe.fuzz.reproducer import ReproducerStore, failure_directions
from flashprobe.fuzz.rule import noise, output_errors
from flashprobe.fuzz.run import FuzzResult
from flashprobe.fuzz.sequences import (
    SEQUENCES,
    Builder,
    Check,
    Outcome,
    call_problem,
    judge_output,
    references_for,
    save_sequence,
)
from flashprobe.judge import RELATIVE_LIMITS, absolute_limit, fp8_baseline, fp8_realisations, judge_errors
from flashprobe.kernels import (
    AttentionCall,
    Kernel,
    default_scale,
    dtype_name,
)
from flashprobe.kernels import get_kernel as _get
from flashprobe.kernels.fp8 import FP8_DTYPES, cast_fp8, realisation_shifts

__all__ = ["CHECKS", "INVARIANTS", "checks_table", "run_checks", "select_checks"]


def _inputs(b: Builder, n_q: int, n_k: int, d: int, *, batch: int = 1, causal: bool = False) -> CaseInputs:
    """Standard normal inputs at shapes the kernel takes (causal only where it takes it)."""
    q, k, v = b.qkv("", batch, n_q, n_k, d)
    causal = causal and "causal" in b.kernel.capabilities.masks
    if causal and b.tensors[q].shape[2] != b.tensors[k].shape[2]:
        causal = False
    return CaseInputs(q=b.tensors[q], k=b.tensors[k], v=b.tensors[v], is_causal=causal)


def _fp8_inputs(b: Builder) -> torch.dtype | None:
    """``float8_e4m3fn`` when the kernel lists it among its dtypes and the check runs at bf16 (FP8
    inputs' output dtype); else None."""
    dtypes = b.kernel.capabilities.dtypes
    fp8 = torch.float8_e4m3fn
    return fp8 if dtypes is not None and fp8 in dtypes and b.dtype == torch.bfloat16 else None


def _run(kernel: Kernel, x: CaseInputs, *, grad: bool = False) -> torch.Tensor:
    """The kernel's logical output on ``x`` (through its api's adapter); with ``grad``, on leaves
    ``x.q``, ``x.k``, ``x.v`` that require grad."""
    call = AttentionCall(q=x.q, k=x.k, v=x.v, attn_mask=x.attn_mask, causal=x.is_causal, scale=x.scale)
    problem = call_problem(kernel, call)
    if problem is not None:
        raise NotApplicableError(problem)
    with torch.set_grad_enabled(grad):
        return kernel.run(call).out


def _bits(a: torch.Tensor, b: torch.Tensor, what: str) -> Outcome | None:
    """A failure when ``a`` and ``b`` differ in any bit (NaN equal to NaN), else None."""
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):
        return None
    diff = (a.double() - b.double()).abs().nan_to_num(float("inf"))[~same]
    return Outcome("fail", f"{what}: {int((~same).sum())} of {same.numel()} values differ (largest by "
                   f"{diff.max().item():.3g})", "bits")  # fmt: skip


def _grads(kernel: Kernel, x: CaseInputs, d_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The kernel's output and ``dq``, ``dk``, ``dv`` on fresh leaves holding ``x``'s values."""
    leaves = [t.detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
    out = _run(kernel, replace(x, q=leaves[0], k=leaves[1], v=leaves[2]), grad=True)
    found = torch.autograd.grad(out, leaves, d_out.to(out.dtype), allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, found, strict=True)]


# ---- the invariants -------------------------------------------------------------------------------


def _unit_values(b: Builder) -> Outcome:
    n_q, n_k, d = b.fit(48, 1024, 64)
    s = default_scale(d, None)
    gen, kinds = b.gen, torch.arange(n_q) % 3  # peaked, sink, diffuse rows
    k = torch.randn(1, 2, n_k, d, generator=gen, dtype=torch.float64)
    k[..., :2] = 0.0
    k[0, torch.arange(2), torch.randint(1, n_k, (2,), generator=gen), 0] = 1.0  # each head's peak key
    k[..., 0, 1] = 1.0  # the sink key
    q = torch.zeros(1, 2, n_q, d, dtype=torch.float64)
    q[..., kinds == 0, 0] = 7.0 / s  # one logit 7 above the others
    q[..., kinds == 1, 1] = 8.0 / s  # the sink key 8 above a rest spread by about ±0.5
    for kind, spread in ((1, 0.5), (2, 2.0)):  # (diffuse: logits spread by about ±2)
        rows = int((kinds == kind).sum())
        q[..., kinds == kind, 2:] = (
            torch.randn(1, 2, rows, d - 2, generator=gen, dtype=torch.float64) * spread / (s * d**0.5)
        )
    wire = _fp8_inputs(b) or b.dtype  # FP8 inputs (e4m3: 7/s, 8/s and 1 exact) for an FP8-input kernel
    x = CaseInputs(q=q.to(wire), k=k.to(wire), v=torch.ones(1, 2, n_k, d, dtype=wire))
    err = (_run(b.kernel, x).double() - 1.0).abs().amax(-1)  # (1, 2, N_q)
    fmt = b.kernel.capabilities.fp8 or ("e4m3" if wire != b.dtype else None)
    u = float(torch.finfo(FP8_DTYPES[fmt]).eps) / 2 if fmt else 0.0
    limit = u + absolute_limit(b.dtype, "out")
    worst = [err[..., kinds == i].max().item() for i in range(3)]
    text = ", ".join(f"{n} rows {w:.3g}" for n, w in zip(("peaked", "sink", "diffuse"), worst, strict=True))
    verdict = "fail" if max(worst) > limit or not bool(torch.isfinite(err).all()) else "pass"
    why = f"V = 1: max |out − 1| {text}; limit {limit:.3g} (" + (f"{fmt} rounding {u:g} + " if fmt else "")
    return Outcome(verdict, why + f"the rule's absolute limit {absolute_limit(b.dtype, 'out'):.3g})",
                   "values" if verdict == "fail" else None)  # fmt: skip


def _positions(b: Builder) -> Outcome:
    x = _inputs(b, 64, 96, 64)
    n_k, d = x.k.shape[2], x.v.shape[3]
    v = torch.nn.functional.one_hot(torch.arange(n_k) % d, d).to(b.dtype).expand(*x.v.shape).contiguous()
    x = replace(x, v=v)
    verdict = judge_output(_run(b.kernel, x), references_for(b.kernel, x, b.baseline))
    return Outcome(verdict.verdict, f"V = one-hot key positions: {verdict.reason}", verdict.failure)


def _key_permutation(b: Builder) -> Outcome:
    x = _inputs(b, 48, 96, 32)
    perm = torch.randperm(x.k.shape[2], generator=b.gen)
    y = replace(x, k=x.k[:, :, perm].contiguous(), v=x.v[:, :, perm].contiguous())
    out0, out1 = _run(b.kernel, x), _run(b.kernel, y)
    base, precision = fp8_baseline(b.kernel, b.baseline)
    with torch.no_grad():  # the baseline's own change, and the spread of an FP8 baseline's roundings
        base0 = _get(base)(x.q, x.k, x.v).double()
        spread = [noise(_get(base)(y.q, y.k, y.v).double(), base0)]
        spread += [noise(_get(r)(x.q, x.k, x.v).double(), base0) for r in fp8_realisations(base)]
    l2, row = max(s[1] for s in spread), max(s[2] for s in spread)
    errors, _, _ = output_errors(out1.double(), out0.double(), l2, row)
    judged = judge_errors(errors, b.dtype, "out", precision=precision)
    what = "out with the keys permuted against out"
    if judged.verdict == "fail":
        return Outcome(
            "fail", f"{what}: changed beyond rounding ({judged.criterion}): {judged.reason}", "values"
        )
    return Outcome(
        "pass", f"{what}: change / limit {judged.limit_ratio:.3g} (the baseline's change as yardstick)"
    )


def _value_scaling(b: Builder) -> Outcome:
    x = _inputs(b, 48, 80, 32, causal=True)
    out0, out1 = _run(b.kernel, x), _run(b.kernel, replace(x, v=x.v * 8))
    normal = out0.abs() >= torch.finfo(out0.dtype).tiny  # (subnormal outputs scale inexactly)
    failed = _bits(out1[normal], out0[normal] * 8, "out at V·2³ against out·2³")
    return failed or Outcome("pass", "out at V·2³ is out·2³ bit for bit (every normal value)")


def _batch(b: Builder) -> Outcome:
    if not b.kernel.capabilities.batch_invariant:
        raise NotApplicableError("it does not declare batch_invariant=True")
    x = _inputs(b, 40, 72, 32, batch=3, causal=True)
    full = _run(b.kernel, x)
    for i in range(3):
        alone = _run(b.kernel, replace(x, q=x.q[i : i + 1], k=x.k[i : i + 1], v=x.v[i : i + 1]))
        failed = _bits(alone, full[i : i + 1], f"batch entry {i} alone against in a batch of 3")
        if failed:
            return failed
    return Outcome("pass", "each of 3 batch entries alone gives the bits it gets in the batch")


def _determinism(b: Builder) -> Outcome:
    if not b.kernel.capabilities.deterministic:
        raise NotApplicableError("it does not declare deterministic=True")
    x = _inputs(b, 48, 80, 32, batch=2, causal=True)
    d_out = b.randn(*x.q.shape[:3], x.v.shape[3]).to(b.dtype)
    caps = b.kernel.capabilities
    backward = b.backward and caps.has_backward(b.device)
    runs = [_grads(b.kernel, x, d_out) if backward else (_run(b.kernel, x), []) for _ in range(2)]
    firsts, seconds = [runs[0][0], *runs[0][1]], [runs[1][0], *runs[1][1]]
    for name, one, two in zip(("out", "dq", "dk", "dv"), firsts, seconds, strict=False):
        failed = _bits(two, one, f"{name} of the second call against the first")
        if failed:
            return failed
    return Outcome("pass", "two calls gave the same bits: out" + (", dq, dk, dv" if backward else ""))


def _fd_disagreement(
    fn: Callable[[list[torch.Tensor]], torch.Tensor], grad: torch.Tensor, xs: list[torch.Tensor],
    i: int, delta: torch.Tensor, h: float, d_out: torch.Tensor, *, wide: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """``(⟨dO, f(x₊) − f(x₋)⟩ − ⟨grad, x₊ − x₋⟩, ⟨grad, x₊ − x₋⟩)``: input ``i`` moved by ±``h·delta``,
    each point rounded to the inputs' dtype (the step taken is the step compared); ``wide``: ``f``
    evaluated at those points in float64."""
    moved = [(xs[i].double() + sign * h * delta).to(xs[i].dtype) for sign in (1, -1)]
    points = [[*xs[:i], m, *xs[i + 1 :]] for m in moved]
    if wide:
        points = [[t.double() for t in p] for p in points]
    with torch.no_grad():
        ends = [(fn(p).double() * d_out.double()).sum() for p in points]
    predicted = (grad.double() * (moved[0].double() - moved[1].double())).sum()
    return (ends[0] - ends[1] - predicted).item(), predicted.item()


def _forward_backward(b: Builder) -> Outcome:
    if not b.backward or not b.kernel.capabilities.has_backward(b.device):
        raise NotApplicableError("gradients are not checked" if not b.backward else "it has no backward here")
    x = _inputs(b, 37, 37, 32, causal=True)
    d_out = b.randn(*x.q.shape[:3], x.v.shape[3])
    try:
        grads = _grads(b.kernel, x, d_out.to(b.dtype))[1]
    except NotApplicableError:
        raise
    except Exception as err:  # no backward for this call after all
        raise NotApplicableError(f"its backward did not run ({type(err).__name__}: {err})") from None
    gold, base = _get("math"), _get(fp8_baseline(b.kernel, b.baseline)[0])
    g_out, g_grads = _grads(gold, replace(x, q=x.q.double(), k=x.k.double(), v=x.v.double()), d_out)
    try:
        b_grads = _grads(base, x, d_out.to(b.dtype))[1]
    except Exception:  # a forward-only baseline (FP8): the golden's gradient beside its forward
        b_grads = g_grads
    forms = {
        "kernel": (lambda t: _run(b.kernel, replace(x, q=t[0], k=t[1], v=t[2])), grads, False),
        "baseline": (lambda t: base(*t, is_causal=x.is_causal), b_grads, False),
        "golden": (lambda t: gold(*t, is_causal=x.is_causal), g_grads, True),
    }
    xs, eps = [x.q, x.k, x.v], float(torch.finfo(b.dtype).eps)
    floor = eps * (g_out * d_out).norm().item()  # two outputs' rounding, seen through dO
    texts = []
    for i, name in enumerate(("dq", "dk", "dv")):
        # along the golden gradient and the kernel's disagreement with it: where a backward that is
        # not its forward's derivative (or a forward that is not plain attention) shows
        apart = grads[i].double() - g_grads[i]
        delta = g_grads[i] / g_grads[i].norm().clamp(min=1e-300) + apart / apart.norm().clamp(min=1e-300)
        h = eps**0.5 * xs[i].double().norm().item() / delta.norm().item()
        found = {
            n: _fd_disagreement(f, g[i], xs, i, delta, h, d_out, wide=w) for n, (f, g, w) in forms.items()
        }
        e_g, pred = found["golden"][0], found["golden"][1]
        ratio = abs(found["kernel"][0] - e_g) / max(abs(found["baseline"][0] - e_g), floor, 1e-300)
        texts.append(f"{name} off by {abs(found['kernel'][0] - e_g) / max(abs(pred), 1e-300):.2g} of the "
                     f"step's change, {ratio:.3g}x the baseline's")  # fmt: skip
        if ratio > RELATIVE_LIMITS[name]:
            return Outcome("fail", f"the backward is not the derivative of the forward: {texts[-1]} (limit "
                           f"{RELATIVE_LIMITS[name]:g}x)", f"{name}:forward_backward")  # fmt: skip
    return Outcome("pass", f"the backward agrees with the forward's finite differences: {'; '.join(texts)}")


def _p_rounded(x: CaseInputs, fmt: str, shift: float) -> torch.Tensor:
    """Attention in float64 with only P rounded to ``fmt``, at FA3's scale 2⁸ times ``shift``."""
    q, k, v = x.q.double(), x.k.double(), x.v.double()
    s = q @ k.transpose(-2, -1) * default_scale(q.shape[-1], x.scale)
    if x.is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    scale = 256.0 * shift
    return (cast_fp8(p * scale, fmt).double() / scale) @ v / p.sum(-1, keepdim=True)


def _declared_precision(b: Builder) -> Outcome:
    fmt, wire = b.kernel.capabilities.fp8, _fp8_inputs(b)
    if fmt is None:  # (FP8 inputs alone declare nothing: a kernel may dequantize them and compute wide)
        raise NotApplicableError("it declares no FP8 format (KernelCapabilities.fp8)")
    dtypes = b.kernel.capabilities.dtypes
    if not wire and dtypes is not None and torch.float8_e4m3fn in dtypes:
        raise NotApplicableError(
            f"its {fmt} path takes FP8 inputs (checked in the bf16 run); {dtype_name(b.dtype)} inputs take "
            "its wide path"
        )
    x = _inputs(b, 128, 128, 64, batch=2, causal=True)
    if wire:  # FP8 inputs: only P (and the output) can be rounded; the golden is of the FP8 values
        x = replace(x, q=x.q.to(wire), k=x.k.to(wire), v=x.v.to(wire))
    wide = replace(x, q=x.q.double(), k=x.k.double(), v=x.v.double())
    golden = references_for(_get("math"), wide, "math").golden

    def error(out: torch.Tensor) -> float:
        return ((out.double() - golden).norm() / golden.norm()).item()

    found = error(_run(b.kernel, x))
    base = f"math:fp8={fmt}"
    with torch.no_grad():
        qkv = [] if wire else [
            error(_get(spec)(x.q, x.k, x.v, is_causal=x.is_causal))
            for spec in [base, *fp8_realisations(base)]
        ]  # fmt: skip
    count = 1 + len(fp8_realisations(base))
    p_only = [error(_p_rounded(wide, fmt, realisation_shifts(r)[0])) for r in range(count)]
    least = min(qkv + p_only)
    text = (f"relative error {found:.3g}; the least of any {fmt} rounding of "
            f"{'P (FP8 inputs)' if wire else 'Q, K, V or P'} over {count} realisations {least:.3g} "
            f"({least / max(found, 1e-300):.3g}x)")  # fmt: skip
    if found < least / 2:
        return Outcome("not_declared", f"not the declared precision ({fmt}): {text}, more accurate than "
                       f"any {fmt} kernel can be", "precision")  # fmt: skip
    return Outcome("pass", f"within the declared precision ({fmt}): {text}")


def _invariant(build: Callable[[Builder], Outcome], name: str) -> Callable[..., Outcome]:
    def run(
        kernel: Kernel, dtype: torch.dtype, seed: int, baseline: str | Kernel, backward: bool, device: Any
    ) -> Outcome:
        builder = Builder(kernel, dtype, case_generator(seed, name), backward, torch.device(device), baseline)
        try:
            return build(builder)
        except NotApplicableError as err:
            return Outcome("unsupported", f"not applicable to this kernel: {err}")

    return run


_INV = "invariant: "
#: Every invariant, by name.
INVARIANTS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("inv_unit_values", _INV + "V = 1 ⇒ out = 1", "peaked, sink and diffuse rows with V = 1 "
              "(FP8 P cast without its prescale)", _invariant(_unit_values, "inv_unit_values")),
        Check("inv_positions", _INV + "V = one-hot positions", "out = the attention matrix folded into D "
              "columns (a tile stored permuted or transposed)", _invariant(_positions, "inv_positions")),
        Check("inv_key_permutation", _INV + "key permutation", "permuted keys and values leave out unchanged "
              "up to rounding", _invariant(_key_permutation, "inv_key_permutation"), profiles=("full",)),
        Check("inv_value_scaling", _INV + "V × 2^k", "V·2³ gives out·2³ bit for bit",
              _invariant(_value_scaling, "inv_value_scaling")),
        Check("inv_batch", _INV + "batch invariance", "a row's bits do not depend on the rest of the batch "
              "(declared batch_invariant=True)", _invariant(_batch, "inv_batch")),
        Check("inv_determinism", _INV + "determinism", "repeated calls give the same bits, backward included "
              "(declared deterministic=True)", _invariant(_determinism, "inv_determinism")),
        Check("inv_forward_backward", _INV + "forward-backward agreement", "the backward is the derivative "
              "of the kernel's own forward (finite differences)",
              _invariant(_forward_backward, "inv_forward_backward"), profiles=("full",)),
        Check("inv_declared_precision", _INV + "declared precision", "an FP8 kernel is not more accurate "
              "than any FP8 rounding can be", _invariant(_declared_precision, "inv_declared_precision")),
    )
}  # fmt: skip

#: The sequences and invariants ``flashprobe fuzz`` runs beside the catalogue, by name.
CHECKS: dict[str, Check] = {**SEQUENCES, **INVARIANTS}


def checks_table() -> str:
    """The sequences and invariants as a Markdown table (``flashprobe fuzz --list``, after the catalogue)."""
    rows = [f"| `{c.name}` | {c.property} | {c.probes} | {', '.join(c.profiles)} |" for c in CHECKS.values()]
    return "\n".join(
        [
            "| sequence or invariant | property | what it probes | profile |",
            "| --- | --- | --- | --- |",
            *rows,
        ]
    )


def select_checks(
    patterns: Sequence[str] | None, *, profile: str = "default"
) -> tuple[list[Check], list[str] | None]:
    """The checks ``--case`` patterns select, and the patterns left for the catalogue.

    Args:
        patterns: globs as :func:`~flashprobe.fuzz.cases.select_cases` takes them; None or empty:
            every check of ``profile``.

    Returns:
        ``(checks, rest)``: the checks the patterns match, and the patterns that do not match only
        checks (None when each pattern given matched only checks: no catalogue case wanted).
    """
    globs = CasePatterns.parse(patterns)
    include = globs.include
    chosen = [
        c for name, c in CHECKS.items() if (profile in c.profiles or name in include) and globs.selects(name)
    ]
    only_checks = [p for p in include if fnmatch.filter(CHECKS, p) and not fnmatch.filter(CATALOGUE, p)]
    rest = [p for p in globs.given if p not in only_checks]
    return chosen, (None if include and len(only_checks) == len(include) else rest)


def run_checks(
    kernels: Sequence[str | Kernel],
    dtypes: Sequence[torch.dtype],
    checks: Sequence[Check],
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    baseline: str | Kernel = "math",
    backward: bool = True,
    reproducers: ReproducerStore | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[FuzzResult]:
    """Run each check on each kernel at each dtype: one :class:`~flashprobe.fuzz.run.FuzzResult` per
    (check, dtype, kernel), ``case`` the check's name; a failing sequence is saved to ``reproducers``."""
    results = []
    for check in checks:
        for dtype in dtypes:
            rows = []
            for kernel in kernels:
                label, start = kernel_label(kernel), time.perf_counter()
                try:
                    _get(kernel).check(device, dtype)
                    outcome = check.run(_get(kernel), dtype, seed, baseline, backward, device)
                except REFUSALS as err:  # the kernel refuses a call
                    outcome = Outcome("unsupported", f"refused: {type(err).__name__}: {err}")
                except Exception as err:  # the kernel raised on one of the check's calls
                    outcome = Outcome("fail", f"raised {type(err).__name__}: {err}", "raised")
                row = FuzzResult(
                    kernel=label, case=check.name, dtype=dtype_name(dtype), verdict=outcome.verdict,
                    reason=outcome.reason, failure=outcome.failure, shape=outcome.shape, seed=seed,
                    property=check.property, seconds=round(time.perf_counter() - start, 3),
                )  # fmt: skip
                if outcome.saved and reproducers is not None and reproducers.wants(row, check.property):
                    path = save_sequence(
                        reproducers.out_dir, check.name, kernel, *outcome.saved, reason=row.reason,
                        failure=row.failure, baseline=baseline, backward=backward,
                    )  # fmt: skip
                    for direction in failure_directions(row):
                        reproducers.saved.setdefault((label, check.property, direction), path)
                    row = replace(row, repro=str(path))
                rows.append(row)
            if progress is not None:
                verdicts = ", ".join(f"{r.kernel} {r.verdict}" for r in rows)
                seconds = sum(r.seconds for r in rows)
                progress(f"{check.name} {dtype_name(dtype)} seed {seed}: {verdicts} ({seconds:.1f} s)")
            results += rows
    return results
