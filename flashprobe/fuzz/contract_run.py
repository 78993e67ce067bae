"""Running and judging the contract catalogue (:mod:`flashprobe.fuzz.contract_cases`).

:func:`check_call` judges one kernel on one :class:`~flashprobe.kernels.AttentionCall` of any storage,
through its api's adapter, against that call's golden and same-dtype baseline: the output by
:func:`flashprobe.fuzz.rule.judge` (read from a preallocated ``out=`` when given: a row left NaN was
never written); the LSE in the kernel's declared base by :func:`flashprobe.judge.judge_lse` (a row that
sees no key must hold the declared ``empty_lse``); the inputs left as they were (a KV cache gains
exactly the appended keys); ``dq``, ``dk``, ``dv`` where the api has a backward; an FP8 kernel with
its format's limits, the baseline's error the largest over its FP8 realisations. A call the kernel
must refuse passes when the kernel raises. :func:`run_contract_catalogue` gives one
:class:`~flashprobe.fuzz.run.FuzzResult` per (case, dtype, kernel).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from flashprobe.fuzz.cases import CATALOGUE, CasePatterns, case_generator
from flashprobe.fuzz.contract_cases import (
    CONTRACT_CASES,
    FP8_NAMES,
    ContractCase,
    build_call,
    contract_cases,
    describe_call,
    fp8_format,
    quantize,
    short_dtype,
)
from flashprobe.fuzz.fit import NotApplicableError
from flashprobe.fuzz.kernel_call import REFUSALS, same_values
from flashprobe.fuzz.references import grad_output
from flashprobe.fuzz.rule import (
    GradientReference,
    References,
    Verdict,
    judge,
    judge_gradients,
    noise,
    value_floor,
)
from flashprobe.fuzz.run import FuzzResult
from flashprobe.judge import fp8_realisations, judge_lse
from flashprobe.kernels import (
    AttentionCall,
    Kernel,
    baseline_call,
    get_kernel,
    golden_call,
)
from flashprobe.kernels.contract import contract_problem, kernel_arguments, run_contract
from flashprobe.kernels.fp8 import FP8_DTYPES
from flashprobe.kernels.math import call_gradients

if TYPE_CHECKING:
    from flashprobe.fuzz.reproducer import ReproducerStore

__all__ = [
    "CallVerdict",
    "check_call",
    "check_contract_case",
    "dense_dtypes",
    "run_contract_catalogue",
    "split_case_patterns",
    "to_dtypes",
]

#: :func:`check_call`'s limit on ``|out − 1|`` for V = 1 (``ones``): ``2^-4``
ONES_LIMIT = 2.0**-4
#: the apis whose kernels have a backward to judge
_BACKWARD_APIS = ("flash_attn_func", "flash_attn_varlen_func")
_NOT_APPLICABLE = "not applicable to this kernel: "


@dataclasses.dataclass(frozen=True)
class CallVerdict:
    """One kernel's verdict on one call (:func:`check_call`).

    Attributes:
        verdict: ``pass``, ``fail``, ``skip`` (undetermined), ``unsupported`` (the kernel's limits or
            api refuse the call), ``no_backward``.
        failure: the first failed check's kind (``nonfinite``, ``lse:empty_row``, ``accepted``, ...).
        fields: the other :class:`FuzzResult` fields it sets (tolerance, gradients, ...).
    """

    verdict: str
    reason: str
    failure: str | None = None
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)


def _tensor_fields(call: AttentionCall) -> dict[str, torch.Tensor]:
    return {
        f.name: getattr(call, f.name)
        for f in dataclasses.fields(call)
        if isinstance(getattr(call, f.name), torch.Tensor)
    }


def _unchecked(call: AttentionCall, each: Callable[[torch.Tensor], Any] | None = None) -> AttentionCall:
    """``call`` as an unchecked :class:`AttentionCall`, every tensor mapped through ``each``."""
    fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}
    if each is not None:
        fields.update({n: each(t) for n, t in _tensor_fields(call).items()})
    return AttentionCall.unchecked(**fields)


def _clone(call: AttentionCall) -> AttentionCall:
    """A call with copies of every tensor (a kernel may write into its cache)."""
    return _unchecked(call, torch.Tensor.clone)


def _touched(original: AttentionCall, ran: AttentionCall) -> list[str]:
    """The tensors the kernel changed, but a cache's keys and values (checked by :func:`_appended`)."""
    cache = original.storage == "cache"
    return [
        name
        for name, t in _tensor_fields(original).items()
        if name != "out" and not (cache and name in ("k", "v")) and not same_values(t, getattr(ran, name))
    ]


