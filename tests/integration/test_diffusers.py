"""The probe on real diffusers model classes (UNet2DConditionModel with cross-attention, DiT,
PixArt), built from tiny random-init configs: every site found and named, training bit-identical,
and error ratios floored at the stated noise floor."""

from __future__ import annotations

import pytest
import torch

from flashprobe.bench import tiny_models as tiny
from flashprobe.deviation import error_ratio
from flashprobe.probing import probe

from ._training import assert_identical, train_steps

diffusers = pytest.importorskip("diffusers")


def test_unet_self_and_cross_attention_sites_and_bit_identical_training() -> None:
    plain = train_steps(tiny.unet(), tiny.unet_batch, tiny.sample)
    model = tiny.unet()
    with probe(model, backward=True) as p:
        probed = train_steps(model, tiny.unet_batch, tiny.sample)
    assert_identical(plain, probed)
    sites = p.sites
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn1" in sites  # self-attention
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn2" in sites  # cross-attention
    assert len(sites) == 8 and all(s.startswith(("down_blocks", "mid_block", "up_blocks")) for s in sites)
    summary = p.summary()
    assert summary.backward_calls == summary.forward_calls == 16 and summary.shadow_errors == 0


def test_unet_gradient_ratios_use_the_noise_floor() -> None:
    """Random-init UNet gradients are tiny (|dq| ~ 1e-11): each ratio is floored at ½·eps·max|golden|."""
    model = tiny.unet()
    with probe(model, backward=True) as p:
        train_steps(model, tiny.unet_batch, tiny.sample, steps=1)
    for site, entry in p.stats().items():
        for grad in ("dq", "dk", "dv"):
            d = entry["backward"][grad]
            assert d["noise_floor"] > 0, (site, grad)
            want = error_ratio(
                d["primary_golden"]["max_abs"], d["baseline_golden"]["max_abs"], floor=d["noise_floor"]
            )
            assert d["error_ratio"] == pytest.approx(want), (site, grad)
            assert d["max_call_error_ratio"] is not None and d["max_call_error_ratio"] < float("inf")


def test_dit_and_pixart_sites() -> None:
    dit, pixart = tiny.dit(), tiny.pixart()
    latents, t = torch.randn(2, 4, 8, 8), torch.tensor([1, 2])
    with probe(dit, backward=True) as p:
        dit(**tiny.dit_batch(0)).sample.sum().backward()
    assert p.sites == ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    assert p.summary().backward_calls == 2
    with probe(pixart) as p:
        pixart(
            hidden_states=latents,
            timestep=t,
            encoder_hidden_states=torch.randn(2, 5, 12),
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        )
    assert p.sites == [f"transformer_blocks.{i}.attn{j}" for i in (0, 1) for j in (1, 2)]


@pytest.mark.slow  # ~25 s of Dynamo tracing on 2 cores
def test_compiled_unet_matches_compiled_without_probe() -> None:
    torch._dynamo.reset()
    model = tiny.unet()
    plain = train_steps(model, tiny.unet_batch, tiny.sample, call=torch.compile(model, backend="eager"))
    torch._dynamo.reset()
    model = tiny.unet()
    compiled = torch.compile(model, backend="eager")
    with probe(compiled, backward=True) as p:
        probed = train_steps(model, tiny.unet_batch, tiny.sample, call=compiled)
    assert_identical(plain, probed)
    assert len(p.sites) == 8 and p.summary().backward_calls == 16
