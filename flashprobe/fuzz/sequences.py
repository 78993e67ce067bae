"""Sequences: several calls of one kernel in one process, every call judged.

A kernel that keeps state between calls (a compiled plan or graph, scratch buffers, a saved output
gradient, a result memoised by pointer) can be right on its first call and wrong on a later one its
cache key misses. Each sequence of :data:`SEQUENCES` changes one thing such a key must hold and judges
every call against its own FP64 golden. A sequence is data: :class:`Step` s run in order by
:func:`run_steps`; steps of the same ``slot`` and layout share storage, written in place. Every call
goes through :meth:`Kernel.run <flashprobe.kernels.Kernel.run>`; steps the kernel cannot take are left
out first (fewer than two left: not applicable). A failing sequence is saved whole
(:func:`save_sequence`) and replayed by ``flashprobe replay FILE`` (:func:`replay_sequence`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flashprobe.formats.reproducer import ReproducerError, kernel_module, load_sequence
from flashprobe.formats.reproducer import save_sequence as _save_file
from flashprobe.fuzz.cases import case_generator
from flashprobe.fuzz.fit import NotApplicableError
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.fuzz.kernel_call import REFUSALS
from flashprobe.fuzz.references import gradient_references
from flashprobe.fuzz.rule import References, Verdict, judge, judge_gradients
from flashprobe.fuzz.run import case_references
from flashprobe.judge import fp8_baseline
from flashprobe.kernels import (
    ANY_CAPABILITIES,
    AttentionCall,
    Kernel,
    KernelUnavailableError,
    KernelUnsupportedError,
    default_scale,
    dtype_name,
    get_kernel,
)
from flashprobe.kernels.contract import contract_problem, sdpa_arguments

__all__ = [
    "SEQUENCES",
    "Check",
    "Outcome",
    "Step",
    "call_problem",
    "judge_output",
    "replay_sequence",
    "run_steps",
]


@dataclass(frozen=True)
class Step:
    """One call of a sequence.

    Attributes:
        q, k, v: names of the call's logical tensors, ``(B, H, N_q, D)``, ``(B, H, N_k, D)``,
            ``(B, H, N_k, D_v)``.
        note: what this call is, in words.
        mask: name of its ``attn_mask`` (bool or additive), or None.
        layout: ``bhnd`` (contiguous ``(B, H, N, D)``) or ``bnhd`` (contiguous ``(B, N, H, D)``).
        slot: steps with the same slot, layout, dtype and shapes share memory, written in place.
        pages: keys on pages of this many rows in an order drawn from ``page_seed``, unused rows
            NaN; 0: dense.
        grads: ``(name, slot)`` of each output gradient: one backward each on this call's forward.
        k_lens: valid keys per batch entry, or ``()`` for all.
    """

    q: str
    k: str
    v: str
    note: str
    mask: str | None = None
    causal: bool = False
    scale: float | None = None
    layout: str = "bhnd"
    slot: str = "a"
    pages: int = 0
    page_seed: int = 0
    grads: tuple[tuple[str, str], ...] = ()
    k_lens: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The step as JSON data (the reproducer's metadata)."""
        return {**asdict(self), "grads": [list(g) for g in self.grads], "k_lens": list(self.k_lens)}

    @classmethod
    def from_dict(cls, data: Any, tensors: dict[str, torch.Tensor]) -> Step:
        """A step read from a reproducer's metadata, every field checked as data.

        Raises:
            ReproducerError: an unknown or mistyped field, or a tensor the file lacks (named).
        """
        kinds = {"q": str, "k": str, "v": str, "note": str, "mask": (str, type(None)), "causal": bool,
                 "scale": (int, float, type(None)), "layout": str, "slot": str, "pages": int,
                 "page_seed": int, "grads": list, "k_lens": list}  # fmt: skip
        if not isinstance(data, dict) or set(data) - set(kinds):
            raise ReproducerError(f"a step of the sequence is not an object of {', '.join(kinds)}: {data!r}")
        for key, value in data.items():
            if not isinstance(value, kinds[key]) or (kinds[key] is int and isinstance(value, bool)):
                raise ReproducerError(f"a step's {key} is {value!r}, of the wrong type")
        grads = data.get("grads", [])
        if not all(isinstance(g, list) and len(g) == 2 and all(isinstance(x, str) for x in g) for g in grads):
            raise ReproducerError(f"a step's grads is {grads!r}, not a list of [name, slot] pairs")
        lens = data.get("k_lens", [])
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lens):
            raise ReproducerError(f"a step's k_lens is {lens!r}, not a list of key counts")
        step = cls(**{**data, "grads": tuple(tuple(g) for g in grads), "k_lens": tuple(lens)})
        missing = [
            n
            for n in (step.q, step.k, step.v, step.mask, *(g for g, _ in step.grads))
            if n and n not in tensors
        ]
        if missing or step.layout not in ("bhnd", "bnhd") or step.pages < 0:
            raise ReproducerError(
                f"step {step.note!r} names tensors the file lacks ({missing}) or a bad layout"
            )
        return step


