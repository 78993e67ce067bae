"""The text-to-image LightningModule in real Trainer runs: learning, reproducibility, precision, kernels."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, Logger
from matplotlib.image import imread

from flashprobe.kernels import KernelSpecError, KernelUnavailableError, math_attention, register_kernel
from flashprobe.t2i import ShapesDataModule, TextToImageModule, dit_tiny, trainer_precision

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*does not have many workers:UserWarning",
    "ignore:.*LeafSpec.*is deprecated",
    "ignore:.*smaller than the logging interval",
)

SIZE = 16  # 16×16 images in 4×4 patches: 16 patch tokens, a few ms per step


def make_module(**kwargs: Any) -> TextToImageModule:
    defaults: dict[str, Any] = {
        "optimizer": partial(torch.optim.AdamW, lr=3e-3),
        "num_samples": 4,
        "num_sample_steps": 4,
    }
    return TextToImageModule(dit_tiny(image_size=SIZE, patch_size=4), **{**defaults, **kwargs})


def fit(
    root: Path,
    *,
    seed: int = 0,
    steps: int = 6,
    val_every: int | None = None,
    module: TextToImageModule | None = None,
    logger: Logger | None = None,
    **trainer_kwargs: Any,
) -> tuple[TextToImageModule, L.Trainer]:
    L.seed_everything(seed, workers=True, verbose=False)
    dm = ShapesDataModule(num_train=128, num_val=32, image_size=SIZE, batch_size=16, seed=0)
    module = module or make_module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=root,
        logger=logger or CSVLogger(root, name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        check_val_every_n_epoch=None,
        val_check_interval=val_every or steps,
        limit_val_batches=1.0 if val_every else 0,
        **trainer_kwargs,
    )
    trainer.fit(module, dm)
    return module, trainer


def test_training_lowers_the_loss_and_writes_sample_grids(tmp_path: Path) -> None:
    dm = ShapesDataModule(num_train=128, num_val=32, image_size=SIZE, batch_size=16, seed=0)
    module = make_module()
    before = L.Trainer(
        accelerator="cpu",
        logger=False,
        default_root_dir=tmp_path / "before",
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loss_before = before.validate(module, dm, verbose=False)[0]["val/loss"]
    assert (tmp_path / "before" / "samples" / "step_0000000.png").is_file()  # validate writes a grid too
    run = tmp_path / "run"
    module, trainer = fit(run, module=module, steps=60, val_every=30)
    loss_after = trainer.callback_metrics["val/loss"].item()
    # the zero-initialised model outputs 0, so the loss is E[v²] = E[ᾱ] + (1 − E[ᾱ]) E[x0²]
    dm.setup("validate")
    mean_alpha = module.diffusion.alphas_cumprod.mean().item()
    expected = mean_alpha + (1 - mean_alpha) * dm.val_set.images.pow(2).mean().item()
    assert loss_before == pytest.approx(expected, abs=0.1)
    assert loss_after < 0.85 * loss_before  # v's floor is high: at high noise x0 is unknowable
    assert [step for step, _, _ in module.sample_history] == [0, 0, 30, 60]
    for step in (0, 30, 60):
        png = imread(run / "samples" / f"step_{step:07d}.png")
        assert png.ndim == 3 and png.shape[0] > 100
    assert not list((run / "samples").glob("*.tmp"))
    logged = (run / "metrics.csv").read_text()
    assert "samples/colour" in logged and "train/loss" in logged
    assert 0 <= trainer.callback_metrics["samples/colour"].item() <= 1


@pytest.fixture
def restore_determinism():
    """``Trainer(deterministic=True)`` switches torch's deterministic mode on for the process."""
    enabled = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(enabled)


