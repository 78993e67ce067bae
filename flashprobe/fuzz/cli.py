"""``flashprobe fuzz``: run adversarial edge cases against attention kernels and judge each one.

Every argument is checked before any case runs (bad usage exits 2 with one message naming the
argument and the fix). The run prints progress on a terminal, the verdict grid, every failure, the
skip reasons, coverage and properties per kernel, and writes ``fuzz.json``, ``fuzz.md`` and the
reproducers. Exits 0 when nothing fails, 1 when a (kernel, case, dtype) fails or is ``not_declared``
(with ``--ledger``: an unaccepted failure, or an unexpected pass).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flashprobe.errors import FlashprobeError
from flashprobe.formats import OutputPathError, atomic_write_text, prepare_output_dir, write_json
from flashprobe.formats.paths import check_output_dir
from flashprobe.fuzz.cases import PROFILES, FuzzCase, select_cases
from flashprobe.fuzz.check import check_kernel
from flashprobe.fuzz.contract_cases import FP8_NAMES
from flashprobe.fuzz.contract_run import split_case_patterns
from flashprobe.fuzz.invariants import checks_table, select_checks
from flashprobe.fuzz.kernel_call import kernel_label
from flashprobe.fuzz.layouts import LAYOUTS
from flashprobe.fuzz.ledger import SHIPPED, Ledger, LedgerError, LedgerReport, load_ledger
from flashprobe.fuzz.rule import RULE
from flashprobe.fuzz.run import FuzzResult
from flashprobe.fuzz.tables import (
    case_seconds,
    catalogue_table,
    coverage,
    coverage_lines,
    markdown_table,
    property_coverage,
    property_lines,
    property_markdown,
    reason_lines,
    summary_counts,
    terminal_table,
)
from flashprobe.kernels import (
    KernelSpecError,
    KernelUnavailableError,
    KernelUnsupportedError,
    add_import_option,
    available_kernels,
    dtype_name,
    get_kernel,
    import_kernel_modules,
    output_problem,
    to_dtype,
)

__all__ = ["DEFAULT_DTYPES", "main"]

DEFAULT_DTYPES = ("bf16", "fp16", "fp32")
_DTYPE_CHOICES = "bf16, fp16, fp32, fp64, e4m3 (FP8 inputs, kernels that declare float8_e4m3fn)"


class UsageError(ValueError, FlashprobeError):
    """A command-line argument is unusable; the message names it and the fix."""


@dataclass(frozen=True)
class _Plan:
    """The checked arguments of one ``flashprobe fuzz`` run."""

    kernels: list[str]
    baseline: str
    dtypes: list[torch.dtype]
    cases: list[FuzzCase]
    budget: int
    seed: int
    device: torch.device
    out_dir: Path
    verbose: bool
    backward: bool
    profile: str
    seeds: int
    layouts: list[str]
    quiet: bool = False
    checks: list[str] = field(default_factory=list)
    ledger: Ledger | None = None
    threads: int = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashprobe fuzz",
        description="Run adversarial edge cases (sentinel logits, fully masked rows, overflow, odd shapes, "
        "...) against attention kernels; judge each against the FP64 golden and the same-dtype baseline "
        "with the probe's rule (absolute, row and relative criteria; flashprobe.judge). "
        "Exits 1 when any (kernel, case) fails, 2 on bad usage.",
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
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="run the catalogue for N seeds from --seed on (a calibration: a correct kernel fails none)",
    )
    p.add_argument("--out", default="out/fuzz", metavar="DIR", help="output directory (default out/fuzz)")
    p.add_argument(
        "--budget", type=int, default=0, metavar="N", help="random samples after the catalogue (default 0)"
    )
    p.add_argument("--no-catalogue", action="store_true", help="run only the random search")
    p.add_argument(
        "--profile",
        default="default",
        metavar="NAME",
        help="cases to run: default (the CI gate) or full (adds 16k/32k keys and the shape sweep)",
    )
    p.add_argument(
        "--no-backward", action="store_true", help="check outputs only, not the gradients dq, dk, dv"
    )
    p.add_argument(
        "--layout",
        action="append",
        metavar="LAYOUT",
        help="run every case with its inputs in these layouts, repeatable or comma list, or 'all': "
        f"{', '.join(LAYOUTS)} (default contiguous; the layout_* cases run in their own)",
    )
    p.add_argument(
        "--baseline",
        metavar="SPEC",
        help="same-dtype baseline (default math; with --from, the one the call recorded)",
    )
    p.add_argument("--device", default="cpu", help="device to run on (default cpu)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="T",
        help="torch intra-op CPU threads for the run, the kernel's calls included (default 1: the "
        "references and statistics are many small ops, and on a small CPU thread hand-offs cost more "
        "than they save)",
    )
    shipped = "; ".join(f"{name}: {path}" for name, path in SHIPPED.items())
    p.add_argument(
        "--ledger",
        metavar="FILE",
        help="accepted findings (YAML, docs/fuzz.md 'A findings ledger'): their failures are reported "
        "known and do not fail the run, their unexpected passes do; a shipped ledger by name "
        f"({shipped})",
    )
    add_import_option(p)
    p.add_argument(
        "--from",
        dest="from_file",
        type=Path,
        metavar="FILE",
        help="a reproducer (*.safetensors) the probe saved in training or a fuzz run saved: replay it "
        "with each --kernel (default: the recorded one) and shrink it to the smallest call that still "
        "fails the same way, written to DIR/<name>.<kernel>.shrunk.safetensors",
    )
    p.add_argument("--list", action="store_true", help="print the catalogue as a Markdown table and exit")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print every (kernel, case, dtype) with its reason"
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress lines (they go to stderr, one per case and dtype, when it is a terminal "
        "outside CI)",
    )
    return p


def _listed(values: Sequence[str] | None, flag: str, example: str) -> list[str]:
    """The comma-separated items of a repeatable option; given but empty is an error."""
    items = [p.strip() for v in values or [] for p in v.split(",") if p.strip()]
    if values is not None and not items:
        given = " ".join(repr(v) for v in values)
        raise UsageError(f"{flag} {given} lists nothing; give e.g. {flag} {example}, or leave {flag} out")
    return items


def _dtypes(values: Sequence[str] | None) -> list[torch.dtype]:
    names = _listed(values, "--dtype", "bf16,fp32") or list(DEFAULT_DTYPES)
    dtypes = []
    for name in names:
        try:
            dtypes.append(FP8_NAMES[name] if name in FP8_NAMES else to_dtype(name))  # e4m3: FP8 inputs
        except ValueError:
            raise UsageError(f"--dtype {name}: unknown dtype; use one of {_DTYPE_CHOICES}") from None
    return dtypes


def _layouts(values: Sequence[str] | None) -> list[str]:
    names = _listed(values, "--layout", "bnhd,offset") or ["contiguous"]
    if "all" in names:
        return list(LAYOUTS)
    for name in names:
        if name not in LAYOUTS:
            raise UsageError(f"--layout {name}: unknown layout; use one of {', '.join(LAYOUTS)} or all")
    return list(dict.fromkeys(names))


def _cases(args: argparse.Namespace) -> tuple[list[FuzzCase], list[str]]:
    """The catalogue cases and the sequences and invariants (by name) the patterns select."""
    patterns = _listed(args.case, "--case", "'sentinel_*'")
    patterns += ["!" + p for p in _listed(args.exclude, "--exclude", "'gqa_*'")]
    if args.profile not in PROFILES:
        raise UsageError(f"--profile {args.profile}: unknown profile; use one of {', '.join(PROFILES)}")
    if args.no_catalogue:
        if args.budget == 0:
            raise UsageError("--no-catalogue with --budget 0 runs nothing; give --budget N (random samples)")
        args.contract_cases = []
        return [], []
    checks, rest = select_checks(patterns, profile=args.profile)
    dense, args.contract_cases = (None, []) if rest is None else split_case_patterns(rest)
    try:
        cases = [] if dense is None else select_cases(dense, profile=args.profile)
    except ValueError as err:
        raise UsageError(f"--case/--exclude: {err}") from None
    if not cases and not checks and not args.contract_cases and not args.budget:
        given = " ".join(
            f"{flag} {v!r}"
            for flag, vs in (("--case", args.case), ("--exclude", args.exclude))
            for v in vs or []
        )
        raise UsageError(
            f"{given} leaves no case of the {args.profile} profile to run; see flashprobe fuzz --list"
        )
    return cases, [c.name for c in checks]


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise UsageError(f"--device {text!r}: {err}; use --device cpu or --device cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):  # meta has no values to judge; others are not supported
        raise UsageError(f"--device {text}: flashprobe fuzz runs on cpu or cuda[:N]; use --device cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text}: CUDA is not available on this machine; use --device cpu")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise UsageError(f"--device {text}: cannot place tensors there ({err}); use --device cpu") from None
    return device


def _label(spec: str, flag: str) -> str:
    try:
        return kernel_label(spec)
    except KernelSpecError as err:
        raise UsageError(f"{flag} {spec!r}: {err}") from None


def _plan(args: argparse.Namespace) -> _Plan:
    """Check every argument, in the order given on the command line's help, before any work."""
    _import_modules(args.imports)
    if not args.kernel:
        raise UsageError("give at least one --kernel SPEC; available: " + ", ".join(available_kernels()))
    kernels = [_label(k, "--kernel") for k in args.kernel]
    baseline = _label(args.baseline or "math", "--baseline")
    dtypes, (cases, checks), layouts = _dtypes(args.dtype), _cases(args), _layouts(args.layout)
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be ≥ 0 (the seed of the inputs)")
    if args.seeds < 1:
        raise UsageError(
            f"--seeds {args.seeds}: must be ≥ 1 (the catalogue runs for seeds --seed … --seed+N-1)"
        )
    if args.budget < 0:
        raise UsageError(f"--budget {args.budget}: must be ≥ 0 (random samples; 0 runs only the catalogue)")
    device = _device(args.device)
    if args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be ≥ 1 (torch intra-op CPU threads)")
    _some_kernel_runs(kernels, device, dtypes)
    try:
        ledger = None if args.ledger is None else load_ledger(args.ledger)
    except LedgerError as err:
        raise UsageError(f"--ledger: {err}") from None
    try:
        out_dir = prepare_output_dir(args.out, flag="--out")
    except OutputPathError as err:
        raise UsageError(str(err)) from None
    return _Plan(
        kernels,
        baseline,
        dtypes,
        cases,
        args.budget,
        args.seed,
        device,
        out_dir,
        args.verbose,
        not args.no_backward,
        args.profile,
        args.seeds,
        layouts,
        args.quiet,
        checks,
        ledger,
        args.threads,
    )


