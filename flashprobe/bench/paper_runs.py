"""What ``flashprobe bench paper`` measures: the setting of each claim, the sweeps, the claims.

Three deviation sweeps (baseline ``math``, FP64 golden), each at :class:`PaperSettings`: ``length``
(bf16 over N at Bc; F4, F5), ``precision`` (every dtype; F3) and ``tiles`` (bf16 over Bc, Br ↔ Bc,
key-tile orders, square vs narrow tiles; F6a–c). Each runs ``tiled:preset=paper`` beside the real
kernels' numerics (``tiled:preset=fa2`` with the same tiles, and :func:`real_kernels` where the claim
needs no tile knobs); :func:`build_claims` turns the rows into judged claims.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flashprobe.bench.claims import (
    Claim,
    Judgement,
    Spread,
    fmt,
    judge_f3,
    judge_f4,
    judge_f5,
    judge_f6a,
    judge_f6b,
    judge_f6c,
    safe_ratio,
)
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.inputs import InputConfig, Shape
from flashprobe.bench.sweep import Primary, SweepPoint, deviation_sweep
from flashprobe.kernels import DEFAULT_PRESET, PRESETS, Kernel, get_kernel, tile_sizes, to_dtype

__all__ = [
    "BASELINE",
    "DEVIATION",
    "DTYPES",
    "SWEEPS",
    "PaperSettings",
    "build_claims",
    "real_kernels",
    "run_sweeps",
]

#: The baseline every claim compares against.
BASELINE = "math"
#: The deviation the paper plots: ``max |flash − baseline|``.
DEVIATION = "primary_baseline_max_abs"
#: The precisions of F3, fewest mantissa bits first.
DTYPES = ("bf16", "fp16", "fp32", "fp64")
#: The sweeps, in the order they run.
SWEEPS = ("length", "precision", "tiles")

Row = Mapping[str, Any]
#: A claim's reading of one kernel (or preset): ``(measured, display, judgement)``.
Measure = Callable[[str], tuple[Any, str, Judgement]]


@dataclass(frozen=True, kw_only=True)
class PaperSettings:
    """Where each claim is measured (the defaults are documented in docs/microbenchmark.md)."""

    head_dim: int = 64
    """d, the head dimension."""
    heads: int = 1
    """H; the batch is 1."""
    seq_lens: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    """F5: the sequence lengths of the length sweep; F4 is measured at the last one."""
    block_k: int = 32
    """Bc of the length and precision sweeps and of F6a's key-tile orders."""
    length_seeds: int = 7
    """Seeds of the length sweep (F4's median and spread)."""
    seq_len: int = 2048
    """N of the precision and tiles sweeps."""
    block_ks: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    """F6c: the tile sizes Bc, each as the paper's SRAM size ``M = 4·d·Bc``."""
    narrow_block_q: int = 16
    """F6b: Br of the non-square tile compared with the square ``d × d`` tile."""
    seeds: int = 3
    """Seeds of the precision and tiles sweeps."""
    first_seed: int = 0
    """The first seed; sweeps use ``first_seed, first_seed + 1, …``."""

    def __post_init__(self) -> None:
        counts = {"head_dim": self.head_dim, "heads": self.heads, "block_k": self.block_k}
        counts |= {"length_seeds": self.length_seeds, "seq_len": self.seq_len, "seeds": self.seeds}
        counts |= {"narrow_block_q": self.narrow_block_q}
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BenchArgumentError(f"bench paper: {name} must be a positive integer, got {value!r}")
        for name, values in (("seq_lens", self.seq_lens), ("block_ks", self.block_ks)):
            if len(values) < 2 or list(values) != sorted(set(values)) or values[0] < 1:
                raise BenchArgumentError(f"bench paper: {name} must be ≥ 2 increasing sizes, got {values!r}")
        if self.block_k not in self.block_ks:
            raise BenchArgumentError(f"bench paper: block_k={self.block_k} must be one of block_ks")
        if not self.narrow_block_q < self.head_dim:
            raise BenchArgumentError("bench paper: narrow_block_q must be smaller than head_dim")
        if self.first_seed < 0:
            raise BenchArgumentError(f"--seed must be ≥ 0, got {self.first_seed}")

    @classmethod
    def tiny(cls, first_seed: int = 0) -> PaperSettings:
        """Small shapes and few seeds: runs in seconds (tests); verdicts there mean little."""
        return cls(
            head_dim=16,
            seq_lens=(64, 128, 256),
            block_k=8,
            length_seeds=3,
            seq_len=128,
            block_ks=(8, 16, 32, 64),
            narrow_block_q=4,
            seeds=2,
            first_seed=first_seed,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def shape(self, seq_len: int) -> Shape:
        """``(1, heads, seq_len, head_dim)``."""
        return Shape(batch=1, heads=self.heads, seq_len=seq_len, head_dim=self.head_dim)

    def seed_list(self, count: int) -> list[int]:
        return [self.first_seed + i for i in range(count)]

    def sram(self, block_k: int) -> int:
        """The paper's SRAM size M whose ``Bc = ⌈M/4d⌉`` is ``block_k``."""
        return 4 * self.head_dim * block_k


def real_kernels(device: torch.device | str) -> list[str]:
    """The real flash kernels of this device: ``sdpa_flash``, plus the CUDA ones on a GPU."""
    cuda = torch.device(device).type == "cuda"
    return ["sdpa_flash", *(("flash_attn", "sdpa_efficient", "sdpa_cudnn") if cuda else ())]


def _spec(preset: str, **options: Any) -> str:
    return Kernel("tiled", {"preset": preset, **options}).spec


def _primary(spec: str, role: str, variant: str, head_dim: int) -> Primary:
    """A sweep primary labelled with its role (``paper``/``fa2``/``real``), variant and tiles."""
    kernel = get_kernel(spec)
    labels: dict[str, Any] = {"kernel": spec, "role": role, "variant": variant}
    if kernel.name == "tiled":
        opts = kernel.options
        tiles = {
            key: opts[key] for key in ("block_q", "block_k", "sram", "swap_blocks", "square") if key in opts
        }
        br, bc = tile_sizes(head_dim, **tiles)
        order = opts.get("order") or PRESETS[opts.get("preset", DEFAULT_PRESET)]["order"]
        labels |= {"block_q": br, "block_k": bc, "block_area": br * bc, "order": order}
        if "sram" in opts:
            labels["sram"] = opts["sram"]
    return Primary(kernel, labels)


def _tile_primaries(settings: PaperSettings) -> list[Primary]:
    """The tiles sweep: Bc sweep (F6c), Br↔Bc swapped and key-tile orders (F6a), square (F6b)."""
    d = settings.head_dim
    out = []
    for bc in settings.block_ks:
        m = settings.sram(bc)
        out += [_primary(_spec(p, sram=m), p, "default", d) for p in ("paper", "fa2")]
        if bc > d:  # Br = d < Bc: swapping Br and Bc changes the key tile (else it is square)
            out.append(_primary(_spec("paper", sram=m, swap_blocks=True), "paper", "swapped", d))
    m = settings.sram(settings.block_k)
    out += [_primary(_spec("paper", sram=m, order=o), "paper", o, d) for o in ("reverse", "shuffle")]
    out += [_primary(_spec("fa2", sram=m, order=o), "fa2", o, d) for o in ("forward", "shuffle")]
    for preset in ("paper", "fa2"):
        for variant, br in (("square", d), ("narrow", settings.narrow_block_q)):
            spec = _spec(preset, block_q=br, block_k=d, loop="q")
            out.append(_primary(spec, preset, variant, d))
    return out


def run_sweeps(
    settings: PaperSettings,
    *,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Run the three sweeps of ``flashprobe bench paper`` on ``device`` (inputs drawn on the CPU).

    Returns:
        ``(sweeps, skipped)``: sweep name (:data:`SWEEPS`) → its rows (labelled with ``sweep``,
        ``role``, ``variant`` and, for ``tiled``, the tile sizes, ``order`` and ``key_tiles`` = ⌈N/Bc⌉),
        and the skipped runs.
    """
    d, bc = settings.head_dim, settings.block_k
    # the length and precision sweeps: both presets at Bc, and the real kernels
    fixed = [_primary(_spec(preset, block_k=bc), preset, "default", d) for preset in ("paper", "fa2")]
    fixed += [_primary(name, "real", "default", d) for name in real_kernels(device)]
    plan = {
        "length": (
            [SweepPoint(settings.shape(n), fixed) for n in settings.seq_lens],
            ["bf16"],
            settings.seed_list(settings.length_seeds),
        ),
        "precision": ([SweepPoint(settings.shape(settings.seq_len), fixed)], list(DTYPES), None),
        "tiles": ([SweepPoint(settings.shape(settings.seq_len), _tile_primaries(settings))], ["bf16"], None),
    }
    baseline = get_kernel(BASELINE)
    sweeps: dict[str, list[dict[str, Any]]] = {}
    skipped: list[dict[str, Any]] = []
    for name in SWEEPS:
        points, dtypes, seeds = plan[name]
        rows, skips = deviation_sweep(
            points,
            baseline=baseline,
            dtypes=[to_dtype(n) for n in dtypes],
            seeds=seeds or settings.seed_list(settings.seeds),
            inputs=InputConfig(),
            device=device,
            progress=progress and (lambda msg, name=name: progress(f"{name} sweep: {msg}")),
        )
        for row in rows:
            row["sweep"] = name
            if "block_k" in row:
                row["key_tiles"] = math.ceil(row["seq_len"] / row["block_k"])
        sweeps[name] = rows
        skipped += [{"sweep": name, **s} for s in skips]
    return sweeps, skipped


def _select(rows: Sequence[Row], **match: Any) -> list[Row]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _one(rows: Sequence[Row], **match: Any) -> Row | None:
    found = _select(rows, **match)
    return found[0] if found else None


def _value(row: Row | None, key: str = DEVIATION) -> float | None:
    return None if row is None else row.get(key)


def _others(rows: Sequence[Row], *, roles: Sequence[str] = ("fa2", "real")) -> dict[str, str]:
    """The kernels of the real kernels' roles in ``rows``, in first-seen order, each read as itself."""
    return {r["kernel"]: r["kernel"] for r in rows if r.get("role") in roles}


def _claim(claim_id: str, measure: Measure, paper: str, real: Mapping[str, str], **fields: Any) -> Claim:
    """Claim ``claim_id`` judged on ``measure(paper)``, with ``measure(real[kernel])`` for each real
    kernel at the same setting; ``fields``: the other :class:`Claim` fields."""
    measured, display, judgement = measure(paper)
    readings = {}
    for kernel, arg in real.items():
        value, text, verdict = measure(arg)
        readings[kernel] = {"measured": value, "display": text, "verdict": verdict.verdict}
    return Claim(
        id=claim_id, measured=measured, display=display, judgement=judgement, real=readings, **fields
    )


def _setting(rows: Sequence[Row], kernel: str, settings: PaperSettings, **extra: Any) -> dict[str, Any]:
    row = rows[0] if rows else {}
    setting = {"kernel": kernel, "baseline": BASELINE, "batch": 1, "heads": settings.heads}
    setting |= {"head_dim": settings.head_dim, "inputs": row.get("distribution", "normal")}
    return setting | extra


def _f3(sweep: Sequence[Row], settings: PaperSettings) -> Claim:
    def measure(kernel: str) -> tuple[Any, str, Judgement]:
        devs = {d: _value(_one(sweep, kernel=kernel, dtype=d)) for d in DTYPES}
        devs = {d: v for d, v in devs.items() if v is not None}
        steps = [safe_ratio(a, b) for a, b in itertools.pairwise(devs.values())]
        weakest = min((s for s in steps if s is not None), default=None)
        display = " → ".join(f"{d} {fmt(v, '.2g')}" for d, v in devs.items())
        return {"deviation": devs, "weakest_step": weakest}, display, judge_f3(devs)

    kernel = _spec("paper", block_k=settings.block_k)
    n = settings.seq_len
    return _claim(
        "F3",
        measure,
        kernel,
        _others(sweep),
        unit="max |flash − baseline| per dtype (median over seeds); weakest_step: the smallest drop factor",
        setting=_setting(sweep, kernel, settings, seq_len=n, dtype=list(DTYPES), block_k=settings.block_k)
        | {"key_tiles": math.ceil(n / settings.block_k), "seeds": settings.seed_list(settings.seeds)},
    )


def _f4(sweep: Sequence[Row], settings: PaperSettings) -> Claim:
    n = settings.seq_lens[-1]

    def measure(kernel: str) -> tuple[Any, str, Judgement]:
        row = _one(sweep, kernel=kernel, seq_len=n)
        median, lo, hi = (_value(row, k) for k in ("error_ratio", "error_ratio_lo", "error_ratio_hi"))
        display = f"{fmt(median)}× ({fmt(lo)}–{fmt(hi)})"
        return median, display, judge_f4(median, lo, hi)

    kernel = _spec("paper", block_k=settings.block_k)
    row = _one(sweep, kernel=kernel, seq_len=n) or {}
    return _claim(
        "F4",
        measure,
        kernel,
        _others(sweep),
        unit="error ratio max|flash − golden| / max|baseline − golden| at bf16, median over seeds",
        spread=(row.get("error_ratio_lo"), row.get("error_ratio_hi")),
        setting=_setting(sweep, kernel, settings, seq_len=n, dtype="bf16", block_k=settings.block_k)
        | {"key_tiles": math.ceil(n / settings.block_k), "seeds": settings.seed_list(settings.length_seeds)},
    )


def _f5(sweep: Sequence[Row], settings: PaperSettings) -> Claim:
    def measure(kernel: str) -> tuple[Any, str, Judgement]:
        rows = sorted(_select(sweep, kernel=kernel), key=lambda r: r["seq_len"])
        lengths, devs = [r["seq_len"] for r in rows], [r[DEVIATION] for r in rows]
        judgement = judge_f5(lengths, devs, [r["primary_golden_rel_l2"] for r in rows])
        growth = safe_ratio(devs[-1], devs[0]) if devs else None
        display = f"{fmt(growth)}× (N {lengths[0]} → {lengths[-1]})" if devs else "–"
        return growth, display, judgement

    kernel = _spec("paper", block_k=settings.block_k)
    rows = sorted(_select(sweep, kernel=kernel), key=lambda r: r["seq_len"])
    series = {r["seq_len"]: r[DEVIATION] for r in rows}
    relative = {r["seq_len"]: r["primary_golden_rel_l2"] for r in rows}
    return _claim(
        "F5",
        measure,
        kernel,
        _others(sweep),
        unit="growth of max |flash − baseline| from the shortest to the longest N (median over seeds)",
        details={"deviation_by_seq_len": series, "relative_error_by_seq_len": relative},
        setting=_setting(sweep, kernel, settings, seq_len=list(settings.seq_lens), dtype="bf16")
        | {"block_k": settings.block_k, "seeds": settings.seed_list(settings.length_seeds)},
    )


def _spread(row: Row | None) -> Spread | None:
    if row is None:
        return None
    values = [row.get(k) for k in (DEVIATION, f"{DEVIATION}_lo", f"{DEVIATION}_hi")]
    return None if any(v is None for v in values) else Spread(*values)


def _f6a(sweep: Sequence[Row], settings: PaperSettings) -> Claim:
    m, largest = settings.sram(settings.block_k), settings.sram(settings.block_ks[-1])

    def measure(preset: str) -> tuple[Any, str, Judgement]:
        rows = _select(sweep, role=preset, sram=m)
        forward = _spread(_one(rows, order="forward"))
        orders = {o: _spread(_one(rows, order=o)) for o in ("reverse", "shuffle")}
        orders = {o: s for o, s in orders.items() if s is not None}
        default = _spread(_one(sweep, role=preset, variant="default", sram=largest))
        swapped = _spread(_one(sweep, role=preset, variant="swapped", sram=largest))
        measured = {o: safe_ratio(s.median, forward and forward.median) for o, s in orders.items()}
        if swapped is not None:
            measured["swapped"] = safe_ratio(swapped.median, default and default.median)
        display = ", ".join(f"{o} {fmt(r)}×" for o, r in measured.items())
        return measured, display, judge_f6a(forward, orders, default, swapped)

    kernel = _spec("paper", sram=m)
    fa2 = _one(sweep, role="fa2", sram=m, variant="default")
    return _claim(
        "F6a",
        measure,
        "paper",
        {fa2["kernel"]: "fa2"} if fa2 else {},
        unit="max |flash − baseline| relative to the forward order (reverse, shuffle) and to the default "
        f"tile at M = {largest} (swapped: Br ↔ Bc), ratio of medians over seeds",
        setting=_setting(sweep, kernel, settings, seq_len=settings.seq_len, dtype="bf16", sram=m)
        | {"block_k": settings.block_k, "swapped_at_sram": largest}
        | {"seeds": settings.seed_list(settings.seeds)},
    )


def _f6b(sweep: Sequence[Row], settings: PaperSettings) -> Claim:
    def measure(preset: str) -> tuple[Any, str, Judgement]:
        square = _value(_one(sweep, role=preset, variant="square"))
        narrow = _value(_one(sweep, role=preset, variant="narrow"))
        ratio = safe_ratio(square, narrow)
        return ratio, f"{fmt(ratio)}×", judge_f6b(ratio)

    square = _one(sweep, role="paper", variant="square") or {}
    narrow = _one(sweep, role="paper", variant="narrow") or {}
    fa2 = _one(sweep, role="fa2", variant="square")
    d = settings.head_dim
    return _claim(
        "F6b",
        measure,
        "paper",
        {fa2["kernel"]: "fa2"} if fa2 else {},
        unit=f"max |flash − baseline| of the square {d}×{d} tile over the {settings.narrow_block_q}×{d} tile",
        setting=_setting(sweep, square.get("kernel", ""), settings, seq_len=settings.seq_len, dtype="bf16")
        | {"compared_with": narrow.get("kernel"), "seeds": settings.seed_list(settings.seeds)},
    )


def _f6c(sweep: Sequence[Row], settings: PaperSettings) -> Claim:
    def measure(preset: str) -> tuple[Any, str, Judgement]:
        rows = sorted(_select(sweep, role=preset, variant="default"), key=lambda r: r["block_k"])
        block_ks, devs = [r["block_k"] for r in rows], [r[DEVIATION] for r in rows]
        gain = safe_ratio(devs[0], devs[-1]) if devs else None
        display = f"{fmt(gain)}× less (Bc {block_ks[0]} → {block_ks[-1]})" if devs else "–"
        return gain, display, judge_f6c(block_ks, devs)

    rows = sorted(_select(sweep, role="paper", variant="default"), key=lambda r: r["block_k"])
    fa2 = _one(sweep, role="fa2", variant="default")
    return _claim(
        "F6c",
        measure,
        "paper",
        {"tiled:preset=fa2,sram=4·d·Bc": "fa2"} if fa2 else {},
        unit="max |flash − baseline| at the smallest Bc over that at the largest (median over seeds)",
        details={"deviation_by_block_k": {r["block_k"]: r[DEVIATION] for r in rows}},
        setting=_setting(sweep, "tiled:preset=paper,sram=4·d·Bc", settings, seq_len=settings.seq_len)
        | {"dtype": "bf16", "block_k": list(settings.block_ks), "seeds": settings.seed_list(settings.seeds)},
    )


def build_claims(sweeps: Mapping[str, Sequence[Row]], settings: PaperSettings) -> list[Claim]:
    """Claims F3, F4, F5, F6a, F6b and F6c, judged from the rows of :func:`run_sweeps` (or of
    ``paper.json``) run with ``settings``."""
    length, precision, tiles = (sweeps.get(name, []) for name in SWEEPS)
    return [
        _f3(precision, settings),
        _f4(length, settings),
        _f5(length, settings),
        _f6a(tiles, settings),
        _f6b(tiles, settings),
        _f6c(tiles, settings),
    ]
