"""Stop a run whose loss or weights become non-finite, instead of training on NaN to a "finished" end.

A kernel that returns NaN in one row makes every weight NaN after one optimizer step; Lightning
trains on and ends normally. :class:`NonFiniteGuard` checks the training loss and the weights after
every step (one host synchronisation per step, not per call) and, by default, stops the run there;
what it found is in :attr:`NonFiniteGuard.reason`, which ``flashprobe train`` records in ``run.json``
and prints. With ``action="continue"`` it only records the first occurrence.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from flashprobe.probing.session import NONFINITE_ACTIONS, nonfinite_weights

__all__ = ["NonFiniteGuard"]

log = logging.getLogger(__name__)


class NonFiniteGuard(Callback):
    """Watch the training loss and every parameter for NaN or infinity after each optimizer step.

    Args:
        action: ``"stop"`` (end training at that step) or ``"continue"`` (only record it).

    Raises:
        ValueError: an unknown ``action``, listing the allowed ones.
    """

    def __init__(self, action: str = "stop") -> None:
        if action not in NONFINITE_ACTIONS:
            raise ValueError(
                f"NonFiniteGuard: action={action!r} must be one of {', '.join(NONFINITE_ACTIONS)}"
            )
        self.action = action
        self.reason: str | None = None
        """What became non-finite and at which step (``None`` while everything is finite)."""
        self.step: int | None = None
        """The optimizer step at which it was found."""

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        checks = [torch.isfinite(p.detach()).all() for p in pl_module.parameters()]
        if isinstance(loss, torch.Tensor):
            checks.insert(0, torch.isfinite(loss.detach()).all())
        finite = bool(torch.stack(checks).all()) if checks else True  # one host sync per step
        bad = trainer.strategy.reduce_boolean_decision(not finite, all=False)  # any rank: every rank
        if not bad:
            return
        if self.reason is None:  # the first occurrence is the one that explains the rest
            self.step = trainer.global_step
            self.reason = self._describe(pl_module, loss, finite)
            then = "training stops" if self.action == "stop" else "training continues"
            log.error("%s; %s", self.reason, then)
        if self.action == "stop":
            trainer.should_stop = True

    @staticmethod
    def _describe(pl_module: pl.LightningModule, loss: Any, finite_here: bool) -> str:
        step = pl_module.trainer.global_step
        if not finite_here and isinstance(loss, torch.Tensor) and not math.isfinite(float(loss.detach())):
            return f"the training loss became {float(loss.detach())} at step {step}"
        weights = nonfinite_weights(pl_module)
        if weights is not None:
            return f"{weights} became non-finite at step {step}"
        return f"a non-finite loss or weight on another rank at step {step}"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "step": self.step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reason, self.step = state_dict.get("reason"), state_dict.get("step")