def _some_kernel_runs(kernels: Sequence[str], device: torch.device, dtypes: Sequence[torch.dtype]) -> None:
    """Refuse a plan in which no kernel runs on ``device`` at any of ``dtypes`` (nothing judged)."""
    reasons = []
    for spec in kernels:
        for dtype in dtypes:
            try:
                get_kernel(spec).check(device, dtype)
                return
            except (KernelUnsupportedError, KernelUnavailableError) as err:
                reasons.append(str(err).replace("<kernel>", spec))
    raise UsageError(
        f"no kernel given runs on {device} at {', '.join(dtype_name(d) for d in dtypes)}, so nothing would "
        f"be judged ({'; '.join(dict.fromkeys(reasons))}); run it where it runs (e.g. --device cuda on a "
        "GPU machine), or choose a kernel that runs here (flashprobe kernels lists them)"
    )


def _import_modules(modules: Sequence[str] | None) -> None:
    try:
        import_kernel_modules(modules or [])
    except KernelSpecError as err:
        raise UsageError(str(err)) from None


def _from_reproducer(args: argparse.Namespace) -> int:
    """``--from FILE``: replay a reproducer with each kernel and shrink the failing ones; 1 when a
    kernel fails or errs (raises, returns the wrong shape or dtype: not shrunk), else 0."""
    from flashprobe.fuzz.reproducer import reproducer_judge
    from flashprobe.probing.repro import (
        ReproducerError,
        load_reproducer,
        replay,
        replay_kernels,
        shrink_reproducer,
    )

    _import_modules(args.imports)
    try:
        call = load_reproducer(args.from_file)
        kernels, baseline = replay_kernels(call, args.kernel, args.baseline)
    except ReproducerError as err:
        raise UsageError(f"--from: {err}") from None
    try:  # checked now, made only for a shrunk reproducer: a replay that ends in errors writes nothing
        out_dir = check_output_dir(args.out, flag="--out")
    except OutputPathError as err:
        raise UsageError(str(err)) from None
    failed = 0
    judge = reproducer_judge(call)
    results = replay(call, kernels, baseline=baseline, judge=judge)
    for spec in kernels:
        if results[spec]["verdict"] != "error" and (problem := _output_problem(spec, call)):
            results[spec] = {**results[spec], "verdict": "error", "reasons": [problem]}
    stem = args.from_file.name.removesuffix(".safetensors")
    for spec, result in results.items():
        if result["verdict"] != "fail":
            # "error": the kernel raised or returned the wrong shape or dtype: a failure of the gate
            failed += result["verdict"] == "error"
            reasons = "; ".join(result["reasons"])
            print(f"{spec}: {result['verdict'].upper()} on {args.from_file} {reasons}".rstrip())
            continue
        failed += 1
        small, tries = shrink_reproducer(call, spec, baseline=baseline, judge=judge)
        path = prepare_output_dir(out_dir, flag="--out") / f"{stem}.{_safe(spec)}.shrunk.safetensors"
        replace(small, meta={**small.meta, "primary": spec, "shrunk_from": str(args.from_file)}).save(path)
        before = "x".join(str(n) for n in (*call.q.shape[:3], call.k.shape[2]))
        after = "x".join(str(n) for n in (*small.q.shape[:3], small.k.shape[2]))
        print(
            f"{spec}: FAIL ({'; '.join(result['reasons'])}); shrunk B x H x N_q x N_k {before} -> {after} "
            f"in {tries} replays; wrote {path} (flashprobe replay {path})"
        )
    return 1 if failed else 0


