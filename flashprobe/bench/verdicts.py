"""``flashprobe bench verdicts``: what the verdict's rule reads on correct kernels in training.

The probe's calibration: tiny random-init models (:mod:`flashprobe.bench.tiny_models`; all but
``t2i`` need the ``integration`` extra) train with AdamW for ``--steps`` steps under
:func:`flashprobe.probing.probe` (``backward=True``), in float32 and under bf16/fp16 autocast, with
torch's own SDPA as the kernel or each ``--kernel SPEC`` (``--import MODULE`` registers a user's,
e.g. ``--import lab.mutants`` for the planted bugs). Each row gives, per direction, ``limit_ratio``
(> 1 fails), the largest error ratio, the judged, failed and undetermined calls (with their reasons),
the per-call ratio of maxima for comparison, and the run's signed bias (:mod:`flashprobe.bias`).
A correct kernel must never fail; the margin to 1 is what the rule leaves for noise.

Writes ``DIR/verdicts.json`` and ``DIR/verdicts.csv``; ``--check`` exits 1 when a call failed or a
site read biased.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from flashprobe.bench.args import add_output_args, run_cli, torch_threads
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.results import format_table, write_results, wrote_line
from flashprobe.bench.tiny_models import MODELS
from flashprobe.bias import BIAS_TOLERANCE, BIAS_Z_LIMIT, COMPONENTS
from flashprobe.judge import DIRECTIONS, LIMITS
from flashprobe.kernels import add_import_option, get_kernel, import_kernel_modules
from flashprobe.probing.stats import site_directions

__all__ = ["MODELS", "MODEL_KERNEL", "calibrate", "main"]


#: ``--kernel`` name of the models' own attention (torch SDPA, the probe with no ``primary``)
MODEL_KERNEL = "model"
#: Static loss scale per ``--precision`` (fp16 only: its gradients underflow without one).
_LOSS_SCALE: dict[str, float] = {"fp16": 2.0**12}
#: ``--precision`` name → the autocast dtype (None: float32, no autocast).
_PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def calibrate(
    model_name: str, precision: str, steps: int, seed: int = 0, kernel: str | None = None
) -> dict[str, Any]:
    """Train the :data:`MODELS` model ``model_name`` for ``steps`` AdamW steps at ``precision`` (fp32,
    bf16, fp16) under the probe, with ``kernel`` as the primary (None: the model's own SDPA); returns
    its row (see the module docstring)."""
    from flashprobe.probing import probe

    model, batch, output = MODELS[model_name](seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst = dict.fromkeys(DIRECTIONS, 0.0)
    worst_max = dict.fromkeys(DIRECTIONS, 0.0)
    score = dict.fromkeys(DIRECTIONS, 0.0)
    judged = dict.fromkeys(DIRECTIONS, 0)
    failed = dict.fromkeys(DIRECTIONS, 0)
    undetermined: dict[str, int] = {}
    low = _PRECISIONS[precision]
    start = time.perf_counter()
    p = probe(model, primary=kernel, backward=True, on_failure="ignore", dtype=low)
    try:
        for step in range(steps):
            p.set_step(step)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                out = output(model(**batch(step)))
            # a static loss scale for fp16 (the rule's statistics are ratios: nothing to undo)
            (out.float().square().mean() * _LOSS_SCALE.get(precision, 1.0)).backward()
            opt.step()
            if step % 50 == 49 or step == steps - 1:  # read and reset: bounded reads, as the callback
                _fold(p.stats(), worst, worst_max, score, judged, failed, undetermined)
                p.reset()
        failures = p.failures
        bias = _bias(p.stats())  # the run's: reset() keeps the bias sums
    finally:
        p.detach()
    row: dict[str, Any] = {
        "model": model_name, "precision": precision, "kernel": kernel or MODEL_KERNEL,
        "steps": steps, "sites": len(p.sites),
    }  # fmt: skip
    for d in DIRECTIONS:
        row[f"{d}_limit_ratio"] = score[d] if judged[d] else None
        row[f"{d}_max_l2_ratio"] = worst[d] if judged[d] else None
        row[f"{d}_max_call_error_ratio"] = worst_max[d] if judged[d] else None
        row[f"{d}_calls"] = judged[d]
    row["failed_calls"] = sum(failed.values())
    row["undetermined_calls"] = sum(undetermined.values())
    judgements = sum(judged.values())
    row["undetermined_share"] = row["undetermined_calls"] / judgements if judgements else None
    row["undetermined_reasons"] = ", ".join(f"{k} {n}" for k, n in sorted(undetermined.items()) if n) or None
    row.update(bias)
    first = failures[0] if failures else None
    row["first_failure"] = first and f"{first['site']} {first['direction']} step {first['step']}"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _bias(stats: dict[str, Any]) -> dict[str, Any]:
    """Per direction the signed bias ``z`` and mean of the largest magnitude over the sites (None before
    any replicate), the (site, direction) pairs that read biased, and the largest replicate count."""
    row: dict[str, Any] = {}
    biased: list[str] = []
    replicates = 0
    for d in DIRECTIONS:
        entries = [(s, site_directions(e)[d].get("bias")) for s, e in stats.items()]
        entries = [(s, b) for s, b in entries if b and b["replicates"]]
        row[f"{d}_bias_z"] = max((b["z"] for _, b in entries), key=abs, default=None)
        row[f"{d}_bias_mean"] = max(
            (b[c]["mean"] for _, b in entries for c in COMPONENTS), key=abs, default=None
        )
        biased += [f"{s}:{d}" for s, b in entries if b["verdict"] == "biased"]
        replicates = max([replicates, *(b["replicates"] for _, b in entries)])
    row["bias_replicates"] = replicates
    row["biased"] = len(biased)
    row["biased_sites"] = " ".join(biased) or None
    return row


def _fold(
    stats: dict[str, Any],
    worst: dict[str, float],
    worst_max: dict[str, float],
    score: dict[str, float],
    judged: dict[str, int],
    failed: dict[str, int],
    undetermined: dict[str, int],
) -> None:
    for entry in stats.values():
        for d, e in site_directions(entry).items():
            if e.get("verdict") is None:
                continue
            calls = entry["forward"]["calls"] if d == "out" else entry["backward"]["calls"]
            judged[d] += calls
            failed[d] += e["failed_calls"]
            for reason, n in e["undetermined_calls"].items():
                undetermined[reason] = undetermined.get(reason, 0) + n
            score[d] = max(score[d], e["limit_ratio"] or 0.0)
            worst[d] = max(worst[d], e["l2_error_ratio"] or 0.0)
            worst_max[d] = max(worst_max[d], e["max_call_error_ratio"] or 0.0)


TABLE_COLUMNS = [
    ("kernel", "kernel"),
    ("model", "model"),
    ("precision", "precision"),
    ("steps", "steps"),
    ("sites", "sites"),
    *((f"{d}_limit_ratio", f"{d} err/limit") for d in DIRECTIONS),
    *((f"{d}_max_l2_ratio", f"{d} L2") for d in DIRECTIONS),
    *((f"{d}_max_call_error_ratio", f"{d} max/max") for d in DIRECTIONS),
    ("out_calls", "calls"),
    ("failed_calls", "failed"),
    ("undetermined_calls", "undet."),
    ("undetermined_share", "undet. share"),
    ("undetermined_reasons", "undet. reasons"),
    *((f"{d}_bias_mean", f"{d} bias mean") for d in DIRECTIONS),
    *((f"{d}_bias_z", f"{d} bias z") for d in DIRECTIONS),
    ("biased", "biased"),
    ("seconds", "s"),
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashprobe bench verdicts",
        description="The verdict's rule on torch's correct kernels in training (its calibration).",
    )
    p.add_argument(
        "--steps", type=int, default=200, help="training steps per model and precision (default 200)"
    )
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)} (default all)"
    )
    p.add_argument(
        "--precision", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16 (default fp32,bf16)"
    )
    p.add_argument(
        "--kernel", action="append", metavar="SPEC",
        help=f"primary kernel spec, repeatable (default: {MODEL_KERNEL}, the models' own SDPA); e.g. "
        "tiled:preset=fa2, or a kernel --import registers (with --import lab.mutants: bug_output_truncated)",
    )  # fmt: skip
    p.set_defaults(kernel_default=[MODEL_KERNEL])
    add_import_option(p)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument(
        "--check", action="store_true", help="exit with 1 when any call failed or a site read biased"
    )
    add_output_args(p, "verdicts", figure=False)
    return p


def _run(args: argparse.Namespace) -> int:
    models = [m for m in args.models.split(",") if m]
    precisions = [p for p in args.precision.split(",") if p]
    unknown = [m for m in models if m not in MODELS] + [p for p in precisions if p not in _PRECISIONS]
    if unknown or not models or not precisions:
        raise BenchArgumentError(
            f"unknown or missing --models/--precision {unknown}: use {', '.join(MODELS)} "
            f"and {', '.join(_PRECISIONS)}"
        )
    if isinstance(args.steps, bool) or args.steps < 1:
        raise BenchArgumentError(f"--steps must be >= 1, got {args.steps}")
    third_party = [m for m in models if m != "t2i"]
    for package in sorted(
        {"transformers" if m in ("gpt2", "llama", "bert", "vit") else "diffusers" for m in third_party}
    ):
        try:
            __import__(package)
        except ImportError:
            raise BenchArgumentError(
                f"--models {','.join(third_party)} needs {package}: pip install 'flashprobe[integration]' "
                "(or --models t2i)"
            ) from None
    import_kernel_modules(args.imports or [])
    for spec in args.kernel:
        _resolve(spec)
    start = time.perf_counter()
    with torch_threads(args.threads):
        rows = []
        for spec in args.kernel:
            for m in models:
                for prec in precisions:
                    kernel = None if spec == MODEL_KERNEL else spec
                    row = calibrate(m, prec, args.steps, kernel=kernel)
                    rows.append(row)
                    done = f"{row['seconds']} s, failed calls {row['failed_calls']}, biased {row['biased']}"
                    print(f"{spec} {m} {prec}: {done}", file=sys.stderr)
    seconds = time.perf_counter() - start
    print(format_table(rows, TABLE_COLUMNS))
    failed = sum(r["failed_calls"] for r in rows)
    undetermined = sum(r["undetermined_calls"] for r in rows)
    biased = sum(r["biased"] for r in rows)
    print(f"failed calls: {failed}; undetermined calls: {undetermined}; biased (site, direction): {biased}")
    meta = {
        "command": args.command_line,
        "kernels": args.kernel,
        "bias_z_limit": BIAS_Z_LIMIT,
        "bias_tolerance": BIAS_TOLERANCE,
        "limits": LIMITS,
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
    }
    paths = write_results(args.out, "verdicts", rows, meta=meta)
    print(wrote_line(rows, seconds, paths))
    return 1 if args.check and (failed or biased) else 0


def _resolve(spec: str) -> None:
    """Refuse an unknown ``--kernel`` before any work."""
    if spec == MODEL_KERNEL:
        return
    try:
        get_kernel(spec)
    except (KeyError, ValueError) as e:
        suite = spec.startswith(("bug_", "ok_"))
        also = " (the project's mutants: --import lab.mutants from the repository's root)" if suite else ""
        raise BenchArgumentError(
            f"--kernel {spec!r}: {e}; or {MODEL_KERNEL} (the models' own SDPA), or a kernel --import "
            f"MODULE registers{also}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench verdicts``; returns the exit code."""
    return run_cli("verdicts", _parser(), _run, argv)