def _appended(original: AttentionCall, ran: AttentionCall) -> str:
    """Why a KV cache call's cache does not hold the keys it appended, read back through its slots
    (``""`` when it does, or when the call appends none)."""
    if original.storage != "cache" or not original.n_new:
        return ""
    seqlens = original.cache_seqlens
    if not isinstance(seqlens, torch.Tensor):
        seqlens = torch.full((original.batch,), int(seqlens), dtype=torch.int32, device=original.q.device)
    seqlens = (seqlens + original.n_new).to(torch.int32)
    after = _unchecked(ran).replace(cache_seqlens=seqlens, k_new=None, v_new=None, out=None, return_lse=False)
    want, got = original.logical(), after.logical()
    if same_values(want.k, got.k) and same_values(want.v, got.v):
        return ""
    return "the appended keys and values are not in the cache at cache_seqlens after the call"


def _logit_max(call: AttentionCall) -> float:
    """The largest valid |logit| of the call (after softcap and ALiBi)."""
    lg = call.logical()
    if not lg.n_k or not lg.n_q:
        return 0.0
    q, k, _ = lg.dequantized(torch.float64)
    s = q @ k.repeat_interleave(lg.group, dim=1).transpose(-1, -2) * lg.softmax_scale  # (B, H, N_q, N_k)
    if lg.softcap:
        s = lg.softcap * torch.tanh(s / lg.softcap)
    terms = lg.score_terms(slice(0, lg.batch), slice(0, lg.heads), slice(0, lg.n_q), lg.n_k, torch.float64)
    if "bias" in terms:
        s = s + terms["bias"]
    if "valid" in terms:
        s = s.masked_fill(~terms["valid"], 0.0)
    return float(s.abs().max())


