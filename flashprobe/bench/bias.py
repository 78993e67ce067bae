"""``flashprobe bench bias``: the biased rounding of Qiu & Yao (arXiv 2510.04212), measured.

Where several scores of a row sit at (or just below) its maximum, low-precision ``P·V`` rounds them
with one sign, and with similar low-rank rows the error biases ``δ = rowsum(dO ∘ O)`` and every
weight gradient; ``tiled:max_shift=repeated`` is the mitigation. Inputs
(:func:`flashprobe.fuzz.inputs.bias_inputs`) have ``ties`` keys at the row max (``repeated``) or one
(``control``). Per inputs, dtype and kernel, the output, ``δ`` (fp32, from the kernel's output) and
the key projection's weight gradient (where only ``δ`` comes from the kernel) are compared with their
FP64 golden by :class:`flashprobe.bias.BiasStats`. A spec with ``rescale_threshold`` is paired with
the same spec without it (``lazy_rescale`` in the metadata).

Writes ``DIR/bias.json``, ``DIR/bias.csv``, ``DIR/bias.md`` and ``DIR/bias.png``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flashprobe.bench.args import (
    add_kernel_args,
    add_output_args,
    parse_device,
    parse_dtypes,
    parse_kernels,
    parse_seeds,
    run_cli,
)
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.inputs import Shape
from flashprobe.bench.results import format_table, write_results, wrote_line
from flashprobe.bias import BIAS_TOLERANCE, BIAS_Z_LIMIT, COMPONENTS, BiasStats
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.fuzz.inputs import bias_inputs
from flashprobe.kernels import Kernel, KernelUnavailableError, get_kernel, parse_spec
from flashprobe.kernels._inputs import dtype_name
from flashprobe.kernels.math import golden_attention

__all__ = ["DEFAULT_KERNELS", "INPUT_KINDS", "QUANTITIES", "bias_rows", "lazy_rescale_pairs", "main"]

#: The baseline, the re-implementation at both presets, torch's CPU kernels, and the mitigation.
DEFAULT_KERNELS = (
    "math",
    "tiled",
    "tiled:preset=paper",
    "sdpa_flash",
    "sdpa_math",
    "tiled:max_shift=repeated",
    "tiled:preset=paper,max_shift=repeated",
)
#: Inputs with repeated row maxima, and the control without.
INPUT_KINDS = ("repeated", "control")
#: What is compared with the golden value.
QUANTITIES = ("out", "delta", "dweight")

_COLUMNS = (
    ("inputs", "inputs"),
    ("dtype", "dtype"),
    ("kernel", "kernel"),
    ("quantity", "of"),
    ("component", "component"),
    ("bias", "bias"),
    ("z", "z"),
    ("bias_rel", "bias/|golden|"),
    ("seed_signs", "seeds +/-"),
    ("verdict", "verdict"),
)


def _key_weight_grad(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, x: torch.Tensor, delta: torch.Tensor
) -> torch.Tensor:
    """``xᵀ dK`` ``(B, H, D, D)`` in float64, ``dK = scale · (P ∘ (dO vᵀ − δ))ᵀ q``: only ``δ`` varies."""
    scale = q.shape[-1] ** -0.5
    p = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)  # (B, H, N, N)
    ds = p * (do @ v.transpose(-2, -1) - delta) * scale
    return x.transpose(-2, -1) @ (ds.transpose(-2, -1) @ q)


def _quantities(
    out: torch.Tensor, inputs: Mapping[str, torch.Tensor], cast: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The output, ``δ`` (fp32 from the output as stored, float64 for the golden) and the weight
    gradient it feeds, as float64."""
    do = cast["do"]
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    delta = (do.to(wide) * out.to(wide)).sum(-1, keepdim=True).double()  # (B, H, N, 1)
    q, k, v = (cast[name].double() for name in ("q", "k", "v"))
    dweight = _key_weight_grad(q, k, v, do.double(), inputs["x"], delta)
    return {"out": out.double(), "delta": delta, "dweight": dweight}


