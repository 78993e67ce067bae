"""``flashprobe bench overhead``: what the shadow probe costs a training step.

A tiny causal LM (:class:`TinyLM`) trains in four modes from the same weights and batches:
``no_probe``; ``control`` (every attention call also computes the probe's references and throws them
away: the floor any shadow pays); ``probe``; ``probe_every_N`` (comparing only every ``--every``
steps). The modes run round-robin in a rotating order, each probe attached only for its own step;
per block of ``--every`` rounds the step times are divided by the reference mode's, and a row has the
median over blocks (``ratio_vs_no_probe``, ``ratio_vs_control``). :data:`LIMITS` are checked
(``--check``: the exit code); ``--compile`` measures compiled training.

Writes ``DIR/overhead.json``, ``DIR/overhead.csv`` and the figure (``--figure``, default
``DIR/overhead.png``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.bench.args import add_output_args, parse_device, run_cli, torch_threads
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.results import format_table, write_results, wrote_line
from flashprobe.probing import Probe, ShadowAttention

__all__ = ["LIMITS", "OverheadConfig", "TinyLM", "limit_checks", "main", "measure_overhead"]

#: Upper limits on a mode's ratio to a reference mode, ``(mode, reference, limit)``, forward (``False``)
#: and with gradients (``True``); ``probe_every`` matches ``probe_every_N``.
LIMITS: dict[bool, tuple[tuple[str, str, float], ...]] = {
    False: (("probe", "control", 1.10), ("probe_every", "no_probe", 1.10)),
    True: (("probe", "control", 1.15), ("probe_every", "no_probe", 1.10)),
}

#: ``--autocast`` values and their dtypes (``""``: no autocast).
AUTOCAST: dict[str, torch.dtype | None] = {"": None, "bf16": torch.bfloat16, "fp16": torch.float16}

#: The integer fields of :class:`OverheadConfig` that must be positive (``warmup``: at least 0).
_COUNTS = ("steps", "warmup", "every", "batch", "seq_len", "d_model", "heads", "layers", "vocab", "threads")

TABLE_COLUMNS = [
    ("mode", "mode"),
    ("step_ms", "step ms"),
    ("ratio_vs_no_probe", "vs no probe"),
    ("ratio_vs_control", "vs control"),
    ("steps", "steps"),
]


@dataclass(frozen=True, kw_only=True)
class OverheadConfig:
    """What ``flashprobe bench overhead`` trains and how long."""

    steps: int = 80
    """Timed rounds (each runs one step of every mode)."""
    warmup: int = 3
    """Untimed rounds first."""
    every: int = 10
    """Sampling period of the ``probe_every_N`` mode and block length of the ratios."""
    batch: int = 2
    """Sequences per step."""
    seq_len: int = 256
    """Tokens per sequence."""
    d_model: int = 256
    """Model width."""
    heads: int = 4
    """Attention heads (head dim = d_model / heads)."""
    layers: int = 2
    """Transformer layers."""
    vocab: int = 256
    """Vocabulary size of the random tokens."""
    backward: bool = False
    """Compare gradients too (probe and control)."""
    golden: bool = True
    """Compute the FP64 golden value (probe and control)."""
    threads: int = 1
    """torch intra-op threads during the run."""
    seed: int = 0
    """Seed of the weights and the batches."""
    compile: str = ""
    """``torch.compile`` backend every mode's model is compiled with (``""``: eager)."""
    device: str = "cpu"
    """Where the models train (``cpu``, ``cuda``, ``cuda:1``)."""
    autocast: str = ""
    """Train under ``torch.autocast`` in ``bf16`` or ``fp16`` (``""``: fp32 throughout)."""

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            low = 0 if name == "warmup" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                flag = "--" + name.replace("_", "-")
                raise BenchArgumentError(f"{flag} must be an integer >= {low}, got {value!r}")
        if self.d_model % self.heads:
            raise BenchArgumentError(f"--d-model {self.d_model} must be divisible by --heads {self.heads}")
        if self.compile and self.compile not in torch._dynamo.list_backends(exclude_tags=()):
            known = ", ".join(torch._dynamo.list_backends(exclude_tags=()))
            raise BenchArgumentError(f"--compile {self.compile!r}: not a torch.compile backend ({known})")
        device = parse_device(self.device)
        if device.type not in ("cpu", "cuda"):
            raise BenchArgumentError(f"--device {self.device}: only cpu and cuda are supported")
        if self.autocast not in AUTOCAST:
            raise BenchArgumentError(
                f"--autocast {self.autocast!r}: use one of {', '.join(a for a in AUTOCAST if a)}"
            )
        if self.steps < self.every:
            raise BenchArgumentError(
                f"--steps {self.steps} must cover at least one block of --every {self.every}"
            )
        self._check_memory(device)

    def _check_memory(self, device: torch.device) -> None:
        """Refuse a model whose attention cannot fit in memory before anything is allocated: the causal
        mask plus the floor of :func:`~flashprobe.bench.args.check_size`."""
        from flashprobe.bench.args import FP64_TENSORS
        from flashprobe.kernels.reference import _available_bytes, reference_budget

        head_dim = self.d_model // self.heads
        mask = 4 * self.seq_len**2
        tensors = FP64_TENSORS * self.batch * self.heads * self.seq_len * head_dim * 8
        needed, available = mask + tensors + reference_budget(device), _available_bytes(device)
        if needed > available:
            gib = 2**30
            raise BenchArgumentError(
                f"--seq-len {self.seq_len} with --batch {self.batch} --d-model {self.d_model} --heads "
                f"{self.heads} needs at least {needed / gib:.3g} GiB (a {mask / gib:.3g} GiB causal mask and "
                f"{tensors / gib:.3g} GiB of float64 attention tensors), but {device} has "
                f"{available / gib:.3g} GiB available; lower --seq-len (or --batch)"
            )

    @property
    def modes(self) -> tuple[str, ...]:
        return ("no_probe", "control", "probe", f"probe_every_{self.every}")


