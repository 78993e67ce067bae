"""The probe never changes training: bit-identical outputs, gradients, weights and RNG state."""

from __future__ import annotations

import pytest
import torch

from flashprobe.probing import ProbeWarning, probe, use_kernel

from ._models import TinyTransformer, train


def _assert_identical(a: dict[str, list], b: dict[str, list]) -> None:
    for step, (x, y) in enumerate(zip(a["outputs"], b["outputs"], strict=True)):
        assert torch.equal(x, y), f"output differs at step {step}"
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        for i, (x, y) in enumerate(zip(ga, gb, strict=True)):
            assert x.dtype == y.dtype and torch.equal(x, y), f"grad {i} differs at step {step}"
    for i, (x, y) in enumerate(zip(a["weights"], b["weights"], strict=True)):
        assert torch.equal(x, y), f"weight {i} differs after training"
    assert torch.equal(a["rng"][0], b["rng"][0]), "the probe consumed random numbers"


def _fresh(**kwargs) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(**kwargs)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast-bf16"])
def test_training_is_bit_identical_with_probe(autocast: bool) -> None:
    plain = train(_fresh(), autocast=autocast)
    model = _fresh()
    with probe(model, golden=True, backward=True) as p:
        probed = train(model, autocast=autocast)
    _assert_identical(plain, probed)
    stats = p.stats()
    # It did compare something at every site, forward and backward.
    assert set(stats) == {"encoder.self_attn", "block"}
    for site, entry in stats.items():
        assert entry["forward"]["calls"] == 3, site
        assert entry["backward"]["calls"] == 3, site
        assert entry["forward"]["out"]["primary_golden"]["max_abs"] > 0, site
    if autocast:  # the shadow ran at the dtype the primary computed in: bf16-sized deviations
        assert stats["block"]["forward"]["out"]["baseline_golden"]["max_abs"] > 1e-4
    else:  # fp32: the GQA block's gradients (dk, dv summed over query groups) agree closely
        for grad in ("dq", "dk", "dv"):
            assert 0 < stats["block"]["backward"][grad]["primary_golden"]["max_abs"] < 1e-5, grad


def test_training_is_bit_identical_with_attention_dropout() -> None:
    plain = train(_fresh(attn_dropout=0.2))
    model = _fresh(attn_dropout=0.2)
    with pytest.warns(ProbeWarning, match="dropout"), probe(model, backward=True) as p:
        probed = train(model)
    _assert_identical(plain, probed)
    stats = p.stats()
    assert stats["encoder.self_attn"]["dropout_calls"] == 3
    # The dropout-free primary was compared: a real, small deviation, forward only.
    out = stats["encoder.self_attn"]["forward"]["out"]
    assert out["primary_baseline"]["numel"] == 3 * 2 * 4 * 6 * 4
    assert 0 <= out["primary_golden"]["max_abs"] < 1e-5
    assert stats["encoder.self_attn"]["backward"]["calls"] == 0


def test_probe_over_a_routed_model_keeps_the_routed_kernel() -> None:
    routed = _fresh()
    with use_kernel(routed, "tiled:block_q=4,block_k=4"):
        plain = train(routed)
    model = _fresh()
    with use_kernel(model, "tiled:block_q=4,block_k=4"), probe(model, backward=True) as p:
        probed = train(model)
    _assert_identical(plain, probed)
    assert p.stats()["block"]["backward"]["calls"] == 3
