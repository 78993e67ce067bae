"""``flashprobe bench verdicts``: what the verdict's rule reads on correct kernels in training.

The calibration of the probe's verdict (the rule of :mod:`flashprobe.judge`): third-party model
classes and the project's own text-to-image DiT, built from tiny random-init configs, are trained
with AdamW for ``--steps`` steps under :func:`flashprobe.probe.probe` (``backward=True``) with
**torch's own SDPA** as the kernel (what the models call; on this CPU the fused flash kernel where
it applies), in float32 and under bf16 or fp16 autocast. Each row reports, per direction (``out``,
``dq``, ``dk``, ``dv``), the verdict's statistic (``limit_ratio``: the worst call's largest
statistic / limit over the criteria; > 1 fails), the largest relative L2 error ratio to the baseline
of any call at any site, the number of judged, failed and undetermined calls; beside it, the largest
per-call ratio of maxima (``max_call_error_ratio``, the 2x rule's statistic), to show how much
noisier that is. A correct kernel must never fail; the margin to 1 is what the rule leaves for noise.

Models (``--models``): ``gpt2``, ``llama`` (grouped-query attention, left padding), ``bert``
(padding, attention dropout 0 so gradients are judged), ``vit``, ``unet`` (diffusers
``UNet2DConditionModel``, self- and cross-attention), ``dit`` (diffusers ``DiTTransformer2DModel``)
need the ``integration`` extra (transformers, diffusers); ``t2i`` (the embedded
:class:`~flashprobe.t2i.model.TextToImageDiT`) needs nothing.

Writes ``DIR/verdicts.json`` and ``DIR/verdicts.csv``; ``--check`` exits 1 when a call failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from flashprobe.bench.args import add_output_args, run_cli
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.results import format_table, write_results, wrote_line
from flashprobe.judge import ABSOLUTE_EPS, RELATIVE_LIMITS, ROW_EPS

__all__ = ["MODELS", "calibrate", "main"]

_DIRECTIONS = ("out", "dq", "dk", "dv")
_SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
VOCAB, TOKENS = 64, 8

Built = tuple[nn.Module, Callable[[int], dict[str, Any]], Callable[[Any], torch.Tensor]]


def _tokens(step: int, *, left_pad: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    batch = {"input_ids": torch.randint(1, VOCAB, (2, TOKENS), generator=gen)}
    if left_pad:  # the first sequence is left-padded by 3 tokens
        mask = torch.ones(2, TOKENS, dtype=torch.long)
        mask[0, :3] = 0
        batch["attention_mask"] = mask
    return batch


def _gpt2() -> Built:
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config), _tokens, lambda out: out.logits


def _llama() -> Built:
    import transformers

    config = transformers.LlamaConfig(
        **_SMALL, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config), lambda s: _tokens(s, left_pad=True), lambda out: out.logits


def _bert() -> Built:
    import transformers

    config = transformers.BertConfig(
        **_SMALL, vocab_size=VOCAB, max_position_embeddings=32, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.BertModel(config)
    return model, lambda s: _tokens(s, left_pad=True), lambda out: out.last_hidden_state


def _vit() -> Built:
    import transformers

    config = transformers.ViTConfig(**_SMALL, image_size=16, patch_size=4, attn_implementation="sdpa")

    def batch(step: int) -> dict[str, Any]:
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(step))}

    return transformers.ViTModel(config), batch, lambda out: out.last_hidden_state


def _unet() -> Built:
    import diffusers

    model = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
        attention_head_dim=8, norm_num_groups=8,
    )  # fmt: skip

    def batch(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(step)
        return {
            "sample": torch.randn(2, 4, 8, 8, generator=gen),
            "timestep": torch.tensor([10, 500]),
            "encoder_hidden_states": torch.randn(2, 5, 16, generator=gen),
        }

    return model, batch, lambda out: out.sample


def _dit() -> Built:
    import diffusers

    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
        sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=8,
    )  # fmt: skip

    def batch(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(step)
        return {
            "hidden_states": torch.randn(2, 4, 8, 8, generator=gen),
            "timestep": torch.tensor([1, 2]),
            "class_labels": torch.tensor([0, 1]),
        }

    return model, batch, lambda out: out.sample


def _t2i() -> Built:
    from flashprobe.t2i.model import TextToImageDiT

    model = TextToImageDiT()
    cfg = model.config

    def batch(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(1, cfg.vocab_size, (4, cfg.max_caption_length), generator=gen)
        tokens[:, 6:] = 0  # padded captions, as the tokenizer makes them
        return {
            "x": torch.randn(4, cfg.in_channels, cfg.image_size, cfg.image_size, generator=gen),
            "t": torch.randint(0, 1000, (4,), generator=gen),
            "tokens": tokens,
        }

    # The DiT starts as the zero function (adaLN-Zero): regress it towards 0.5, so gradients flow.
    return model, batch, lambda out: out - 0.5


#: ``--models`` name → builder of ``(model, batch(step), output(out))``.
MODELS: dict[str, Callable[[], Built]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "bert": _bert,
    "vit": _vit,
    "unet": _unet,
    "dit": _dit,
    "t2i": _t2i,
}
#: Static loss scale per ``--precision`` (fp16 only: its gradients underflow without one).
_LOSS_SCALE: dict[str, float] = {"fp16": 2.0**12}
#: ``--precision`` name → the autocast dtype (None: float32, no autocast).
_PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def calibrate(model_name: str, precision: str, steps: int, seed: int = 0) -> dict[str, Any]:
    """Train one model under the probe with torch's SDPA and return its row (see the module docstring)."""
    from flashprobe.probe import probe

    torch.manual_seed(seed)
    model, batch, output = MODELS[model_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst = dict.fromkeys(_DIRECTIONS, 0.0)
    worst_max = dict.fromkeys(_DIRECTIONS, 0.0)
    score = dict.fromkeys(_DIRECTIONS, 0.0)
    judged = dict.fromkeys(_DIRECTIONS, 0)
    failed = dict.fromkeys(_DIRECTIONS, 0)
    undetermined = dict.fromkeys(_DIRECTIONS, 0)
    low = _PRECISIONS[precision]
    start = time.perf_counter()
    p = probe(model, backward=True, on_failure="ignore", dtype=low)
    try:
        for step in range(steps):
            p.set_step(step)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                out = output(model(**batch(step)))
            # fp16 gradients underflow without loss scaling: a static scale, as fp16 training uses
            # (the rule's statistics are ratios, so the scale needs no undoing)
            (out.float().square().mean() * _LOSS_SCALE.get(precision, 1.0)).backward()
            opt.step()
            if step % 50 == 49 or step == steps - 1:  # read and reset: bounded reads, as the callback
                _fold(p.stats(), worst, worst_max, score, judged, failed, undetermined)
                p.reset()
        failures = p.failures
    finally:
        p.detach()
    row: dict[str, Any] = {"model": model_name, "precision": precision, "steps": steps, "sites": len(p.sites)}
    for d in _DIRECTIONS:
        row[f"{d}_limit_ratio"] = score[d] if judged[d] else None
        row[f"{d}_max_l2_ratio"] = worst[d] if judged[d] else None
        row[f"{d}_max_call_error_ratio"] = worst_max[d] if judged[d] else None
        row[f"{d}_calls"] = judged[d]
    row["failed_calls"] = sum(failed.values())
    row["undetermined_calls"] = sum(undetermined.values())
    row["first_failure"] = (
        None
        if not failures
        else f"{failures[0]['site']} {failures[0]['direction']} step {failures[0]['step']}"
    )
    row["seconds"] = round(time.perf_counter() - start, 1)
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
        for d in _DIRECTIONS:
            e = entry["forward"]["out"] if d == "out" else entry["backward"][d]
            if e.get("verdict") is None:
                continue
            calls = entry["forward"]["calls"] if d == "out" else entry["backward"]["calls"]
            judged[d] += calls
            failed[d] += e["failed_calls"]
            undetermined[d] += sum(e["undetermined_calls"].values())
            score[d] = max(score[d], e["limit_ratio"] or 0.0)
            worst[d] = max(worst[d], e["l2_error_ratio"] or 0.0)
            worst_max[d] = max(worst_max[d], e["max_call_error_ratio"] or 0.0)


TABLE_COLUMNS = [
    ("model", "model"),
    ("precision", "precision"),
    ("steps", "steps"),
    ("sites", "sites"),
    *((f"{d}_limit_ratio", f"{d} err/limit") for d in _DIRECTIONS),
    *((f"{d}_max_l2_ratio", f"{d} L2") for d in _DIRECTIONS),
    *((f"{d}_max_call_error_ratio", f"{d} max/max") for d in _DIRECTIONS),
    ("out_calls", "calls"),
    ("failed_calls", "failed"),
    ("undetermined_calls", "undet."),
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
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--check", action="store_true", help="exit with 1 when any call failed")
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
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    try:
        rows = []
        for m in models:
            for prec in precisions:
                rows.append(calibrate(m, prec, args.steps))
                print(
                    f"{m} {prec}: {rows[-1]['seconds']} s, failed calls {rows[-1]['failed_calls']}",
                    file=sys.stderr,
                )
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    print(format_table(rows, TABLE_COLUMNS))
    failed = sum(r["failed_calls"] for r in rows)
    undetermined = sum(r["undetermined_calls"] for r in rows)
    print(f"failed calls: {failed}; undetermined calls: {undetermined}")
    meta = {
        "command": args.command_line,
        "limits": {"relative": RELATIVE_LIMITS, "absolute_eps": ABSOLUTE_EPS, "row_eps": ROW_EPS},
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
    }
    paths = write_results(args.out, "verdicts", rows, meta=meta)
    print(wrote_line(rows, seconds, paths))
    return 1 if args.check and failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench verdicts``; returns the exit code."""
    return run_cli("verdicts", _parser(), _run, argv)