@dataclass
class _Storage:
    """The memory of a sequence's slots: one buffer per (slot, layout, dtype, shape, device)."""

    buffers: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)

    def put(self, slot: str, values: torch.Tensor, layout: str = "bhnd") -> torch.Tensor:
        """``values`` ``(B, H, N, D)`` written into the slot's memory in ``layout``; that tensor."""
        physical = values.transpose(1, 2) if layout == "bnhd" else values
        key = (slot, layout, physical.dtype, tuple(physical.shape), str(physical.device))
        if key not in self.buffers:
            self.buffers[key] = torch.empty(physical.shape, dtype=physical.dtype, device=physical.device)
        return self.buffers[key].copy_(physical)


def _logical(step: Step, tensors: dict[str, torch.Tensor], device: torch.device) -> CaseInputs:
    """The step's call as SDPA values (what its references are computed from)."""
    q, k, v = (tensors[n].to(device) for n in (step.q, step.k, step.v))
    mask = tensors[step.mask].to(device) if step.mask else None
    if step.k_lens:  # key padding: keys [0, k_lens[b]) of entry b
        lens = torch.tensor(step.k_lens, device=device)
        mask = (torch.arange(k.shape[2], device=device) < lens[:, None])[:, None, None, :]
    return CaseInputs(q=q, k=k, v=v, attn_mask=mask, is_causal=step.causal, scale=step.scale)


def _call(
    kernel: Kernel, step: Step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any
) -> AttentionCall:
    """The step's :class:`AttentionCall` on these tensors (in its layout; paged as the api takes pages)."""
    lens = torch.tensor(step.k_lens, dtype=torch.int32, device=q.device) if step.k_lens else None
    call = AttentionCall(
        q=q,
        k=k,
        v=v,
        layout=step.layout,
        attn_mask=None if step.k_lens else mask,
        causal=step.causal,
        scale=step.scale,
        k_lens=lens,
    )
    if not step.pages:
        return call
    pages = {
        "page_size": step.pages,
        "generator": torch.Generator().manual_seed(step.page_seed),
        "fill": float("nan"),
    }
    if kernel.api == "flash_attn_with_kvcache":
        return call.logical().cached(**pages)
    page_size = pages.pop("page_size")
    return call.logical().paged(page_size, **pages)


def call_problem(kernel: Kernel, call: AttentionCall) -> str | None:
    """Why ``kernel`` cannot take ``call`` (its api's and its capabilities' refusal), before any work."""
    if call.storage != "dense" and kernel.api in ("sdpa", "flash_attn_func", "merge_state"):
        return f"its api ({kernel.api}) takes no page table"
    caps = kernel.capabilities
    problem = contract_problem(kernel.api, call, caps)
    if problem is None and kernel.api == "sdpa" and caps is not ANY_CAPABILITIES:
        a = sdpa_arguments(call, caps)
        problem = caps.call_problem(a["q"], a["k"], a["v"], a["attn_mask"], a["is_causal"])
    return problem


def references_for(kernel: Kernel, inputs: CaseInputs, baseline: str | Kernel) -> References:
    """The forward references of one call (:func:`~flashprobe.fuzz.run.case_references`; an FP8
    kernel's FP8 baseline and limits)."""
    base, precision = fp8_baseline(kernel, baseline)
    return replace(case_references(inputs, base, backward=False), precision=precision)


