"""Reproducers of fuzz failures, in the one reproducer format (:mod:`flashprobe.formats.reproducer`).

A failing case is saved as ``repro_<case>_<hash>.safetensors`` (its inputs, with ``fuzz`` metadata:
the case, layout, poison, whether gradients and the signed bias were judged, the failure kind, the
random sample's parameters) plus a script ``repro_<case>_<hash>.py`` that exits 1 while the failure
reproduces, 0 once it passes and 2 when the kernel cannot be loaded. ``flashprobe replay`` and
``flashprobe fuzz --from`` judge it with :func:`replay_case` (:func:`reproducer_judge`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from flashprobe.formats import safe_name
from flashprobe.formats.reproducer import Reproducer, kernel_module
from flashprobe.fuzz.cases import CATALOGUE, SIGNED_BIAS
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import kernel_label
from flashprobe.fuzz.run import FuzzResult, case_references, check_case
from flashprobe.judge import fp8_baseline
from flashprobe.kernels import Kernel, get_kernel

__all__ = [
    "ReproducerStore",
    "case_inputs",
    "case_reproducer",
    "contract_reproducer",
    "failure_directions",
    "replay_case",
    "reproducer_judge",
    "save_reproducer",
]

#: a fuzz verdict as :func:`flashprobe.probing.repro.replay` says it
_REPLAY = {
    "pass": "pass",
    "no_backward": "pass",
    "fail": "fail",
    "skip": "undetermined",
    "unsupported": "error",
}


def case_reproducer(
    case: str,
    kernel: str | Kernel,
    inputs: CaseInputs,
    result: FuzzResult,
    *,
    baseline: str | Kernel = "math",
    params: dict[str, Any] | None = None,
    backward: bool = True,
    bias: bool = False,
) -> Reproducer:
    """A failing case as a reproducer, in memory (:meth:`~ReproducerStore.keep` saves it).

    Args:
        inputs: q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_k, ·)``, stored contiguous on the CPU with
            their layout and poison by name.
        result: the kernel's result on ``inputs``.
        baseline: the same-dtype baseline spec the replay judges with.
        params: the random sample's parameters.
        backward, bias: gradients and the signed bias were judged; the replay judges them too.
    """
    cpu = inputs.to("cpu")
    fuzz = {"case": case, "layout": cpu.layout, "poison": cpu.poison, "backward": backward, "bias": bias}
    meta = {
        "primary": kernel_label(kernel),
        "kernel_module": kernel_module(get_kernel(kernel)),
        "baseline": kernel_label(baseline),
        "reason": result.reason,
        "directions": failure_directions(result),
        "fuzz": {**fuzz, "failure": result.failure, "params": params or {}},
    }
    q, k, v = (t.contiguous() for t in (cpu.q, cpu.k, cpu.v))
    return Reproducer(q, k, v, cpu.attn_mask, None, cpu.is_causal, cpu.scale, meta)


def _file_name(call: Reproducer) -> str:
    """``repro_<case>_<hash>.safetensors``, the hash of the kernel, dtype, parameters and shapes.

    Raises:
        OutputPathError: the case's name cannot be used in a file name.
    """
    fuzz = call.meta["fuzz"]
    shapes = [list(t.shape) for t in (call.q, call.k, call.v)]
    key = [call.meta["primary"], str(call.dtype), fuzz["params"], shapes, fuzz["layout"]]
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"repro_{safe_name(fuzz['case'], what='case name')}_{digest}.safetensors"


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
    """Save a failing case (:func:`case_reproducer`'s arguments) as
    ``out_dir/repro_<case>_<hash>.safetensors`` with its script; returns the ``.safetensors`` path.

    Raises:
        OutputPathError: ``case`` cannot be used in a file name.
    """
    settings = {"baseline": baseline, "params": params, "backward": backward, "bias": bias}
    call = case_reproducer(case, kernel, inputs, result, **settings)
    return call.save(Path(out_dir) / _file_name(call))


def case_inputs(call: Reproducer) -> CaseInputs:
    """A fuzz reproducer's inputs, laid out in its recorded layout and poisoned memory.

    Raises:
        ValueError: the recorded layout or poison is not one the fuzzer knows.
    """
    fuzz = call.meta["fuzz"]
    q, k, v = (t.contiguous() for t in (call.q, call.k, call.v))
    plain = CaseInputs(
        q=q, k=k, v=v, attn_mask=call.attn_mask, is_causal=call.is_causal, scale=call.scale,
        poison=fuzz.get("poison", ""),
    )  # fmt: skip
    return plain.with_layout(fuzz.get("layout", "contiguous"))


def replay_case(call: Reproducer, kernel: str, baseline: str = "math") -> dict[str, Any]:
    """Judge a fuzz reproducer's case with ``kernel`` as the fuzzer does (:func:`check_case`, the
    FP8 baseline for an FP8 kernel), in the form of :func:`flashprobe.probing.repro.replay`."""
    fuzz = call.meta["fuzz"]
    try:
        inputs = case_inputs(call)
        base, precision = fp8_baseline(kernel, baseline)
        case = CATALOGUE.get(fuzz.get("case", ""))  # its output gradient: × 2^-20, transposed, ...
        refs = case_references(
            inputs, base, backward=fuzz.get("backward", True), grad=case.grad if case else "",
            bias=fuzz.get("bias", False),
        )  # fmt: skip
        result = check_case(
            kernel, inputs, case=fuzz.get("case", "custom"), refs=replace(refs, precision=precision)
        )
    except Exception as err:  # a kernel or a file that cannot be judged is a result, not a crash
        result = FuzzResult(
            kernel=kernel, case="", dtype="", verdict="unsupported", reason=f"{type(err).__name__}: {err}"
        )
    failed = result.verdict == "fail"
    return {
        "verdict": _REPLAY[result.verdict],
        "reasons": [result.reason],
        "failure": result.failure if failed else None,
        "directions": dict.fromkeys(failure_directions(result), "fail")
        if failed
        else {"out": _REPLAY[result.verdict]},
        "limit_ratio": {},
        "l2_error_ratio": {},
    }


def reproducer_judge(call: Reproducer) -> Callable[[Reproducer, str, str], dict[str, Any]] | None:
    """:func:`replay_case` for a reproducer the fuzzer saved, None (the probe's judge) for the probe's."""
    return replay_case if call.meta.get("fuzz") is not None else None


def failure_directions(result: FuzzResult) -> list[str]:
    """The directions a failing result fails in: ``out`` and/or ``dq``, ``dk``, ``dv``."""
    kinds = [k for k in (result.failure, result.backward_failure) if k]
    return list(dict.fromkeys(k.partition(":")[0] if ":" in k else "out" for k in kinds))


@dataclass
class ReproducerStore:
    """Where a fuzz run saves its failures: one reproducer per (kernel, property, direction), at
    most ``limit`` in all.

    Attributes:
        baseline: the same-dtype baseline spec the reproducers are judged with.
        backward: the failures were found with gradients checked.
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

    def reproducer(
        self, result: FuzzResult, inputs: CaseInputs, prop: str, *, params: dict[str, Any] | None = None
    ) -> Reproducer:
        """:func:`case_reproducer` of ``result`` on ``inputs`` with this store's settings."""
        bias = prop == SIGNED_BIAS
        settings = {"baseline": self.baseline, "params": params, "backward": self.backward, "bias": bias}
        return case_reproducer(result.case, result.kernel, inputs, result, **settings)

    def save(
        self, result: FuzzResult, inputs: CaseInputs, prop: str, *, params: dict[str, Any] | None = None
    ) -> FuzzResult:
        """Save ``inputs`` as the reproducer of ``result`` for each of its new directions; returns
        ``result`` with ``repro`` set."""
        return self.keep(result, self.reproducer(result, inputs, prop, params=params), prop)

    def keep(self, result: FuzzResult, call: Reproducer, prop: str) -> FuzzResult:
        """Save ``call`` (shrunk or not) as the reproducer of ``result``; see :meth:`save`."""
        path = call.save(self.out_dir / _file_name(call))
        for direction in failure_directions(result):
            self.saved.setdefault((result.kernel, prop, direction), path)
        return replace(result, repro=str(path))

    def offer(self, result: FuzzResult, inputs: Callable[[], CaseInputs]) -> FuzzResult:
        """Save a catalogue failure when :meth:`wants` it (``inputs`` builds its call on demand)."""
        prop = result.property or result.case
        return self.save(result, inputs(), prop) if self.wants(result, prop) else result


def contract_reproducer(result: FuzzResult, kernel: str | Kernel, call: Any, case: Any) -> Any:
    """A failing contract case (:mod:`flashprobe.fuzz.contract_run`) as a
    :class:`~flashprobe.formats.reproducer.ContractReproducer`: the call as the kernel got it."""
    from flashprobe.formats.reproducer import ContractReproducer

    entry = get_kernel(kernel)
    meta = {
        "primary": kernel_label(kernel),
        "kernel_module": kernel_module(entry),
        "reason": result.reason,
        "directions": failure_directions(result),
        "fuzz": {"case": case.name, "layout": call.storage, "params": {}, "failure": result.failure},
        "contract": {
            "api": entry.api, "refuse": case.refuse, "backward": case.backward, "property": case.property,
        },
    }  # fmt: skip
    return ContractReproducer(call, meta)