def _output_problem(spec: str, call: Any) -> str:
    """Why ``spec``'s output on the saved call is not a ``(B, H, N_q, D_v)`` tensor of the inputs'
    dtype (``""`` when it is)."""
    with torch.no_grad():
        out = get_kernel(spec)(
            call.q, call.k, call.v, attn_mask=call.attn_mask, is_causal=call.is_causal, scale=call.scale
        )
    return output_problem(out, call.q, call.v, spec) or ""


def _safe(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in spec)


def _outputs_only(plan: _Plan, results: Sequence[FuzzResult]) -> dict[str, str]:
    """The kernels given whose gradients were not checked, each with why: ``--no-backward``, no
    backward declared on the device (its ``KernelCapabilities``), or none in the calls run (every
    row of it that asked for gradients got ``no_backward``)."""
    why = {}
    for spec in plan.kernels:
        asked = {r.backward for r in results if r.kernel == spec and r.backward is not None}
        if not plan.backward:
            why[spec] = "--no-backward"
        elif not get_kernel(spec).capabilities.has_backward(plan.device):
            why[spec] = f"no backward on {plan.device.type}"
        elif asked == {"no_backward"}:
            why[spec] = "no backward in the calls run"
    return why


def _gradients_text(plan: _Plan, outputs_only: dict[str, str]) -> str:
    """What the header says of the gradients: ``with gradients``, ``outputs only`` or both, with why."""
    if not plan.backward:
        return "outputs only"
    without = ", ".join(f"{spec}: {why}" for spec, why in outputs_only.items())
    if len(outputs_only) == len(plan.kernels):
        return f"outputs only ({without})"
    return f"with gradients (outputs only for {without})" if outputs_only else "with gradients"


