"""Gaussian diffusion: the DDPM denoising loss and a DDIM sampler with classifier-free guidance.

Forward process ``x_t = sqrt(ᾱ_t) x_0 + sqrt(1 − ᾱ_t) ε`` over ``T`` steps with a cosine
(Nichol & Dhariwal 2021) or linear (Ho et al. 2020) ``β`` schedule. The model predicts either the
noise ``ε`` (``prediction="epsilon"``, DDPM) or the velocity ``v = sqrt(ᾱ_t) ε − sqrt(1 − ᾱ_t) x_0``
(``prediction="v"``, Salimans & Ho 2022), trained with the mean squared error; v weights the
high-noise steps, where the caption decides the layout, so a small model learns captions sooner.
Sampling runs DDIM (Song et al. 2021). The schedule is kept in float64, so half precision never
rounds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["GaussianDiffusion", "NoisePredictor"]

#: ``fn(x_t (B, C, H, W), t (B,), tokens (B, L)) -> (B, C, H, W)``: the predicted ε or v.
NoisePredictor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_SCHEDULES = ("cosine", "linear")
_PREDICTIONS = ("epsilon", "v")


class GaussianDiffusion:
    """DDPM schedule, loss and DDIM sampler.

    Args:
        num_timesteps: ``T``.
        schedule: ``"cosine"`` or ``"linear"``.
        prediction: what the model outputs, ``"v"`` (the velocity, default, as
            :class:`~flashprobe.t2i.TextToImageModule`) or ``"epsilon"`` (the noise).
    """

    def __init__(self, num_timesteps: int = 1000, schedule: str = "cosine", prediction: str = "v") -> None:
        if num_timesteps < 2:
            raise ValueError(f"num_timesteps must be at least 2, got {num_timesteps}")
        if schedule not in _SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(_SCHEDULES)}")
        if prediction not in _PREDICTIONS:
            raise ValueError(f"unknown prediction {prediction!r}; choose one of: {', '.join(_PREDICTIONS)}")
        self.num_timesteps = num_timesteps
        self.schedule = schedule
        self.prediction = prediction
        steps = torch.arange(num_timesteps + 1, dtype=torch.float64)
        if schedule == "cosine":
            f = torch.cos((steps / num_timesteps + 0.008) / 1.008 * math.pi / 2) ** 2
            betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
        else:
            scale = 1000 / num_timesteps  # Ho et al.'s range, for T = 1000
            betas = torch.linspace(1e-4 * scale, 0.02 * scale, num_timesteps, dtype=torch.float64)
        #: ``ᾱ_t`` for ``t = 0 … T−1``, float64.
        self.alphas_cumprod = torch.cumprod(1 - betas, dim=0)

    def __repr__(self) -> str:
        return (
            f"GaussianDiffusion(num_timesteps={self.num_timesteps}, schedule={self.schedule!r}, "
            f"prediction={self.prediction!r})"
        )

    def _alpha_bar(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``ᾱ_t`` for ``t (B,)`` as ``(B, 1, 1, 1)`` float32 on ``like``'s device."""
        return self.alphas_cumprod[t.cpu()].to(like.device, torch.float32).view(-1, 1, 1, 1)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Noisy images ``x_t`` ``(B, C, H, W)`` from clean ``x0`` and ``noise`` (same shape), ``t (B,)``."""
        a = self._alpha_bar(t, x0)
        return (a.sqrt() * x0.float() + (1 - a).sqrt() * noise.float()).to(x0.dtype)

    def training_loss(
        self,
        model: NoisePredictor,
        x0: torch.Tensor,
        tokens: torch.Tensor,
        generator: torch.Generator | None = None,
        stratified: bool = False,
    ) -> torch.Tensor:
        """MSE of the model's ε (or v) prediction at random timesteps.

        Args:
            model: the ε (or v) predictor.
            x0: clean images ``(B, C, H, W)`` in ``[-1, 1]``.
            tokens: caption tokens ``(B, L)``.
            generator: source of timesteps and noise (default: torch's global RNG).
            stratified: spread the timesteps evenly over ``[0, T)`` (a random offset each call)
                instead of drawing them independently; lowers the variance of validation losses.

        Returns:
            The scalar float32 loss.
        """
        b = x0.shape[0]
        if stratified:
            offset = torch.rand((), generator=generator, device=x0.device, dtype=torch.float64)
            t = ((torch.arange(b, device=x0.device) + offset) * self.num_timesteps / b).long()
        else:
            t = torch.randint(0, self.num_timesteps, (b,), device=x0.device, generator=generator)
        noise = torch.randn(x0.shape, device=x0.device, dtype=x0.dtype, generator=generator)
        out = model(self.q_sample(x0, t, noise), t, tokens)
        return torch.nn.functional.mse_loss(out.float(), self.target(x0, t, noise))

    def target(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """What the model should output for ``x_t = q_sample(x0, t, noise)``: ε or v, float32."""
        if self.prediction == "epsilon":
            return noise.float()
        a = self._alpha_bar(t, x0)
        return a.sqrt() * noise.float() - (1 - a).sqrt() * x0.float()

    @torch.no_grad()
    def sample(
        self,
        model: NoisePredictor,
        tokens: torch.Tensor,
        shape: tuple[int, int, int],
        *,
        steps: int = 50,
        guidance_scale: float = 1.0,
        null_tokens: torch.Tensor | None = None,
        eta: float = 0.0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Generate images for captions with DDIM and optional classifier-free guidance.

        Args:
            model: the ε (or v) predictor.
            tokens: caption tokens ``(B, L)``.
            shape: ``(C, H, W)`` of one image.
            steps: number of denoising steps (at most ``T``).
            guidance_scale: ``w`` in ``eps = eps_null + w (eps_cond − eps_null)``; ``1`` turns
                guidance off (one model call per step instead of two).
            null_tokens: ``(L,)`` tokens of the empty caption (needed when ``w != 1``).
            eta: 0 for deterministic DDIM, 1 for DDPM-like ancestral noise.
            generator: source of the starting noise (and of the ancestral noise).
            dtype: dtype of the images fed to the model.

        Returns:
            Images ``(B, C, H, W)`` float32, clamped to ``[-1, 1]``.
        """
        if not 1 <= steps <= self.num_timesteps:
            raise ValueError(f"steps must be in [1, {self.num_timesteps}], got {steps}")
        guided = guidance_scale != 1.0
        if guided and null_tokens is None:
            raise ValueError("classifier-free guidance (guidance_scale != 1) needs null_tokens")
        b, device = tokens.shape[0], tokens.device
        noise_device = generator.device if generator else device
        x = torch.randn((b, *shape), generator=generator, device=noise_device, dtype=torch.float32).to(device)
        if guided:
            tokens = torch.cat([tokens, null_tokens.to(device).expand(b, -1)])  # type: ignore[union-attr]
        times = torch.linspace(self.num_timesteps - 1, 0, steps, dtype=torch.float64).round().long().tolist()
        for i, t in enumerate(times):
            t_prev = times[i + 1] if i + 1 < steps else -1
            x_in = torch.cat([x, x]) if guided else x
            t_in = torch.full((x_in.shape[0],), t, device=device, dtype=torch.long)
            out = model(x_in.to(dtype), t_in, tokens).float()
            if guided:
                cond, null = out.chunk(2)
                out = null + guidance_scale * (cond - null)
            a = self.alphas_cumprod[t].item()
            a_prev = self.alphas_cumprod[t_prev].item() if t_prev >= 0 else 1.0
            if self.prediction == "epsilon":
                x0 = (x - math.sqrt(1 - a) * out) / math.sqrt(a)
            else:  # x_0 = sqrt(ᾱ) x_t − sqrt(1 − ᾱ) v
                x0 = math.sqrt(a) * x - math.sqrt(1 - a) * out
            x0 = x0.clamp(-1, 1)
            eps = (x - math.sqrt(a) * x0) / math.sqrt(1 - a)  # consistent with the clamped x0
            sigma = eta * math.sqrt((1 - a_prev) / (1 - a) * (1 - a / a_prev))
            x = math.sqrt(a_prev) * x0 + math.sqrt(max(1 - a_prev - sigma**2, 0.0)) * eps
            if sigma > 0 and t_prev >= 0:
                noise = torch.randn(x.shape, generator=generator, device=noise_device, dtype=torch.float32)
                x = x + sigma * noise.to(device)
        return x.clamp(-1, 1)
