"""Reproducers of fuzz failures: ``repro_<case>_<hash>.pt`` (the inputs) and a ``.py`` that re-checks them.

The ``.py`` reloads the ``.pt`` beside it (in the inputs' memory layout), runs the kernel, prints
the non-finite and all-zero row counts and the verdict (gradients included when the failure was
found with them), and exits 1 while the failure reproduces, 0 once it passes and 2 when the kernel
cannot be loaded (its module fails to import: that says nothing about the bug). Everything
in it that comes from the failure (kernel spec, case, reason) is a Python literal (``repr``), so
the snippet is valid Python whatever that text contains.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flashprobe.formats import atomic_write_file, atomic_write_text, safe_name
from flashprobe.fuzz.cases import SIGNED_BIAS
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import kernel_label
from flashprobe.fuzz.run import FuzzResult
from flashprobe.kernels import Kernel, get_kernel

__all__ = ["ReproducerStore", "failure_directions", "reproducer_snippet", "save_reproducer"]

_SNIPPET = '''"""Reproducer saved by `flashprobe fuzz`: KERNEL fails CASE at DTYPE (the constants below).

Run `python {stem}.py`: it exits 1 while the kernel still fails, 0 once it passes, and 2 when the
kernel cannot be loaded (its module does not import).
"""

import importlib
import sys
from pathlib import Path

import torch

from flashprobe import get_kernel, golden_attention
from flashprobe.fuzz import CaseInputs, check_case

KERNEL = {kernel!r}
KERNEL_MODULE = {module!r}  # imported first: it registers the kernel (None: built in)
CASE = {case!r}
DTYPE = {dtype!r}
INPUTS = {shape!r}
REASON = {reason!r}  # the failure when the reproducer was saved

try:  # exit 2, not 1: a kernel that cannot be loaded says nothing about the bug
    if KERNEL_MODULE:
        importlib.import_module(KERNEL_MODULE)
    get_kernel(KERNEL)
except Exception as err:
    print(f"cannot load the kernel {{KERNEL}}: {{type(err).__name__}}: {{err}}", file=sys.stderr)
    sys.exit(2)
saved = torch.load(Path(__file__).with_suffix(".pt"), weights_only=True)
inputs = CaseInputs(
    q=saved["q"],  # (B, H, N_q, D)
    k=saved["k"],  # (B, H_kv, N_k, D)
    v=saved["v"],  # (B, H_kv, N_k, D_v)
    attn_mask=saved["attn_mask"],
    is_causal=saved["is_causal"],
    scale=saved["scale"],
    poison=saved.get("poison", ""),
).with_layout(saved.get("layout", "contiguous"))
k, v = inputs.reference_kv()
out = get_kernel(KERNEL)(inputs.q, inputs.k, inputs.v, attn_mask=inputs.attn_mask,
                         is_causal=inputs.is_causal, scale=inputs.scale)
golden = golden_attention(inputs.q, k, v, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal,
                          scale=inputs.scale)
print(f"{{KERNEL}} on {{inputs.describe()}}")
print(f"non-finite outputs: {{(~torch.isfinite(out)).sum().item()}}, all-zero rows: "
      f"{{(out == 0).all(-1).sum().item()}}, golden all-zero rows: {{(golden == 0).all(-1).sum().item()}}")
backward = saved.get("backward", True)  # gradients too, as when the failure was found
result = check_case(KERNEL, inputs, case=CASE, baseline=saved["baseline"], backward=backward,
                    bias=saved.get("bias", False))
print(f"{{result.verdict}}: {{result.reason}}")
sys.exit(1 if result.verdict == "fail" else 0)
'''


def reproducer_snippet(
    *, stem: str, kernel: str, module: str | None, case: str, dtype: str, shape: str, reason: str
) -> str:
    """The source of the ``.py`` that re-checks ``<stem>.pt``; every text is embedded as a literal."""
    return _SNIPPET.format(
        stem=stem, kernel=kernel, module=module, case=case, dtype=dtype, shape=shape, reason=reason
    )


def _user_module(kernel: Kernel) -> str | None:
    """The module that registered a user kernel (``None`` for a built-in or ``__main__``)."""
    module = kernel.fn.__module__
    return None if module.startswith("flashprobe.kernels") or module == "__main__" else module


def _tensors(inputs: CaseInputs) -> dict[str, Any]:
    """The call's inputs on the CPU, as saved in the ``.pt``."""
    cpu = inputs.to("cpu")
    return {
        "q": cpu.q.contiguous(),
        "k": cpu.k.contiguous(),
        "v": cpu.v.contiguous(),
        "attn_mask": cpu.attn_mask,
        "is_causal": cpu.is_causal,
        "scale": cpu.scale,
        "layout": cpu.layout,
        "poison": cpu.poison,
    }