def _print_results(
    plan: _Plan,
    results: list[FuzzResult],
    elapsed: float,
    ledger: LedgerReport | None = None,
    contract_cases: Sequence[str] = (),
    *,
    outputs_only: dict[str, str],
) -> None:
    catalogue = [r for r in results if r.params is None]
    randoms = [r for r in results if r.params is not None]
    names = ", ".join(dtype_name(d) for d in plan.dtypes)
    grads = _gradients_text(plan, outputs_only)
    last = plan.seed + plan.seeds - 1
    seeds = f"seed {plan.seed}" if plan.seeds == 1 else f"seeds {plan.seed}–{last}"
    print(
        f"flashprobe fuzz: {len(plan.cases)} cases ({plan.profile} profile) + {len(plan.checks)} sequences "
        f"and invariants + {plan.budget} random × "
        f"{len(plan.kernels)} kernels × {names}, {grads} ({seeds}, baseline {plan.baseline}) "
        f"in {elapsed:.1f} s\n"
    )
    if catalogue:
        print(terminal_table(catalogue))
    if randoms:
        failed = sum(r.verdict == "fail" for r in randoms)
        print(f"random search: {plan.budget} samples, {failed} failing (kernel, sample) pairs")
    for r in results:
        if (r.verdict in ("fail", "not_declared") and not r.known) or plan.verbose:
            seed = f" | seed {r.seed}" if plan.seeds > 1 and r.seed is not None else ""
            layout = f" | {r.layout}" if r.layout != "contiguous" else ""
            print(f"{r.verdict.upper():<5} {r.kernel} | {r.case} | {r.dtype}{layout}{seed}: {r.reason}")
            if r.repro:
                print(f"      reproducer: {r.repro} (run: python {Path(r.repro).with_suffix('.py')})")
    if ledger is not None:
        counts = f"{len(ledger.known)} known failures, {len(ledger.unexpected)} unexpected passes"
        print(f"\nledger {ledger.path}: {counts}")
        print("\n".join("  " + line for line in ledger.lines()))
        for passed in ledger.unexpected:
            print(f"FAIL  {passed.line()}")
    if not plan.verbose and (lines := reason_lines(results, ("skip", "unsupported", "no_backward"))):
        print("\nskipped / unsupported (count of kernel × case × dtype | cases | dtypes | kernels: reason):")
        print("\n".join(lines))
    if cover := coverage(results):
        print("\ncoverage (values exercised per axis):")
        print("\n".join("  " + line for line in coverage_lines(cover)))
    if properties := property_coverage(catalogue, contract_cases):
        print("\nproperties (per kernel: tested, or why not):")
        print("\n".join("  " + line for line in property_lines(properties)))


