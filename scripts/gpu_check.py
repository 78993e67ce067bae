"""flashprobe's prepared GPU check (run through ``scripts/gpu_check.sh OUT_DIR``).

One command for a CUDA machine with torch and flashprobe installed and no network: it runs each
step of :data:`STEPS` as its own process with its own time limit (together at most
:data:`TOTAL_LIMIT_S` seconds), keeps each step's output under ``OUT_DIR/<step>/`` and its log in
``OUT_DIR/<step>.log``, and writes ``OUT_DIR/gpu_check.json`` and ``OUT_DIR/gpu_check.md``: per
step its command, exit code, seconds and the figures read from its results (overhead ratios,
reference cost per call, fuzz failures, the study's answer line).

Without CUDA it prints the plan (every command it would run) and exits 0: the same plan a test
checks on a CPU machine (``tests/test_gpu_check.py``).

``python scripts/gpu_check.py --reference-cost DIR`` is one of the steps: the probe's cost per
attention call at B = 2, H = 16, N = 8192, D = 128 (bf16, causal and not, forward and with
gradients), timed with CUDA events against the bare flash call, and the number of reference
blocks per call.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Upper bound on the whole check, seconds (the issue's budget is 8 minutes).
TOTAL_LIMIT_S = 470

#: The realistic overhead shape: 8 layers, N = 2048, d_model 1024 in 8 heads of d = 128, bf16.
OVERHEAD_SHAPE = [
    "--device", "cuda", "--autocast", "bf16", "--layers", "8", "--seq-len", "2048",
    "--d-model", "1024", "--heads", "8", "--batch", "4", "--steps", "40", "--warmup", "5",
]  # fmt: skip


@dataclass(frozen=True)
class Step:
    """One step of the check: a command run in its own process.

    Attributes:
        name: the step's name (its output folder and log are named after it).
        argv: the command after ``python``; ``{out}`` is replaced by the step's output folder.
        limit_s: seconds before the step is stopped.
    """

    name: str
    argv: tuple[str, ...]
    limit_s: int

    def command(self, out: Path) -> list[str]:
        """The full command line (``sys.executable`` first) writing into ``out``."""
        return [sys.executable, *(a.replace("{out}", str(out)) for a in self.argv)]


STEPS: tuple[Step, ...] = (
    Step("gpu_tests", ("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"), 90),
    Step(
        "overhead_forward",
        ("-m", "flashprobe.cli", "bench", "overhead", *OVERHEAD_SHAPE, "--out", "{out}"),
        75,
    ),
    Step(
        "overhead_backward",
        ("-m", "flashprobe.cli", "bench", "overhead", *OVERHEAD_SHAPE, "--backward", "--out", "{out}"),
        90,
    ),
    Step("reference_cost", (str(Path(__file__).resolve()), "--reference-cost", "{out}"), 45),
    Step(
        "fuzz_cuda_sdpa",
        (
            "-m",
            "flashprobe.cli",
            "fuzz",
            "--device",
            "cuda",
            "--kernel",
            "sdpa_flash",
            "--kernel",
            "sdpa_efficient",
            "--kernel",
            "sdpa_cudnn",
            "--kernel",
            "sdpa_math",
            "--dtype",
            "bf16,fp16",
            "--out",
            "{out}",
        ),
        75,
    ),
    Step(
        "study_50_steps",
        (
            "-m",
            "flashprobe.cli",
            "study",
            "--out",
            "{out}",
            "trainer=gpu",
            "study.replicates=1",  # one seed: the step's time as before replicates (seven runs)
            "trainer.max_steps=50",
            "callbacks.weight_snapshot.every_n_steps=10",
            "trainer.log_every_n_steps=10",
        ),
        95,
    ),
)


def plan(out_dir: Path) -> list[str]:
    """The commands the check runs, one line each (what a machine without CUDA is shown)."""
    return [f"{s.name} (<= {s.limit_s} s): {shlex.join(s.command(out_dir / s.name))}" for s in STEPS]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def figures(step: str, out: Path, log: str) -> dict[str, Any]:
    """The figures a step's results hold (empty when it wrote none)."""
    if step.startswith("overhead"):
        data = _read_json(out / "overhead.json") or {}
        return {
            "rows": [
                {k: r.get(k) for k in ("mode", "step_ms", "ratio_vs_no_probe", "ratio_vs_control")}
                for r in data.get("rows", [])
            ],
            "limits": data.get("limits"),
        }
    if step == "reference_cost":
        return _read_json(out / "reference_cost.json") or {}
    if step == "fuzz_cuda_sdpa":
        data = _read_json(out / "fuzz.json") or {}
        failed = [
            {k: r.get(k) for k in ("kernel", "case", "dtype", "reason")}
            for r in data.get("rows", [])
            if r.get("verdict") == "fail"
        ]
        return {"summary": data.get("summary"), "elapsed_s": data.get("elapsed_s"), "failed": failed}
    if step == "gpu_tests":
        tail = [line for line in log.splitlines() if " passed" in line or " failed" in line]
        return {"pytest": tail[-1] if tail else None}
    if step == "study_50_steps":  # the verdict from its answer line on, and the paths
        lines = log.strip().splitlines()
        answer = [
            i for i, line in enumerate(lines) if line.startswith(("PASS", "LOOK CLOSER", "UNDETERMINED"))
        ]
        return {"closing_lines": lines[answer[-1] if answer else -8 :]}
    return {}


