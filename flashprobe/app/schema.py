"""The schema of a ``flashprobe train`` config: one keyword-only dataclass per config group,
validated in ``__post_init__``, so a bad value is refused before any work, naming the fix.

The schemas cover the settings flashprobe relies on; every other argument of a ``_target_`` node is
checked by its constructor. They are not in Hydra's ConfigStore, whose type errors name no fix.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DataSchema", "ModuleSchema", "RunSchema", "TrainerSchema", "check_sites", "run_device"]

log = logging.getLogger(__name__)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def run_device(accelerator: Any) -> str:
    """The device type a run's model trains on, from ``trainer.accelerator`` (``auto``: CUDA if present)."""
    import torch

    accelerator = str(accelerator or "cpu").lower()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return accelerator if accelerator in ("mps", "xpu") else "cpu"


@dataclass(frozen=True, kw_only=True)
class TrainerSchema:
    """``trainer``: the settings of Lightning's ``Trainer`` that flashprobe relies on."""

    max_steps: int | None = -1
    """Optimizer steps; -1: until ``max_epochs``."""
    max_epochs: int | None = None
    """Epochs; -1: no limit."""
    log_every_n_steps: int | float | None = None
    """Logging interval, also the probe's."""
    val_check_interval: int | float | None = None
    """Validation (loss and sample grid) every so many training batches."""
    accelerator: str = "cpu"
    """``cpu``, ``gpu``, ``auto``, ...: the device the model trains on (:func:`run_device`)."""
    precision: str | int = "32-true"
    """Lightning's precision (:data:`flashprobe.t2i.precision.PRECISIONS`)."""

    def __post_init__(self) -> None:
        from flashprobe.t2i.precision import trainer_precision

        steps = self.max_steps
        if steps is not None and not _integer(steps):
            raise ValueError(f"trainer.max_steps={steps!r} must be an integer (or -1 for max_epochs)")
        if steps is not None and steps != -1 and steps <= 0:
            raise ValueError(f"trainer.max_steps={steps} must be positive (or -1 for max_epochs)")
        for key in ("log_every_n_steps", "val_check_interval"):
            value = getattr(self, key)
            if value is not None and (not _number(value) or value <= 0):
                raise ValueError(
                    f"trainer.{key}={value!r} must be a positive number of steps, e.g. trainer.{key}=25"
                )
        if self.max_epochs is not None and not _integer(self.max_epochs):
            raise ValueError(f"trainer.max_epochs={self.max_epochs!r} must be an integer (-1: no limit)")
        try:
            trainer_precision(self.precision, str(self.accelerator))
        except ValueError as err:
            raise ValueError(f"trainer.precision: {err}") from None

    @property
    def device(self) -> str:
        """The device type the model trains on."""
        return run_device(self.accelerator)


