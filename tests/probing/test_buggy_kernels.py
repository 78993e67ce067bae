"""The mutants of :mod:`lab.mutants` that have a small trigger call, against an independent
FP64 oracle.

The oracle is torch's own math SDPA on float64 copies of the inputs, with autograd for the
gradients. The yardstick is torch's math SDPA at the call's dtype: on its trigger call a bug's
direction deviates from the oracle by more than 100 times what torch math does (or is non-finite),
the directions before it do not; on its quiet call, and for :func:`correct_flash` on every call,
each direction is as close to the oracle as torch math is (within 4x, plus a small floor).
The last tests use the registered kernels as a probe ``primary``: through ``run_kernel`` and in one
training step of a model under ``probe(..., backward=True)``, every bug the probe's calling
convention lets through (all but the two GQA bugs, whose k/v it expands first) is caught and
``bug_none`` passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashprobe.kernels import get_kernel
from flashprobe.probing import probe
from flashprobe.probing.call import SdpaCall, run_kernel
from lab.mutants import (
    CONTRACT_MUTANTS,
    CORRECT,
    CORRECT_CONTRACTS,
    DIRECTIONS,
    MUTANTS,
    Case,
    Mutant,
    correct_flash,
    register_mutants,
)

#: the mutants with a small call that fires them (the others fire on fuzz cases: tests/fuzz/test_mutants.py)
BUGS: dict[str, Mutant] = {name: m for name, m in MUTANTS.items() if m.trigger is not None}

Results = dict[str, torch.Tensor]

#: how much worse than torch math a triggered bug must be
TRIGGER_FACTOR = 100.0
#: how much worse than torch math a quiet call (or the correct kernel) may be, plus a floor
QUIET_FACTOR = 4.0
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 2.0**-10, torch.float16: 2.0**-13}

CASES = [(name, "trigger", spec.trigger) for name, spec in BUGS.items()] + [
    (name, "quiet", spec.quiet) for name, spec in BUGS.items() if spec.quiet is not None
]


def _torch_math(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )


def _run(fn: Callable[..., torch.Tensor], case: Case, dtype: torch.dtype | None = None) -> Results:
    """Output and input gradients of one call (at ``dtype``: float64 copies of the inputs)."""
    q, k, v = case.tensors(requires_grad=True)
    kwargs = case.kwargs()
    grad_out = case.grad_out()
    if dtype is not None:
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        mask = kwargs["attn_mask"]
        if mask is not None and mask.is_floating_point():
            kwargs["attn_mask"] = mask.to(dtype)
        grad_out = grad_out.to(dtype)
    out = fn(q, k, v, **kwargs)
    assert out.shape == grad_out.shape and out.dtype == q.dtype
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return dict(zip(DIRECTIONS, (out.detach(), *grads), strict=True))


@functools.cache
def _oracle(case: Case) -> Results:
    return _run(_torch_math, case, torch.float64)


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``x`` from the float64 ``ref``; ``inf`` when ``x`` is not finite."""
    x = x.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@functools.cache
def _torch_errors(case: Case) -> dict[str, float]:
    ref, mine = _oracle(case), _run(_torch_math, case)
    return {d: _rel_err(mine[d], ref[d]) for d in DIRECTIONS}


def _errors(fn: Callable[..., torch.Tensor], case: Case) -> dict[str, float]:
    ref, mine = _oracle(case), _run(fn, case)
    return {d: _rel_err(mine[d], ref[d]) for d in DIRECTIONS}


def _quiet_bound(case: Case, direction: str) -> float:
    return QUIET_FACTOR * _torch_errors(case)[direction] + FLOOR[case.dtype]


def _fires(err: float, case: Case, direction: str) -> bool:
    return err > TRIGGER_FACTOR * max(_torch_errors(case)[direction], 1e-12)


def _table(errs: dict[str, float], case: Case) -> str:
    return ", ".join(f"{d}: {errs[d]:.2e} (torch math {_torch_errors(case)[d]:.2e})" for d in DIRECTIONS)


