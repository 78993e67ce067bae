"""``flashprobe bench paper``: every microbenchmark claim of the paper (F3–F6c), measured and judged.

Each claim is measured at the setting it needs (:mod:`flashprobe.bench.paper_runs`) with the
paper's re-implementation and the real kernels' numerics, and judged against a stated criterion
(:mod:`flashprobe.bench.claims`). Writes ``paper.json`` (claims, sweeps, settings, skipped runs;
non-finite numbers as ``"inf"``), ``paper.md`` and ``paper_{length,precision,tiles}.png``;
``--replot`` redraws the figures and ``paper.md`` from ``paper.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashprobe.bench.args import add_output_args, parse_device, run_cli, torch_threads
from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.paper_runs import PaperSettings, build_claims, run_sweeps
from flashprobe.bench.results import environment, read_results_json
from flashprobe.formats.atomic import atomic_write_text
from flashprobe.formats.jsonio import decode, write_json

__all__ = ["FIGURES", "build_parser", "claims_markdown", "draw_figures", "load_paper", "main", "run"]

#: Sweep → (file name, :mod:`flashprobe.report.bench_figures` function drawing its rows).
FIGURES: dict[str, tuple[str, str]] = {
    "length": ("paper_length.png", "plot_seqlen"),
    "precision": ("paper_precision.png", "plot_precision"),
    "tiles": ("paper_tiles.png", "plot_paper_tiles"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``flashprobe bench paper``."""
    parser = argparse.ArgumentParser(
        prog="flashprobe bench paper",
        description="Measure and judge every microbenchmark claim of 'Is Flash Attention Stable?' "
        "(Figs 3–6) with the paper's re-implementation and the real kernels' numerics.",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--seed", type=int, default=0, help="first seed of every sweep (default 0)")
    parser.add_argument(
        "--threads", type=int, default=1, metavar="T",
        help="torch intra-op threads while measuring (default 1: the tiled kernels are many small ops, "
        "and on a small CPU thread hand-offs cost more than they save)",
    )  # fmt: skip
    parser.add_argument(
        "--tiny", action="store_true",
        help="small shapes and 2–3 seeds: runs in seconds, to check the command (verdicts mean little)",
    )  # fmt: skip
    add_output_args(parser, "paper", files="paper.json, paper.md and the paper_*.png figures")
    parser.add_argument(
        "--replot", action="store_true",
        help="measure nothing: redraw the figures and paper.md from DIR/paper.json",
    )  # fmt: skip
    return parser


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _setting_text(setting: Mapping[str, Any]) -> str:
    parts = []
    for key, value in setting.items():
        if key == "seeds" and isinstance(value, list) and len(value) > 2:
            value = f"{value[0]}–{value[-1]} ({len(value)})"
        elif isinstance(value, list):
            value = ", ".join(map(str, value))
        quoted = key in ("kernel", "baseline", "compared_with")
        parts.append(f"{key} `{value}`" if quoted else f"{key} {value}")
    return "; ".join(parts)


def claims_markdown(doc: Mapping[str, Any]) -> str:
    """``paper.md`` of the ``paper.json`` object ``doc``: the claims table, then each claim's setting,
    criterion and reason."""
    env = doc.get("environment", {})
    lines = [
        "# Is Flash Attention Stable? — the microbenchmark claims, measured",
        "",
        f"`{doc.get('command', 'flashprobe bench paper')}` · torch {env.get('torch', '?')} · "
        f"device {doc.get('device', 'cpu')} · {doc.get('threads', '?')} thread(s) · "
        f"{doc.get('seconds', 0):.0f} s",
        "",
        "| claim | the paper | measured (`tiled:preset=paper`) | verdict | real kernels, same setting |",
        "| --- | --- | --- | --- | --- |",
    ]
    for claim in doc["claims"]:
        real = "<br>".join(
            f"`{kernel}`: {_cell(r['display'])} ({r['verdict']})" for kernel, r in claim["real"].items()
        )
        lines.append(
            f"| {claim['id']} | {_cell(claim['paper'])} | {_cell(claim['display'])} | "
            f"**{claim['verdict']}** | {real or '–'} |"
        )
    for claim in doc["claims"]:
        lines += [
            "",
            f"**{claim['id']}** — {claim['paper']}.",
            f"- setting: {_setting_text(claim['setting'])}",
            f"- measured: {claim['display']} — {claim['unit']}",
            f"- criterion: {claim['criterion']}",
            f"- verdict: **{claim['verdict']}** — {claim['why']}",
        ]
    return "\n".join(lines) + "\n"


def draw_figures(sweeps: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: Path) -> list[Path]:
    """Draw :data:`FIGURES` from the sweeps' rows into ``out_dir``; returns the paths written."""
    from flashprobe.report import bench_figures  # matplotlib is slow to import: only when drawing

    paths = []
    for name, (file_name, function) in FIGURES.items():
        if sweeps.get(name):
            paths.append(getattr(bench_figures, function)(sweeps[name], out_dir / file_name))
    return paths


def load_paper(out_dir: Path) -> dict[str, Any]:
    """Read ``out_dir/paper.json`` with its non-finite numbers decoded.

    Raises:
        BenchArgumentError: the file is missing, is not JSON or has no claims.
    """
    path, doc = read_results_json(out_dir, "paper")
    if not isinstance(doc, dict) or not isinstance(doc.get("claims"), list):
        raise BenchArgumentError(f"{path} has no 'claims'; was it written by flashprobe bench paper?")
    return decode(doc, text_keys=frozenset({"paper", "display", "unit", "criterion", "why", "command"}))


def _write(doc: Mapping[str, Any], out_dir: Path) -> list[Path]:
    md = out_dir / "paper.md"
    atomic_write_text(md, claims_markdown(doc))
    return [md, *draw_figures(doc.get("sweeps", {}), out_dir)]


def _summary(doc: Mapping[str, Any]) -> str:
    width = max(len(c["id"]) for c in doc["claims"])
    return "\n".join(
        f"{c['id']:<{width}}  {c['verdict']:<14}  {c['display']}  [real: "
        + "; ".join(f"{k} {r['display']}" for k, r in c["real"].items())
        + "]"
        for c in doc["claims"]
    )


def run(args: argparse.Namespace) -> int:
    """The command body on parsed arguments (``args.out`` already checked); returns the exit code."""
    if args.replot:
        doc = load_paper(args.out)
        paths = _write(doc, args.out)
        print(f"redrew {', '.join(map(str, paths))}")
        return 0
    device = parse_device(args.device)
    if args.threads < 1:
        raise BenchArgumentError(f"--threads must be at least 1, got {args.threads}")
    settings = PaperSettings.tiny(args.seed) if args.tiny else PaperSettings(first_seed=args.seed)
    start = time.perf_counter()

    def progress(msg: str) -> None:
        elapsed = time.perf_counter() - start
        print(f"flashprobe bench paper: [{elapsed:5.1f} s] {msg}", file=sys.stderr, flush=True)

    with torch_threads(args.threads):
        sweeps, skipped = run_sweeps(settings, device=device, progress=progress)
    claims = build_claims(sweeps, settings)
    seconds = time.perf_counter() - start
    doc = {
        "name": "paper", "environment": environment(), "command": args.command_line, "device": str(device),
        "seconds": round(seconds, 1), "threads": args.threads, "settings": settings.as_dict(),
        "claims": [c.as_dict() for c in claims], "sweeps": sweeps, "skipped": skipped,
    }  # fmt: skip
    json_path = write_json(args.out / "paper.json", doc)
    paths = [json_path, *_write(doc, args.out)]
    print(_summary(doc))
    for entry in skipped:
        print(f"skipped {entry['kernel']} at {entry['dtype']} ({entry['sweep']} sweep): {entry['reason']}")
    print(f"{len(claims)} claims in {seconds:.1f} s; wrote " + ", ".join(map(str, paths)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flashprobe bench paper``; returns the exit code."""
    return run_cli("paper", build_parser(), run, argv)
