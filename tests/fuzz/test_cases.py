"""The catalogue and the random family: the inputs are what each case says they are.

Oracle: logits recomputed by hand in float64 from the cast inputs, and closed forms of the golden.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashprobe.fuzz import (
    CATALOGUE,
    SENTINELS,
    exact_logit_qk,
    make_random_case,
    references,
    run_catalogue,
    sample_random_spec,
    select_cases,
)

from ._helpers import case, logits64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_logits_are_exact_in_every_dtype(dtype):
    gen = torch.Generator().manual_seed(1)
    z = -6e4 + 8 * torch.rand(2, 3, 5, 37, generator=gen, dtype=torch.float64)
    q, k = exact_logit_qk(z, dtype, head_dim=16, c=16.0, scale=1.0)
    computed = torch.matmul(q, k.transpose(-2, -1))  # in the dtype itself
    assert torch.equal(computed.double(), z.to(dtype).double())


@pytest.mark.parametrize("key", ["5e4", "1e5", "halfmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sentinel_cases_put_every_valid_logit_below_the_sentinel(key, dtype):
    inputs = case(f"sentinel_{key}", dtype)
    logits = logits64(inputs)
    sentinel = SENTINELS[key](dtype)
    assert logits.max().item() < sentinel
    assert torch.isfinite(logits.to(dtype)).all()  # representable in the dtype
    valid = inputs.valid_keys()
    assert valid[0].all() and not valid[1].all()  # one batch unmasked, one with masked keys


def test_expected_semantics_of_cases_with_a_closed_form():
    """The golden of these cases equals a value computed by hand from v and the mask."""
    inputs = case("one_valid_key")
    index = inputs.attn_mask.double().argmax(-1)  # (B, H, N_q): the only valid key
    expected = torch.gather(inputs.v.double(), 2, index.unsqueeze(-1).expand(-1, -1, -1, inputs.v.shape[-1]))
    assert torch.equal(references(inputs).golden, expected)

    inputs = case("scale_zero_causal")
    v = inputs.v.double()
    cumulative_mean = v.cumsum(2) / torch.arange(1, v.shape[2] + 1, dtype=torch.float64).view(-1, 1)
    torch.testing.assert_close(references(inputs).golden, cumulative_mean, rtol=1e-12, atol=1e-12)

    inputs = case("padding_mask")  # batch 0 has length 0: every row of it is 0
    golden = references(inputs).golden
    assert torch.equal(golden[0], torch.zeros_like(golden[0])) and golden[1:].abs().amax(-1).min() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_samples_with_a_logit_level_have_exact_logits(dtype):
    rng = random.Random(11)
    specs = [s for s in (sample_random_spec(rng, dtype) for _ in range(100)) if s.level]
    assert len(specs) >= 10
    for spec in specs:
        inputs = make_random_case(spec, dtype)
        k, _ = inputs.reference_kv()
        in_dtype = torch.matmul(inputs.q, k.transpose(-2, -1))  # any summation order is exact
        assert torch.equal(in_dtype.double(), inputs.q.double() @ k.double().transpose(-2, -1))
        logits = logits64(inputs)
        assert logits.max() < 0.9 * spec.level  # every row sits at the level (×1 … ×1.1)
        assert torch.isfinite(logits.to(dtype)).all()


def test_sentinel_1e5_is_skipped_in_fp16_with_the_reason():
    (row,) = run_catalogue(["tiled"], ["fp16"], cases=select_cases(["sentinel_1e5"]))
    assert row.verdict == "skip"
    assert "fp16" in row.reason and "65504" in row.reason


def test_select_cases_patterns():
    assert [c.name for c in select_cases(["sentinel_5e4"])] == ["sentinel_5e4"]
    names = [c.name for c in select_cases(["*", "-sentinel_*", "!gqa_*"])]
    assert "gqa_broadcast" not in names and not any(n.startswith("sentinel_") for n in names)
    default = [c for c in CATALOGUE.values() if "default" in c.profiles]
    assert len(names) == len(default) - 5
    with pytest.raises(ValueError, match="matches no case"):
        select_cases(["no_such_case"])