class TinyLM(nn.Module):
    """Causal transformer LM: embedding + positions → pre-norm ``nn.TransformerEncoder`` → head."""

    def __init__(self, *, vocab: int, seq_len: int, d_model: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens (B, N)`` → logits ``(B, N, vocab)``."""
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(h)


def measure_overhead(
    config: OverheadConfig, progress: Callable[[str], None] | None = None
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Train the four modes side by side and return the rows and each mode's block means (ms)."""
    with torch_threads(config.threads):
        return _measure(config, progress or (lambda _: None))


def _measure(
    config: OverheadConfig, progress: Callable[[str], None]
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    torch.manual_seed(config.seed)
    device = torch.device(config.device)
    base = TinyLM(
        vocab=config.vocab,
        seq_len=config.seq_len,
        d_model=config.d_model,
        heads=config.heads,
        layers=config.layers,
    ).to(device)
    gen = torch.Generator().manual_seed(config.seed + 1)
    rounds = config.warmup + config.steps
    tokens = torch.randint(config.vocab, (rounds, config.batch, config.seq_len + 1), generator=gen).to(device)
    modes = config.modes
    models = {m: copy.deepcopy(base) for m in modes}
    optims = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-3) for m in modes}
    if config.compile:
        torch._dynamo.reset()
        # the probes attach to the model inside; warm-up rounds compile with and without them
        calls: dict[str, Callable[..., torch.Tensor]] = {
            m: torch.compile(models[m], backend=config.compile) for m in modes
        }
    else:
        calls = dict(models)

    def shadow(record: bool, every: int = 1) -> ShadowAttention:
        return ShadowAttention(
            golden=config.golden, backward=config.backward, every_n_steps=every, record=record
        )

    handles: dict[str, Probe | None] = {
        "no_probe": None,
        "control": Probe(models["control"], shadow(record=False)),
        "probe": Probe(models["probe"], shadow(record=True)),
        modes[3]: Probe(models[modes[3]], shadow(record=True, every=config.every)),
    }
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            x, y = tokens[r, :, :-1], tokens[r, :, 1:]
            step = max(r - config.warmup, 0)  # warm-up rounds compare too
            seconds = _timed_step(calls[mode], optims[mode], handles[mode], x, y, step, config.autocast)
            if r >= config.warmup:
                times[mode].append(seconds)
        if r >= config.warmup and (r - config.warmup + 1) % config.every == 0:
            done = r - config.warmup + 1
            means = ", ".join(f"{m} {1e3 * statistics.fmean(times[m][-config.every :]):.0f}" for m in modes)
            progress(f"[{done}/{config.steps}] ms per step over the last block: {means}")
    rows, block_ms = _summarize(config, times)
    # The probes really compared something (and the sampled one only at its steps).
    rows[2]["compared_calls"] = handles["probe"].shadow.summary().forward_calls  # type: ignore[union-attr]
    rows[3]["compared_calls"] = handles[modes[3]].shadow.summary().forward_calls  # type: ignore[union-attr]
    return rows, block_ms


def _timed_step(
    model: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    handle: Probe | None,
    x: torch.Tensor,
    y: torch.Tensor,
    step: int,
    autocast: str = "",
) -> float:
    """One training step on tokens ``x (B, N)`` → targets ``y (B, N)``, with ``handle`` attached just for
    it; returns its wall-clock seconds, attach and detach included (on CUDA, synchronised)."""
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    if handle is not None:
        handle.set_step(step)
        handle.attach()
    opt.zero_grad(set_to_none=True)
    dtype = AUTOCAST[autocast]
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    if handle is not None:
        handle.detach()
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


