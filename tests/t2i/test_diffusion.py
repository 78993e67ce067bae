"""DDPM schedule, loss and DDIM sampler, checked against closed forms and oracle noise predictors."""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.t2i import GaussianDiffusion


def test_cosine_schedule_matches_closed_form() -> None:
    diffusion = GaussianDiffusion(1000, "cosine")
    a = diffusion.alphas_cumprod
    assert a.dtype == torch.float64 and a.shape == (1000,)
    assert (a[1:] < a[:-1]).all() and 0.999 < a[0] < 1 and a[-1] < 1e-4

    def f(t: float) -> float:  # Nichol & Dhariwal (2021), eq. 17
        return math.cos((t / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2

    assert a[499].item() == pytest.approx(f(500) / f(0), rel=1e-9)


def test_linear_schedule_matches_ddpm() -> None:
    a = GaussianDiffusion(1000, "linear").alphas_cumprod
    betas = [1e-4 + (0.02 - 1e-4) * i / 999 for i in range(1000)]
    assert a[999].item() == pytest.approx(math.prod(1 - b for b in betas), rel=1e-9)
    with pytest.raises(ValueError, match="unknown schedule 'quadratic'"):
        GaussianDiffusion(10, "quadratic")
    with pytest.raises(ValueError, match="unknown prediction 'x0'"):
        GaussianDiffusion(10, prediction="x0")


def test_q_sample_formula() -> None:
    diffusion = GaussianDiffusion(100)
    x0, noise = torch.rand(3, 3, 4, 4) * 2 - 1, torch.randn(3, 3, 4, 4)
    t = torch.tensor([0, 50, 99])
    xt = diffusion.q_sample(x0, t, noise)
    for i, ti in enumerate(t.tolist()):
        a = diffusion.alphas_cumprod[ti].item()
        torch.testing.assert_close(xt[i], math.sqrt(a) * x0[i] + math.sqrt(1 - a) * noise[i])


def _oracle(diffusion: GaussianDiffusion, targets: dict[int, torch.Tensor]):
    """A perfect ε (or v) predictor for a data set of one image per caption token ``tokens[:, 0]``."""

    def predict(x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        a = diffusion.alphas_cumprod[t].float().view(-1, 1, 1, 1)
        x0 = torch.stack([targets[int(k)] for k in tokens[:, 0]])
        eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
        return eps if diffusion.prediction == "epsilon" else a.sqrt() * eps - (1 - a).sqrt() * x0

    return predict


@pytest.mark.parametrize("prediction", ["epsilon", "v"])
def test_loss_is_zero_for_a_perfect_predictor(prediction: str) -> None:
    diffusion = GaussianDiffusion(1000, prediction=prediction)
    x0 = torch.rand(8, 3, 8, 8) * 2 - 1
    tokens = torch.arange(8)[:, None].expand(8, 12)
    oracle = _oracle(diffusion, dict(enumerate(x0)))
    torch.manual_seed(0)
    assert diffusion.training_loss(oracle, x0, tokens).item() < 1e-6


def test_loss_of_the_zero_predictor() -> None:
    x0 = torch.rand(256, 3, 8, 8) * 2 - 1  # uniform on [-1, 1]: E[x0²] = 1/3
    tokens = torch.zeros(256, 12, dtype=torch.long)

    def zero(x, t, c):
        return torch.zeros_like(x)

    eps = GaussianDiffusion(1000, prediction="epsilon")
    assert eps.training_loss(zero, x0, tokens, stratified=True).item() == pytest.approx(1.0, abs=0.02)
    # v = sqrt(ᾱ) ε − sqrt(1 − ᾱ) x0, so E[v²] = mean over t of ᾱ + (1 − ᾱ)/3
    v = GaussianDiffusion(1000, prediction="v")
    a = v.alphas_cumprod.mean().item()
    expected = a + (1 - a) / 3
    assert v.training_loss(zero, x0, tokens, stratified=True).item() == pytest.approx(expected, abs=0.02)


@pytest.mark.parametrize("prediction", ["epsilon", "v"])
def test_ddim_with_perfect_predictor_recovers_the_image_and_guidance_picks_the_caption(
    prediction: str,
) -> None:
    diffusion = GaussianDiffusion(1000, prediction=prediction)
    cat, dog = torch.rand(3, 8, 8) * 2 - 1, torch.rand(3, 8, 8) * 2 - 1
    oracle = _oracle(diffusion, {1: cat, 0: dog})  # token 0 is the "empty caption"
    tokens = torch.ones(2, 12, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    out = diffusion.sample(oracle, tokens, (3, 8, 8), steps=20, generator=g)
    assert out.shape == (2, 3, 8, 8)
    torch.testing.assert_close(out, cat.expand(2, -1, -1, -1), atol=1e-4, rtol=0)
    null = torch.zeros(12, dtype=torch.long)
    for scale, expected in ((1.0, cat), (0.0, dog)):  # w = 0: the unconditional prediction only
        out = diffusion.sample(oracle, tokens, (3, 8, 8), steps=20, guidance_scale=scale, null_tokens=null)
        torch.testing.assert_close(out, expected.expand(2, -1, -1, -1), atol=1e-4, rtol=0)
    ancestral = diffusion.sample(oracle, tokens, (3, 8, 8), steps=20, eta=1.0, generator=g)
    torch.testing.assert_close(ancestral, cat.expand(2, -1, -1, -1), atol=1e-3, rtol=0)


def test_sampler_range_seed_and_rng_isolation() -> None:
    diffusion = GaussianDiffusion(1000)

    def wild(x, t, c):  # a bad predictor: outputs must still be clamped to [-1, 1]
        return -5 * x

    tokens = torch.zeros(4, 12, dtype=torch.long)
    state = torch.get_rng_state()
    a = diffusion.sample(wild, tokens, (3, 8, 8), steps=5, generator=torch.Generator().manual_seed(1))
    b = diffusion.sample(wild, tokens, (3, 8, 8), steps=5, generator=torch.Generator().manual_seed(1))
    c = diffusion.sample(wild, tokens, (3, 8, 8), steps=5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(torch.get_rng_state(), state)  # sampling never consumes the global RNG
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= -1 and a.max() <= 1
    with pytest.raises(ValueError, match="needs null_tokens"):
        diffusion.sample(wild, tokens, (3, 8, 8), guidance_scale=2.0)
    with pytest.raises(ValueError, match=r"steps must be in \[1, 1000\]"):
        diffusion.sample(wild, tokens, (3, 8, 8), steps=0)


def test_training_loss_draws_from_the_global_rng() -> None:
    diffusion = GaussianDiffusion(1000)
    x0, tokens = torch.zeros(4, 3, 8, 8), torch.zeros(4, 12, dtype=torch.long)

    def model(x, t, c):
        return x * t.float().view(-1, 1, 1, 1) / 1000

    torch.manual_seed(5)
    first = diffusion.training_loss(model, x0, tokens)
    torch.manual_seed(5)
    again = diffusion.training_loss(model, x0, tokens)
    torch.manual_seed(6)
    other = diffusion.training_loss(model, x0, tokens)
    assert first.item() == again.item() != other.item()


def test_diffusion_and_module_default_to_the_same_prediction() -> None:
    import inspect

    from flashprobe.t2i import TextToImageModule

    module_default = inspect.signature(TextToImageModule).parameters["prediction"].default
    assert GaussianDiffusion().prediction == module_default == "v"
