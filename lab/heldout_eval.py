"""The held-out floor of issue 52: kernels no one here wrote, fuzzed as a user would fuzz them.

``python -m lab.heldout_eval`` registers every kernel of :data:`lab.heldout.HELDOUT` with the api and
the conventions :data:`lab.heldout.CONTRACTS` gives it (LSE base, LSE of a row without keys, dtypes,
backward, ``out=``) — the implementations are not read — and runs ``flashprobe fuzz``'s default
profile on each at bf16, fp16 and fp32 (and ``e4m3`` for a kernel that declares FP8 inputs), with
gradients where it has a backward. It prints one line per kernel (its verdict and the failing cases)
and the floor: the fraction of bug kernels that fail, and whether every control passes. The bugs
that only a sequence of calls shows (``calls > 1``: a plan cache keyed without the scale or the
strides, a stale ``dO``, reused scratch) are listed apart: a single call cannot show them.

Options: ``--contract-only`` runs the contract catalogue only (not the dense catalogue through the
kernel's adapter), ``--kernel NAME`` (repeatable) a subset, ``--json FILE`` writes the rows,
``--ledger FILE`` accepts findings as ``flashprobe fuzz --ledger`` does (``lab/heldout/ledger.yaml``:
the biased rounding of bf16 P that the FlashAttention-2-style controls share with torch's
``sdpa_flash``, arXiv 2510.04212; without it those controls fail ``bias_repeated_max`` at bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flashprobe.bench.args import torch_threads
from flashprobe.fuzz.check import check_kernel
from flashprobe.fuzz.contract_run import run_contract_catalogue
from flashprobe.fuzz.ledger import load_ledger
from flashprobe.kernels import KernelCapabilities, register_kernel, unregister_kernel

__all__ = ["capabilities", "evaluate", "main", "register_heldout"]

#: Verdicts that fail the gate: a wrong answer, and a kernel clearly more accurate than it declares.
_FAILING = ("fail", "not_declared")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "e4m3": torch.float8_e4m3fn}


def capabilities(contract: Any) -> KernelCapabilities:
    """The :class:`KernelCapabilities` a held-out kernel declares, from its ``Contract``."""
    return KernelCapabilities(
        masks=frozenset({"causal"}),
        dtypes=frozenset(_DTYPES[d] for d in contract.dtypes),
        backward_devices=None if contract.backward else frozenset(),
        lse_base=2 if contract.lse_base == 2 else "e",
        empty_lse=float(contract.empty_row_lse),
        preallocated_out=bool(contract.out_kwarg),
        sinks=False,
        alibi=contract.signature != "FlashAttention-3",
        cache_leftpad=False,  # the held-out KV-cache kernels refuse cache_leftpad (ValueError), as declared
    )


def register_heldout() -> dict[str, Any]:
    """Register every held-out kernel as ``heldout_<name>``; returns name → ``HeldOut``."""
    from lab.heldout import CONTRACTS, HELDOUT

    for name, held in HELDOUT.items():
        register_kernel(
            f"heldout_{name}",
            held.fn,
            api=held.api,
            capabilities=capabilities(CONTRACTS[name]),
            overwrite=True,
        )
    return dict(HELDOUT)


def evaluate(
    names: Sequence[str] | None = None,
    *,
    contract_only: bool = False,
    seed: int = 0,
    backward: bool = True,
    progress: bool = False,
    dtypes: Sequence[str] = ("bf16", "fp16", "fp32"),
    threads: int = 1,
    ledger: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Fuzz each held-out kernel (all, or ``names``) at the default profile, with ``threads`` torch
    intra-op threads (``flashprobe fuzz``'s default); one row per kernel: name, api, kind, calls,
    verdict (``fail`` when any case fails outside ``ledger``, a ``flashprobe fuzz --ledger`` file, or
    an entry of it passes), the failing cases, the ledger's known ones, counts, seconds."""
    from lab.heldout import CONTRACTS, stateful

    held = register_heldout()
    rows = []
    try:
        for name in names or list(held):
            contract = CONTRACTS[name]
            chosen = [_DTYPES[d] for d in dtypes]
            chosen += [torch.float8_e4m3fn] if "e4m3" in contract.dtypes else []
            stateful.reset_state()
            start = time.perf_counter()
            spec = f"heldout_{name}"
            unexpected = []
            if contract_only:
                with torch_threads(threads):
                    results = run_contract_catalogue([spec], chosen, seed=seed, backward=backward)
                if ledger is not None:
                    report = load_ledger(ledger).apply(results)
                    results, unexpected = report.results, report.unexpected
            else:
                found = check_kernel(
                    spec, dtypes=chosen, seed=seed, backward=backward, threads=threads, ledger=ledger
                )
                results, unexpected = found.results, found.unexpected_passes
            failing = [r for r in results if r.verdict in _FAILING and not r.known]
            failed = sorted({f"{r.case}@{r.dtype}" for r in failing})
            failed += [f"{u.case}@{u.dtype} passed: fixed? remove the entry" for u in unexpected]
            known = sorted({f"{r.case}@{r.dtype}" for r in results if r.verdict == "fail" and r.known})
            counts = {
                v: sum(r.verdict == v for r in results) for v in ("pass", "fail", "skip", "unsupported")
            }
            rows.append({
                "kernel": name, "api": held[name].api, "kind": held[name].kind, "calls": contract.calls,
                "trigger": held[name].trigger, "verdict": "fail" if failed else "pass", "failed": failed,
                "known": known,
                "counts": counts, "seconds": round(time.perf_counter() - start, 1),
                "reasons": sorted({r.reason[:160] for r in failing})[:3],
            })  # fmt: skip
            if progress:
                _line(rows[-1])
    finally:
        for name in held:
            unregister_kernel(f"heldout_{name}")
    return rows