def _payload(
    plan: _Plan,
    command: str,
    results: list[FuzzResult],
    timing: dict[str, float],
    contract_cases: Sequence[str] = (),
    *,
    outputs_only: dict[str, str],
) -> dict[str, Any]:
    return {
        "command": command,
        "torch": torch.__version__,
        "device": str(plan.device),
        "seed": plan.seed,
        "seeds": plan.seeds,
        "layouts": plan.layouts,
        "baseline": plan.baseline,
        "dtypes": [dtype_name(d) for d in plan.dtypes],
        "kernels": plan.kernels,
        "cases": [c.name for c in plan.cases],
        "budget": plan.budget,
        "profile": plan.profile,
        "backward": plan.backward,
        "outputs_only": outputs_only,
        "threads": plan.threads,
        "rule": RULE,
        **{k: round(v, 3) for k, v in timing.items()},
        "summary": summary_counts(results),
        "coverage": coverage(results),
        "properties": property_coverage(results, contract_cases),
        "case_seconds": case_seconds(results),
        "rows": [r.as_dict() for r in results],
    }


def _ledger_payload(report: LedgerReport) -> dict[str, Any]:
    """The ledger's part of ``fuzz.json``: its file, the known failures' count, the unexpected passes."""
    return {
        "path": str(report.path),
        "known": len(report.known),
        "unexpected": [
            {"entry": u.entry.where, "kernel": u.kernel, "case": u.case, "dtype": u.dtype, "runs": u.runs}
            for u in report.unexpected
        ],
    }


def _write(
    plan: _Plan, payload: dict[str, Any], results: list[FuzzResult], contract_cases: Sequence[str] = ()
) -> list[Path]:
    """Write ``fuzz.json`` (and ``fuzz.md`` when a catalogue ran); every file written, reproducers too."""
    written = [write_json(plan.out_dir / "fuzz.json", payload)]
    if plan.cases or plan.checks or any(r.params is None for r in results):
        written.append(atomic_write_text(plan.out_dir / "fuzz.md", _markdown(results, contract_cases)))
    for repro in dict.fromkeys(r.repro for r in results if r.repro):
        written += [Path(repro), Path(repro).with_suffix(".py")]
    return written