def save_reproducer(
    out_dir: str | os.PathLike[str],
    case: str,
    kernel: str | Kernel,
    inputs: CaseInputs,
    result: FuzzResult,
    *,
    baseline: str | Kernel = "math",
    params: dict[str, Any] | None = None,
    backward: bool = True,
    bias: bool = False,
) -> Path:
    """Save ``repro_<case>_<hash>.pt`` (inputs on CPU, kernel, dtype) and a ``.py`` that re-checks it.

    The snippet imports the module that registered a user kernel (``kernel.fn.__module__``) and
    exits 1 while the failure reproduces.

    Args:
        out_dir: the directory (created if needed).
        case: the case's name, part of the file name.
        kernel: the failing kernel.
        inputs: the (shrunk) inputs: q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_k, ·)``.
        result: the kernel's result on ``inputs``.
        baseline: the same-dtype baseline spec the snippet re-checks with.
        params: the random sample's parameters, saved with the inputs.
        backward: the failure was found with gradients checked; the snippet checks them too.
        bias: the case judged the sign of the errors (``signed bias``); the snippet does too.

    Returns:
        Path of the ``.pt`` file (the ``.py`` is beside it).

    Raises:
        OutputPathError: ``case`` cannot be used in a file name.
    """
    label, module = kernel_label(kernel), _user_module(get_kernel(kernel))
    key = json.dumps([label, result.dtype, params, inputs.describe()], sort_keys=True, default=str)
    stem = f"repro_{safe_name(case, what='case name')}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    payload = {
        **_tensors(inputs),
        "kernel": label,
        "kernel_module": module,
        "dtype": result.dtype,
        "baseline": kernel_label(baseline),
        "case": case,
        "reason": result.reason,
        "params": params or {},
        "backward": backward,
        "bias": bias,
    }
    path = Path(out_dir) / f"{stem}.pt"
    atomic_write_file(path, lambda tmp: torch.save(payload, tmp))
    snippet = reproducer_snippet(
        stem=stem,
        kernel=label,
        module=module,
        case=case,
        dtype=result.dtype,
        shape=inputs.describe(),
        reason=result.reason,
    )
    atomic_write_text(path.with_suffix(".py"), snippet)
    return path


def failure_directions(result: FuzzResult) -> list[str]:
    """The directions a failing result fails in: ``out`` and/or ``dq``, ``dk``, ``dv``."""
    kinds = [k for k in (result.failure, result.backward_failure) if k]
    return list(dict.fromkeys(k.partition(":")[0] if ":" in k else "out" for k in kinds))


@dataclass
class ReproducerStore:
    """Where a fuzz run saves its failures: one reproducer per (kernel, property, direction), at
    most ``limit`` in all, so every distinct failure keeps its evidence and none floods the
    directory.

    Attributes:
        out_dir: the directory the reproducers go to.
        baseline: the same-dtype baseline spec the snippets re-check with.
        backward: the failures were found with gradients checked.
        limit: the most reproducers saved.
        saved: (kernel, property, direction) → the reproducer saved for it.
    """

    out_dir: Path
    baseline: str | Kernel = "math"
    backward: bool = True
    limit: int = 64
    saved: dict[tuple[str, str, str], Path] = field(default_factory=dict)

    def wants(self, result: FuzzResult, prop: str) -> bool:
        """Whether a failure of ``result`` for property ``prop`` would be saved (a new key, room left)."""
        if result.verdict != "fail" or len(set(self.saved.values())) >= self.limit:
            return False
        return any((result.kernel, prop, d) not in self.saved for d in failure_directions(result))

    def save(
        self, result: FuzzResult, inputs: CaseInputs, prop: str, *, params: dict[str, Any] | None = None
    ) -> FuzzResult:
        """Save ``inputs`` as the reproducer of ``result`` for each of its new directions; returns
        ``result`` with ``repro`` set."""
        path = save_reproducer(
            self.out_dir,
            result.case,
            result.kernel,
            inputs,
            result,
            baseline=self.baseline,
            params=params,
            backward=self.backward,
            bias=prop == SIGNED_BIAS,
        )
        for direction in failure_directions(result):
            self.saved.setdefault((result.kernel, prop, direction), path)
        return replace(result, repro=str(path))

    def offer(self, result: FuzzResult, inputs: Callable[[], CaseInputs]) -> FuzzResult:
        """Save a catalogue failure when :meth:`wants` it (``inputs`` builds its call on demand)."""
        prop = result.property or result.case
        return self.save(result, inputs(), prop) if self.wants(result, prop) else result