def test_at_least_14_bugs_of_all_four_directions() -> None:
    assert len(BUGS) >= 14
    assert {spec.direction for spec in BUGS.values()} == set(DIRECTIONS)
    for name, spec in BUGS.items():
        assert spec.name == name and spec.needs and spec.bug and callable(spec.fn)
        assert "Trigger" in (spec.fn.__doc__ or ""), f"{name}: the docstring must say when it fires"


@pytest.mark.parametrize("name", list(BUGS))
def test_bug_fires_on_its_trigger_case(name: str) -> None:
    spec: Mutant = BUGS[name]
    case = spec.trigger
    errs = _errors(spec.fn, case)
    assert _fires(errs[spec.direction], case, spec.direction), f"{name} did not fire: {_table(errs, case)}"
    earlier = DIRECTIONS[: DIRECTIONS.index(spec.direction)]
    for d in earlier:
        assert errs[d] <= _quiet_bound(case, d), (
            f"{name}: {d} is wrong before {spec.direction}: {_table(errs, case)}"
        )


@pytest.mark.parametrize("name", [name for name, spec in BUGS.items() if spec.quiet is not None])
def test_bug_is_quiet_on_its_quiet_case(name: str) -> None:
    spec = BUGS[name]
    case = spec.quiet
    assert case is not None
    errs = _errors(spec.fn, case)
    for d in DIRECTIONS:
        assert errs[d] <= _quiet_bound(case, d), f"{name} fired on its quiet case ({d}): {_table(errs, case)}"


@pytest.mark.parametrize(("name", "kind", "case"), CASES, ids=[f"{n}-{k}" for n, k, _ in CASES])
def test_correct_flash_matches_the_oracle(name: str, kind: str, case: Case) -> None:
    errs = _errors(correct_flash, case)
    for d in DIRECTIONS:
        assert errs[d] <= _quiet_bound(case, d), f"correct_flash on {name} {kind}: {d}: {_table(errs, case)}"


def test_trigger_cases_differ_from_quiet_cases_and_make_valid_calls() -> None:
    for name, spec in BUGS.items():
        trigger, quiet = spec.trigger, spec.quiet
        assert trigger != quiet, name
        for case in (trigger, quiet):
            if case is None:
                continue
            q, k, v = case.tensors()
            assert (q.shape, k.shape, v.shape) == tuple(case.shapes.values())
            assert q.dtype == case.dtype
            assert q.is_contiguous() == (case.layout == "bhnd")


def test_mask_sentinel_fires_only_on_fully_masked_rows() -> None:
    """The trigger's padded rows get the mean of the values; every other row is right."""
    case = BUGS["mask_sentinel"].trigger
    q, k, v = case.tensors()
    mask = case.attn_mask()
    assert mask is not None
    out = BUGS["mask_sentinel"].fn(q, k, v, attn_mask=mask)
    ref = _oracle(case)["out"]
    dead = ~mask.any(dim=-1)  # (B, 1, N_q)
    assert dead.any()
    dead = dead.expand(out.shape[:-1])
    torch.testing.assert_close(out[~dead].double(), ref[~dead], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[dead], v.mean(dim=-2, keepdim=True).expand_as(out)[dead])


def test_registered_kernels_are_the_bugs(make_qkv) -> None:
    registered = register_mutants()
    names = [f"bug_{name}" for name in MUTANTS] + ["bug_none"] + [f"ok_{name}" for name in CORRECT]
    others = [f"bug_{n}" for n in CONTRACT_MUTANTS] + [f"ok_{n}" for n in CORRECT_CONTRACTS]
    assert registered == names + others
    assert register_mutants() == registered  # overwrite=True: registering twice is fine
    for name in others:  # kernels of the other apis, each registered with its own
        fn, api = (
            (CONTRACT_MUTANTS[name[4:]].fn, CONTRACT_MUTANTS[name[4:]].api)
            if name.startswith("bug_")
            else CORRECT_CONTRACTS[name[3:]][:2]
        )
        kernel = get_kernel(name)
        assert kernel.api == api and getattr(kernel.fn, "__wrapped__", kernel.fn) is fn
    q, k, v = make_qkv(16, 16, 16)
    for name in names:
        kernel = get_kernel(name)
        if name.startswith("ok_"):
            fn = CORRECT[name.removeprefix("ok_")]
        else:
            fn = correct_flash if name == "bug_none" else MUTANTS[name.removeprefix("bug_")].fn
        assert kernel.fn is fn
        if name.startswith("bug_") and name != "bug_none" and name.removeprefix("bug_") not in BUGS:
            continue  # fires on fuzz-sized calls only (key tiles of 128, limited shapes)
        torch.testing.assert_close(
            kernel(q, k, v, is_causal=True), fn(q, k, v, is_causal=True), equal_nan=True
        )