#: how many of the slowest cases ``fuzz.md`` lists
_SLOWEST = 8


def _markdown(results: list[FuzzResult], contract_cases: Sequence[str] = ()) -> str:
    """``fuzz.md``: the verdict table, the properties per kernel and the slowest cases."""
    catalogue = [r for r in results if r.params is None]
    slowest = list(case_seconds(results).items())[:_SLOWEST]
    return (
        markdown_table(catalogue)
        + "\n## Properties\n\n"
        + property_markdown(property_coverage(catalogue, contract_cases))
        + "\n## Slowest cases\n\n| case | seconds (every kernel, dtype and seed) |\n| --- | --- |\n"
        + "".join(f"| `{case}` | {seconds:.1f} |\n" for case, seconds in slowest)
    )


def _progress(quiet: bool, budget: int = 0) -> Callable[[str], None] | None:
    """The progress printer: every line to stderr on a terminal outside CI; elsewhere a random search
    prints one line a minute (and its estimate up front); None under ``--quiet``."""
    if quiet:
        return None
    if sys.stderr.isatty() and not os.environ.get("CI"):
        return lambda line: print(line, file=sys.stderr, flush=True)
    if not budget:
        return None
    last = [-float("inf")]

    def sparse(line: str) -> None:
        now = time.monotonic()
        if line.startswith("random search:") or now - last[0] >= _SPARSE_PROGRESS_S:
            last[0] = now
            print(line, file=sys.stderr, flush=True)

    return sparse


#: seconds between progress lines of a random search outside a terminal
_SPARSE_PROGRESS_S = 60.0


def main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe fuzz``: 0 when nothing fails, 1 when a (kernel, case) fails, 2 on bad usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as stop:  # --help (0) or a usage error (2)
        return int(stop.code or 0)
    if args.list:
        print(catalogue_table() + "\n\n" + checks_table())
        return 0
    try:
        if args.from_file is not None:
            return _from_reproducer(args)
        plan = _plan(args)
    except UsageError as err:
        print(f"flashprobe fuzz: {err}", file=sys.stderr)
        return 2
    check = check_kernel(
        plan.kernels,
        dtypes=plan.dtypes,
        cases=plan.cases,
        profile=plan.profile,
        seed=plan.seed,
        seeds=plan.seeds,
        budget=plan.budget,
        backward=plan.backward,
        layouts=plan.layouts,
        checks=plan.checks,
        baseline=plan.baseline,
        device=plan.device,
        out_dir=plan.out_dir,
        progress=_progress(plan.quiet, plan.budget),
        ledger=plan.ledger,
        contract_cases=getattr(args, "contract_cases", None),
        threads=plan.threads,
    )
    results, elapsed, catalogue_s = check.results, check.elapsed_s, check.catalogue_s
    outputs_only = _outputs_only(plan, results)
    _print_results(plan, results, elapsed, check.ledger, check.contract_cases, outputs_only=outputs_only)
    timing = {"elapsed_s": elapsed, "catalogue_s": catalogue_s}
    command = "flashprobe fuzz " + " ".join(argv)
    payload = _payload(plan, command, results, timing, check.contract_cases, outputs_only=outputs_only)
    if check.ledger is not None:
        payload["ledger"] = _ledger_payload(check.ledger)
    written = _write(plan, payload, results, check.contract_cases)
    summary = summary_counts(results)
    no_backward = f", {summary['no_backward']} no_backward" if summary["no_backward"] else ""
    no_backward += f", {summary['not_declared']} not_declared" if summary["not_declared"] else ""
    fail = f"{summary['fail']} fail" + (f" ({summary['known']} known)" if summary["known"] else "")
    unexpected = f", {len(check.unexpected_passes)} unexpected passes" if check.unexpected_passes else ""
    print(
        f"\n{summary['pass']} pass, {fail}{unexpected}, {summary['skip']} skip, "
        f"{summary['unsupported']} unsupported{no_backward}; wrote {', '.join(str(p) for p in written)}"
    )
    return 0 if check.passed else 1