def judge_output(found: Any, refs: References) -> Verdict:
    """:func:`~flashprobe.fuzz.rule.judge` of what a kernel returned (not a tensor: ``raised``)."""
    if not isinstance(found, torch.Tensor):
        return Verdict(
            verdict="fail", failure="raised", reason=f"returned {type(found).__name__}, not a tensor"
        )
    return judge(found, refs)


def _backward(
    out: torch.Tensor, leaves: list[torch.Tensor], call: AttentionCall, d_out: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    """``dq``, ``dk``, ``dv`` (logical) of one backward with ``d_out``, the graph kept for the next."""
    found = torch.autograd.grad(out, leaves, d_out.to(out.dtype), retain_graph=True, allow_unused=True)
    to_logical = (call.q_to_logical, call.kv_to_logical, call.kv_to_logical)
    return {
        n: None if g is None else f(g) for n, g, f in zip(("dq", "dk", "dv"), found, to_logical, strict=True)
    }


def run_steps(
    kernel: Kernel,
    steps: Sequence[Step],
    tensors: dict[str, torch.Tensor],
    *,
    baseline: str | Kernel = "math",
    backward: bool = True,
    device: str | torch.device = "cpu",
) -> list[tuple[int, str, Verdict]]:
    """Run ``steps`` in order on one kernel, in one process, and judge every call.

    Args:
        tensors: every tensor the steps name, in its dtype.
        baseline: the same-dtype baseline (an FP8 kernel gets the FP8 one).
        backward: run each step's backwards (kernels without a backward run forward only).

    Returns:
        ``(step index, what was judged, verdict)`` per judgement, in order: ``out``, then
        ``backward <j>`` per output gradient; a failing judgement ends the list.
    """
    device = torch.device(device)
    storage, judged = _Storage(), []
    for i, step in enumerate(steps):
        inputs = _logical(step, tensors, device)
        refs = references_for(kernel, inputs, baseline)
        mask = inputs.attn_mask
        bufs = [
            storage.put(f"{step.slot}.{r}", t, step.layout)
            for r, t in zip("qkv", (inputs.q, inputs.k, inputs.v), strict=True)
        ]
        with_grad = backward and bool(step.grads) and not step.pages
        try:
            try:
                leaves = [b.detach().requires_grad_(with_grad) for b in bufs]  # the same memory
                call = _call(kernel, step, *leaves, mask)
                with torch.enable_grad():
                    out = kernel.run(call).out
            except KernelUnsupportedError:  # no backward for this call: forward only
                if not with_grad:
                    raise
                with_grad, leaves = False, bufs
                call = _call(kernel, step, *bufs, mask)
                out = kernel.run(call).out
        except REFUSALS as err:  # the kernel refuses the call
            refused = Verdict(verdict="unsupported", reason=f"refused: {type(err).__name__}: {err}")
            return [*judged, (i, "out", refused)]
        except Exception as err:  # a kernel that raises on a later call fails there
            raised = Verdict(verdict="fail", failure="raised", reason=f"raised {type(err).__name__}: {err}")
            return [*judged, (i, "out", raised)]
        verdict = judge_output(out, refs)
        judged.append((i, "out", verdict))
        if verdict.verdict == "fail":
            return judged
        if not (with_grad and isinstance(out, torch.Tensor) and out.requires_grad):
            continue
        for j, (name, slot) in enumerate(step.grads, 1):
            d_out = (
                storage.put(f"grad.{slot}", tensors[name].to(device)) if slot else tensors[name].to(device)
            )
            grads, note = gradient_references(
                inputs, fp8_baseline(kernel, baseline)[0], d_out, inputs.valid_keys()
            )
            try:
                found = _backward(out, leaves, call, d_out)
            except Exception as err:
                grads_verdict = Verdict(
                    verdict="fail",
                    failure="backward:raised",
                    reason=f"backward raised {type(err).__name__}: {err}",
                )
            else:
                grads_verdict, _ = judge_gradients(
                    found, replace(refs, grad_out=d_out, gradients=grads, grad_note=note)
                )
            judged.append((i, f"backward {j}", grads_verdict))
            if grads_verdict.verdict == "fail":
                return judged
    return judged


# ---- the sequences ------------------------------------------------------------------------------


@dataclass
class Builder:
    """Builds one sequence's tensors and steps at shapes the kernel takes."""

    kernel: Kernel
    dtype: torch.dtype
    gen: torch.Generator
    backward: bool
    device: torch.device
    baseline: str | Kernel = "math"
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def fit(self, n_q: int, n_k: int, d: int) -> tuple[int, int, int]:
        """``(N_q, N_k, D)`` moved inside the kernel's lengths and head dims (up, where it can)."""
        caps = self.kernel.capabilities
        m = caps.seq_multiple
        n_q, n_k = -(-n_q // m) * m, -(-n_k // m) * m
        if caps.same_length:
            n_q = n_k = max(n_q, n_k)
        if caps.head_dims:
            d = min((x for x in caps.head_dims if x >= d), default=max(caps.head_dims))
        d = -(-d // caps.head_dim_multiple) * caps.head_dim_multiple
        if caps.max_head_dim is not None and d > caps.max_head_dim:
            d = caps.max_head_dim // caps.head_dim_multiple * caps.head_dim_multiple
        return n_q, n_k, d

    def add(self, name: str, t: torch.Tensor) -> str:
        """Keep ``t`` as ``name``: float64 values in the sequence's dtype, others as they are."""
        self.tensors[name] = t.to(self.dtype) if t.dtype == torch.float64 else t
        return name

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def qkv(self, tag: str, b: int, n_q: int, n_k: int, d: int = 32, h: int = 2) -> tuple[str, str, str]:
        """Standard normal q, k, v named ``q<tag>``, ``k<tag>``, ``v<tag>`` (shapes fitted)."""
        n_q, n_k, d = self.fit(n_q, n_k, d)
        shapes = {"q": (b, h, n_q, d), "k": (b, h, n_k, d), "v": (b, h, n_k, d)}
        names = [self.add(f"{r}{tag}", self.randn(*s)) for r, s in shapes.items()]
        return names[0], names[1], names[2]

    def grads(self, step: Step, *slots: str) -> Step:
        """``step`` with an output gradient per slot (``""``: a tensor of its own)."""
        if not self.backward:
            return step
        q, v = self.tensors[step.q], self.tensors[step.v]
        shape = (*q.shape[:3], v.shape[3])
        named = [(self.add(f"do{len(self.tensors)}", self.randn(*shape)), s) for s in slots]
        return replace(step, grads=tuple(named))


def _scale(b: Builder) -> list[Step]:
    t = b.qkv("0", 2, 48, 48)
    s = default_scale(b.tensors[t[0]].shape[-1], None)
    return [b.grads(Step(*t, f"scale 1/√D = {s:.4g}"), "g"),
            b.grads(Step(*t, scale=4 * s, note=f"same tensors, scale {4 * s:.4g}"), "g"),
            b.grads(Step(*t, "same tensors, scale 1/√D again"), "g")]  # fmt: skip


def _dtype(b: Builder) -> list[Step]:
    t = b.qkv("0", 2, 48, 48)
    others = [d for d in (torch.float32, torch.bfloat16, torch.float16) if d != b.dtype]
    caps = b.kernel.capabilities
    other = next((d for d in others if caps.dtypes is None or d in caps.dtypes), None)
    if other is None:
        raise NotApplicableError("it takes no second dtype of bf16, fp16, fp32")
    u = tuple(b.add(f"{n}@{dtype_name(other)}", b.tensors[n].to(other)) for n in t)
    return [Step(*t, f"{dtype_name(b.dtype)}"), Step(*u, f"the same values in {dtype_name(other)}"),
            Step(*t, f"{dtype_name(b.dtype)} again")]  # fmt: skip


def _layout(b: Builder) -> list[Step]:
    t = b.qkv("0", 2, 64, 64)
    return [b.grads(Step(*t, "contiguous (B, H, N, D)"), "g"),
            b.grads(Step(*t, "the same values as (B, N, H, D) memory (NHD views)", layout="bnhd"), "g"),
            b.grads(Step(*t, "contiguous (B, H, N, D) again"), "g")]  # fmt: skip


def _mask(b: Builder) -> list[Step]:
    t = b.qkv("0", 2, 64, 64)
    n_k = b.tensors[t[1]].shape[2]
    pad = [b.add(f"pad{i}", torch.arange(n_k)[None, None, None, :] < torch.tensor(lens)[:, None, None, None])
           for i, lens in enumerate(([n_k, n_k - 7], [n_k - 29, n_k - 1]))]  # fmt: skip
    return [Step(*t, "no mask"), Step(*t, "causal", causal=True),
            Step(*t, "key padding, lengths N, N−7", mask=pad[0]),
            Step(*t, "key padding, lengths N−29, N−1", mask=pad[1]), Step(*t, "no mask again")]  # fmt: skip


def _in_place(b: Builder) -> list[Step]:
    tags = [b.qkv(str(i), 2, 48, 48) for i in range(3)]
    return [b.grads(Step(*tags[0], "q, k, v"), "g"),
            b.grads(Step(*tags[1], "new values written into the same q, k, v memory"), "g"),
            b.grads(Step(*tags[2], "new values written into it again"), "g")]  # fmt: skip


def _dout(b: Builder) -> list[Step]:
    if not b.backward:
        raise NotApplicableError("gradients are not checked (--no-backward)")
    if not b.kernel.capabilities.has_backward(b.device):
        raise NotApplicableError(f"it has no backward on {b.device.type}")
    step = Step(
        *b.qkv("0", 2, 48, 48),
        "one forward, then three backwards: dO₁, dO₂ (new memory), dO₃ written into dO₁'s memory",
    )
    step = b.grads(step, "g", "", "g")
    return [step, b.grads(Step(step.q, step.k, step.v, "a second forward and backward"), "g")]


def _interleave(b: Builder) -> list[Step]:
    x, y = b.qkv("0", 2, 48, 48), b.qkv("1", 1, 80, 112)
    return [Step(*x, "shape A: B=2, N_q=N_k=48"), Step(*y, "shape B: B=1, N_q=80, N_k=112"),
            Step(*x, "shape A again"), Step(*y, "shape B again")]  # fmt: skip


def _grow(b: Builder) -> list[Step]:
    short, long = b.qkv("0", 2, 16, 32), b.qkv("1", 2, 16, 300)
    n_k = b.tensors[long[1]].shape[2]
    return [Step(*short, "short: N_k=32"), Step(*long, "long: N_k=300, the same B, H, N_q, D"),
            Step(*short, "short again"),
            Step(*long, f"long, ragged: {n_k} and 5 valid keys", k_lens=(n_k, 5)),
            Step(*long, "long, every key again")]  # fmt: skip


def _pages(b: Builder) -> list[Step]:
    if b.kernel.api not in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        raise NotApplicableError(f"its api ({b.kernel.api}) takes no page table")
    caps = b.kernel.capabilities
    size = min(caps.page_sizes) if caps.page_sizes else max(16, caps.page_multiple)
    x, y = b.qkv("0", 2, 16, 3 * size + 5), b.qkv("1", 2, 16, 3 * size + 5)
    return [Step(*x, f"pages of {size} keys", pages=size, page_seed=1),
            Step(*y, "other keys on other pages (another block table)", pages=size, page_seed=2),
            Step(*x, "the first keys and block table again", pages=size, page_seed=1)]  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """What one check found on one kernel at one dtype.

    Attributes:
        verdict: of :data:`~flashprobe.fuzz.rule.VERDICTS`.
        failure: the failed check's kind (``values``, ``dq:values``, ``bits``, ...).
        shape: the (first) call, in words.
        repro: the saved reproducer (sequences), or None.
        saved: a failing sequence's ``(steps, tensors)``, to save.
    """

    verdict: str
    reason: str
    failure: str | None = None
    shape: str = ""
    repro: str | None = None
    saved: tuple[list[Step], dict[str, torch.Tensor]] | None = None


@dataclass(frozen=True)
class Check:
    """A sequence or an invariant: one named property, run on one kernel at one dtype and seed.

    Attributes:
        name: the name ``--case`` selects (``seq_scale``, ``inv_unit_values``).
        property: the property it tests (a row's ``property``); probes: what it probes, one line.
        run: ``run(kernel, dtype, seed, baseline, backward, device) -> Outcome``.
    """

    name: str
    property: str
    probes: str
    run: Callable[..., Outcome]
    profiles: tuple[str, ...] = ("default", "full")


def _describe(step: Step, tensors: dict[str, torch.Tensor]) -> str:
    q, k = tensors[step.q], tensors[step.k]
    return (
        f"B={q.shape[0]} H={q.shape[1]} Nq={q.shape[2]} Nk={k.shape[2]} D={q.shape[3]} {dtype_name(q.dtype)}"
    )


def _sequence(
    name: str, build: Callable[[Builder], list[Step]], *, storage: bool = False
) -> Callable[..., Outcome]:
    """The check of one sequence: built at the kernel's shapes, unsupported steps left out, run."""

    def run(
        kernel: Kernel, dtype: torch.dtype, seed: int, baseline: str | Kernel, backward: bool, device: Any
    ) -> Outcome:
        builder = Builder(kernel, dtype, case_generator(seed, name), backward, torch.device(device))
        try:
            steps = build(builder)
        except NotApplicableError as err:
            return Outcome("unsupported", f"not applicable to this kernel: {err}")
        tensors = builder.tensors
        kept, left_out = [], []
        for step in steps:
            try:
                kernel.check(device, tensors[step.q].dtype)
                x = _logical(step, tensors, torch.device(device))
                problem = call_problem(kernel, _call(kernel, step, x.q, x.k, x.v, x.attn_mask))
            except (KernelUnavailableError, ValueError) as err:
                problem = str(err)
            (left_out if problem else kept).append((step, problem))
        settings = {(s.mask, s.causal, s.scale, s.layout, s.pages, s.page_seed, s.k_lens, tensors[s.q].dtype,
                     tensors[s.q].shape, tensors[s.k].shape) for s, _ in kept}  # fmt: skip
        if len(kept) < 2 or (len(settings) < 2 and not storage):
            why = left_out[0][1] if left_out else "nothing varies"
            return Outcome(
                "unsupported",
                f"not applicable to this kernel: {left_out[0][0].note if left_out else ''}: {why}",
            )
        steps = [s for s, _ in kept]
        judged = run_steps(kernel, steps, tensors, baseline=baseline, backward=backward, device=device)
        shape = _describe(steps[0], tensors)
        listing = "; ".join(f"{i}. {s.note}" for i, s in enumerate(steps, 1))
        if left_out:
            listing += f" (left out: {', '.join(s.note for s, _ in left_out)})"
        i, what, verdict = judged[-1]
        where = f"call {i + 1} of {len(steps)} ({steps[i].note}){'' if what == 'out' else ', ' + what}"
        if verdict.verdict == "unsupported":
            return Outcome("unsupported", f"{where}: {verdict.reason} — sequence: {listing}", shape=shape)
        if verdict.verdict == "fail":
            return Outcome("fail", f"{where}: {verdict.reason} — sequence: {listing}", verdict.failure, shape,
                           saved=(steps, tensors))  # fmt: skip
        grads = sum(w != "out" for _, w, _ in judged)
        return Outcome(
            "pass",
            f"{len(steps)} calls in one process, each passed ({grads} backwards): {listing}",
            shape=shape,
        )

    return run


_SEQ = "sequence: "
#: Every sequence, by name.
SEQUENCES: dict[str, Check] = {
    c.name: c
    for c in (
        Check("seq_scale", _SEQ + "scale", "the same tensors with another softmax scale (a plan keyed "
              "without it)", _sequence("seq_scale", _scale)),
        Check("seq_dtype", _SEQ + "dtype", "the same values in another dtype, then the first again",
              _sequence("seq_dtype", _dtype), profiles=("full",)),
        Check("seq_layout", _SEQ + "layout", "the same values as NHD views after BHND (a plan keyed "
              "without strides)", _sequence("seq_layout", _layout)),
        Check("seq_mask", _SEQ + "mask", "another causal flag and mask on the same tensors",
              _sequence("seq_mask", _mask), profiles=("full",)),
        Check("seq_in_place", _SEQ + "in-place inputs", "new values written into the same q, k, v memory "
              "(a result kept by pointer, a graph replayed)",
              _sequence("seq_in_place", _in_place, storage=True)),
        Check("seq_dout", _SEQ + "output gradients", "one forward, backwards with other dO (a stale dO)",
              _sequence("seq_dout", _dout, storage=True)),
        Check("seq_interleave", _SEQ + "interleaved shapes", "calls alternating between two shapes",
              _sequence("seq_interleave", _interleave), profiles=("full",)),
        Check("seq_grow", _SEQ + "scratch reuse", "a long call after a short one, the short "
              "again, a ragged one after full ones",
              _sequence("seq_grow", _grow)),
        Check("seq_pages", _SEQ + "page tables", "the same keys on other pages (a gather keyed without the "
              "block table)", _sequence("seq_pages", _pages)),
    )
}  # fmt: skip


# ---- reproducers ---------------------------------------------------------------------------------


def save_sequence(
    out_dir: str | Path, name: str, kernel: str | Kernel, steps: Sequence[Step],
    tensors: dict[str, torch.Tensor], *, reason: str, failure: str | None, baseline: str | Kernel = "math",
    backward: bool = True,
) -> Path:  # fmt: skip
    """Save a failing sequence, every call up to the failing one in order, as one reproducer
    ``out_dir/repro_<name>_<hash>.safetensors`` (and its script): ``flashprobe replay`` replays it."""
    used = {n for s in steps for n in (s.q, s.k, s.v, s.mask, *(g for g, _ in s.grads)) if n}
    kept = {n: t for n, t in tensors.items() if n in used}
    spec, module = get_kernel(kernel).spec, kernel_module(get_kernel(kernel))
    meta = {
        "primary": spec, "kernel_module": module, "baseline": get_kernel(baseline).spec,
        "reason": reason, "sequence": [s.as_dict() for s in steps],
        "fuzz": {"case": name, "failure": failure, "backward": backward},
    }  # fmt: skip
    key = json.dumps([spec, meta["sequence"], {n: list(t.shape) for n, t in kept.items()}], sort_keys=True)
    path = Path(out_dir) / f"repro_{name}_{hashlib.sha1(key.encode()).hexdigest()[:8]}.safetensors"
    return _save_file(path, kept, meta)


def replay_sequence(path: str | Path, kernels: Sequence[str] | None = None, baseline: str | None = None,
                    device: str | torch.device = "cpu") -> dict[str, dict[str, Any]]:  # fmt: skip
    """Replay a sequence reproducer with each kernel (default: the recorded one), judged as found.

    Returns:
        ``{spec: {"verdict": "pass"|"fail"|"unsupported", "calls": [(step, what, verdict, reason)],
        "reasons": [...]}}``; ``unsupported``: the kernel refused a call.

    Raises:
        ReproducerError: the file is not a sequence reproducer, or its steps are not valid data.
    """
    tensors, meta = load_sequence(path)
    raw = meta.get("sequence")
    if not isinstance(raw, list) or not raw:
        raise ReproducerError(f"{path}: its sequence is {raw!r}, not a list of steps")
    steps = [Step.from_dict(s, tensors) for s in raw]
    fuzz = meta.get("fuzz") if isinstance(meta.get("fuzz"), dict) else {}
    results = {}
    for spec in kernels or [meta.get("primary") or "math"]:
        judged = run_steps(
            get_kernel(spec), steps, tensors, baseline=baseline or meta.get("baseline") or "math",
            backward=bool(fuzz.get("backward", True)), device=device,
        )  # fmt: skip
        calls = [(i + 1, what, v.verdict, v.reason) for i, what, v in judged]
        failed = [
            f"call {i} ({steps[i - 1].note}) {w}: {r}" for i, w, verdict, r in calls if verdict == "fail"
        ]
        refused = [f"call {i} ({steps[i - 1].note}): {r}" for i, _, v, r in calls if v == "unsupported"]
        overall = "fail" if failed else "unsupported" if refused else "pass"
        results[spec] = {"verdict": overall, "calls": calls, "reasons": failed or refused}
    return results


def replay_main(path: Path, kernels: Sequence[str] | None, baseline: str | None, as_json: bool) -> int:
    """``flashprobe replay`` of a sequence reproducer: a line per kernel (and per failing call);
    1 when a kernel fails, 2 when one refuses a call (and none fails)."""
    results = replay_sequence(path, kernels, baseline)
    if as_json:
        print(json.dumps({"file": str(path), "results": results}, indent=2))
    else:
        _, meta = load_sequence(path)
        print(f"{path}: a sequence of {len(meta['sequence'])} calls — recorded: {meta.get('reason')}")
        for spec, r in results.items():
            print(
                f"  {spec}: {r['verdict'].upper()} ({len(r['calls'])} judgements)"
                + "".join(f"\n    {x}" for x in r["reasons"])
            )
    verdicts = {r["verdict"] for r in results.values()}
    return 1 if "fail" in verdicts else 2 if "unsupported" in verdicts else 0