@dataclass(frozen=True, kw_only=True)
class DataSchema:
    """``data``: the sizes and seeds of the generated captioned shapes."""

    num_train: int = 1
    """Training images."""
    num_val: int | None = 0
    """Validation images."""
    batch_size: int = 1
    """Batch size of both loaders."""
    image_size: int = 16
    """Side of the square images, pixels."""
    seed: int | None = None
    """Seed of the data."""
    shuffle_seed: int | None = None
    """Seed of the training order."""
    num_workers: int | None = 0
    """DataLoader worker processes (at most :func:`max_threads`)."""

    def __post_init__(self) -> None:
        workers, most = self.num_workers, max_threads()
        if workers is not None and (not _integer(workers) or not 0 <= workers <= most):
            raise ValueError(
                f"data.num_workers={workers!r} must be an integer from 0 to {most} (4 per CPU of this "
                f"machine: {os.cpu_count()}); 0 loads in-process"
            )
        for key in ("seed", "shuffle_seed"):
            value = getattr(self, key)
            if value is not None and (not _integer(value) or value < 0):
                raise ValueError(f"data.{key}={value!r} must be a non-negative integer, e.g. data.{key}=0")
        for key in ("num_train", "num_val", "batch_size", "image_size"):
            value = getattr(self, key)
            if value is not None and (not _integer(value) or value <= 0):
                raise ValueError(f"data.{key}={value!r} must be a positive integer, e.g. data.{key}=16")

    def check_memory(self, patch_size: int, memory: int, heads: int = 2) -> None:
        """Refuse sizes whose data and attention alone cannot fit in ``memory`` bytes, before allocating.

        A floor: the float32 images plus one batch's attention scores over the ``(S/p)²`` image tokens.

        Raises:
            ValueError: naming the settings, the estimate and the machine's memory.
        """
        sizes = (self.num_train, self.batch_size, self.image_size)
        if not _integer(patch_size) or patch_size <= 0 or any(v is None for v in sizes):
            return  # the model and the data module name what is wrong with these
        images = self.num_train + (self.num_val or 0)
        size = self.image_size
        image_bytes = images * 3 * size * size * 4
        tokens = (size // patch_size) ** 2
        attention_bytes = self.batch_size * heads * tokens * tokens * 4 * 3  # scores, probabilities, grad
        needed = image_bytes + attention_bytes
        if memory and needed > 0.9 * memory:
            gib = 2**30
            raise ValueError(
                f"data.image_size={size} with data.num_train + data.num_val = {images} images and "
                f"data.batch_size={self.batch_size} needs at least {needed / gib:.3g} GiB "
                f"({image_bytes / gib:.3g} GiB of images, {attention_bytes / gib:.3g} GiB of attention "
                f"scores over {tokens} image tokens), but this machine has {memory / gib:.1f} GiB; lower "
                "data.image_size (e.g. 16 or 32), data.num_train or data.batch_size"
            )


@dataclass(frozen=True, kw_only=True)
class ModuleSchema:
    """``module``: the LightningModule's settings that are numbers the optimizer or sampler trusts."""

    lr: float | None = None
    """``module.optimizer.lr``: the learning rate."""
    guidance_scale: float | None = None
    """Classifier-free guidance of the sampler."""

    def __post_init__(self) -> None:
        lr = self.lr
        if lr is not None and (not _number(lr) or not 0 < lr < math.inf):
            raise ValueError(
                f"module.optimizer.lr={lr!r} must be a positive number (finite), "
                "e.g. module.optimizer.lr=2e-3"
            )
        if self.guidance_scale is not None and not _number(self.guidance_scale):
            scale = self.guidance_scale
            raise ValueError(
                f"module.guidance_scale={scale!r} must be a number, e.g. module.guidance_scale=3.0"
            )


@dataclass(frozen=True, kw_only=True)
class AttentionSchema:
    """``attention``: the kernel the model trains with and the probe's kernels, placed on ``device``."""

    kernel: str
    """The kernel spec routed to every attention call."""
    probe: Mapping[str, Any] = field(default_factory=dict)
    """``attention.probe``: ``enabled`` and the settings of :class:`~flashprobe.probing.ProbeConfig`."""
    device: str = "cpu"
    """The device type the run trains on."""
    accelerator: Any = "cpu"
    """``trainer.accelerator`` as given (named in messages)."""
    probed: bool = False
    """Whether the run has the probe's callback (``callbacks.attention_probe`` set)."""

    def __post_init__(self) -> None:
        from flashprobe.kernels import get_kernel

        enabled = self.probe.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"attention.probe.enabled={enabled!r} must be true or false")
        for key, spec in (
            ("attention.kernel", self.kernel),
            ("attention.probe.primary", self.probe.get("primary")),
            ("attention.probe.baseline", self.probe.get("baseline")),
        ):
            if spec is None:
                continue
            kernel = get_kernel(spec)  # unknown kernels and options fail here, before any work
            devices = kernel.capabilities.devices
            if devices is not None and self.device not in devices:  # placement: not in the first batch
                problem = kernel.capabilities.setting_problem(self.device, _float32())
                raise ValueError(
                    f"{key}={spec}: {problem}. This run trains on {self.device} "
                    f"(trainer.accelerator={self.accelerator}); for a GPU run give trainer=gpu"
                )
            trains_through = key == "attention.kernel" or (key == "attention.probe.primary" and enabled)
            if trains_through and not kernel.capabilities.has_backward(self.device):  # its first step fails
                gpu = ", or train on a GPU (trainer=gpu)" if kernel.capabilities.has_backward("cuda") else ""
                raise ValueError(
                    f"{key}={spec} has no backward on {self.device}, and the model trains through it; "
                    f"choose a kernel with a backward there (math, tiled or sdpa_math){gpu}"
                )
        if enabled and self.probed:  # the probe's settings, as its callback will check them
            from flashprobe.probing import ProbeConfig

            try:
                ProbeConfig.from_mapping(self.probe, ignore=("enabled",))
            except ValueError as err:
                raise ValueError(f"attention.probe: {err}") from None

    @property
    def probing(self) -> bool:
        """Whether the run probes its attention (enabled, with the probe's callback)."""
        return bool(self.probe.get("enabled", True)) and self.probed