@pytest.mark.usefixtures("restore_determinism")
def test_same_seed_gives_identical_weights_other_seed_does_not(tmp_path: Path) -> None:
    runs = [
        fit(tmp_path / f"run{i}", seed=seed, steps=6, val_every=3, deterministic=True)[0]
        for i, seed in enumerate((7, 7, 8))
    ]
    a, b, c = (r.model.state_dict() for r in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert any(
        not torch.equal(a[k], dit_tiny(image_size=SIZE, patch_size=4).state_dict()[k]) for k in a
    )  # it trained


def _sdpa_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append(q.dtype)
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize(
    ("precision", "attention_dtype", "weight_dtype"),
    [
        ("32-true", torch.float32, torch.float32),
        ("bf16-mixed", torch.bfloat16, torch.float32),
        ("16-mixed", torch.float16, torch.float32),  # through trainer_precision's CPU plugin
        ("bf16-true", torch.bfloat16, torch.bfloat16),
    ],
)
def test_precisions_on_cpu(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    precision: str,
    attention_dtype: torch.dtype,
    weight_dtype: torch.dtype,
) -> None:
    seen = _sdpa_dtypes(monkeypatch)
    module, trainer = fit(tmp_path, steps=4, **trainer_precision(precision, "cpu"))
    assert seen and set(seen) == {attention_dtype}  # training and the step-0 samples
    params = list(module.model.parameters())
    assert {p.dtype for p in params} == {weight_dtype}
    assert all(torch.isfinite(p).all() for p in params)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert module.sample_history[0][1].exists()


def test_lightning_turns_fp16_mixed_into_bf16_on_cpu() -> None:
    """Why :func:`trainer_precision` exists: plain ``precision="16-mixed"`` is not fp16 on CPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(accelerator="cpu", precision="16-mixed", logger=False)
    assert trainer.precision == "bf16-mixed"
    assert any("not supported on CPU" in str(w.message) for w in caught)
    assert trainer_precision("16-mixed", "gpu") == {"precision": "16-mixed"}
    assert trainer_precision(32) == {"precision": "32-true"}
    with pytest.raises(ValueError, match="unknown precision '8-mixed'"):
        trainer_precision("8-mixed")


@pytest.fixture
def counting_kernel() -> list[tuple[int, ...]]:
    """A registered kernel (``t2i_counting``) that records each call and runs the baseline."""
    calls: list[tuple[int, ...]] = []

    def t2i_counting(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        calls.append(tuple(q.shape))
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    register_kernel("t2i_counting", t2i_counting, overwrite=True)
    return calls


def test_attention_kernel_is_routed_during_fit_and_sampling(
    tmp_path: Path, counting_kernel: list[tuple[int, ...]]
) -> None:
    from flashprobe.probing.intercept import active_handles

    module, _ = fit(tmp_path, steps=2, module=make_module(attention="t2i_counting", guidance_scale=1.0))
    calls_per_forward = 1 + 2 * 2  # dit_tiny: one text block, two DiT blocks (self + cross)
    sampling = 4 * calls_per_forward  # 4 DDIM steps, no guidance
    assert len(counting_kernel) == sampling + 2 * calls_per_forward  # step-0 grid + 2 training steps
    assert not active_handles(module.model)  # detached at teardown

    x, t, tokens = torch.zeros(1, 3, SIZE, SIZE), torch.zeros(1), torch.ones(1, 12, dtype=torch.long)
    module.model(x, t, tokens)
    assert len(counting_kernel) == sampling + 2 * calls_per_forward  # torch's SDPA again
    module.sample(["a small red circle in the center on a blue background"])
    assert len(counting_kernel) == 2 * sampling + 2 * calls_per_forward  # sample() routes by itself
    assert not active_handles(module.model)


def test_unavailable_kernel_fails_at_fit_start_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KernelUnavailableError, match="CUDA"):
        fit(tmp_path, steps=1, module=make_module(attention="sdpa_efficient"))


def test_sample_outside_fit_is_seeded_and_leaves_the_global_rng_alone() -> None:
    module = make_module()
    torch.manual_seed(0)
    for p in module.model.parameters():  # a non-trivial model instead of the zero-output init
        torch.nn.init.normal_(p, std=0.05)
    captions = ["a small red circle in the center on a blue background"] * 2 + [
        "a large white square in the top left on a black background"
    ]
    state = torch.get_rng_state()
    a = module.sample(captions, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert a.shape == (3, 3, SIZE, SIZE) and a.dtype == torch.float32
    assert a.min() >= -1 and a.max() <= 1
    assert torch.equal(module.sample(captions, seed=1), a)
    assert not torch.equal(module.sample(captions, seed=2), a)
    assert module.model.training  # restored after sampling in eval mode


class _ImageLogger(Logger):
    """A minimal logger that supports images the way ``WandbLogger.log_image`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, list[str], int | None]] = []

    @property
    def name(self) -> str:
        return "images"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_image(self, key: str, images: list[str], step: int | None = None) -> None:
        self.images.append((key, images, step))


def test_grids_go_to_loggers_that_take_images(tmp_path: Path) -> None:
    logger = _ImageLogger()
    fit(tmp_path, steps=2, val_every=2, logger=logger)
    assert [(key, step) for key, _, step in logger.images] == [("samples", 0), ("samples", 2)]
    assert all(Path(images[0]).is_file() for _, images, _ in logger.images)


def test_bad_arguments_fail_early() -> None:
    with pytest.raises(ValueError, match="caption_dropout"):
        make_module(caption_dropout=1.0)
    with pytest.raises(ValueError, match="set caption_dropout > 0"):
        make_module(caption_dropout=0.0, guidance_scale=2.0)
    with pytest.raises(KernelSpecError, match="unknown kernel 'nope'"):
        make_module(attention="nope")
    with pytest.raises(ValueError, match="'purple'"):
        make_module(sample_captions=["a small purple circle in the center on a blue background"])
