"""Hugging Face transformers: weight snapshots of a ``transformers.Trainer`` run, for ``flashprobe compare``.

:class:`WeightSnapshotCallback` is the Lightning :class:`~flashprobe.callbacks.WeightSnapshot` for the
HF ``Trainer``: the same steps, files and manifest facts, read from the Trainer. This module imports
transformers; ``import flashprobe`` does not.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from flashprobe.probing.run_session import SessionCallback
from flashprobe.probing.session import attention_record
from flashprobe.weights.snapshot import TRUE_PRECISION, SnapshotSchedule, module_tensors, own_attention

if TYPE_CHECKING:
    from flashprobe.integrations.hf import AttentionProbeCallback

__all__ = ["WeightSnapshotCallback"]

log = logging.getLogger(__name__)


class WeightSnapshotCallback(SnapshotSchedule, TrainerCallback):
    """Save the model's weights at configured steps into ``RUN_DIR/snapshots`` during ``Trainer.train``.

    ::

        callback = WeightSnapshotCallback(every_n_steps=100)
        trainer = Trainer(model, args, train_dataset=data, callbacks=[callback])

        probe = AttentionProbeCallback(primary="tiled")  # with a probe: hand it over
        callbacks = [probe, WeightSnapshotCallback(every_n_steps=100, probe=probe)]

    Args:
        dirpath: the run directory; snapshots go to ``dirpath/snapshots``. Default: ``args.output_dir``.
        probe: the ``AttentionProbeCallback`` of the same Trainer, whose explicit ``primary`` (and its
            fallbacks) the manifest records as the attention; None: the model's own attention.
        every_n_steps, steps, save_initial, save_last, include_buffers, trainable_only, run_id: as
            for the Lightning :class:`~flashprobe.callbacks.WeightSnapshot`.
        seed: recorded in the manifest; default: ``args.seed``.
        attention: the attention the run trains with, recorded in the manifest; default: the explicit
            ``primary`` of ``probe``, else the model's own attention.
        precision: recorded in the manifest; default: Lightning's name of the Trainer's setting
            (``bf16-mixed`` for ``bf16=True``, ``16-mixed`` for ``fp16=True``, else the weights'
            dtype: ``32-true``, ``bf16-true``, ...).
        config: any JSON-serialisable mapping recorded in the manifest (compared by ``flashprobe
            compare``: a key that differs between two runs is a thing they differ in).

    Raises:
        ValueError: an argument is out of range, or nothing would ever be saved; at train begin,
            sharded training (FSDP, DeepSpeed).
        TypeError: ``config`` cannot be stored as JSON.

    The snapshot of step ``s`` holds the weights after ``s`` optimizer updates (``state.global_step``
    at ``on_step_end``). The initial weights are copied at ``on_train_begin`` and written after the
    first step, so a run whose kernel is refused in its first step leaves no snapshot naming it. Only
    the main process writes. A resumed run (``trainer.train(resume_from_checkpoint=...)``) keeps the
    snapshots up to the checkpoint's step, removes those after it (an abandoned timeline, with a
    warning) and writes them again as training reaches them.
    """

    #: the initial weights (tensors, specs) copied at ``on_train_begin``, until written
    _initial: tuple[dict[str, torch.Tensor], list[Any]] | None = None

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        probe: AttentionProbeCallback | None = None,
        **schedule: Any,
    ) -> None:
        super().__init__(dirpath, **schedule)
        if probe is not None and not isinstance(probe, SessionCallback):
            raise TypeError(
                f"{type(self).__name__}: probe must be the AttentionProbeCallback of the same Trainer, "
                f"got {type(probe).__name__}"
            )
        self.probe = probe

    @property
    def run_dir(self) -> Path | None:
        """The run directory, known once training has begun."""
        return None if self._writer is None else self._writer.directory.parent

    # ------------------------------------------------------------------------------ hooks
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        name = type(self).__name__
        model = kwargs.get("model")
        if not isinstance(model, nn.Module):
            raise RuntimeError(f"{name}: the Trainer passed no model to on_train_begin")
        if args.fsdp or args.deepspeed:
            raise ValueError(
                f"{name}: sharded training (fsdp={args.fsdp!r}, deepspeed={args.deepspeed!r}) is not "
                "supported: each process holds a shard, not the weights; train without sharding, or "
                "with Lightning's FSDPStrategy and flashprobe.callbacks.WeightSnapshot"
            )
        step = state.global_step
        self._writer = None
        if state.is_world_process_zero:
            run_dir = self.dirpath or Path(args.output_dir or ".")
            self._saved = set(
                self._open(run_dir, self._header(args, model, run_dir), step, log.warning).steps
            )
        self._initial = None
        if self.save_initial and step == 0 and 0 not in self._saved:
            if self._writer is None:  # another process writes it
                self._saved.add(0)
            else:  # copied now, written when the first step has run with the run's attention
                self._initial = module_tensors(
                    model, include_buffers=self.include_buffers, trainable_only=self.trainable_only
                )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._write_initial(kwargs["model"])
        step = state.global_step
        if step not in self._saved and self.should_save(step):
            self._save(kwargs["model"], step, state)
        elif self.attention is None and self._writer is not None:
            callback = self._primary_callback()
            self._refresh_attention(callback, lambda: _trained_attention(kwargs["model"], callback))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._write_initial(kwargs["model"])  # training that ran no step
        step = state.global_step
        if self.save_last and step not in self._saved:
            self._save(kwargs["model"], step, state)

    # ------------------------------------------------------------------------------ saving
    def _header(self, args: TrainingArguments, model: nn.Module, run_dir: Path) -> dict[str, Any]:
        return {
            "run_id": self.run_id or run_dir.resolve().name,
            "seed": self.seed if self.seed is not None else int(args.seed),
            **(
                {"attention": self.attention}
                if self.attention
                else _trained_attention(model, self._primary_callback())
            ),
            "precision": self.precision or _precision(args, model),
            "config": self.config,
        }

    def _write_initial(self, model: nn.Module) -> None:
        """Write the initial weights copied at ``on_train_begin``, if they are still waiting."""
        if self._initial is not None:
            tensors, specs = self._initial
            self._initial = None
            self._write(model, 0, tensors, specs, 0.0)

    def _save(self, model: nn.Module, step: int, state: TrainerState) -> None:
        if self._writer is None:
            self._saved.add(step)
            return
        tensors, specs = module_tensors(
            model, include_buffers=self.include_buffers, trainable_only=self.trainable_only
        )
        self._write(model, step, tensors, specs, state.epoch or 0.0)

    def _write(
        self, model: nn.Module, step: int, tensors: dict[str, torch.Tensor], specs: list[Any], epoch: float
    ) -> None:
        """Write the snapshot of ``step`` (the main process) and count it saved."""
        if self._writer is not None:
            if self.attention is None:  # what computed the attention so far (a probe's fallbacks)
                self._writer.manifest.update(_trained_attention(model, self._primary_callback()))
            path = self._writer.write(step, tensors, specs, epoch=epoch)
            log.info("%s: saved step %d to %s", type(self).__name__, step, path)
        self._saved.add(step)

    def _primary_callback(self) -> AttentionProbeCallback | None:
        """:attr:`probe` when it has an explicit ``primary``, else None."""
        return self.probe if self.probe is not None and self.probe.config.primary is not None else None


def _trained_attention(model: nn.Module, callback: AttentionProbeCallback | None) -> dict[str, Any]:
    """``{"attention": ..., "attention_fallback": ...}`` for the manifest: the explicit ``primary`` of
    ``callback`` corrected by its fallbacks (:func:`flashprobe.probing.session.attention_record`), else
    the model's own attention."""
    own = own_attention(model)
    if callback is None:
        return {"attention": own}
    primary = callback.config.primary
    spec = str(getattr(primary, "spec", primary))
    return attention_record(spec, callback.fallbacks, callback.sites_seen, own)


def _precision(args: TrainingArguments, model: nn.Module) -> str:
    """Lightning's name of the Trainer's precision: autocast from ``args``, else the weights' dtype."""
    if args.bf16:
        return "bf16-mixed"
    if args.fp16:
        return "16-mixed"
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return TRUE_PRECISION.get(dtype, f"{str(dtype).removeprefix('torch.')}-true")