def _float32() -> Any:
    import torch

    return torch.float32


@dataclass(frozen=True, kw_only=True)
class RunSchema:
    """A whole run's config: the top-level settings and one schema per group."""

    seed: int
    """Seeds torch, numpy, python and the data."""
    trainer: TrainerSchema
    data: DataSchema
    module: ModuleSchema
    attention: AttentionSchema
    run_name: str = "run"
    """Names the run's directory (and the W&B run)."""
    threads: int | None = None
    """torch intra-op threads (None: torch's default)."""
    overwrite: bool = False
    """Start afresh in a directory that holds a run (deleting its outputs)."""
    on_nonfinite: str = "stop"
    """A non-finite loss or weight: ``stop`` or ``continue``."""
    ckpt_path: str | None = None
    """A Lightning checkpoint to start from."""
    patch_size: int = 2
    """``model.patch_size``: the image tokens' side, pixels (for the memory estimate)."""

    def __post_init__(self) -> None:
        from flashprobe.formats.paths import safe_name

        if not _integer(self.seed) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer, e.g. seed=0")
        most = max_threads()
        if self.threads is not None and (not _integer(self.threads) or not 0 < self.threads <= most):
            raise ValueError(
                f"threads={self.threads!r} must be a positive integer, at most {most} (4 per CPU of this "
                f"machine: {os.cpu_count()}), or null: torch's default"
            )
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"overwrite={self.overwrite!r} must be true or false")
        self.data.check_memory(self.patch_size, _machine_memory())
        if str(self.on_nonfinite) not in ("stop", "continue"):
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r} must be stop or continue")
        safe_name(str(self.run_name), what="run_name")  # it names the run's directory
        if self.ckpt_path is not None and not Path(str(self.ckpt_path)).is_file():
            raise ValueError(
                f"ckpt_path={self.ckpt_path}: no such file; give a Lightning .ckpt file (or resume=RUN_DIR)"
            )

    @classmethod
    def from_config(
        cls, cfg: Any, run_dir: str | Path | None = None, source: Callable[[str], str] | None = None
    ) -> RunSchema:
        """Validate a composed run config against the schemas, and every path it writes
        (:func:`flashprobe.app.compose.check_paths`).

        Args:
            cfg: the composed config (a ``DictConfig``, interpolations resolvable).
            run_dir: given, every file the run writes is checked to stay inside it.
            source: where a key's value came from, for a refusal's message.

        Raises:
            ValueError: naming the setting, the value and what to give instead.
            KernelSpecError: an unknown kernel or kernel option.
        """
        from omegaconf import OmegaConf

        from flashprobe.app.compose import check_paths

        trainer = cfg.trainer
        node = OmegaConf.to_container(cfg.attention.probe, resolve=True)
        callbacks = cfg.get("callbacks") or {}
        schema = cls(
            seed=cfg.get("seed"),
            trainer=TrainerSchema(
                max_steps=trainer.get("max_steps", -1),
                max_epochs=trainer.get("max_epochs"),
                log_every_n_steps=trainer.get("log_every_n_steps"),
                val_check_interval=trainer.get("val_check_interval"),
                accelerator=trainer.get("accelerator") or "cpu",
                precision=trainer.get("precision", "32-true"),
            ),
            data=DataSchema(**_known(cfg.get("data") or {}, DataSchema)),
            module=ModuleSchema(
                lr=((cfg.get("module") or {}).get("optimizer") or {}).get("lr"),
                guidance_scale=(cfg.get("module") or {}).get("guidance_scale"),
            ),
            attention=AttentionSchema(
                kernel=cfg.attention.kernel,
                probe=node,
                device=run_device(trainer.get("accelerator")),
                accelerator=trainer.get("accelerator"),
                probed=callbacks.get("attention_probe") is not None,
            ),
            run_name=cfg.get("run_name"),
            threads=cfg.get("threads"),
            overwrite=cfg.get("overwrite"),
            on_nonfinite=cfg.get("on_nonfinite", "stop"),
            ckpt_path=cfg.get("ckpt_path"),
            patch_size=(cfg.get("model") or {}).get("patch_size", 2),
        )
        check_paths(cfg, run_dir, source)  # (after run_name's own check: a logger's name comes from it)
        schema.warn_checkpoint_interval(callbacks)
        return schema

    def warn_checkpoint_interval(self, callbacks: Mapping[str, Any]) -> None:
        """Warn when checkpoints fall inside the probe's logging intervals (a resume loses statistics)."""
        checkpoint = callbacks.get("checkpoint") or {}
        every, log_every = checkpoint.get("every_n_train_steps"), self.trainer.log_every_n_steps
        inside = every and log_every and every % log_every and (self.trainer.max_steps or 0) >= log_every
        if self.attention.probing and inside:
            log.warning(
                "callbacks.checkpoint.every_n_train_steps=%s is not a multiple of "
                "trainer.log_every_n_steps=%s: a run resumed from a checkpoint inside a logging interval "
                "loses the probe statistics of that interval's first steps (weights and snapshots still "
                "resume exactly); make it a multiple",
                every,
                log_every,
            )