def _line(r: dict[str, Any]) -> None:
    what = ", ".join(r["failed"][:6]) + (" ..." if len(r["failed"]) > 6 else "")
    what += f" (known: {', '.join(r['known'])})" if r["known"] else ""
    print(
        f"{r['kind']:<8} {r['kernel']:<34} {r['verdict'].upper():<5} {r['seconds']:>6.1f}s {what}", flush=True
    )


def floor(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The floor's figures: bugs caught of the single-call bugs, controls passing, the sequence-only bugs."""
    single = [r for r in rows if r["kind"] == "bug" and r["calls"] == 1]
    sequence = [r for r in rows if r["kind"] == "bug" and r["calls"] > 1]
    controls = [r for r in rows if r["kind"] == "control"]
    caught = [r["kernel"] for r in single if r["verdict"] == "fail"]
    return {
        "bugs": len(single), "caught": len(caught),
        "fraction": len(caught) / len(single) if single else math.nan,
        "missed": [r["kernel"] for r in single if r["verdict"] != "fail"],
        "controls": len(controls),
        "controls_failing": [r["kernel"] for r in controls if r["verdict"] == "fail"],
        "sequence_only": {r["kernel"]: r["verdict"] for r in sequence},
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.heldout_eval``: 0 when the floor holds (≥ 90 % of the single-call bugs fail,
    every control passes), 1 when not."""
    p = argparse.ArgumentParser(prog="python -m lab.heldout_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", action="append", help="a held-out kernel's name (repeatable; default all)")
    p.add_argument("--contract-only", action="store_true", help="the contract catalogue only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-backward", action="store_true", help="judge outputs and LSEs only")
    p.add_argument("--dtype", action="append", choices=("bf16", "fp16", "fp32"), help="default: all three")
    p.add_argument("--json", type=Path, help="write the rows and the floor as JSON")
    p.add_argument(
        "--ledger",
        help="accepted findings, as `flashprobe fuzz --ledger` (lab/heldout/ledger.yaml: the biased "
        "rounding that FlashAttention-2's numerics have in bf16)",
    )
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows = evaluate(
        args.kernel,
        contract_only=args.contract_only,
        seed=args.seed,
        dtypes=args.dtype or ("bf16", "fp16", "fp32"),
        backward=not args.no_backward,
        progress=True,
        ledger=args.ledger,
    )
    result = floor(rows)
    print(
        f"\nsingle-call bugs failing: {result['caught']} of {result['bugs']} "
        f"({100 * result['fraction']:.0f} %); missed: {', '.join(result['missed']) or 'none'}\n"
        f"controls: {result['controls']}, failing: {', '.join(result['controls_failing']) or 'none'}\n"
        f"sequence-only bugs (issue 54's call sequences): {result['sequence_only']}\n"
        f"{time.perf_counter() - start:.0f} s"
    )
    if args.json:
        from flashprobe.formats import atomic_write_text

        atomic_write_text(args.json, json.dumps({"rows": rows, "floor": result}, indent=2, default=str))
    ok = result["fraction"] >= 0.9 and not result["controls_failing"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
