"""``WeightSnapshot``: a Lightning callback that saves the model's weights at chosen training steps.

Snapshots go to ``RUN_DIR/snapshots/`` (layout: :mod:`flashprobe.weights.store`);
:class:`flashprobe.weights.SnapshotStore` reads them and ``flashprobe compare`` compares runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from flashprobe.probing.session import attention_record
from flashprobe.weights.snapshot import (
    SnapshotSchedule,
    clean_name,
    live_tensors,
    module_tensors,
    own_attention,
)
from flashprobe.weights.store import SNAPSHOT_DIRNAME, NonFiniteSnapshotError, TensorSpec

if TYPE_CHECKING:
    from flashprobe.callbacks.attention_probe import AttentionProbe

__all__ = ["WeightSnapshot", "trained_attention"]

log = logging.getLogger(__name__)


class WeightSnapshot(SnapshotSchedule, Callback):
    """Save the model's weights at configured steps into ``RUN_DIR/snapshots``.

    Args:
        dirpath: the run directory; snapshots go to ``dirpath/snapshots``. Default:
            ``trainer.log_dir`` (the logger's version directory), else ``trainer.default_root_dir``.
        every_n_steps: save every ``n`` optimizer steps (steps ``n, 2n, ...``); ``None`` for none.
        steps: explicit steps to save, in addition to ``every_n_steps``.
        save_initial: save the initial weights as step 0 when training starts from scratch.
        save_last: always save the weights at the end of training (the last step).
        include_buffers: also save the model's persistent buffers (e.g. norm running statistics).
        trainable_only: save only parameters with ``requires_grad=True`` (skip frozen encoders).
        run_id: recorded in the manifest; default: the name of the run directory.
        seed: recorded in the manifest; default: ``PL_GLOBAL_SEED`` as set by ``pl.seed_everything``.
        attention: the attention kernel spec the run trains with, recorded in the manifest; default:
            :func:`trained_attention`, else the model's own attention
            (:func:`~flashprobe.weights.snapshot.own_attention`, e.g. ``"own sdpa on cpu"``).
        precision: recorded in the manifest; default: ``trainer.precision`` (e.g. ``bf16-mixed``).
        config: any JSON-serialisable mapping (a dict, dataclass or OmegaConf config) recorded in the
            manifest, typically the run's full configuration.

    Raises:
        ValueError: an argument is out of range, or nothing would ever be saved.
        TypeError: ``config`` cannot be stored as JSON.

    The snapshot of step ``s`` holds the weights after ``s`` optimizer updates (``trainer.global_step``
    after the step), detached, on CPU, in their training dtype (the float32 master weights under
    mixed precision). The initial weights are copied at ``on_train_start`` and written once the first
    batch has run, so a run whose kernel is refused in its first step leaves no snapshot naming it.
    Resuming restores the saved steps (:meth:`state_dict`); snapshots after the resumed step belong
    to an abandoned timeline and are removed (with a warning), then written again. Only rank zero
    writes; under FSDP every rank takes part in gathering the full state dict (:meth:`_collect`).
    """

    #: the run id in the checkpoint resumed from; the run directory, once ``fit`` has started
    _restored_run_id: str | None = None
    _run_dir: Path | None = None
    #: the initial weights (tensors, specs, epoch) copied at ``on_train_start``, until written
    _initial: tuple[dict[str, torch.Tensor] | None, list[TensorSpec], int] | None = None
    #: the snapshot directory, when this run created it (removed again if a refusal leaves it empty)
    _created: Path | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, steps=self.steps)

    @property
    def run_dir(self) -> Path | None:
        """The run directory, known once ``fit`` has started."""
        return self._run_dir

    # ---------------------------------------------------------------- hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        run_dir = (
            self.dirpath if self.dirpath is not None else Path(trainer.log_dir or trainer.default_root_dir)
        )
        self._run_dir = Path(trainer.strategy.broadcast(str(run_dir)))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        self._saved = {s for s in self._saved if s <= step}
        if trainer.is_global_zero:
            assert self._run_dir is not None
            existed = (self._run_dir / SNAPSHOT_DIRNAME).exists()
            writer = self._open(self._run_dir, self._header(trainer, pl_module), step, rank_zero_warn)
            self._created = None if existed else writer.directory
            lost = sorted(self._saved - set(writer.steps))
            if lost:
                rank_zero_warn(
                    f"WeightSnapshot: the checkpoint says steps {lost} were saved, but "
                    f"{writer.directory} does not list them (was the run directory changed or "
                    "cleaned?); they cannot be recreated"
                )
        if self.save_initial and step == 0 and 0 not in self._saved:
            # copied now, written when the first batch has run with the run's attention
            self._initial = (*self._collect(trainer, pl_module), trainer.current_epoch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._write_initial(trainer, pl_module)
        step = trainer.global_step
        if step not in self._saved and self.should_save(step):
            self._save(trainer, pl_module, step)
        elif self.attention is None and self._writer is not None and trainer.is_global_zero:
            record = lambda: trained_attention_record(trainer, pl_module)  # noqa: E731
            self._refresh_attention(_primary_probe(trainer), record)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_initial(trainer, pl_module)  # training that ran no batch
        step = trainer.global_step
        if self.save_last and step not in self._saved:
            self._save(trainer, pl_module, step)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Training ended by an error: initial weights not yet written stay unwritten (the first batch,
        which would have trained with the run's attention, did not finish), and a snapshot directory
        this run created and left empty is removed."""
        self._initial = None
        if self._created is not None:
            with contextlib.suppress(OSError):  # not empty (or gone): left as it is
                self._created.rmdir()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "saved_steps": sorted(self._saved),
            "run_id": self._resolved_run_id(),
            "dirpath": None if self._run_dir is None else str(self._run_dir),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = {int(s) for s in state_dict.get("saved_steps", [])}
        self._restored_run_id = state_dict.get("run_id")

    # ---------------------------------------------------------------- saving

    def _resolved_run_id(self) -> str | None:
        if self.run_id is not None:
            return self.run_id
        if self._restored_run_id is not None:
            return self._restored_run_id
        return None if self._run_dir is None else self._run_dir.name

    def _header(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        seed = self.seed
        if seed is None and os.environ.get("PL_GLOBAL_SEED", "").lstrip("-").isdigit():
            seed = int(os.environ["PL_GLOBAL_SEED"])
        attention = (
            {"attention": self.attention} if self.attention else trained_attention_record(trainer, pl_module)
        )
        return {
            "run_id": self._resolved_run_id(),
            "seed": seed,
            **attention,
            "precision": self.precision if self.precision is not None else str(trainer.precision),
            "config": self.config,
        }

    def _write_initial(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the initial weights copied at ``on_train_start``, if they are still waiting."""
        if self._initial is not None:
            tensors, specs, epoch = self._initial
            self._initial = None
            self._write(trainer, pl_module, 0, tensors, specs, epoch)

    def _save(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        tensors, specs = self._collect(trainer, pl_module)
        self._write(trainer, pl_module, step, tensors, specs, trainer.current_epoch)

    def _write(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        step: int,
        tensors: dict[str, torch.Tensor] | None,
        specs: list[TensorSpec],
        epoch: int,
    ) -> None:
        """Write the snapshot of ``step`` (rank zero) and count it saved (every rank)."""
        if trainer.is_global_zero:
            assert self._writer is not None and tensors is not None
            if self.attention is None:  # what computed the attention so far (a probe's fallbacks)
                self._writer.manifest.update(trained_attention_record(trainer, pl_module))
            try:
                path = self._writer.write(step, tensors, specs, epoch=epoch)
            except NonFiniteSnapshotError as err:  # the run's guard stops it (or records it: continue)
                log.error("WeightSnapshot: %s", err)
                return
            log.info("WeightSnapshot: saved step %d to %s", step, path)
        self._saved.add(step)

    def _collect(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[dict[str, torch.Tensor] | None, list[TensorSpec]]:
        """CPU copies of the tensors to save (rank zero; ``None`` elsewhere) and their specs.

        Every rank must call this: under FSDP the full state dict is gathered collectively
        (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``: on rank zero's CPU only).
        """
        if not _is_sharded(trainer, pl_module):
            if not trainer.is_global_zero:
                return None, []
            return module_tensors(
                pl_module, include_buffers=self.include_buffers, trainable_only=self.trainable_only
            )
        _, kinds = live_tensors(
            pl_module, include_buffers=self.include_buffers, trainable_only=self.trainable_only
        )
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        module = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not trainer.is_global_zero:
            return None, []
        full = {clean_name(k): v for k, v in full.items()}
        missing = [n for n in kinds if n not in full]
        if missing:
            raise RuntimeError(
                f"WeightSnapshot: the gathered FSDP state dict has no entry for {missing[0]!r} "
                f"(keys: {list(full)[:5]}...); please report this with your strategy settings"
            )
        tensors = {n: full[n].detach().to("cpu", copy=True).contiguous() for n in kinds}
        return tensors, [TensorSpec.of(n, t, kinds[n]) for n, t in tensors.items()]


def trained_attention(trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
    """The attention kernel spec ``pl_module`` trains with, as far as the run says: the explicit
    ``primary`` of an :class:`~flashprobe.callbacks.AttentionProbe` in ``trainer`` (it replaces the
    model's kernel in training batches), else the kernel of the newest
    :func:`~flashprobe.probing.use_kernel` route attached to the module or one of its submodules, else
    ``hparams["attention"]``; None when nothing says."""
    from flashprobe.probing.intercept import active_handles

    probe = _primary_probe(trainer)
    if probe is not None:
        return str(getattr(probe.primary, "spec", probe.primary))
    modules = {id(m) for m in pl_module.modules()}
    routes = [h for h in active_handles() if h.kind == "route" and id(h.model) in modules]
    if routes:
        return str(routes[-1].kernel.spec)
    hparams = getattr(pl_module, "hparams", {})
    if isinstance(hparams, Mapping) and hparams.get("attention") is not None:
        return str(hparams["attention"])
    return None


def trained_attention_record(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """``{"attention": ..., "attention_fallback": ...}`` for the manifest: :func:`trained_attention`
    (else the model's own), corrected by an :class:`~flashprobe.callbacks.AttentionProbe`'s fallbacks
    (:func:`flashprobe.probing.session.attention_record`), so no manifest names a kernel that did not
    compute the attention."""
    own = own_attention(pl_module)
    probe = _primary_probe(trainer)
    if probe is None:
        return {"attention": trained_attention(trainer, pl_module) or own}
    spec = str(getattr(probe.primary, "spec", probe.primary))
    return attention_record(spec, probe.fallbacks, probe.sites_seen, own)


def _primary_probe(trainer: pl.Trainer) -> AttentionProbe | None:
    """The trainer's :class:`~flashprobe.callbacks.AttentionProbe` with an explicit ``primary``
    (it replaces the model's kernel in training batches), or None."""
    from flashprobe.callbacks.attention_probe import AttentionProbe

    return next(
        (c for c in trainer.callbacks if isinstance(c, AttentionProbe) and c.primary is not None), None
    )


def _is_sharded(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
    """Whether the weights are sharded across ranks (FSDP1 via Lightning, or FSDP2/DTensor)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy):
        return True
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in pl_module.parameters())
