"""``AttentionProbe``: the shadow attention probe inside any Lightning ``Trainer``.

A thin adapter: its hooks translate Lightning's events for a
:class:`~flashprobe.probing.run_session.ProbeSession` (``self.session``), which builds
:func:`flashprobe.probing.probe` at fit start, compares every training call, logs the statistics
every ``log_every_n_steps`` (reduced across ranks) to the Trainer's loggers and ``probe.jsonl``,
acts on failures and draws ``probe.png`` at the end; validation and sampling run the primary alone.
On the CPU a failure is seen at the batch it happens in; on a GPU at the next logging step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from flashprobe.deviation import PAIRS
from flashprobe.probing import ProbeConfig
from flashprobe.probing.run_session import SessionCallback
from flashprobe.probing.session import nonfinite_weights
from flashprobe.probing.session import verdict_line as verdict_line
from flashprobe.probing.summary import ProbeSummary, summary_scalars

__all__ = ["AttentionProbe"]

log = logging.getLogger(__name__)

_PRECISION_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}


class AttentionProbe(SessionCallback, Callback):
    """Compare the model's attention kernel with the baseline at every call during training.

    Args:
        config: the probe's settings (:class:`~flashprobe.probing.ProbeConfig`: ``primary``,
            ``baseline``, ``golden``, ``backward``, ``every_n_steps``, ``every_n_calls``, ``sites``,
            ``dropout``, ``memory_budget``); default: its defaults (``backward="auto"``: gradients
            compared where the primary and baseline have a backward on the model's device).
            ``primary=None`` keeps the kernel the model already uses.
        log_every_n_steps: read, log and reset the statistics every n steps; default: the
            Trainer's ``log_every_n_steps``.
        dirpath: directory of ``probe.jsonl``; default: ``trainer.log_dir`` or
            ``trainer.default_root_dir``.
        filename: name of the JSON-lines file.
        log_sites: also log every site's statistics as scalars (about 15 per site and direction;
            default: only the summary's, every site's statistics stay in ``probe.jsonl``).
        plot: at the end of training, draw the per-site deviation plot of the file next to it
            (``probe.png``, :func:`flashprobe.report.probe_figures.plot_probe`).
        on_failure: at the first failure of each site and direction: ``"warn"`` (default, one
            line), ``"raise"`` (:class:`~flashprobe.probing.ProbeFailureError`) or ``"stop"`` (write
            the record, then stop training through ``trainer.should_stop``).
        max_reproducers: reproducer files saved in ``DIRPATH/repro/`` at most (0: none).
        on_nonfinite: when the weights become non-finite after a step, or the primary returns
            non-finite values from finite inputs: ``"stop"`` (default: write the record, save the
            reproducer, print the verdict and stop training through ``trainer.should_stop``, so a
            run never trains on NaN weights to a quiet end) or ``"continue"`` (only record it). With
            a :class:`~flashprobe.callbacks.NonFiniteGuard` in the Trainer the guard checks the
            weights (and decides) instead.
        console: print the verdict block (:func:`flashprobe.probing.session.verdict_block`: the
            verdict, a per-site table, the reproducers) to stdout at the first failure and at the
            end of training, with no logging set-up needed.
        **settings: fields of :class:`~flashprobe.probing.ProbeConfig` replacing ``config``'s.

    With ``16-mixed`` precision the gradient statistics are divided by the ``GradScaler``'s current
    scale (read on the device, no sync), so they are in the model's units. Its state (last logged
    step, the failures seen) goes into checkpoints: a resumed run continues ``probe.jsonl`` without
    duplicate lines and keeps its verdict.

    Raises:
        ProbeConfigError: an unknown setting or a bad value, naming it.
        ValueError: a non-positive logging interval or an empty filename, naming the argument.
        KernelSpecError: an unknown kernel spec (at construction, before any training).
        KernelUnavailableError: at fit start, a kernel that cannot run on the model's device
            or dtype (e.g. ``flash_attn`` on CPU).
    """

    def __init__(
        self, config: ProbeConfig | None = None, /, *, log_sites: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(config, **kwargs)
        self.log_sites = log_sites

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any], /, **kwargs: Any) -> AttentionProbe:
        """The callback from a mapping of probe settings, e.g. Hydra's ``attention.probe`` (its
        ``enabled`` key, which decides whether the callback exists at all, is left out).

        Args:
            settings: fields of :class:`~flashprobe.probing.ProbeConfig` (plus ``enabled``).
            **kwargs: the callback's own arguments (``dirpath``, ``log_every_n_steps``, ...).
        """
        return cls(ProbeConfig.from_mapping(settings, ignore=("enabled",)), **kwargs)

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(primary=self.primary, baseline=self.baseline, filename=self.filename)

    # ------------------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def publish(step: int, stats: dict[str, Any], summary: ProbeSummary) -> None:
            if trainer.is_global_zero:
                self._log_to_loggers(trainer, stats, summary, step)

        self.session.attach(
            pl_module,
            root=trainer.log_dir or trainer.default_root_dir,
            dtype=_PRECISION_DTYPES.get(str(trainer.precision)),
            is_zero=trainer.is_global_zero,
            reduce_device=trainer.strategy.root_device if trainer.world_size > 1 else None,
            grad_scale=_loss_scale(trainer),
            publish=publish,
        )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.detach()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.session.detach()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.session.begin_step(trainer.global_step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation and sampling calls run the primary only; the probe re-attaches at the next batch.
        self.session.pause()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        result = self.session.end_step(
            step,
            every=trainer.log_every_n_steps,
            last=trainer.max_steps != -1 and step >= trainer.max_steps,
            weights=_weights_check(trainer, pl_module),
            stopping=trainer.should_stop,
        )
        if result.stop:
            trainer.should_stop = True
        ratio = None if result.summary is None else result.summary.limit_ratio
        if ratio is not None and math.isfinite(ratio):  # the verdict's statistic: error / limit, > 1 fails
            # The progress bar only (logger=False): the loggers get every metric once, under the
            # same name and step.
            pl_module.log(
                "probe/limit_ratio",
                float(ratio),
                prog_bar=True,
                logger=False,
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Steps probed since the last logging step (e.g. max_epochs runs) are not lost.
        from flashprobe.report.probe_figures import plot_probe  # matplotlib: imported at the end only

        self.session.finish(trainer.global_step, draw=plot_probe)

    def _log_to_loggers(
        self, trainer: pl.Trainer, stats: dict[str, Any], summary: ProbeSummary, step: int
    ) -> None:
        metrics = summary_scalars(summary)
        if self.log_sites:
            metrics.update({k: v for k, v in _flatten_sites(stats).items() if math.isfinite(v)})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            log_table = getattr(logger, "log_table", None)
            if log_table is not None and type(logger).__name__ == "WandbLogger":
                columns, rows = _site_table(stats)
                log_table(key="probe/sites", columns=columns, data=rows, step=step)

    # ---------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.session.load_state_dict(state_dict)


def _weights_check(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[], str | None] | None:
    """The check of the weights after a step (one host read; ``trainer.strategy`` decides across
    ranks), or None when a :class:`~flashprobe.callbacks.NonFiniteGuard` in the Trainer checks them."""
    from flashprobe.callbacks.nonfinite_guard import NonFiniteGuard

    if any(isinstance(c, NonFiniteGuard) for c in trainer.callbacks):
        return None

    def check() -> str | None:
        found = nonfinite_weights(pl_module)
        if not trainer.strategy.reduce_boolean_decision(found is not None, all=False):
            return None
        return found or "values of a weight on another rank"

    return check


def _loss_scale(trainer: pl.Trainer) -> Callable[[], torch.Tensor | float | None] | None:
    """The current loss scale of the Trainer's ``GradScaler`` (``16-mixed``), read without a sync:
    its scale tensor where it has one (a private attribute of ``torch.amp.GradScaler``), else
    ``get_scale()``; None without loss scaling."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None:
        return None

    def current() -> torch.Tensor | float | None:
        if not scaler.is_enabled():
            return None
        scale = getattr(scaler, "_scale", None)
        return scale if isinstance(scale, torch.Tensor) else scaler.get_scale()

    return current


def _flatten_sites(stats: dict[str, Any]) -> dict[str, float]:
    """``probe/<site>/out/primary_golden/max_abs``-style scalars of every site (None dropped)."""
    flat: dict[str, float] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(node, int | float) and not isinstance(node, bool):
            flat[prefix] = float(node)

    for site, entry in stats.items():
        walk(f"probe/{site}/forward", entry["forward"]["out"])
        if entry["backward"]["calls"]:
            for d in ("dq", "dk", "dv"):
                walk(f"probe/{site}/backward/{d}", entry["backward"][d])
    return flat


def _site_table(stats: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One row per site: calls, forward max_abs of each pair, error ratio, non-finite inputs."""
    columns = ["site", "calls", *(f"{pair}_max_abs" for pair in PAIRS), "error_ratio", "nonfinite_inputs"]
    rows = []
    for site, entry in stats.items():
        out = entry["forward"]["out"]
        rows.append(
            [
                site,
                entry["forward"]["calls"],
                *(out[pair]["max_abs"] if out.get(pair) else None for pair in PAIRS),
                out.get("error_ratio"),
                sum(entry["nonfinite_inputs"].values()),
            ]
        )
    return columns, rows
