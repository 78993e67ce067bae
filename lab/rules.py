"""``python -m lab.rules``: how many correct kernels each pass/fail rule fails, how many bugs it catches.

The calibration table of the verdict's rule (:mod:`flashprobe.judge`) beside the rules kernel
projects test with. Every kernel runs on the same calibration calls (:data:`CALLS`: cross-attention
over 77 keys, key-padded, causal self-attention, head dim 256, at flat to very sharp softmax, a few
seeds) in float32, bf16 and fp16, forward and backward with one fixed output gradient; each rule
reads the kernel's output and input gradients against the same references:

* ``flashprobe``: the verdict as ``flashprobe fuzz`` applies it (:func:`flashprobe.fuzz.check_case`:
  the one rule of :mod:`flashprobe.judge` plus the fuzzer's checks of masked rows); ``undetermined``
  counts as neither a failure nor a catch.
* ``flash-attention``: its tests' rule (Dao-AILab/flash-attention ``hopper/test_flash_attn.py``;
  ``tests/test_flash_attn.py`` has the same 2x without the slack): per tensor,
  ``max|x − ref| ≤ 2 · max|pt − ref| + 2 · max|(ref + 0.3 − 0.3) − ref|`` with ``ref`` the
  upcast reference rounded to the dtype (here the FP64 golden rounded to the dtype) and ``pt`` the
  same-dtype PyTorch attention (here the baseline, ``math``).
* ``pytorch-sdpa``: PyTorch's SDPA tests (``test/test_transformers.py``, ``get_tolerances`` and
  ``check_out_and_grad`` of ``test_flash_attention_vs_math_ref_grads``): per tensor
  ``atol = f · max(max|ref − lp|, default_atol)``, ``rtol = f · max(max|(ref − lp)/ref|, default_rtol)``
  (NaN ratios read as ``default_rtol``; an infinite ``rtol`` falls back to it), then
  ``assert_close(x, ref, atol, rtol)``; ``ref`` the higher-precision math reference (here the FP64
  golden), ``lp`` the same-dtype math (the baseline), fudge factors ``f``: out 4, dq 180, dk 16,
  dv 4; defaults atol fp32 1e-5, 16-bit 1e-3; rtol fp32 1.3e-6, fp16 1e-3, bf16 1.6e-2.
* ``assert_close``: ``torch.testing.assert_close(x, golden.to(dtype))`` with its default
  tolerances per dtype (fp32 rtol 1.3e-6, atol 1e-5; bf16 1.6e-2, 1e-5; fp16 1e-3, 1e-5).
* ``kernelbench``: KernelBench's check, ``torch.allclose(x, ref, atol=1e-2, rtol=1e-2)`` against
  the reference program run at the same dtype (the baseline); on the output only, as KernelBench
  compares model outputs.

A **correct kernel** is one of torch's CPU SDPA backends, the ``tiled`` presets, FlexAttention where
it runs (forward only on the CPU) and the correct kernels of the mutation suite
(:data:`lab.mutants.CORRECT`); a call of one that a rule fails is a false alarm. A **bug** is a
call of a mutant (:data:`lab.mutants.MUTANTS` with a small trigger call) on which its bug
fires: one of its tensors is non-finite where the same call of the bug-free
:func:`~lab.mutants.correct_flash` is finite, or differs from that one's by more than
``4 · eps(dtype)`` and 4 times that one's own error against the golden (relative L2) — a definition
that depends on none of the rules compared. A mutant call where the bug does
not fire is not counted.

Writes ``DIR/rules.json``, ``DIR/rules.csv`` (one row per rule and dtype) and ``DIR/rules.md`` (the
table, with the command); ``--check`` exits 1 when flashprobe's rule fails a correct kernel or
misses a bug. Run it from the repository's root (``lab`` is not installed with flashprobe).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashprobe.bench.args import add_output_args, run_cli, torch_threads
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.results import format_table, write_results, wrote_line
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.fuzz import CaseInputs, check_case
from flashprobe.fuzz.kernel_call import call_kernel
from flashprobe.fuzz.run import case_references
from flashprobe.judge import DIRECTIONS, LIMITS
from flashprobe.kernels import available_kernels, get_kernel, math_attention, unregister_kernel
from flashprobe.kernels.reference import expand_kv
from lab.mutants import MUTANTS, register_mutants

__all__ = ["CALLS", "CORRECT_KERNELS", "RULES", "CalibrationCall", "main", "peer_failures", "run_rules"]

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The rules compared, in the table's order.
RULES: tuple[str, ...] = ("flashprobe", "flash-attention", "pytorch-sdpa", "assert_close", "kernelbench")
#: The correct kernels (specs): torch's CPU SDPA backends, the ``tiled`` presets, the suite's correct
#: kernels and FlexAttention (eager; forward only on the CPU).
CORRECT_KERNELS: tuple[str, ...] = (
    "sdpa_math",
    "sdpa_flash",
    "tiled",
    "tiled:preset=paper",
    "ok_flash_backward",
    "ok_exp2_folded",
    "ok_split_k_lse",
    "flex:compile=false",
)
#: PyTorch's SDPA tests: fudge factors per tensor and the default tolerances per dtype.
_SDPA_FUDGE = {"out": 4.0, "dq": 180.0, "dk": 16.0, "dv": 4.0}
_SDPA_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
_SDPA_RTOL = {torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}
_KERNELBENCH_TOL = 1e-2
#: A bug fires when a tensor differs from the bug-free kernel's by this many eps(dtype) and times
#: that kernel's own error (relative L2).
_FIRES_EPS = 4.0


@dataclass(frozen=True)
class CalibrationCall:
    """One calibration call's shape: ``(B, H, N_q, D)`` queries, ``N_k`` keys.

    Attributes:
        name: what it stands for.
        b, h, n_q, n_k, d: batch, query heads, query rows, keys (``n_q`` when causal), head dim.
        h_kv: key/value heads (grouped-query attention; default ``h``), passed un-expanded.
        sharpness: the variance of q and k entries (the logits' spread grows with it).
        causal: top-left causal.
        mask: ``None``; ``key_padding`` (bool ``(B, 1, 1, N_k)``: entry ``i`` has its last ``9 i`` keys
            padded); ``padded_rows`` (bool ``(B, 1, N_q, N_k)``: padded queries and keys masked, so
            padded query rows see no key, as a padding mask built from one attention mask).
        scale: the ``scale`` argument (None: ``1/sqrt(D)``).
        layout: the memory layout (``contiguous``, or ``bnhd``: transposed views of ``(B, N, H, D)``
            projections, as models make their heads).
    """

    name: str
    b: int = 2
    h: int = 2
    n_q: int = 40
    n_k: int = 77
    d: int = 32
    h_kv: int | None = None
    sharpness: float = 1.0
    causal: bool = False
    mask: str | None = None
    scale: float | None = None
    layout: str = "contiguous"

    def inputs(self, dtype: torch.dtype, seed: int) -> CaseInputs:
        """The call's :class:`~flashprobe.fuzz.CaseInputs` in ``dtype``, from a seeded float64 draw."""
        gen = torch.Generator().manual_seed(seed)
        n_k = self.n_q if self.causal else self.n_k

        def draw(heads: int, n: int, std: float) -> torch.Tensor:
            x = torch.randn(self.b, heads, n, self.d, generator=gen, dtype=torch.float64)  # (B, H, N, D)
            return (x * std).to(dtype)

        spread = self.sharpness**0.5
        h_kv = self.h_kv or self.h
        q, k, v = draw(self.h, self.n_q, spread), draw(h_kv, n_k, spread), draw(h_kv, n_k, 1.0)
        lengths = n_k - 9 * torch.arange(self.b)  # (B,)
        mask = None
        if self.mask == "key_padding":
            mask = (torch.arange(n_k) < lengths.unsqueeze(-1))[:, None, None, :]  # (B, 1, 1, N_k)
        elif self.mask == "padded_rows":
            valid_q = torch.arange(self.n_q) < lengths.clamp(max=self.n_q).unsqueeze(-1)  # (B, N_q)
            valid_k = torch.arange(n_k) < lengths.unsqueeze(-1)  # (B, N_k)
            mask = (valid_q[:, :, None] & valid_k[:, None, :])[:, None]  # (B, 1, N_q, N_k)
        call = CaseInputs(q=q, k=k, v=v, attn_mask=mask, is_causal=self.causal, scale=self.scale)
        return call.with_layout(self.layout)


#: The calibration calls: the sites of the calibration models (``bench verdicts``: cross-attention,
#: key padding, causal self-attention, grouped-query heads, heads as transposed views, an explicit
#: scale, padded query rows, head dim 256), from a flat to a very sharp softmax.
CALLS: tuple[CalibrationCall, ...] = (
    CalibrationCall("cross, flat", sharpness=0.1),
    CalibrationCall("causal", causal=True),
    CalibrationCall("cross, key-padded, sharp", sharpness=4.0, mask="key_padding"),
    CalibrationCall("causal, very sharp", sharpness=16.0, causal=True),
    CalibrationCall("head dim 256", b=1, h=1, d=256, n_k=40),
    CalibrationCall(
        "GQA, (B, N, H, D) views, explicit scale",
        h=4,
        h_kv=2,
        n_q=48,
        causal=True,
        scale=0.125,
        layout="bnhd",
    ),
    CalibrationCall("padded query rows", n_q=64, n_k=64, mask="padded_rows"),
)


def _max_abs(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|x − ref|`` in float64; NaN when any difference is NaN."""
    d = (x.double() - ref.double()).abs()
    return float("nan") if torch.isnan(d).any() else float(d.max()) if d.numel() else 0.0


def _close(x: torch.Tensor, ref: torch.Tensor, **tolerances: float) -> bool:
    try:
        torch.testing.assert_close(x, ref, **tolerances)
    except AssertionError:
        return False
    return True


def _sdpa_tolerances(ref: torch.Tensor, lp: torch.Tensor, direction: str) -> tuple[float, float]:
    """PyTorch's ``get_tolerances(ref, lp, fudge)`` (test/test_transformers.py)."""
    fudge = _SDPA_FUDGE[direction]
    deviation = ref.double() - lp.double()
    atol = float(deviation.abs().max()) if deviation.numel() else 0.0
    ratio = torch.nan_to_num((deviation / ref.double()).abs(), nan=_SDPA_RTOL[lp.dtype])
    rtol = float(ratio.max()) if ratio.numel() else 0.0
    atol = fudge * max(atol, _SDPA_ATOL[lp.dtype])
    rtol = fudge * max(rtol, _SDPA_RTOL[lp.dtype])
    if rtol > 1e30:
        rtol = _SDPA_RTOL[lp.dtype]
    return atol, rtol


def peer_failures(
    x: torch.Tensor, baseline: torch.Tensor, golden: torch.Tensor, direction: str
) -> dict[str, bool]:
    """Whether each peer rule fails one tensor of a call.

    Args:
        x: the kernel's output or gradient, in the call's dtype.
        baseline: the same-dtype baseline's (``math``), same shape and dtype.
        golden: the FP64 golden's, same shape.
        direction: ``out``, ``dq``, ``dk`` or ``dv``.

    Returns:
        ``{rule: failed}`` for ``flash-attention``, ``pytorch-sdpa``, ``assert_close`` and (for
        ``out``) ``kernelbench``.
    """
    dtype = x.dtype
    ref = golden.to(dtype)
    slack = 2.0 * _max_abs((ref + 0.3) - 0.3, ref)
    allowed = 2.0 * _max_abs(baseline, ref) + slack
    err = _max_abs(x, ref)
    failed = {"flash-attention": not err <= allowed}  # NaN fails
    atol, rtol = _sdpa_tolerances(golden, baseline, direction)
    failed["pytorch-sdpa"] = not _close(x, ref, atol=atol, rtol=rtol)
    failed["assert_close"] = not _close(x, ref)
    if direction == "out":
        tol = _KERNELBENCH_TOL
        close = x.shape == baseline.shape and torch.allclose(x, baseline, atol=tol, rtol=tol)
        failed["kernelbench"] = not close
    return failed


def _fires(x: torch.Tensor, clean: torch.Tensor | None, golden: torch.Tensor) -> bool:
    """Whether a mutant's tensor differs from the bug-free kernel's beyond rounding: non-finite where
    that one is finite, or off it by more than ``4 · eps(dtype)`` and 4 times its own error (both
    relative L2 against the golden's size)."""
    if clean is None:
        return False
    if (~torch.isfinite(x) & torch.isfinite(clean)).any():
        return True
    g = golden.double().nan_to_num(0.0)
    diff = torch.linalg.vector_norm((x.double() - clean.double()).nan_to_num(0.0))
    own = torch.linalg.vector_norm((clean.double() - g).nan_to_num(0.0))
    floor = _FIRES_EPS * torch.finfo(x.dtype).eps * torch.linalg.vector_norm(g)
    return bool(diff > torch.maximum(floor, _FIRES_EPS * own))


@dataclass
class _Tally:
    """Counts for one rule and dtype."""

    correct_calls: int = 0
    false_alarms: int = 0
    undetermined: int = 0
    bug_calls: int = 0
    caught: int = 0


def _baseline(inputs: CaseInputs, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same-dtype baseline's output and gradients (``math``; grouped k/v heads repeated, so their
    gradients are summed over each group)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    with torch.enable_grad():
        k_all, v_all = expand_kv(k, v, q.shape[1] // k.shape[1])  # (B, H, N_k, D)
        out = math_attention(
            q, k_all, v_all, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal, scale=inputs.scale
        )
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return dict(zip(DIRECTIONS, (out.detach(), *grads), strict=True))


def _tensors(call: Any) -> dict[str, torch.Tensor]:
    """A kernel call's output and gradients by direction (only those it gave)."""
    found = {} if call.output is None else {"out": call.output}
    if not call.no_backward:
        found.update({d: g for d, g in call.grads.items() if g is not None})
    return found


def run_rules(
    dtypes: Sequence[str],
    seeds: Sequence[int],
    *,
    correct: Sequence[str] = CORRECT_KERNELS,
    calls: Sequence[CalibrationCall] = CALLS,
    mutants: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Judge every correct kernel and mutant on every calibration call by every rule.

    Args:
        dtypes: of ``fp32``, ``bf16``, ``fp16``.
        seeds: the draws of each calibration call.
        correct: the correct kernels' specs.
        calls: the calibration calls.
        mutants: the mutant names (default: every mutant with a small trigger call).
        progress: called with one line per dtype.

    Returns:
        ``(rows, details)``: one row per rule and dtype (correct calls, false alarms and the correct
        kernels they hit, bug calls, caught, the mutants missed on some call), and one entry per
        (kernel, call, seed, dtype) with each rule's outcome.
    """
    names = list(mutants) if mutants is not None else [n for n, m in MUTANTS.items() if m.trigger is not None]
    before = set(available_kernels())
    registered = [name for name in register_mutants() if name not in before]
    rows: list[dict[str, Any]] = []
    details: list[dict[str, Any]] = []
    try:
        clean = get_kernel("bug_none")
        # every spec is resolved before any work: an unknown one is refused at once
        kernels = {spec: get_kernel(spec) for spec in correct} | {n: get_kernel(f"bug_{n}") for n in names}
        for dtype_name in dtypes:
            dtype = _DTYPES[dtype_name]
            tally = {rule: _Tally() for rule in RULES}
            missed: dict[str, set[str]] = {rule: set() for rule in RULES}
            alarmed: dict[str, set[str]] = {rule: set() for rule in RULES}
            for call_shape, seed in itertools.product(calls, seeds):
                inputs = call_shape.inputs(dtype, seed)
                refs = case_references(inputs, "math", backward=True)
                golden = {"out": refs.golden, **{d: g.golden for d, g in refs.gradients.items()}}
                base = _baseline(inputs, refs.grad_out)
                bug_free = _tensors(call_kernel(clean, inputs, refs.grad_out))
                for label, kernel in kernels.items():
                    is_bug = label in names
                    ran = call_kernel(kernel, inputs, refs.grad_out)
                    if ran.problem is not None and ran.problem.verdict == "unsupported":
                        continue  # the kernel does not take this call (e.g. GQA, a mask kind)
                    got = _tensors(ran)
                    judged = [d for d in DIRECTIONS if d in got and d in base and d in golden]
                    fired = ran.problem is not None or any(
                        _fires(got[d], bug_free.get(d), golden[d]) for d in judged
                    )
                    if is_bug and not fired:
                        continue  # the bug does not fire on this call
                    verdict = check_case(kernel, inputs, refs=refs).verdict
                    outcome = {"flashprobe": verdict == "fail"}
                    if ran.problem is not None:  # it raised or changed its inputs: every rule fails it
                        outcome |= dict.fromkeys(RULES, True)
                    for d in judged:
                        for rule, failed in peer_failures(got[d], base[d], golden[d], d).items():
                            outcome[rule] = outcome.get(rule, False) or failed
                    outcome = {rule: outcome.get(rule, False) for rule in RULES}
                    details.append({
                        "kernel": label if not is_bug else f"bug_{label}", "call": call_shape.name,
                        "seed": seed, "dtype": dtype_name, "bug": is_bug, "flashprobe_verdict": verdict,
                        **outcome,
                    })  # fmt: skip
                    for rule, hit in outcome.items():
                        t = tally[rule]
                        if is_bug:
                            t.bug_calls += 1
                            t.caught += hit
                        else:
                            t.correct_calls += 1
                            t.false_alarms += hit
                            t.undetermined += rule == "flashprobe" and verdict == "undetermined"
                        if hit != is_bug:  # a false alarm or a missed bug
                            (missed if is_bug else alarmed)[rule].add(label)
            for rule in RULES:
                t = tally[rule]
                rows.append(
                    {
                        "rule": rule,
                        "dtype": dtype_name,
                        "correct_calls": t.correct_calls,
                        "false_alarms": t.false_alarms,
                        "failed_kernels": ",".join(sorted(alarmed[rule])),
                        "undetermined": t.undetermined if rule == "flashprobe" else None,
                        "bug_calls": t.bug_calls,
                        "caught": t.caught,
                        "missed_bugs": ",".join(sorted(missed[rule])),
                    }
                )
            if progress is not None:
                fp = next(r for r in rows if r["rule"] == "flashprobe" and r["dtype"] == dtype_name)
                progress(
                    f"{dtype_name}: flashprobe fails {fp['false_alarms']}/{fp['correct_calls']} correct "
                    f"calls, catches {fp['caught']}/{fp['bug_calls']} bug calls"
                )
    finally:
        for name in registered:
            unregister_kernel(name)
    return rows, details


TABLE_COLUMNS = [
    ("rule", "rule"),
    ("dtype", "dtype"),
    ("false_alarms", "correct calls failed"),
    ("correct_calls", "of"),
    ("failed_kernels", "correct kernels failed (any call)"),
    ("undetermined", "undet."),
    ("caught", "bug calls caught"),
    ("bug_calls", "of"),
    ("missed_bugs", "bugs missed (any call)"),
]


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table: one line per rule and dtype."""
    lines = [
        "| rule | dtype | correct kernels: calls failed | correct kernels failed on some call "
        "| bugs: calls caught | bugs missed on some call |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        undetermined = f" ({r['undetermined']} undetermined)" if r.get("undetermined") else ""
        alarmed = ", ".join(f"`{k}`" for k in r["failed_kernels"].split(",") if k) or "none"
        missed = ", ".join(f"`{m}`" for m in r["missed_bugs"].split(",") if m) or "none"
        lines.append(
            f"| {r['rule']} | {r['dtype']} | {r['false_alarms']} / {r['correct_calls']}{undetermined} "
            f"| {alarmed} | {r['caught']} / {r['bug_calls']} | {missed} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lab.rules",
        description="Pass/fail rules compared: correct kernels failed and planted bugs caught, per dtype.",
    )
    p.add_argument("--seeds", type=int, default=3, help="draws of each calibration call (default 3)")
    p.add_argument(
        "--precision", default="fp32,bf16,fp16", help="comma-separated: fp32, bf16, fp16 (default all three)"
    )
    p.add_argument(
        "--mutants", default=None, help="comma-separated mutant names (default: each with a small trigger)"
    )
    p.add_argument(
        "--kernels",
        default=",".join(CORRECT_KERNELS),
        help="comma-separated specs of the correct kernels (default: torch's CPU backends, the tiled "
        "presets, the suite's correct kernels, eager FlexAttention)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when flashprobe's rule fails a correct call or misses a bug",
    )
    add_output_args(p, "rules", figure=False)
    return p


def _run(args: argparse.Namespace) -> int:
    precisions = [p for p in args.precision.split(",") if p]
    if not precisions or any(p not in _DTYPES for p in precisions):
        raise BenchArgumentError(
            f"--precision {args.precision!r}: use a comma-separated list of {', '.join(_DTYPES)}"
        )
    if isinstance(args.seeds, bool) or args.seeds < 1:
        raise BenchArgumentError(f"--seeds must be >= 1, got {args.seeds}")
    mutants = None
    if args.mutants is not None:
        mutants = [m for m in args.mutants.split(",") if m]
        small = [n for n, m in MUTANTS.items() if m.trigger is not None]
        unknown = [m for m in mutants if m not in small]
        if unknown or not mutants:
            raise BenchArgumentError(f"--mutants {unknown or args.mutants!r}: choose from {', '.join(small)}")
    correct = [k for k in args.kernels.split(",") if k]
    if not correct:
        raise BenchArgumentError("--kernels is empty: give at least one correct kernel's spec")
    start = time.perf_counter()
    with torch_threads(args.threads):
        rows, details = run_rules(
            precisions,
            range(args.seeds),
            mutants=mutants,
            correct=correct,
            progress=lambda line: print(line, file=sys.stderr),
        )
    seconds = time.perf_counter() - start
    print(format_table(rows, TABLE_COLUMNS))
    meta = {
        "command": args.command_line,
        "limits": LIMITS,
        "calls": [c.name for c in CALLS],
        "seeds": args.seeds,
        "details": details,
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
    }
    paths = write_results(args.out, "rules", rows, meta=meta)
    paths["md"] = atomic_write_text(
        args.out / "rules.md", f"Produced by `{args.command_line}`\n\n{markdown_table(rows)}\n"
    )
    print(wrote_line(rows, seconds, paths))
    ours = [r for r in rows if r["rule"] == "flashprobe"]
    bad = any(r["false_alarms"] or r["caught"] < r["bug_calls"] for r in ours)
    return 1 if args.check and bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m lab.rules``; returns the exit code."""
    return run_cli("rules", _parser(), _run, argv, command="python -m lab.rules")


if __name__ == "__main__":
    sys.exit(main())
