"""The LightningModule that trains :class:`~flashprobe.t2i.model.TextToImageDiT` and samples from it.

Validation writes a grid of fixed captions to ``<run dir>/samples/step_XXXXXXX.png`` (also before the
first step), scored with :func:`~flashprobe.t2i.metrics.caption_agreement`. The ``attention`` kernel
is routed into the model (:func:`flashprobe.probing.use_kernel`) from the start of a Trainer stage
until ``teardown``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.optim import Optimizer

from flashprobe.kernels import get_kernel
from flashprobe.t2i.data import COLOURS, CaptionTokenizer, ShapeAttributes, describe, sample_attributes
from flashprobe.t2i.diffusion import GaussianDiffusion
from flashprobe.t2i.metrics import CaptionAgreement, caption_agreement
from flashprobe.t2i.model import DiTConfig, dit_small
from flashprobe.t2i.steps import batch_generator

__all__ = ["OptimizerFactory", "TextToImageModule", "default_sample_captions"]

log = logging.getLogger(__name__)

#: Builds the optimizer from the parameters, e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)``
#: (Hydra: ``_target_: torch.optim.AdamW`` with ``_partial_: true``).
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]


def default_sample_captions(n: int, seed: int = 0) -> list[str]:
    """``n`` captions for sample grids: shape colours in turn (each about ``n/6`` times), the other
    attributes drawn at random from ``seed``, so colour agreement is measured on every colour."""
    colours = list(COLOURS)
    drawn = sample_attributes(n, np.random.default_rng(seed))
    captions = []
    for i, a in enumerate(drawn):
        colour = colours[i % len(colours)]
        background = a.background if a.background != colour else a.colour
        captions.append(describe(ShapeAttributes(a.shape, colour, background, a.size, a.position)))
    return captions


class TextToImageModule(L.LightningModule):
    """Text-to-image diffusion training with a chosen attention kernel.

    Args:
        model: the denoiser ``model(x_t, t, tokens)`` (it predicts ε or v, see ``prediction``);
            default :func:`dit_small`.
        optimizer: builds the optimizer from the parameters; default AdamW, lr 2e-3, no weight decay.
        attention: kernel spec routed to every attention call of ``model`` (``None``: torch's
            default SDPA dispatch).
        num_timesteps: diffusion steps ``T``.
        noise_schedule: ``"cosine"`` or ``"linear"``.
        prediction: the model predicts the noise (``"epsilon"``) or the velocity (``"v"``).
        caption_dropout: probability of training on the empty caption (for guidance).
        guidance_scale: classifier-free guidance weight of the sampler (1 = off).
        num_sample_steps: DDIM steps of the sampler.
        sample_eta: 0 for deterministic DDIM, 1 for ancestral sampling.
        num_samples: images in each validation grid.
        sample_captions: captions of the grid (default :func:`default_sample_captions`).
        sample_seed: seed of the grid's starting noise and of the validation noise.
        warmup_steps: linear learning-rate warm-up steps (0 = none).
        noise_seed: seed of each batch's generator (:func:`~flashprobe.t2i.steps.batch_generator`);
            default: ``PL_GLOBAL_SEED``, else 0.
        tokenizer: caption tokenizer (default :class:`~flashprobe.t2i.data.CaptionTokenizer`).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: OptimizerFactory | None = None,
        attention: str | None = None,
        *,
        num_timesteps: int = 1000,
        noise_schedule: str = "cosine",
        prediction: str = "v",
        caption_dropout: float = 0.1,
        guidance_scale: float = 3.0,
        num_sample_steps: int = 50,
        sample_eta: float = 0.0,
        num_samples: int = 16,
        sample_captions: Sequence[str] | None = None,
        sample_seed: int = 0,
        warmup_steps: int = 50,
        noise_seed: int | None = None,
        tokenizer: CaptionTokenizer | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= caption_dropout < 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1), got {caption_dropout}")
        if guidance_scale != 1.0 and caption_dropout == 0.0:
            raise ValueError(
                f"guidance_scale={guidance_scale} needs a model trained on empty captions: "
                "set caption_dropout > 0 (e.g. 0.1) or guidance_scale=1"
            )
        if num_samples < 1 or num_sample_steps < 1 or warmup_steps < 0:
            raise ValueError(
                f"num_samples ({num_samples}) and num_sample_steps ({num_sample_steps}) must be positive, "
                f"warmup_steps ({warmup_steps}) non-negative"
            )
        if attention is not None:
            get_kernel(attention)  # fail now on a malformed spec or an unknown kernel
        self.save_hyperparameters(ignore=["model", "optimizer", "tokenizer"])
        self.model = model if model is not None else dit_small()
        self.optimizer_factory = optimizer
        self.attention = attention
        self.diffusion = GaussianDiffusion(num_timesteps, noise_schedule, prediction)
        self.tokenizer = tokenizer or CaptionTokenizer()
        captions = (
            list(sample_captions) if sample_captions is not None else default_sample_captions(num_samples)
        )
        self.sample_captions = captions[:num_samples]
        self.tokenizer.encode(self.sample_captions)  # fail now on words the tokenizer does not know
        #: ``(step, path, agreement)`` of every grid written during fit.
        self.sample_history: list[tuple[int, Path, CaptionAgreement]] = []
        self._kernel_handle: Any = None

    # ----------------------------------------------------------------- attention kernel
    def _route_attention(self) -> None:
        """Send every SDPA call inside ``self.model`` to the ``attention`` kernel (until unrouted),
        checked against the model's device and compute dtype."""
        if self.attention is None or self._kernel_handle is not None:
            return
        from flashprobe.probing import use_kernel

        self._kernel_handle = use_kernel(self.model, self.attention, dtype=self._compute_dtype())

    def unroute_attention(self) -> None:
        """Give torch's SDPA back to the model's attention (idempotent; also called when a fit raises,
        as Lightning then skips ``teardown``)."""
        if self._kernel_handle is not None:
            self._kernel_handle.detach()
            self._kernel_handle = None

    def _compute_dtype(self) -> torch.dtype:
        """The dtype attention runs in: the autocast dtype under mixed precision, else the weights'."""
        plugin = self._trainer.precision_plugin if self._trainer is not None else None
        if isinstance(plugin, MixedPrecision):
            return torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
        return next(self.model.parameters()).dtype

    @contextlib.contextmanager
    def _kernel_context(self) -> Iterator[None]:
        """The ``attention`` kernel for code run outside a Trainer stage (already routed inside)."""
        if self.attention is None or self._kernel_handle is not None:
            yield
            return
        self._route_attention()
        try:
            yield
        finally:
            self.unroute_attention()

    def on_fit_start(self) -> None:
        self._route_attention()  # here, not in setup: the model is on its device now

    def on_validation_start(self) -> None:
        self._route_attention()  # for Trainer.validate, test and predict (a no-op during fit)

    on_test_start = on_predict_start = on_validation_start

    def teardown(self, stage: str) -> None:
        self.unroute_attention()

    # ----------------------------------------------------------------- training
    def forward(self, x: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The model's ε or v ``(B, C, H, W)`` for ``x (B, C, H, W)`` at ``t (B,)``, ``tokens (B, L)``."""
        return self.model(x, t, tokens)

    def _batch_generator(self) -> torch.Generator:
        """The generator of the current training batch (see ``noise_seed``)."""
        seed = self.hparams.noise_seed
        if seed is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
        index = self.trainer.fit_loop.epoch_loop.total_batch_idx if self._trainer is not None else 0
        return batch_generator(seed, index, self.global_rank, self.device)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        tokens = batch["tokens"]
        generator = self._batch_generator()
        if self.hparams.caption_dropout > 0:
            drop = torch.rand(tokens.shape[0], device=tokens.device, generator=generator)
            drop = drop < self.hparams.caption_dropout
            tokens = torch.where(drop[:, None], self.tokenizer.pad_id, tokens)
        loss = self.diffusion.training_loss(self.model, batch["image"], tokens, generator=generator)
        self.log("train/loss", loss, prog_bar=True, batch_size=tokens.shape[0])
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        generator = torch.Generator(self.device).manual_seed(self.hparams.sample_seed + batch_idx)
        loss = self.diffusion.training_loss(
            self.model, batch["image"], batch["tokens"], generator=generator, stratified=True
        )
        self.log("val/loss", loss, prog_bar=True, batch_size=batch["tokens"].shape[0])
        return loss

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = (
            self.optimizer_factory(params)
            if self.optimizer_factory is not None
            else torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
        )
        if self.hparams.warmup_steps == 0:
            return optimizer
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------- sampling
    @torch.no_grad()
    def sample(
        self,
        captions: Sequence[str],
        *,
        steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Generate one image per caption with the ``attention`` kernel and the Trainer's precision.

        Args:
            captions: ``N`` captions in the dataset's vocabulary.
            steps: DDIM steps (default ``num_sample_steps``).
            guidance_scale: guidance weight (default ``guidance_scale``).
            seed: seed of the starting noise (default ``sample_seed``); the global RNG is untouched.

        Returns:
            Images ``(N, C, H, W)`` float32 in ``[-1, 1]``.
        """
        hp = self.hparams
        tokens = self.tokenizer.encode(list(captions)).to(self.device)
        null = torch.full((tokens.shape[1],), self.tokenizer.pad_id, dtype=torch.long, device=self.device)
        cfg = getattr(self.model, "config", None)
        if not isinstance(cfg, DiTConfig):
            raise TypeError(
                f"sample() needs the image size from model.config (a DiTConfig); {type(self.model).__name__} "
                "has none: build the model with flashprobe.t2i.TextToImageDiT or a DIT_MODELS preset"
            )
        shape = (cfg.in_channels, cfg.image_size, cfg.image_size)
        generator = torch.Generator("cpu").manual_seed(hp.sample_seed if seed is None else seed)
        precision = (
            self._trainer.precision_plugin.forward_context() if self._trainer else contextlib.nullcontext()
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with self._kernel_context(), precision:
                images = self.diffusion.sample(
                    self.model,
                    tokens,
                    shape,
                    steps=steps or hp.num_sample_steps,
                    guidance_scale=hp.guidance_scale if guidance_scale is None else guidance_scale,
                    null_tokens=null,
                    eta=hp.sample_eta,
                    generator=generator,
                    dtype=next(self.model.parameters()).dtype,
                )
        finally:
            self.model.train(was_training)
        return images

    def _write_samples(self) -> CaptionAgreement | None:
        """Sample the grid captions, save the PNG, log it; returns the agreement (rank zero only)."""
        run_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir)  # collective: every rank asks
        if not self.trainer.is_global_zero:
            return None
        from flashprobe.report.grid import save_sample_grid

        step = self.global_step
        images = self.sample(self.sample_captions)
        nonfinite = int((~torch.isfinite(images)).sum())
        agreement = caption_agreement(images, self.sample_captions)
        title = (
            f"step {step}: colour {agreement.colour:.0%}, background {agreement.background:.0%}, "
            f"position {agreement.position:.0%}"
        )
        if nonfinite:
            log.warning("step %d: %d non-finite pixels in the sample grid (drawn black)", step, nonfinite)
            title += f", {nonfinite} non-finite pixels"
        path = save_sample_grid(
            images, self.sample_captions, run_dir / "samples" / f"step_{step:07d}.png", title=title
        )
        self.sample_history.append((step, path, agreement))
        self._log_image(path, step)
        log.info("wrote %s (%s)", path, title)
        return agreement

    @rank_zero_only
    def _log_image(self, path: Path, step: int) -> None:
        for logger in self.loggers:
            log_image = getattr(logger, "log_image", None)  # WandbLogger (and a few others) only
            if callable(log_image):
                try:
                    log_image(key="samples", images=[str(path)], step=step)
                except Exception as err:  # a logger without images must not stop training
                    log.warning("could not log the sample grid to %s: %s", type(logger).__name__, err)

    def on_train_start(self) -> None:
        agreement = self._write_samples()
        if agreement is not None:  # self.log would attach it to the end of the first epoch
            metrics = {f"samples/{k}": float(v) for k, v in agreement.as_dict().items() if k != "count"}
            for logger in self.loggers:
                logger.log_metrics(metrics, step=self.global_step)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        agreement = self._write_samples()
        if agreement is not None:
            for key, value in agreement.as_dict().items():
                if key != "count":
                    self.log(f"samples/{key}", float(value), rank_zero_only=True)