def bias_rows(
    shape: Shape,
    *,
    kernels: Sequence[Kernel],
    dtypes: Sequence[torch.dtype],
    seeds: Sequence[int],
    kinds: Sequence[str] = INPUT_KINDS,
    ties: int = 16,
    device: torch.device | str = "cpu",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The bias of every kernel's output, ``δ`` and weight gradient, per input kind and dtype.

    Returns:
        ``(rows, skipped)``: one row per (inputs, dtype, kernel, quantity) with ``bias`` (the signed
        mean error of the larger-|z| ``component``, in units of the ``math`` baseline's error RMS),
        ``z``, ``bias_rel`` (relative to the mean ``|golden|``; per seed: ``seed_bias_rel``),
        ``verdict`` and both components' ``*_mean``/``*_z``; and the skipped kernels with the reason.
    """
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for kind in kinds:
        for dtype in dtypes:
            measured = _measure(kernels, shape, seeds, kind, dtype, ties, device, skipped)
            for spec, (stats, seed_rel) in measured.items():
                common = {"inputs": kind, "dtype": dtype_name(dtype), "kernel": spec}
                setting = {**shape.as_dict(), "ties": ties if kind == "repeated" else 1}
                rows += [
                    {**common, **_row(name, entry, seed_rel), **setting}
                    for name, entry in stats.as_dict().items()
                ]
    return rows, skipped


_Measured = dict[str, tuple[BiasStats, dict[tuple[str, str], list[float]]]]


def _measure(
    kernels: Sequence[Kernel],
    shape: Shape,
    seeds: Sequence[int],
    kind: str,
    dtype: torch.dtype,
    ties: int,
    device: torch.device | str,
    skipped: list[dict[str, Any]],
) -> _Measured:
    """Per kernel spec its :class:`BiasStats` over all seeds and, per (quantity, component), each seed's
    signed mean error relative to the mean ``|golden|``; unavailable kernels go to ``skipped``."""
    baseline = get_kernel("math")
    measured: _Measured = {}
    unavailable: set[str] = set()
    for seed in seeds:
        inputs = bias_inputs(shape.dims, seed, repeated=kind == "repeated", ties=ties)
        cast = {name: t.to(device, dtype) for name, t in inputs.items() if name != "x"}
        args = (cast["q"], cast["k"], cast["v"])
        golden = _quantities(golden_attention(*(t.double() for t in args)), inputs, cast)
        base = _quantities(baseline(*args), inputs, cast)
        for kernel in kernels:
            if kernel.spec in unavailable:
                continue
            try:
                got = _quantities(kernel(*args), inputs, cast)
            except KernelUnavailableError as err:
                unavailable.add(kernel.spec)
                skipped.append({"kernel": kernel.spec, "dtype": dtype_name(dtype), "reason": str(err)})
                continue
            stats, seed_rel = measured.setdefault(kernel.spec, (BiasStats(QUANTITIES, device), {}))
            for name in QUANTITIES:
                stats.add(name, got[name], golden[name], base[name])
                err, size = got[name] - golden[name], golden[name].abs().mean().item()
                seed_rel.setdefault((name, "offset"), []).append(err.mean().item() / size)
                signed = (err * golden[name].sign()).mean().item()
                seed_rel.setdefault((name, "magnitude"), []).append(signed / size)
    return measured


def _row(
    name: str, entry: Mapping[str, Any], seed_rel: Mapping[tuple[str, str], list[float]]
) -> dict[str, Any]:
    """The columns of one quantity's row from its ``BiasStats.as_dict()`` entry."""
    component = max(COMPONENTS, key=lambda c: abs(entry[c]["z"]))
    per_seed = seed_rel[name, component]
    return {
        "quantity": name,
        "component": component,
        "bias": entry[component]["mean"],
        "z": entry[component]["z"],
        "excess_z": entry["z"],
        "replicates": entry["replicates"],
        "bias_rel": sum(per_seed) / len(per_seed),
        "seed_bias_rel": per_seed,
        "seed_signs": f"{sum(x > 0 for x in per_seed)}/{sum(x < 0 for x in per_seed)}",
        "verdict": entry["verdict"],
        **{f"{c}_{key}": entry[c][key] for c in COMPONENTS for key in ("mean", "z")},
    }


def mitigation_factors(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``|bias(kernel)| / |bias(kernel with max_shift=repeated)|`` per inputs, dtype and quantity (of the
    component the kernel's row reports), with whether the kernel read biased."""
    index = {(r["inputs"], r["dtype"], r["kernel"], r["quantity"]): r for r in rows}
    factors = []
    for (kind, dtype, spec, name), row in index.items():
        if "max_shift" in spec:
            continue
        shifted = spec + (",max_shift=repeated" if ":" in spec else ":max_shift=repeated")
        mitigated = index.get((kind, dtype, shifted, name))
        after = None if mitigated is None else mitigated[f"{row['component']}_mean"]
        if not after:
            continue
        factors.append({
            "inputs": kind, "dtype": dtype, "kernel": spec, "quantity": name,
            "component": row["component"], "biased": row["verdict"] == "biased",
            "mitigated_verdict": mitigated["verdict"], "factor": abs(row["bias"]) / abs(after),
        })  # fmt: skip
    return factors


def _lazy_key(spec: str) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], float]:
    """``((name, options but rescale_threshold), rescale_threshold)`` of a kernel spec."""
    name, options = parse_spec(spec)
    threshold = float(options.pop("rescale_threshold", 0) or 0)
    return (name, tuple(sorted(options.items()))), threshold


def lazy_rescale_pairs(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every kernel with ``rescale_threshold`` > 0 beside the same spec without it, per inputs, dtype and
    quantity: both biases (of the eager row's component), their z and verdicts."""
    keyed = [((r["inputs"], r["dtype"], *_lazy_key(r["kernel"]), r["quantity"]), r) for r in rows]
    eager_rows = {(kind, dtype, spec, name): r for (kind, dtype, spec, t, name), r in keyed if not t}
    pairs = []
    for (kind, dtype, spec, threshold, name), lazy in keyed:
        eager = eager_rows.get((kind, dtype, spec, name)) if threshold else None
        if eager is None:
            continue
        component = eager["component"]
        pairs.append({
            "inputs": kind, "dtype": dtype, "kernel": lazy["kernel"], "eager": eager["kernel"],
            "quantity": name, "component": component, "threshold": threshold,
            "bias_eager": eager[f"{component}_mean"], "z_eager": eager[f"{component}_z"],
            "verdict_eager": eager["verdict"], "bias_lazy": lazy[f"{component}_mean"],
            "z_lazy": lazy[f"{component}_z"], "verdict_lazy": lazy["verdict"],
        })  # fmt: skip
    return pairs


def markdown(
    rows: Sequence[Mapping[str, Any]],
    factors: Sequence[Mapping[str, Any]],
    command: str,
    lazy: Sequence[Mapping[str, Any]] = (),
) -> str:
    """``bias.md``: the table of every row, then the mitigation factors and the lazy-rescale pairs."""
    lines = [
        "# flashprobe bench bias",
        "",
        f"`{command}`",
        "",
        "bias: mean signed error in units of the `math` baseline's error RMS, of the component with "
        "the larger |z| (offset: + upward; magnitude: + away from zero); "
        "z over (seed, batch, head) replicates against 0; the verdict's z is that of the mean's excess "
        f"over the tolerance ±{BIAS_TOLERANCE:g}: biased at ≥ {BIAS_Z_LIMIT:g}.",
        "",
        "| inputs | dtype | kernel | of | component | bias | z | verdict's z | bias/\\|golden\\| | seeds +/- "
        "| verdict |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['inputs']} | {r['dtype']} | `{r['kernel']}` | {r['quantity']} | {r['component']} | "
            f"{_signed(r['bias'], '.3g')} | {r['z']:+.1f} | {r['excess_z']:+.1f} | "
            f"{_signed(r['bias_rel'], '.2e')} | "
            f"{r['seed_signs']} | {r['verdict']} |"
        )
    if factors:
        lines += [
            "",
            "## max_shift=repeated",
            "",
            "| inputs | dtype | kernel | of | biased | bias ÷ mitigated bias | mitigated |",
            "|---|---|---|---|---|---:|---|",
        ]
        lines += [
            f"| {f['inputs']} | {f['dtype']} | `{f['kernel']}` | {f['quantity']} | "
            f"{'yes' if f['biased'] else 'no'} | {f['factor']:.3g} | {f['mitigated_verdict']} |"
            for f in factors
        ]
    if lazy:
        lines += [
            "",
            "## rescale_threshold (lazy rescale)",
            "",
            "| inputs | dtype | kernel | without it | of | component | bias without | z | verdict "
            "| bias with | z | verdict |",
            "|---|---|---|---|---|---|---:|---:|---|---:|---:|---|",
        ]
        lines += [
            f"| {p['inputs']} | {p['dtype']} | `{p['kernel']}` | `{p['eager']}` | {p['quantity']} | "
            f"{p['component']} | {_signed(p['bias_eager'], '.3g')} | {p['z_eager']:+.1f} | "
            f"{p['verdict_eager']} | {_signed(p['bias_lazy'], '.3g')} | {p['z_lazy']:+.1f} | "
            f"{p['verdict_lazy']} |"
            for p in lazy
        ]
    return "\n".join(lines) + "\n"


def _signed(value: float | None, spec: str) -> str:
    """``value`` with its sign, or ``-`` when nothing was measured (no finite element)."""
    return "-" if value is None or math.isnan(value) else format(value, "+" + spec)


def plot_bias(rows: Sequence[Mapping[str, Any]], path: Any) -> Any:
    """One panel per quantity: ``z`` of every (kernel, dtype), repeated inputs beside the control."""
    from matplotlib.figure import Figure

    from flashprobe.report.bench_figures import save_figure

    names = list(dict.fromkeys(r["quantity"] for r in rows))
    labels = list(dict.fromkeys(f"{r['kernel']} {r['dtype']}" for r in rows))
    fig = Figure(figsize=(5 * len(names), 0.35 * len(labels) + 1.8), layout="constrained")
    axes = fig.subplots(1, len(names), sharey=True, squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        for offset, kind, color in ((-0.2, "repeated", "tab:red"), (0.2, "control", "tab:blue")):
            sel = {
                f"{r['kernel']} {r['dtype']}": r
                for r in rows
                if r["quantity"] == name and r["inputs"] == kind
            }
            ys = [i + offset for i, label in enumerate(labels) if label in sel]
            zs = [sel[label]["z"] for label in labels if label in sel]
            ax.barh(ys, zs, height=0.4, color=color, label=f"{kind} maxima" if kind == "repeated" else kind)
        for x in (-BIAS_Z_LIMIT, BIAS_Z_LIMIT):
            ax.axvline(x, color="0.4", linestyle="--", linewidth=0.8)
        reach = max([BIAS_Z_LIMIT, *(abs(r["z"]) for r in rows if r["quantity"] == name)]) * 1.15
        ax.set_xlim(-reach, reach)
        ax.set_title(name)
        ax.set_xlabel("z of the signed mean error (dashed: biased limit)")
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)), labels, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=8)
    fig.suptitle("flashprobe bench bias: signed error vs FP64 golden", fontsize=10)
    return save_figure(fig, path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flashprobe bench bias",
        description="Signed (biased) error of kernels on inputs with repeated row maxima and similar "
        "low-rank rows, against a control without (Qiu & Yao, arXiv 2510.04212).",
    )
    add_kernel_args(parser, default=DEFAULT_KERNELS, baseline=False)
    parser.add_argument(
        "--dtype", nargs="+", default=["bf16", "fp16"], metavar="DTYPE", help="dtypes (default: bf16 fp16)"
    )
    parser.add_argument("--batch", type=int, default=4, metavar="B", help="batch size (default 4)")
    parser.add_argument("--heads", type=int, default=8, metavar="H", help="heads (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, metavar="N", help="sequence length (default 128)")
    parser.add_argument("--head-dim", type=int, default=64, metavar="D", help="head dimension (default 64)")
    parser.add_argument(
        "--ties", type=int, default=16, help="keys at the row max, repeated inputs (default 16)"
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--repeats", type=int, default=5, metavar="R", help="seeds (default 5)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    add_output_args(parser, "bias")
    return parser


def _run(args: argparse.Namespace) -> int:
    seeds = parse_seeds(args.seed, args.repeats)
    if args.ties < 2:
        raise BenchArgumentError(f"--ties must be at least 2 (repeated maxima), got {args.ties}")
    shape = Shape(batch=args.batch, heads=args.heads, seq_len=args.seq_len, head_dim=args.head_dim)
    if shape.head_dim < 3:
        raise BenchArgumentError(f"--head-dim must be at least 3 for bias inputs, got {shape.head_dim}")
    if args.ties > shape.seq_len:
        raise BenchArgumentError(f"--ties must be between 2 and --seq-len ({shape.seq_len}), got {args.ties}")
    kernels = parse_kernels(args.kernel)
    dtypes = parse_dtypes(args.dtype)
    device = parse_device(args.device)
    start = time.perf_counter()
    rows, skipped = bias_rows(
        shape, kernels=kernels, dtypes=dtypes, seeds=seeds, ties=args.ties, device=device
    )
    factors = mitigation_factors(rows)
    lazy = lazy_rescale_pairs(rows)
    meta = {
        "command": args.command_line,
        "seeds": seeds,
        "z_limit": BIAS_Z_LIMIT,
        "tolerance": BIAS_TOLERANCE,
        "mitigation": factors,
        "lazy_rescale": lazy,
    }
    paths = write_results(args.out, "bias", rows, meta=meta, skipped=skipped)
    paths["md"] = args.out / "bias.md"
    atomic_write_text(paths["md"], markdown(rows, factors, args.command_line, lazy))
    paths["png"] = plot_bias(rows, args.out / "bias.png")
    print(format_table(rows, _COLUMNS))
    for f in factors:
        if f["biased"]:
            print(
                f"max_shift=repeated: {f['kernel']} {f['dtype']} {f['inputs']} {f['quantity']}: "
                f"bias ÷ {f['factor']:.3g} ({f['mitigated_verdict']} after)"
            )
    for p in lazy:
        print(
            f"rescale_threshold={p['threshold']:g}: {p['eager']} {p['dtype']} {p['inputs']} {p['quantity']}: "
            f"bias {_signed(p['bias_eager'], '.3g')} (z {p['z_eager']:+.1f}, {p['verdict_eager']}) without, "
            f"{_signed(p['bias_lazy'], '.3g')} (z {p['z_lazy']:+.1f}, {p['verdict_lazy']}) with"
        )
    for s in skipped:
        print(f"skipped {s['kernel']} {s['dtype']}: {s['reason']}")
    print(wrote_line(rows, time.perf_counter() - start, paths))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench bias``."""
    return run_cli("bias", _parser(), _run, argv)