def _summarize(
    config: OverheadConfig, times: dict[str, list[float]]
) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Rows (median block ratios, see the module docstring) and each mode's block means in ms."""
    modes = config.modes
    n_blocks = config.steps // config.every
    blocks = {
        m: [sum(times[m][b * config.every : (b + 1) * config.every]) for b in range(n_blocks)] for m in modes
    }
    rows = []
    for mode in modes:
        vs_none = [a / b for a, b in zip(blocks[mode], blocks["no_probe"], strict=True)]
        vs_control = [a / b for a, b in zip(blocks[mode], blocks["control"], strict=True)]
        rows.append({
            "mode": mode,
            "step_ms": 1e3 * statistics.median(blocks[mode]) / config.every,
            "ratio_vs_no_probe": statistics.median(vs_none),
            "ratio_vs_control": statistics.median(vs_control),
            "steps": len(times[mode]),
        })  # fmt: skip
    block_ms = {m: [1e3 * b / config.every for b in blocks[m]] for m in modes}
    return rows, block_ms


def limit_checks(rows: Sequence[dict[str, Any]], backward: bool = False) -> list[dict[str, Any]]:
    """The checks of :data:`LIMITS` on the rows: ``{"mode", "reference", "ratio", "limit", "ok"}`` each."""
    by_mode = {row["mode"]: row for row in rows}
    checks = []
    for prefix, reference, limit in LIMITS[backward]:
        mode = next(m for m in by_mode if m == prefix or m.startswith(prefix + "_"))
        ratio = by_mode[mode][f"ratio_vs_{reference}"]
        checks.append(
            {"mode": mode, "reference": reference, "ratio": ratio, "limit": limit, "ok": ratio <= limit}
        )
    return checks


def _parser() -> argparse.ArgumentParser:
    d = OverheadConfig()
    parser = argparse.ArgumentParser(
        prog="flashprobe bench overhead",
        description="Training-step overhead of the shadow probe: no probe, control, probe, sampled probe.",
    )
    for name, text in (
        ("steps", "timed rounds"),
        ("warmup", "untimed rounds first"),
        ("every", "sampling period in steps"),
        ("batch", "sequences per step"),
        ("seq_len", "tokens per sequence"),
        ("d_model", "model width"),
        ("heads", "attention heads"),
        ("layers", "transformer layers"),
    ):
        default = getattr(d, name)
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=default, help=f"{text} (default {default})"
        )
    parser.add_argument("--backward", action="store_true", help="compare gradients too (probe and control)")
    parser.add_argument("--no-golden", action="store_true", help="skip the FP64 golden value")
    parser.add_argument("--threads", type=int, default=d.threads, help=f"torch threads (default {d.threads})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed (default {d.seed})")
    parser.add_argument(
        "--device", default=d.device, help=f"where to train: cpu or cuda (default {d.device})"
    )
    parser.add_argument(
        "--autocast", default=d.autocast, choices=[a for a in AUTOCAST if a], help="train under autocast"
    )
    parser.add_argument(
        "--compile", nargs="?", const="inductor", default="", metavar="BACKEND",
        help="torch.compile every mode's model (backend default inductor; e.g. eager, aot_eager)",
    )  # fmt: skip
    parser.add_argument("--figure", type=Path, help="where to write the PNG (default DIR/overhead.png)")
    parser.add_argument("--check", action="store_true", help="exit with 1 when a limit is exceeded")
    add_output_args(parser, "overhead")
    return parser


def _config(args: argparse.Namespace) -> OverheadConfig:
    names = [f.name for f in fields(OverheadConfig) if f.name not in ("vocab", "golden")]
    return OverheadConfig(golden=not args.no_golden, **{name: getattr(args, name) for name in names})


def _run(args: argparse.Namespace) -> int:
    from flashprobe.report.bench_figures import plot_overhead

    config = _config(args)
    start = time.perf_counter()
    rows, block_ms = measure_overhead(config, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    seconds = time.perf_counter() - start
    checks = limit_checks(rows, config.backward)
    print(format_table(rows, TABLE_COLUMNS))
    for c in checks:
        verdict = "ok" if c["ok"] else "EXCEEDED"
        print(f"limit: {c['mode']} / {c['reference']} = {c['ratio']:.3f} <= {c['limit']:.2f}: {verdict}")
    meta = {
        "command": args.command_line,
        "config": asdict(config),
        "limits": checks,
        "block_ms": block_ms,
        "seconds": round(seconds, 2),
    }
    paths = write_results(args.out, "overhead", rows, meta=meta)
    subtitle = (
        f"{config.layers} layers, d={config.d_model}, {config.heads} heads, B={config.batch}, "
        f"N={config.seq_len}, golden={config.golden}, backward={config.backward}, "
        f"{config.steps} steps/mode, {config.threads} thread(s), {config.device}"
        + (f", autocast {config.autocast}" if config.autocast else "")
        + (f", torch.compile(backend={config.compile!r})" if config.compile else "")
    )
    paths["png"] = plot_overhead(rows, args.figure or args.out / "overhead.png", subtitle)
    print(wrote_line(rows, seconds, paths))
    return 1 if args.check and not all(c["ok"] for c in checks) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench overhead``; returns the exit code."""
    return run_cli("overhead", _parser(), _run, argv)
