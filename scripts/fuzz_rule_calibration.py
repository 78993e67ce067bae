"""How often correct kernels fail the max rule alone, and flashprobe's rule, on small random calls.

Each call is standard normal q, k, v and a random output gradient of shape ``(1, 2, N, 32)`` (every
second call causal); each kernel's output and ``dq``, ``dk``, ``dv`` are judged with the fuzzer's
own references (:func:`flashprobe.fuzz.references`): ``autograd max`` is the max rule with the
noise of the ``math`` baseline's autograd gradients alone (flash-attention's test rule), ``max
rule`` the max rule with the fuzzer's noise (both scale placements and the flash form of the
backward), ``rule`` flashprobe's (:mod:`flashprobe.judge`, as ``flashprobe fuzz`` applies it). Writes
``rule_calibration.json`` and ``rule_calibration.md`` into ``--out`` and prints the table.

    python scripts/fuzz_rule_calibration.py --calls 400 --out out/rule-calibration
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashprobe.fuzz import CaseInputs, references
from flashprobe.fuzz.kernel_call import call_kernel
from flashprobe.fuzz.rule import judge, judge_gradients
from flashprobe.kernels import get_kernel, math_attention, to_dtype
from flashprobe.kernels.reference import reference_input_gradients

TENSORS = ("out", "dq", "dk", "dv")


def _call(seed: int, n: int, dtype: torch.dtype) -> CaseInputs:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, 32, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))
    return CaseInputs(q=q, k=k, v=v, is_causal=seed % 2 == 0)


def _failures(kernel: str, inputs: CaseInputs) -> dict[str, tuple[bool, bool, bool]]:
    """Tensor → (fails the autograd-noise max rule, the max rule alone, flashprobe's rule)."""
    refs = references(inputs, backward=True)
    call = call_kernel(get_kernel(kernel), inputs, refs.grad_out)
    assert call.output is not None, call.problem
    out = call.output.double()
    max_out = (out - refs.golden).abs().max().item() > refs.tolerance
    found = {"out": (max_out, max_out, not judge(call.output, refs).passed)}
    _, *autograd = reference_input_gradients(
        math_attention, inputs.q, inputs.k, inputs.v, refs.grad_out, is_causal=inputs.is_causal
    )
    _, stats = judge_gradients(call.grads, refs)
    for (name, s), base in zip(stats.items(), autograd, strict=True):  # NaN/Inf fails all three
        ref = refs.gradients[name]
        err = call.grads[name].double() - ref.golden
        noise = (base.double() - ref.golden).abs().max().item()
        flash_attention_rule = not bool(err.abs().max().item() <= 2 * noise + ref.floor)
        max_fail = s["max_abs"] is None or s["max_abs"] > s["tolerance"]
        found[name] = (flash_attention_rule, max_fail, s.get("verdict", "fail") == "fail")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=400, help="random calls per kernel and dtype")
    p.add_argument("--seq-len", type=int, default=16, help="N of every call (default 16)")
    p.add_argument(
        "--kernel", action="append", help="kernels (default sdpa_flash, tiled, tiled:preset=paper)"
    )
    p.add_argument("--dtype", action="append", help="dtypes (default fp32, bf16)")
    p.add_argument("--out", default="out/rule-calibration", help="output directory")
    args = p.parse_args()
    kernels = args.kernel or ["sdpa_flash", "tiled", "tiled:preset=paper"]
    dtypes = args.dtype or ["fp32", "bf16"]
    rows = []
    for kernel in kernels:
        for name in dtypes:
            counts = {t: [0, 0, 0] for t in TENSORS}
            for seed in range(args.calls):
                for t, fails in _failures(kernel, _call(seed, args.seq_len, to_dtype(name))).items():
                    for i, fail in enumerate(fails):
                        counts[t][i] += fail
            rows.append({"kernel": kernel, "dtype": name, "calls": args.calls, "counts": counts})
    head = " | ".join(f"{t}: autograd max / max rule / rule" for t in TENSORS)
    lines = [
        f"| kernel | dtype | calls | {head} |",
        "| --- | --- | --- |" + " --- |" * len(TENSORS),
    ]
    for r in rows:
        cells = " | ".join(" / ".join(str(c) for c in r["counts"][t]) for t in TENSORS)
        lines.append(f"| `{r['kernel']}` | {r['dtype']} | {r['calls']} | {cells} |")
    table = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rule_calibration.json").write_text(json.dumps({"seq_len": args.seq_len, "rows": rows}, indent=2))
    (out / "rule_calibration.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