def _fp8_forms(call: AttentionCall, fmt: str) -> list[torch.Tensor]:
    """The FP8 baseline's outputs on the call (its realisations of the format's rounding), in the
    call's output dtype; a form the call cannot be expressed to (softcap, sinks) is left out."""
    lg = call.logical()
    q, k, v = lg.dequantized(torch.float32 if call.fp8 else call.q.dtype)
    k, v = (t.repeat_interleave(lg.group, dim=1) for t in (k, v))  # the SDPA baseline takes no GQA
    plain = _unchecked(lg).replace(
        q=q, k=k, v=v, q_descale=None, k_descale=None, v_descale=None, return_lse=False, out=None
    )
    forms = []
    if not call.fp8:  # the same-dtype baseline on q, k, v rounded to the format (expresses every feature)
        fp8 = FP8_NAMES[fmt]
        rounded = {
            n: (
                lambda x, s: (
                    x.double() * s.double().repeat_interleave(x.shape[1] // s.shape[1], 1)[..., None, None]
                )
            )(*quantize(t.double(), fp8, lg.heads_kv))
            for n, t in (("q", lg.q), ("k", lg.k), ("v", lg.v))
        }
        forms.append(
            baseline_call(
                lg.replace(**{n: t.to(call.q.dtype) for n, t in rounded.items()}, return_lse=False, out=None)
            ).out.to(call.out_dtype)
        )
    base = f"math:fp8={fmt}"
    for spec in (base, *fp8_realisations(base)):
        try:
            forms.append(get_kernel(spec).run(plain).out.to(call.out_dtype))
        except REFUSALS:
            continue
    return forms


def _references(call: AttentionCall, golden: Any, base: Any, fmt: str | None) -> References:
    """The rule's references of one call's output."""
    g = golden.out.double()
    forms = [base.out, *(_fp8_forms(call, fmt) if fmt else [])]
    stats = [noise(f.double(), g) for f in forms]
    bad = stats[0][3]
    note, source = "", "baseline"
    if bad:  # a non-finite baseline sets no floor: the golden rounded to the output dtype does
        stats[0] = noise(g.to(call.out_dtype).double(), g)
        note, source = (
            "the baseline is non-finite here; the golden rounded to the dtype sets the floor",
            "rounded",
        )
    _, _, v = call.logical().dequantized(torch.float64)
    out_dtype = call.out_dtype
    return References(
        golden=g,
        baseline_golden_max_abs=None if bad else stats[0][0],
        baseline_nonfinite=bad,
        noise_max=max(s[0] for s in stats),
        noise_l2=max(s[1] for s in stats),
        noise_row=max(s[2] for s in stats),
        noise_from=source,
        note=note,
        floor=value_floor(v, out_dtype),
        fully_masked=golden.lse == float("-inf"),
        eps=float(torch.finfo(out_dtype).eps),
        dtype=out_dtype,
        precision=FP8_DTYPES[fmt] if fmt else None,
        logit_max=_logit_max(call),
    )


def _rows(call: AttentionCall) -> torch.Tensor | slice:
    """The logical form's real query rows ``(B, H, N_q)`` (not the padding past a sequence's length)."""
    lg = call.logical()
    if lg.q_lens is None:
        return slice(None)
    valid = torch.arange(lg.n_q, device=lg.q.device)[None, :] < lg.q_lens.long()[:, None]  # (B, N_q)
    return valid[:, None, :].expand(lg.batch, lg.heads, lg.n_q)


def _refusal(kernel: Kernel, call: AttentionCall, how: str) -> CallVerdict:
    """A call the kernel must refuse: it passes when the kernel raises."""
    try:
        _, args, kw = kernel_arguments(kernel.api, call, kernel.capabilities)
    except Exception as err:  # the adapter cannot even form the arguments: nothing posed
        return CallVerdict("skip", f"cannot pose the call ({type(err).__name__}: {err})")
    try:
        kernel.fn(*args, **kw, **kernel.options)
    except Exception as err:  # any exception refuses the call
        return CallVerdict("pass", f"refused the call ({how.replace('_', ' ')}): {type(err).__name__}: {err}")
    return CallVerdict(
        "fail",
        f"accepted a call it must refuse ({how.replace('_', ' ')}) and returned an output: reject or correct",
        "accepted",
    )


def _run(kernel: Kernel, call: AttentionCall) -> Any:
    """The kernel on ``call`` through its adapter, its LSE's empty rows left as the kernel gave them."""
    if kernel.api == "sdpa":
        return kernel.run(call)
    raw = dataclasses.replace(kernel.capabilities, empty_lse=float("-inf"))  # no mapping of its empty rows
    return run_contract(kernel.api, kernel.fn, call, raw, kernel.options)


def _unseen(logical: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose gradient the masks make 0: queries that see no key ``(B, H, N_q)`` (dq) and keys
    no query sees ``(B, H_kv, N_k)`` (dk, dv)."""
    b, h, n_q, n_k = logical.batch, logical.heads, logical.n_q, logical.n_k
    terms = logical.score_terms(slice(0, b), slice(0, h), slice(0, n_q), n_k, torch.float64)
    valid = terms.get("valid")
    valid = torch.ones(1, 1, n_q, n_k, dtype=torch.bool, device=logical.q.device) if valid is None else valid
    mask = logical.attn_mask
    if mask is not None:
        valid = valid & (mask if mask.dtype == torch.bool else mask > float("-inf"))
    valid = valid.expand(b, h, n_q, n_k)
    unseen = ~valid.any(2).view(b, logical.heads_kv, logical.group, n_k).any(2)
    return ~valid.any(-1), unseen


def _gradients(
    kernel: Kernel, call: AttentionCall, refs: References
) -> tuple[Verdict | None, dict[str, Any], str]:
    """The gradients' verdict (None: not judged), their statistics and a note."""
    caps = kernel.capabilities
    if kernel.api not in _BACKWARD_APIS or call.storage not in ("dense", "packed") or call.fp8:
        return None, {}, ""
    if (problem := caps.setting_problem(call.q.device, call.q.dtype, backward=True)) is not None:
        why = f"no backward: {problem}"
        return Verdict(verdict="no_backward", reason=why), {}, why
    leaves = {n: getattr(call, n).detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    posed = _clone(call).replace(out=None, **leaves)
    logical = call.logical()
    g = grad_output(
        (logical.batch, logical.heads, logical.n_q, logical.head_dim_v), call.q.dtype, call.q.device
    )
    try:
        with torch.enable_grad():
            out = _run(kernel, posed).out
            if not out.requires_grad:
                why = "no backward: its output has no autograd graph"
                return Verdict(verdict="no_backward", reason=why), {}, ""
            grads = torch.autograd.grad(out, tuple(leaves.values()), g.to(out.dtype), allow_unused=True)
    except Exception as err:  # a backward that raises is a bug
        text = f"backward raised {type(err).__name__}: {err}"
        return Verdict(verdict="fail", failure="backward:raised", reason=text), {}, text
    to_logical = (posed.q_to_logical, posed.kv_to_logical, posed.kv_to_logical)
    found = {
        n: None if x is None else f(x) for n, x, f in zip(("dq", "dk", "dv"), grads, to_logical, strict=True)
    }
    golden = call_gradients(call, g.double(), dtype=torch.float64)
    base = call_gradients(call, g)
    no_key, unseen = _unseen(logical)
    gradients = {}
    for name, gold, b, masked in zip(("dq", "dk", "dv"), golden, base, (no_key, unseen, unseen), strict=True):
        max_abs, l2, row, _ = noise(b.double(), gold)
        gradients[name] = GradientReference(
            name=name,
            golden=gold,
            noise_max=max_abs,
            noise_l2=l2,
            noise_row=row,
            eps=refs.eps,
            floor=refs.eps * (float(gold.abs().max()) if gold.numel() else 0.0),
            zero_rows=masked,
        )
    verdict, stats = judge_gradients(found, dataclasses.replace(refs, gradients=gradients))
    return verdict, stats, verdict.reason


def check_call(
    kernel: str | Kernel, call: AttentionCall, *, refuse: str = "", backward: bool = True, ones: bool = False
) -> CallVerdict:
    """Judge ``kernel`` (any api) on ``call`` (any storage), as the module docstring says.

    Args:
        refuse: the call is one the kernel must refuse, for this reason (``cu_seqlens_decreasing``, ...).
        backward: judge the gradients too, where the api has a backward.
        ones: V is all ones (the FP8 P-cast fixture): every row that sees a key must be 1 within
            :data:`ONES_LIMIT` (E4M3's 3 mantissa bits: ``2^-4`` relative per element).
    """
    kernel = get_kernel(kernel)
    if refuse:
        return _refusal(kernel, call, refuse)
    caps = kernel.capabilities
    problem = contract_problem(kernel.api, call, caps)
    if problem is not None:
        return CallVerdict("unsupported", f"{kernel.spec}: {problem}")
    golden = golden_call(call.replace(return_lse=True, out=None))
    base = baseline_call(call.replace(out=None))
    refs = _references(call, golden, base, fp8_format(call, caps))
    ran = _clone(call)
    try:
        found = _run(kernel, ran)
    except REFUSALS as err:
        return CallVerdict("unsupported", f"{type(err).__name__}: {err}")
    except Exception as err:  # any other exception is a bug the fuzzer reports
        return CallVerdict("fail", f"raised {type(err).__name__}: {err}", "raised")
    reasons: list[tuple[str, str]] = []
    out = found.out
    if call.out is not None:  # judged where the kernel wrote: a row never written stays NaN
        written = ran.q_to_logical(ran.out)
        if out.shape != written.shape or not same_values(out.to(written.dtype), written):
            reasons.append(("out_buffer", "the output it returned is not what it wrote into out="))
        out = written
    verdict = judge(out, refs)
    if ones:
        seen = torch.isfinite(golden.lse)  # (B, H, N_q): rows that see a key
        rows = _rows(call)
        seen = seen & rows if isinstance(rows, torch.Tensor) else seen
        seen = seen[..., None].expand_as(out)
        worst = float(torch.where(seen, (out.double() - 1.0).abs().nan_to_num(math.inf), 0.0).max())
        if worst > ONES_LIMIT:
            text = f"V = 1 but a row's output is off 1 by {worst:.3g} (limit {ONES_LIMIT:g}): "
            reasons.append(("fp8_pcast", text + "probability mass lost or saturated in P's cast to FP8"))
    fields: dict[str, Any] = {
        "tolerance": refs.tolerance,
        "noise_from": refs.noise_from,
        "primary_golden_max_abs": verdict.primary_golden_max_abs,
        "baseline_golden_max_abs": refs.baseline_golden_max_abs,
        "primary_nonfinite": verdict.primary_nonfinite,
        "baseline_nonfinite": refs.baseline_nonfinite,
    }
    if verdict.verdict == "fail":
        reasons.append((verdict.failure or "values", verdict.reason))
    if call.return_lse:
        if found.lse is None:
            reasons.append(("lse:missing", "asked for the LSE, returned none"))
        else:
            rows = _rows(call)
            lse = judge_lse(
                found.lse[rows], base.lse[rows], golden.lse[rows], dtype=call.out_dtype, empty=caps.empty_lse
            )
            if lse.verdict == "fail":
                reasons.append((f"lse:{lse.criterion}", f"lse: {lse.reason}"))
            fields["gradients"] = {
                "lse": {"verdict": lse.verdict, "limit_ratio": lse.limit_ratio, "reason": lse.reason}
            }
    if changed := _touched(call, ran):
        reasons.append(("inplace", f"modified its inputs in place: {', '.join(changed)}"))
    if missing := _appended(call, ran):
        reasons.append(("kv_append", missing))
    grads, stats, grad_reason = _gradients(kernel, call, refs) if backward else (None, {}, "")
    fields["gradients"] = {**fields.get("gradients", {}), **stats}
    if grads is not None:
        fields["backward"] = grads.verdict
        fields["backward_failure"] = grads.failure if grads.verdict == "fail" else None
    if reasons or (grads is not None and grads.verdict == "fail"):
        texts = [t for _, t in reasons] + (
            [grad_reason] if grads is not None and grads.verdict == "fail" else []
        )
        first = reasons[0][0] if reasons else grads.failure
        return CallVerdict("fail", "; ".join(texts), first, fields)
    if verdict.verdict == "skip":
        return CallVerdict("skip", verdict.reason, None, fields)
    if grads is not None and grads.verdict == "no_backward":
        return CallVerdict("no_backward", f"{verdict.reason}; {grad_reason}", None, fields)
    return CallVerdict("pass", verdict.reason + (f"; {grad_reason}" if grad_reason else ""), None, fields)


def check_contract_case(
    kernel: str | Kernel,
    case: ContractCase | str,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    backward: bool = True,
) -> tuple[FuzzResult, AttentionCall | None]:
    """Pose one contract case to one kernel at ``dtype`` and judge it (:func:`check_call`).

    Returns:
        The :class:`FuzzResult` and the call it was posed as (None when it could not be posed).
    """
    kernel = get_kernel(kernel)
    case = CONTRACT_CASES[case] if isinstance(case, str) else case
    common = {
        "kernel": kernel.spec,
        "case": case.name,
        "dtype": short_dtype(dtype),
        "seed": seed,
        "property": case.property,
    }
    start = time.perf_counter()
    try:
        call = build_call(case, kernel.api, kernel.capabilities, dtype, case_generator(seed, case.name))
    except NotApplicableError as err:
        verdict = "skip" if str(err).startswith("posed at") else "unsupported"
        reason = str(err) if verdict == "skip" else _NOT_APPLICABLE + str(err)
        return FuzzResult(verdict=verdict, reason=reason, **common), None
    call = _to(call, torch.device(device))
    ones = case.property == "FP8 P-cast"
    found = check_call(kernel, call, refuse=case.refuse, backward=backward and case.backward, ones=ones)
    reason = found.reason
    if found.verdict == "unsupported" and not case.refuse:
        reason = _NOT_APPLICABLE + reason.removeprefix(f"{kernel.spec}: ")
    axes = {
        "storage": call.storage,
        "head_dim": call.head_dim,
        "gqa_ratio": max(call.heads // max(call.heads_kv, 1), 1),
    }
    result = FuzzResult(
        verdict=found.verdict,
        reason=reason,
        failure=found.failure,
        shape=describe_call(call),
        axes=axes,
        seconds=round(time.perf_counter() - start, 3),
        **found.fields,
        **common,
    )
    return result, call


def _to(call: AttentionCall, device: torch.device) -> AttentionCall:
    return call if call.q.device == device else _unchecked(call, lambda t: t.to(device))


def run_contract_catalogue(
    kernels: Sequence[str | Kernel],
    dtypes: Sequence[torch.dtype],
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    backward: bool = True,
    names: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    reproducers: ReproducerStore | None = None,
) -> list[FuzzResult]:
    """The contract catalogue on every kernel that has a contract api (and SDPA kernels that declare
    an FP8 format), at every dtype: one row per (case, dtype, kernel).

    Args:
        dtypes: ``float8_e4m3fn`` poses the cases marked ``fp8`` with FP8 inputs.
        names: the cases to run (default: all).
        progress: called with one line per (case, dtype).
        reproducers: where failures are saved.
    """
    chosen = [get_kernel(k) for k in kernels]
    results: list[FuzzResult] = []
    for name, case in CONTRACT_CASES.items():
        if names is not None and name not in names:
            continue
        users = [k for k in chosen if case in contract_cases(k.api, k.capabilities)]
        for dtype in dtypes:
            rows = []
            for kernel in users:
                result, call = check_contract_case(
                    kernel, case, dtype, seed=seed, device=device, backward=backward
                )
                if reproducers is not None and call is not None and reproducers.wants(result, case.property):
                    from flashprobe.fuzz.reproducer import contract_reproducer

                    result = reproducers.keep(
                        result, contract_reproducer(result, kernel, call, case), case.property
                    )
                rows.append(result)
            if progress is not None and rows:
                verdicts = ", ".join(f"{r.kernel} {r.verdict}" for r in rows)
                progress(f"{name} {short_dtype(dtype)} seed {seed}: {verdicts}")
            results += rows
    return results


def split_case_patterns(patterns: Sequence[str]) -> tuple[list[str] | None, list[str]]:
    """``--case`` patterns split between the dense catalogue and the contract catalogue.

    Returns:
        The patterns for :func:`flashprobe.fuzz.cases.select_cases` (None: no dense case is named,
        run none) and the names of the contract cases the patterns select (all when none is given;
        ``-``/``!`` patterns remove cases from both).
    """
    chosen = CasePatterns.parse(patterns)
    contract = [n for n in CONTRACT_CASES if chosen.selects(n)]
    dense = [
        p for p in chosen.include if fnmatch.filter(CATALOGUE, p) or not fnmatch.filter(CONTRACT_CASES, p)
    ]
    if chosen.include and not dense:
        return None, contract
    return [*dense, *chosen.removals], contract


def dense_dtypes(dtypes: Sequence[str | torch.dtype]) -> list[str | torch.dtype]:
    """The dtypes the dense catalogue runs at: all but FP8 inputs (``e4m3``: the contract catalogue's)."""
    return [d for d in dtypes if d not in FP8_NAMES and d not in FP8_NAMES.values()]


def to_dtypes(dtypes: Sequence[str | torch.dtype]) -> list[torch.dtype]:
    """Dtypes by name, ``e4m3`` and ``e5m2`` included (FP8 inputs)."""
    from flashprobe.kernels import to_dtype

    return [FP8_NAMES[d] if isinstance(d, str) and d in FP8_NAMES else to_dtype(d) for d in dtypes]