def _known(node: Mapping[str, Any], schema: type) -> dict[str, Any]:
    """The keys of ``node`` that ``schema`` has (the others belong to the constructor alone)."""
    names = schema.__dataclass_fields__
    return {k: v for k, v in node.items() if k in names}


def max_threads() -> int:
    """The most torch threads a run may ask for: 4 per CPU (each thread reserves a stack and buffers)."""
    return 4 * (os.cpu_count() or 1)


def _machine_memory() -> int:
    """Physical memory of this machine in bytes (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def check_sites(sites: str | Sequence[str] | None, module: Any) -> None:
    """Refuse ``attention.probe.sites`` patterns that match no module path of the model.

    Args:
        sites: the patterns (``None``: every site).
        module: the LightningModule (an ``nn.Module``) whose module paths the sites name.

    Raises:
        ValueError: naming the patterns and the model's attention modules.
    """
    if sites is None:
        return
    patterns = [sites] if isinstance(sites, str) else [str(p) for p in sites]
    include = [p for p in patterns if not p.startswith("!")]
    names = [name for name, _ in module.named_modules() if name]
    if include and not any(fnmatch.fnmatchcase(name, p) for name in names for p in include):
        attention = [name for name in names if name.rsplit(".", 1)[-1] in ("attn", "attention", "self_attn")]
        shown = ", ".join(attention[:6]) + (", ..." if len(attention) > 6 else "")
        raise ValueError(
            f"attention.probe.sites={patterns!r} matches no module of the model, so no attention site: its "
            f"attention modules are {shown or 'unnamed'}; give glob patterns of these names (e.g. "
            f"'{attention[0].rsplit('.', 2)[0] + '.*.attn' if attention else 'blocks.*.attn'}') or "
            "attention.probe.sites=null for all"
        )
