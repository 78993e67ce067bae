"""Properties that keep their point: every case fitted inside a kernel's limits still exhibits its
property (the calls are inspected), masks only where a property needs one, random samples inside the
declared limits, and the capabilities that say so (one mask shared by every head, contiguous inputs
only, a length rule that depends on the call).

Oracles: each property read off the fitted call by code written here, apart from the fuzzer's own
check (:data:`ORACLES`: valid keys, logits, strides and storage recomputed from the tensors); kernels
whose one bug is known by construction (:mod:`lab.mutants`: the padding mask ignored in the last key
tile) against the same kernel without it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from flashprobe import register_kernel
from flashprobe.fuzz import CATALOGUE, CaseInputs, run_catalogue, select_cases
from flashprobe.fuzz.fit import NotApplicableError, fit_inputs
from flashprobe.fuzz.random_cases import make_random_case, sample_random_spec, shared_limits
from flashprobe.fuzz.tables import property_coverage
from flashprobe.kernels import KernelCapabilities, get_kernel, unregister_kernel
from lab.mutants import TRITON_LIKE, TRITON_LIKE_64, blockwise_64, blockwise_attention, tail_tile_mask

#: the limits the fitted calls are inspected under: key tiles of 64 and 128, and kernels without a
#: mask input (FlagAttention's: causal calls N_q = N_k only; one with lengths multiples of 64)
NO_MASK = KernelCapabilities(
    masks=frozenset({"causal"}), causal_cross=False, head_dims=frozenset({16, 32, 64, 128}), gqa="native"
)
LIMITS = {
    "seq_multiple 64": TRITON_LIKE_64,
    "seq_multiple 128": TRITON_LIKE,
    "no mask input": NO_MASK,
    "no mask input, seq_multiple 64": KernelCapabilities(
        masks=frozenset({"causal"}), seq_multiple=64, head_dims=frozenset({16, 32, 64, 128})
    ),
}


def _valid(x: CaseInputs) -> torch.Tensor:
    """``(B, H, N_q, N_k)`` bool: where a query may attend to a key (causal top-left, the mask)."""
    b, h, n_q, _ = x.q.shape
    n_k = x.k.shape[2]
    valid = torch.ones(b, h, n_q, n_k, dtype=torch.bool)
    if x.is_causal:
        valid &= torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None]
    if x.attn_mask is not None:
        valid &= x.attn_mask if x.attn_mask.dtype == torch.bool else x.attn_mask > -math.inf
    return valid


def _keep(x: CaseInputs) -> torch.Tensor | None:
    m = x.attn_mask
    return None if m is None else (m if m.dtype == torch.bool else m > -math.inf)


def _scores(x: CaseInputs, *, scaled: bool = True) -> torch.Tensor:
    """Float64 ``q·kᵀ`` (scaled), GQA heads repeated, invalid keys at −inf."""
    k = x.k.double().repeat_interleave(x.q.shape[1] // x.k.shape[1], dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", x.q.double(), k)
    if scaled:
        s = s * (1 / math.sqrt(x.q.shape[-1]) if x.scale is None else x.scale)
    return s.masked_fill(~_valid(x), -math.inf)


def _rows_below(x: CaseInputs, level: float, *, scaled: bool = True) -> bool:
    s, seen = _scores(x, scaled=scaled), _valid(x).any(-1)
    return bool(((s.amax(-1) < level) & seen).any())


def _partial(x: CaseInputs, caps: KernelCapabilities) -> bool:
    """Some key tile of the kernel is partial: a length off its multiple, a head dim that is not a
    power of two, or a padding mask that cuts the last key tile (a row sees a key there, not the last)."""
    n_q, n_k, d = x.q.shape[2], x.k.shape[2], x.q.shape[3]
    tiles = [caps.seq_multiple] if caps.seq_multiple > 1 else [64, 128]
    if any(n % t for n in (n_q, n_k) for t in tiles) or d & (d - 1):
        return True
    keep = _keep(x)
    if keep is None:
        return False
    keep = keep.expand(*keep.shape[:-1], n_k)
    return any(bool((keep[..., (n_k - 1) // t * t :].any(-1) & ~keep[..., -1]).any()) for t in tiles)


def _poisoned(x: CaseInputs) -> bool:
    """The storage around q holds values that are not in the view (NaN, Inf or huge)."""
    storage = torch.empty(0, dtype=x.q.dtype).set_(x.q.untyped_storage())
    outside = storage.numel() - x.q.numel()
    huge = float(torch.finfo(x.q.dtype).max) / 4
    return outside > 0 and bool((~torch.isfinite(storage) | (storage.abs() > huge)).sum() > 0)


#: property → does the call exhibit it (written apart from flashprobe.fuzz.fit.EXHIBITS)
ORACLES: dict[str, Callable[[CaseInputs, KernelCapabilities], bool]] = {
    "sentinel": lambda x, c: _rows_below(x, -1e4),
    "raw sentinel": lambda x, c: _rows_below(x, -5e4, scaled=False),
    "large logits": lambda x, c: bool(_scores(x).nan_to_num(0, 0, 0).abs().max() >= 1e4),
    "qk overflow": lambda x, c: bool(_scores(x, scaled=False).nan_to_num(0, 0, 0).abs().max() > 65504),
    "extreme scale": lambda x, c: x.scale is not None and (0 < x.scale <= 2**-14 or x.scale >= 2**12),
    "scale zero": lambda x, c: x.scale == 0.0,
    "fully masked row": lambda x, c: bool((_valid(x).sum(-1) == 0).any()),
    "one valid key": lambda x, c: bool((_valid(x).sum(-1) == 1).any()),
    "key padding": lambda x, c: _keep(x) is not None and _keep(x).shape[1:3] == (1, 1) and not _keep(x).all(),
    "left padding": lambda x, c: _keep(x) is not None and bool((~_keep(x)[..., 0] & _keep(x).any(-1)).any()),
    "additive mask": lambda x, c: x.attn_mask is not None and x.attn_mask.is_floating_point(),
    "causal": lambda x, c: x.is_causal,
    "causal N_q ≠ N_k": lambda x, c: x.is_causal and x.q.shape[2] != x.k.shape[2],
    "partial tile": _partial,
    "decode": lambda x, c: x.q.shape[2] == 1,
    "single key": lambda x, c: bool((_valid(x).sum(-1) <= 1).all() and (_valid(x).sum(-1) == 1).any()),
    "rescaling": lambda x, c: bool((_scores(x)[..., 64:].amax(-1) > _scores(x)[..., :64].amax(-1) + 1).any()),
    "outliers": lambda x, c: bool(x.v.abs().amax((0, 1, 2)).max() > 100 * x.v.abs().median()),
    "GQA": lambda x, c: x.k.shape[1] < x.q.shape[1],
    "strided inputs": lambda x, c: any(not t.is_contiguous() or t.storage_offset() for t in (x.q, x.k, x.v)),
    "head dim > 128": lambda x, c: x.q.shape[-1] > 128,
    "D_v ≠ D": lambda x, c: x.v.shape[-1] != x.q.shape[-1],
    "long context": lambda x, c: bool(_valid(x).sum(-1).max() > 4096),
    "large grid": lambda x, c: x.q.shape[0] * x.q.shape[1] > 1024,
    "poisoned memory": lambda x, c: _poisoned(x),
    "NaN inputs": lambda x, c: any(bool(torch.isnan(t).any()) for t in (x.q, x.k, x.v)),
    "large offsets": lambda x, c: max(t.numel() for t in (x.q, x.k, x.v)) > 2**24,
    "signed bias": lambda x, c: x.q.shape[0] * x.q.shape[1] >= 256,
}
#: properties of the output gradient, not of the call (the fitted call keeps the case's form)
GRADIENT_PROPERTIES = {"output-gradient layout", "output-gradient magnitude"}
#: the default profile's cases the inspection builds (the 2^24-element case: its size only)
CASES = [c for c in select_cases() if c.name != "offsets_2e24"]


def test_every_property_has_an_oracle_here():
    from flashprobe.fuzz import PROPERTIES

    assert set(PROPERTIES) == set(ORACLES) | GRADIENT_PROPERTIES


@pytest.mark.parametrize("limits", list(LIMITS))
def test_every_fitted_call_exhibits_its_property(limits):
    """Each case posed to a kernel with these limits exhibits its property, or is not applicable
    with the reason; the other properties it tests are exhibited or reported lost."""
    caps = LIMITS[limits]
    applicable = 0
    for case in CASES:
        original = case.build(torch.float32, seed=0)
        try:
            fitted = fit_inputs(original, caps, fixed=case.fixed, properties=case.properties)
        except NotApplicableError as err:
            assert str(err), case.name
            continue
        applicable += 1
        x = fitted.inputs
        assert caps.call_problem(x.q, x.k, x.v, x.attn_mask, x.is_causal) is None, case.name
        for prop in case.properties:
            if prop in GRADIENT_PROPERTIES:
                assert case.grad, case.name
            elif prop == case.property:
                assert ORACLES[prop](x, caps), (limits, case.name, prop, fitted.changes)
            else:
                assert ORACLES[prop](x, caps) or prop in fitted.lost, (limits, case.name, prop)
    assert applicable >= len(CASES) // 2, limits


def test_a_kernel_without_a_mask_input_keeps_the_properties_that_need_none():
    """Sentinel, decode, long-context, poisoned-memory and NaN-input cases carry a key-padding mask
    their property does not need: a kernel without a mask gets the call without it."""
    for name in ("sentinel_5e4", "single_query", "long_context_8k", "poisoned_nan", "nan_inputs", "mqa"):
        case = CATALOGUE[name]
        fitted = fit_inputs(case.build(torch.float32), NO_MASK, fixed=case.fixed, properties=case.properties)
        assert fitted.inputs.attn_mask is None and "mask dropped" in fitted.changes, name
    with pytest.raises(NotApplicableError, match="does not support attn_mask"):  # its property needs it
        case = CATALOGUE["padding_mask"]
        fit_inputs(case.build(torch.float32), NO_MASK, fixed=case.fixed, properties=case.properties)


def test_a_partial_tile_stays_partial_at_the_kernels_multiple_or_is_not_applicable():
    keys = CATALOGUE["keys_mod128_64"]  # N_k = 320: whole tiles of 64
    fitted = fit_inputs(
        keys.build(torch.float32), TRITON_LIKE_64, fixed=keys.fixed, properties=keys.properties
    )
    keep = fitted.inputs.attn_mask.expand(-1, -1, -1, 320)
    assert keep[..., :288].all() and not keep[..., 288:].any()  # the mask cuts the last tile of 64
    no_mask = LIMITS["no mask input, seq_multiple 64"]
    with pytest.raises(NotApplicableError, match="has no partial tile"):
        fit_inputs(keys.build(torch.float32), no_mask, fixed=keys.fixed, properties=keys.properties)
    odd = CATALOGUE["odd_shapes"]  # N_k = 203: cut to 192 keys, the property gone
    with pytest.raises(NotApplicableError, match=r"N_k 203→192 .* has no partial tile"):
        fit_inputs(odd.build(torch.float32), no_mask, fixed=odd.fixed, properties=odd.properties)


def test_the_fitter_shrinks_a_call_where_nothing_can_hide_added_keys():
    rising = CATALOGUE["rising_max"]  # 517 keys: 576 would need a mask, so 512
    caps = LIMITS["no mask input, seq_multiple 64"]
    fitted = fit_inputs(rising.build(torch.float32), caps, properties=rising.properties)
    assert (
        fitted.inputs.k.shape[2] == 512 and fitted.inputs.q.shape[2] == 64 and "N_k 517→512" in fitted.changes
    )
    assert ORACLES["rescaling"](fitted.inputs, caps)


@pytest.fixture
def blockwise64():
    register_kernel("blockwise64", blockwise_64, capabilities=TRITON_LIKE_64, overwrite=True)
    register_kernel("tail_tile_mask", tail_tile_mask, capabilities=TRITON_LIKE_64, overwrite=True)
    yield
    unregister_kernel("blockwise64")
    unregister_kernel("tail_tile_mask")


@pytest.mark.slow
@pytest.mark.parametrize("limits", ["seq_multiple 64", "seq_multiple 128", "no mask input"])
def test_a_correct_kernel_tests_each_property_with_a_call_that_has_it(limits):
    """Issue 54's floor: every property reported tested for a correct blockwise kernel with these
    limits has a fitted call that exhibits it (the calls are inspected with this file's oracles), and
    the kernel passes them; every property not tested says why."""
    caps = LIMITS[limits]
    fn = blockwise_64 if caps.seq_multiple == 64 else blockwise_attention
    register_kernel("fitted_correct", fn, capabilities=caps, overwrite=True)
    try:
        results = run_catalogue(["fitted_correct"], ["fp32"], cases=CASES, backward=False)
    finally:
        unregister_kernel("fitted_correct")
    assert [(r.case, r.reason) for r in results if r.verdict == "fail"] == []
    cover = property_coverage(results)["fitted_correct"]
    tested = [p for p, e in cover.items() if e["status"] == "tested"]
    assert {"partial tile", "sentinel", "long context", "NaN inputs", "poisoned memory"} <= set(tested)
    if "key_padding" in caps.masks:
        assert {"key padding", "left padding"} <= set(tested)
    for prop in tested:
        exhibits = []
        for name in cover[prop]["cases"]:
            case = CATALOGUE[name]
            fitted = fit_inputs(case.build(torch.float32), caps, fixed=case.fixed, properties=case.properties)
            exhibits.append(prop in GRADIENT_PROPERTIES or ORACLES[prop](fitted.inputs, caps))
        assert any(exhibits), (limits, prop)
    assert all(e["reason"] for e in cover.values() if e["status"] != "tested")


def test_a_tail_tile_mask_bug_is_caught_by_the_partial_tile_property_over_twenty_seeds(blockwise64):
    partial = [c for c in CASES if c.property == "partial tile"]
    assert {c.name for c in partial} == {"odd_shapes", "keys_mod128_64"}
    for seed in range(20):
        rows = run_catalogue(
            ["tail_tile_mask", "blockwise64"], ["fp32"], cases=partial, seed=seed, backward=False
        )
        verdicts = {(r.kernel, r.case): r.verdict for r in rows}
        assert all(v == "fail" for (k, _), v in verdicts.items() if k == "tail_tile_mask"), (seed, verdicts)
        assert all(v == "pass" for (k, _), v in verdicts.items() if k == "blockwise64"), (seed, verdicts)


@pytest.mark.parametrize(
    "caps",
    [
        NO_MASK,  # FlagAttention: no mask, causal N_q = N_k only
        KernelCapabilities(
            masks=frozenset({"causal", "head_shared"}), max_head_dim=128, head_dim_multiple=16
        ),
        KernelCapabilities(masks=frozenset({"key_padding"}), same_length=True, contiguous=True),
    ],
    ids=["no-mask-causal-square", "head-shared-mask", "square-contiguous"],
)
def test_random_search_samples_only_calls_inside_the_declared_limits(caps):
    limits = shared_limits([caps, KernelCapabilities()])
    rng = random.Random(0)
    for _ in range(64):
        spec = sample_random_spec(rng, torch.float32, "default", limits)
        x = make_random_case(spec, torch.float32)
        fitted = fit_inputs(x, caps).inputs  # lengths' multiples only
        assert caps.call_problem(fitted.q, fitted.k, fitted.v, fitted.attn_mask, fitted.is_causal) is None, (
            spec
        )
        if x.is_causal and not caps.causal_cross:
            assert x.q.shape[2] == x.k.shape[2]


def test_capabilities_one_shared_mask_contiguous_only_and_a_length_rule_per_call():
    q = k = v = torch.zeros(2, 4, 128, 32)
    shared = KernelCapabilities(masks=frozenset({"head_shared"}))
    assert shared.call_problem(q, k, v, torch.ones(2, 1, 128, 128, dtype=torch.bool), False) is None
    assert "bool masks per head" in shared.call_problem(
        q, k, v, torch.ones(2, 4, 128, 128, dtype=torch.bool), False
    )
    contiguous = KernelCapabilities(contiguous=True)
    assert "contiguous q, k, v only" in contiguous.call_problem(
        q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None, False
    )
    rule = KernelCapabilities(seq_multiple=128, causal_seq_multiple=1)  # multiples of 128 without causal only
    x = torch.zeros(1, 1, 100, 32)
    assert rule.call_problem(x, x, x, None, True) is None
    assert "multiples of 128 without causal" in rule.call_problem(x, x, x, None, False)
    assert "lengths multiples of 128 without causal" in rule.describe_lengths()
    # the fitter follows the rule of the call: a causal case is posed as built, the others grown
    case = CATALOGUE["odd_shapes_causal"]
    assert fit_inputs(case.build(torch.float32), rule, properties=case.properties).changes == ""
    fitted = fit_inputs(CATALOGUE["odd_shapes"].build(torch.float32), rule, properties=("partial tile",))
    assert fitted.inputs.k.shape[2] == 256
    # per-head masks become head 0's for a kernel that takes one mask for every head
    case = CATALOGUE["fully_masked_rows"]
    fitted = fit_inputs(case.build(torch.float32), shared, properties=case.properties)
    assert fitted.inputs.attn_mask.shape[1] == 1 and ORACLES["fully masked row"](fitted.inputs, shared)
    # contiguous only: poisoned memory moves after each tensor
    case = CATALOGUE["poisoned_nan"]
    fitted = fit_inputs(case.build(torch.float32), contiguous, properties=case.properties).inputs
    assert fitted.q.is_contiguous() and fitted.poison == "nan_after" and _poisoned(fitted)


def test_layouts_give_k_and_v_different_strides_and_each_of_q_k_v_its_own():
    case = CATALOGUE["layout_kv_strides"].build(torch.float32)
    assert case.k.is_contiguous() and case.k.stride() != case.v.stride()
    mixed = CATALOGUE["layout_mixed"].build(torch.float32)
    assert len({(t.stride(), t.storage_offset()) for t in (mixed.q, mixed.k, mixed.v)}) == 3
    plain = mixed.with_layout("contiguous")
    for a, b in zip((plain.q, plain.k, plain.v), (mixed.q, mixed.k, mixed.v), strict=True):
        assert torch.equal(a, b)  # the same values
    assert get_kernel("sdpa_math").capabilities.call_problem(mixed.q, mixed.k, mixed.v, None, True) is None