def run_check(out_dir: Path) -> int:
    """Run every step (within :data:`TOTAL_LIMIT_S`); write the JSON and Markdown summaries."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    results = []
    for step in STEPS:
        out = out_dir / step.name
        out.mkdir(exist_ok=True)
        left = TOTAL_LIMIT_S - (time.monotonic() - started)
        limit = min(step.limit_s, max(0, int(left)))
        record: dict[str, Any] = {"step": step.name, "command": shlex.join(step.command(out))}
        if limit < 10:
            record.update(rc=None, seconds=0.0, status="skipped: the check's time is spent")
            results.append(record)
            continue
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                step.command(out), capture_output=True, text=True, timeout=limit, env=env, check=False
            )
            rc, log = proc.returncode, proc.stdout + proc.stderr
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired as err:
            rc, status = None, f"timed out after {limit} s"
            log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (err.stdout, err.stderr))
        (out_dir / f"{step.name}.log").write_text(log)
        record.update(rc=rc, seconds=round(time.monotonic() - t0, 1), status=status)
        record["figures"] = figures(step.name, out, log)
        results.append(record)
        print(f"{step.name}: {status} in {record['seconds']} s", flush=True)
    summary = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "seconds": round(time.monotonic() - started, 1),
        "steps": results,
    }
    (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "gpu_check.md").write_text(markdown(summary))
    print(f"wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    return 0 if all(r["status"] == "ok" for r in results) else 1


def markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown: one table of steps, then each step's figures as JSON."""
    lines = [
        f"# flashprobe GPU check — {summary['device']}",
        "",
        f"torch {summary['torch']}, CUDA {summary['cuda']}, {summary['seconds']} s in all.",
        "",
        "| step | status | seconds |",
        "| --- | --- | ---: |",
    ]
    lines += [f"| {r['step']} | {r['status']} | {r['seconds']} |" for r in summary["steps"]]
    for r in summary["steps"]:
        lines += ["", f"## {r['step']}", "", f"`{r['command']}`", "", "```json"]
        lines += [json.dumps(r.get("figures", {}), indent=2), "```"]
    return "\n".join(lines) + "\n"


def reference_cost(out: Path, *, seq_len: int = 8192, repeats: int = 5) -> dict[str, Any]:
    """The probe's cost per call at B = 2, H = 16, N = ``seq_len``, D = 128 on CUDA, bf16.

    Times (CUDA events, median of ``repeats``) the bare flash call and the same call through a
    :class:`~flashprobe.probing.ShadowAttention` (baseline and FP64 golden), forward and with
    gradients, causal and not; records the reference blocks per call from
    :func:`flashprobe.kernels.reference.plan_blocks` and the peak memory. Writes
    ``out/reference_cost.json``.
    """
    import statistics

    import torch
    import torch.nn.functional as F

    from flashprobe.kernels.reference import plan_blocks, reference_budget
    from flashprobe.probing import ShadowAttention

    device = torch.device("cuda")
    shape = (2, 16, seq_len, 128)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=torch.bfloat16)

    def timed(fn: Any) -> float:
        times = []
        for i in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if i:  # the first is a warm-up
                times.append(start.elapsed_time(end))
        return statistics.median(times)

    rows = []
    budget = reference_budget(device)
    for causal in (False, True):
        for backward in (False, True):
            shadow = ShadowAttention(backward=backward, name="call")

            def bare(causal: bool = causal, backward: bool = backward) -> None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                if backward:
                    out.backward(grad_out)

            def probed(causal: bool = causal, backward: bool = backward, shadow: Any = shadow) -> None:
                out = shadow(q, k, v, is_causal=causal)
                if backward:
                    out.backward(grad_out)

            torch.cuda.reset_peak_memory_stats()
            bare_ms = timed(bare)
            probe_ms = timed(probed)
            blocks = plan_blocks(shape, shape, shape, is_causal=causal, backward=backward, budget=budget)
            rows.append(
                {
                    "causal": causal,
                    "backward": backward,
                    "bare_ms": round(bare_ms, 3),
                    "probe_ms": round(probe_ms, 3),
                    "ratio": round(probe_ms / bare_ms, 2),
                    "reference_blocks": len(blocks),
                    "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                }
            )
    result = {"shape": list(shape), "dtype": "bfloat16", "budget_bytes": budget, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "reference_cost.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str]) -> int:
    """``gpu_check.py OUT_DIR`` or ``gpu_check.py --reference-cost DIR``."""
    if len(argv) == 2 and argv[0] == "--reference-cost":
        print(json.dumps(reference_cost(Path(argv[1])), indent=2))
        return 0
    if len(argv) != 1 or not argv[0]:
        print("usage: scripts/gpu_check.sh OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__}): nothing run.")
        print("On a CUDA machine this check runs:")
        for line in plan(out_dir):
            print(f"  {line}")
        print(f"and writes {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}.")
        return 0
    return run_check(out_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