@pytest.mark.parametrize("name", list(BUGS))
def test_bugs_fire_through_the_probes_run_kernel(name: str) -> None:
    """As a probe ``primary``: the kernel gets what :func:`run_kernel` makes of the model's call.

    GQA bugs can only fire where the kernel sees un-expanded key/value heads; ``run_kernel``
    repeats them first (``expand_kv``), so those bugs are skipped when they stay quiet there.
    """
    register_mutants()
    spec = BUGS[name]
    case = spec.trigger

    def through_probe(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        call = SdpaCall(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return run_kernel(get_kernel(f"bug_{name}"), call)

    errs = _errors(through_probe, case)
    fired = _fires(errs[spec.direction], case, spec.direction)
    if not fired and case.h_kv is not None and case.h_kv < case.h:
        pytest.skip(f"{name}: run_kernel passes GQA-expanded k/v, so the kernel never sees H_kv < H")
    assert fired, f"{name} did not fire through run_kernel: {_table(errs, case)}"
    assert errs == _errors(spec.fn, case)


class _OneCall(nn.Module):
    """A model making one case's SDPA call from its parameters, in the case's layout (the
    ``(B, N, H, D)`` parameters transposed, as models make their heads; made contiguous for
    ``bhnd``), with GQA key/value heads passed un-expanded under ``enable_gqa``."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.qkv = nn.ParameterList([nn.Parameter(t.transpose(1, 2).contiguous()) for t in case.tensors()])

    def forward(self) -> torch.Tensor:
        q, k, v = (p.transpose(1, 2) for p in self.qkv)
        if self.case.layout == "bhnd":
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **self.case.kwargs())


#: a direction fails in the probe when its error ratio (primary vs golden over baseline vs golden)
#: exceeds this, or its primary has non-finite values; it passes at most at ``PROBE_PASS``
PROBE_FAIL, PROBE_PASS = 100.0, 8.0


def _probe_ratios(primary: str, case: Case) -> dict[str, float]:
    """One training step of :class:`_OneCall` under ``probe(primary=..., backward=True)``: each
    direction's error ratio, ``inf`` where the primary was non-finite."""
    model = _OneCall(case)
    with probe(model, primary=primary, backward=True) as p:
        out = model()
        (out.float() * case.grad_out().float()).sum().backward()
    (site,) = p.stats().values()
    ratios = {}
    for d in DIRECTIONS:
        stats = site["forward"]["out"] if d == "out" else site["backward"][d]
        ratios[d] = float("inf") if stats["primary_golden"]["nonfinite"] else stats["error_ratio"]
    return ratios


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", list(BUGS))
def test_probe_catches_each_bug_in_a_training_step_and_passes_the_correct_kernel(name: str) -> None:
    register_mutants()
    spec = BUGS[name]
    case = spec.trigger
    ratios = _probe_ratios(f"bug_{name}", case)
    fired = ratios[spec.direction] > PROBE_FAIL
    if not fired and case.h_kv is not None and case.h_kv < case.h:
        pytest.skip(f"{name}: run_kernel passes GQA-expanded k/v, so the kernel never sees H_kv < H")
    assert fired, f"the probe missed {name}: {ratios}"
    for d in DIRECTIONS[: DIRECTIONS.index(spec.direction)]:
        assert ratios[d] <= PROBE_PASS, f"{name}: the probe failed {d} before {spec.direction}: {ratios}"
    correct = _probe_ratios("bug_none", case)
    assert max(correct.values()) <= PROBE_PASS, f"the probe failed the correct kernel: {correct}"
