"""``flashprobe replay FILE [--kernel SPEC ...] [--import MODULE]``: rerun a saved failing call.

Runs a reproducer (:mod:`flashprobe.probing.repro`) through each kernel (default: the one that failed)
with the judge that found it, prints one line per kernel and exits 1 when any does not pass, 2 on bad
arguments (and, for a contract or sequence reproducer, when a kernel refuses a call)::

    flashprobe replay out/run/repro/blocks.0.attn.dq.step0000003.safetensors --import mykernels
    flashprobe replay FILE --kernel mykernel --kernel sdpa_math
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from flashprobe.kernels import KernelSpecError, add_import_option, import_kernel_modules

if TYPE_CHECKING:
    from flashprobe.formats.reproducer import Reproducer

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashprobe replay",
        description="Rerun a failing attention call saved by the probe or flashprobe fuzz (*.safetensors) "
        "and judge it.",
    )
    p.add_argument("file", type=Path, help="the reproducer (.safetensors) the probe or flashprobe fuzz saved")
    p.add_argument(
        "--kernel",
        action="append",
        metavar="SPEC",
        help="kernel spec to replay with (repeatable; default: the recorded primary)",
    )
    p.add_argument("--baseline", metavar="SPEC", help="baseline kernel (default: the recorded one)")
    add_import_option(p)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns 0 when every kernel passes, 1 when one fails or errors, 2 on bad input."""
    from flashprobe.formats.reproducer import is_sequence_file
    from flashprobe.fuzz.reproducer import reproducer_judge  # a command: the fuzzer's cases too
    from flashprobe.probing.repro import ReproducerError, load_reproducer, replay, replay_kernels

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        import_kernel_modules(args.imports or [])
    except KernelSpecError as err:
        parser.error(str(err))
    if is_sequence_file(args.file):  # several calls in order (flashprobe fuzz's seq_* checks)
        from flashprobe.fuzz.sequences import replay_main

        try:
            return replay_main(args.file, args.kernel, args.baseline, args.json)
        except (ReproducerError, KernelSpecError) as err:
            parser.error(str(err))
    from flashprobe.formats.reproducer import is_contract_reproducer

    if is_contract_reproducer(args.file):  # a call of a kernel's own api (varlen, paged, KV cache, merge)
        return _replay_contract(parser, args)
    try:
        call = load_reproducer(args.file)
        kernels, baseline = replay_kernels(call, args.kernel, args.baseline)
    except ReproducerError as err:
        parser.error(str(err))
    meta = call.meta
    results = replay(call, kernels, baseline=baseline, judge=reproducer_judge(call))
    if args.json:
        print(json.dumps({"file": str(args.file), "call": _describe(call), "results": results}, indent=2))
    else:
        fuzz = meta.get("fuzz")
        where = (
            f"fuzz case {fuzz.get('case')!r}"
            if fuzz is not None
            else f"site {meta.get('site')!r}, {meta.get('direction')}, step {meta.get('step')}"
        )
        print(f"{args.file}: {where} — {_describe(call)}\n  recorded: {meta.get('reason')}")
        for spec, r in results.items():
            ratios = ", ".join(f"{d} {v:.3g}" for d, v in r["limit_ratio"].items() if v is not None)
            why = "; ".join(r["reasons"])
            print(
                f"  {spec}: {r['verdict'].upper()}"
                + (f" (error / limit {ratios})" if ratios else "")
                + (f": {why}" if why else "")
            )
    return 1 if any(r["verdict"] != "pass" for r in results.values()) else 0


def _describe(call: Reproducer) -> str:
    """The call in one line: shapes, dtype, device, arguments, mask, whether gradients are judged."""
    fuzz = call.meta.get("fuzz")
    backward = fuzz.get("backward", True) if fuzz is not None else call.grad_out is not None
    layout = (
        f", layout {fuzz.get('layout')}" if fuzz and fuzz.get("layout", "contiguous") != "contiguous" else ""
    )
    mask = (
        "none"
        if call.attn_mask is None
        else f"{str(call.attn_mask.dtype).removeprefix('torch.')} {tuple(call.attn_mask.shape)}"
    )
    return (
        f"q {tuple(call.q.shape)} k {tuple(call.k.shape)} v {tuple(call.v.shape)} "
        f"{str(call.dtype).removeprefix('torch.')} on {call.q.device}, causal={call.is_causal}, "
        f"scale={call.scale}, mask {mask}{layout}, backward={'yes' if backward else 'no'}"
    )


def _replay_contract(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Replay a contract reproducer: 0 when every kernel passes, 1 when one fails, 2 when none fails
    and a kernel refuses the (valid) call or is not registered."""
    from flashprobe.formats.reproducer import ReproducerError, load_contract_reproducer
    from flashprobe.fuzz.contract_cases import describe_call
    from flashprobe.fuzz.contract_run import check_call
    from flashprobe.kernels import get_kernel

    try:
        saved = load_contract_reproducer(args.file)
    except ReproducerError as err:
        parser.error(str(err))
    meta, contract = saved.meta, saved.meta["contract"]
    specs = list(args.kernel or ([meta["primary"]] if meta.get("primary") else []))
    if not specs:
        parser.error("the reproducer records no kernel; name one with --kernel")
    for spec in specs:
        try:
            get_kernel(spec)
        except KernelSpecError as err:
            module = meta.get("kernel_module")
            parser.error(
                f"--kernel {spec!r}: {err} ({'--import ' + module if module else 'pass --import MODULE'})"
            )
    results = {}
    for spec in specs:
        found = check_call(
            spec, saved.call, refuse=contract.get("refuse", ""), backward=contract.get("backward", True)
        )
        results[spec] = {"verdict": found.verdict, "failure": found.failure, "reasons": [found.reason]}
    case = (meta.get("fuzz") or {}).get("case")
    if args.json:
        print(
            json.dumps(
                {"file": str(args.file), "call": describe_call(saved.call), "results": results}, indent=2
            )
        )
    else:
        print(f"{args.file}: fuzz case {case!r} ({contract.get('api')}) — {describe_call(saved.call)}")
        print(f"  recorded: {meta.get('reason')}")
        for spec, r in results.items():
            print(f"  {spec}: {r['verdict'].upper()}: {r['reasons'][0]}")
    verdicts = {r["verdict"] for r in results.values()}
    if "fail" in verdicts:
        return 1
    return 2 if "unsupported" in verdicts else 0
