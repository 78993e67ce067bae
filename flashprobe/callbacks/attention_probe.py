"""``AttentionProbe``: the shadow attention probe inside any Lightning ``Trainer``.

At fit start it builds :func:`flashprobe.probing.probe` for the ``LightningModule`` (checking that
every kernel can run there); during training batches every ``scaled_dot_product_attention`` call
made inside the module is compared with the baseline and the FP64 golden value (validation and
sampling run the primary alone). It advances the probe's step with ``trainer.global_step``, and every
``log_every_n_steps`` reads the statistics once, reduces them across ranks (max of maxima, sum of
sums), logs them to every logger of the Trainer and appends one JSON line to
``DIRPATH/probe.jsonl``; at the end of training it draws the per-site deviation plot
``DIRPATH/probe.png`` from that file. It detaches at the end of fit. Its state (last logged step,
the failures seen) goes into checkpoints, so a resumed run continues ``probe.jsonl`` without
duplicate lines and keeps its verdict.

**Verdicts.** Every compared call is judged on the device (:func:`flashprobe.judge.decide`);
the summary of each record carries ``verdict`` and ``failures`` (the first failure of each site and
direction since training started, and the worst call). At the first failure of a site and
direction the callback warns with one line (``on_failure="warn"``), raises
:class:`~flashprobe.probing.ProbeFailureError` (``"raise"``) or writes its record and asks the
Trainer to stop (``"stop"``: ``trainer.should_stop``); the failing call is saved as a reproducer in
``DIRPATH/repro/`` (at most ``max_reproducers``; ``flashprobe replay FILE``). On the CPU a failure
is seen at the batch it happens in; on a GPU at the next logging step (no host read per call),
and the reproducer is that site's next failing call.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from flashprobe.deviation import PAIRS
from flashprobe.formats.atomic import DiskFullError
from flashprobe.formats.probe_log import PROBE_LOG_NAME, ProbeLogWriter
from flashprobe.kernels import KernelUnavailableError
from flashprobe.probing import Probe, ProbeConfig, ProbeFailureError, ProbeWarning, probe, reduce_across_ranks
from flashprobe.probing.session import (
    NONFINITE_ACTIONS,
    RunTally,
    check_trainable,
    nonfinite_weights,
    verdict_block,
)
from flashprobe.probing.shadow import failure_message
from flashprobe.probing.summary import bias_words, summary_scalars

__all__ = ["AttentionProbe"]

log = logging.getLogger(__name__)

_PRECISION_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}


class AttentionProbe(Callback):
    """Compare the model's attention kernel with the baseline at every call during training.

    Args:
        config: the probe's settings (:class:`~flashprobe.probing.ProbeConfig`: ``primary``,
            ``baseline``, ``golden``, ``backward``, ``every_n_steps``, ``every_n_calls``, ``sites``,
            ``dropout``, ``memory_budget``); default: its defaults (``backward="auto"``: gradients
            compared where the primary and baseline have a backward on the model's device).
            ``primary=None`` keeps the kernel the
            model already uses.
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
    scale (read on the device, no sync), so they are in the model's units.

    Raises:
        ProbeConfigError: an unknown setting or a bad value, naming it.
        ValueError: a non-positive logging interval or an empty filename, naming the argument.
        KernelSpecError: an unknown kernel spec (at construction, before any training).
        KernelUnavailableError: at fit start, a kernel that cannot run on the model's device
            or dtype (e.g. ``flash_attn`` on CPU).
    """

    def __init__(
        self,
        config: ProbeConfig | None = None,
        /,
        *,
        log_every_n_steps: int | None = None,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str = PROBE_LOG_NAME,
        log_sites: bool = False,
        plot: bool = True,
        on_failure: str = "warn",
        max_reproducers: int = 8,
        on_nonfinite: str = "stop",
        console: bool = True,
        **settings: Any,
    ) -> None:
        self.config = ProbeConfig.from_settings(config, **settings)
        if on_failure not in ("warn", "raise", "stop"):
            raise ValueError(f"AttentionProbe: on_failure={on_failure!r} must be 'warn', 'raise' or 'stop'")
        if on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(
                f"AttentionProbe: on_nonfinite={on_nonfinite!r} must be one of {', '.join(NONFINITE_ACTIONS)}"
            )
        self.on_nonfinite = on_nonfinite
        self.console = bool(console)
        if isinstance(max_reproducers, bool) or not isinstance(max_reproducers, int) or max_reproducers < 0:
            raise ValueError(f"AttentionProbe: max_reproducers={max_reproducers!r} must be an int >= 0")
        self.on_failure = on_failure
        self.max_reproducers = max_reproducers
        value = 1 if log_every_n_steps is None else log_every_n_steps
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"AttentionProbe: log_every_n_steps={log_every_n_steps!r} must be a positive int"
            )
        plain = isinstance(filename, str) and filename not in {"", ".", ".."}
        plain = plain and Path(filename).name == filename
        if not plain:
            raise ValueError(
                f"AttentionProbe: filename={filename!r} must be a plain file name inside dirpath, e.g. "
                "'probe.jsonl' (no directories: set dirpath for the directory)"
            )
        self.log_every_n_steps = log_every_n_steps
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.log_sites = log_sites
        self.plot = plot
        self.last_logged_step = -1
        self.records = 0
        self.last_summary: dict[str, Any] = {}
        self._probe: Probe | None = None
        self._path: Path | None = None
        self._writer: ProbeLogWriter | None = None
        self._calls_checked = False
        self._reported: set[tuple[str, str]] = set()
        self._restored_failures: list[dict[str, Any]] = []
        self._restored_bias: dict[str, list[float]] = {}
        self._global_zero = True
        self._tally = RunTally()
        self._fallbacks: list[dict[str, Any]] = []
        self._sites_seen: list[str] = []
        self._printed_failure = False
        self.stopped: str | None = None
        """Why the callback stopped training on non-finite values (None: it did not)."""

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
    def primary(self) -> Any:
        """The primary kernel spec (None: the model's own)."""
        return self.config.primary

    @property
    def baseline(self) -> Any:
        """The baseline kernel spec."""
        return self.config.baseline

    @property
    def sites(self) -> tuple[str, ...] | None:
        """The site patterns (None: every site)."""
        return self.config.sites

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(primary=self.primary, baseline=self.baseline, filename=self.filename)

    @property
    def probe(self) -> Probe | None:
        """The attached probe handle (``None`` outside fit)."""
        return self._probe

    @property
    def fallbacks(self) -> list[dict[str, Any]]:
        """Where torch's SDPA computed the attention instead of the primary (``fallback=True``):
        :attr:`flashprobe.probing.Probe.fallbacks`, kept after fit."""
        return self._fallbacks if self._probe is None else self._probe.fallbacks

    @property
    def sites_seen(self) -> list[str]:
        """Every attention site the probe saw (kept after fit)."""
        return self._sites_seen if self._probe is None else sorted(self._probe.calls)

    # ------------------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dtype = _PRECISION_DTYPES.get(str(trainer.precision))
        root = self.dirpath or Path(trainer.log_dir or trainer.default_root_dir)
        # Attaching checks every kernel on the model's device and dtype now, before any step.
        self._probe = probe(
            pl_module,
            self.config,
            dtype=dtype,
            on_failure="ignore",  # the callback reports, once per site and direction
            repro_dir=root / "repro" if trainer.is_global_zero and self.max_reproducers else None,
            max_reproducers=self.max_reproducers,
        )
        try:  # a primary without a backward on this device is refused before the first step
            check_trainable(
                self._probe.shadow.primary, pl_module, "AttentionProbe", fallback=self.config.fallback
            )
        except KernelUnavailableError:
            self._probe.detach()
            self._probe = None
            raise
        self._probe.detach()  # only training batches are probed: attached at each batch start
        self._probe.shadow.set_grad_scale(_loss_scale(trainer))
        self._global_zero = trainer.is_global_zero
        self._apply_restored()
        self._path = root / self.filename
        self._writer = ProbeLogWriter(self._path)
        self._calls_checked = False

    def _apply_restored(self) -> None:
        """A resumed run keeps the failures it had seen and its signed bias (restored before or after
        fit start)."""
        if self._probe is None:
            return
        for failure in self._restored_failures:
            key = (failure["site"], failure["direction"])
            self._probe.shadow.failures.setdefault(key, dict(failure))
            self._reported.add(key)
        self._restored_failures = []
        if self._restored_bias and self._global_zero:  # the other ranks' sums add from zero
            self._probe.shadow.restore_bias(self._restored_bias)
            self._restored_bias = {}

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._detach()

    def _detach(self) -> None:
        if self._probe is not None:
            self._probe.detach()
            self._restored_failures = self._probe.failures  # kept for state_dict and a next fit
            self._restored_bias = self._probe.shadow.bias_state()
            self._fallbacks, self._sites_seen = self._probe.fallbacks, sorted(self._probe.calls)
            self._probe = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._probe is not None:
            self._apply_restored()
            self._probe.attach()
            self._probe.set_step(trainer.global_step)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation and sampling calls run the primary only; the probe re-attaches at the next batch.
        if self._probe is not None:
            self._probe.detach()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._probe is None:
            return
        if not self._calls_checked:
            self._check_calls(pl_module)
        step = trainer.global_step
        every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        last_batch = trainer.max_steps != -1 and step >= trainer.max_steps
        new = self._new_failures()
        halt = self._nonfinite_stop(trainer, pl_module, new)
        if ((new and self.on_failure == "stop") or halt) and step > self.last_logged_step:
            self._flush(trainer, pl_module, step)  # the record of the failing step is written first
        elif step > self.last_logged_step and (not step % every or last_batch):
            self._flush(trainer, pl_module, step)
            new += self._new_failures()  # failures a read on a device found
            halt = halt or self._nonfinite_stop(trainer, pl_module, new, weights=False)
        self._react(trainer, new)
        if halt:
            trainer.should_stop = True
        elif new and trainer.is_global_zero and not self._printed_failure and not trainer.should_stop:
            self._printed_failure = True
            self._print_block()

    def _nonfinite_stop(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        new: list[dict[str, Any]],
        *,
        weights: bool = True,
    ) -> bool:
        """Whether to stop for non-finite values (``on_nonfinite="stop"``): a new non-finite failure of
        the primary, or (one host read per step; left to a ``NonFiniteGuard`` in the Trainer) non-finite
        weights. Records why in :attr:`stopped`."""
        if self.on_nonfinite != "stop" or self.stopped is not None:
            return False
        from flashprobe.callbacks.nonfinite_guard import NonFiniteGuard

        nonfinite = next((f for f in new if f.get("kind") == "nonfinite"), None)
        why = None
        if nonfinite is not None:
            why = (
                f"the primary returned non-finite values at {nonfinite['site']} {nonfinite['direction']}, "
                f"step {nonfinite['step']}"
            )
        elif weights and not any(isinstance(c, NonFiniteGuard) for c in trainer.callbacks):
            found = nonfinite_weights(pl_module)
            bad = trainer.strategy.reduce_boolean_decision(found is not None, all=False)
            if bad:
                found = f"{found} are" if found else "a weight on another rank is"
                why = f"{found} non-finite after step {trainer.global_step - 1}"
        if why is None:
            return False
        self.stopped = f"{why} (on_nonfinite='stop'; pass on_nonfinite='continue' to train on)"
        if trainer.is_global_zero:
            log.error("AttentionProbe: stopping training: %s", self.stopped)
        return True

    def _new_failures(self) -> list[dict[str, Any]]:
        """Failures not reported yet (the shadow's log: at once on the CPU, at reads elsewhere)."""
        assert self._probe is not None
        new = [f for f in self._probe.failures if (f["site"], f["direction"]) not in self._reported]
        self._reported.update((f["site"], f["direction"]) for f in new)
        return new

    def _react(self, trainer: pl.Trainer, failures: list[dict[str, Any]]) -> None:
        if not failures:
            return
        if self.on_failure == "raise":
            raise ProbeFailureError(failure_message(failures[0]), failures[0])
        if trainer.is_global_zero:
            for failure in failures:
                warnings.warn(failure_message(failure), ProbeWarning, stacklevel=2)
        if self.on_failure == "stop":
            trainer.should_stop = True
            if trainer.is_global_zero:
                log.warning("AttentionProbe: stopping training (on_failure='stop')")

    def _check_calls(self, pl_module: pl.LightningModule) -> None:
        """After the first training batch: fail early when there is nothing to probe (host-side counts)."""
        assert self._probe is not None
        self._calls_checked = True
        calls = self._probe.calls
        if not calls:
            raise RuntimeError(
                f"AttentionProbe: {type(pl_module).__name__} made no "
                "torch.nn.functional.scaled_dot_product_attention call in its first training batch, "
                "so there is nothing to probe. Either the model has no attention, or it calls a fused "
                "kernel flashprobe does not intercept, flash-attn/FlashInfer with arguments it cannot "
                "compare (warned), or nn.MultiheadAttention's inference fast path. "
                "Route its attention through F.scaled_dot_product_attention, or remove the callback "
                "(flashprobe train: attention.probe.enabled=false)."
            )
        if self.sites is not None and not any(self._probe.selects(site) for site in calls):
            raise ValueError(
                f"AttentionProbe: sites={list(self.sites)!r} matches none of the model's attention sites "
                f"({', '.join(sorted(calls))}); fix the patterns or use sites=None for all"
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Steps probed since the last logging step (e.g. max_epochs runs) are not lost.
        if self._probe is not None and trainer.global_step > self.last_logged_step:
            self._flush(trainer, pl_module, trainer.global_step)
            self._react(trainer, self._new_failures())
        if trainer.is_global_zero and self.last_summary:
            log.info("%s", verdict_line(self.last_summary, self._path))
            self._print_block()
        if self.plot and trainer.is_global_zero and self._path is not None and self._path.is_file():
            from flashprobe.report.probe_figures import plot_probe

            if self._path.stat().st_size:
                try:  # a convenience: a plotting error must not fail a finished run
                    figure = plot_probe(self._path, self._path.with_suffix(".png"))
                    log.info("AttentionProbe: per-site deviation plot %s", figure)
                except DiskFullError:  # but a full disk must: the run is not complete without it
                    raise
                except Exception as err:
                    log.warning("AttentionProbe: could not draw %s: %s", self._path.with_suffix(".png"), err)

    def _print_block(self) -> None:
        """Print the verdict block to stdout (``console=True``)."""
        if self.console and self.last_summary:
            rows = self._tally.rows(self.last_summary.get("failures") or [])
            block = verdict_block(
                self.last_summary, rows, who="AttentionProbe", path=self._path, stopped=self.stopped
            )
            print(block, flush=True)

    # ------------------------------------------------------------------------------- reading
    def _reduced_tensors(self, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        """The per-site accumulators, all-reduced across ranks (MAX for maxima, SUM for sums)."""
        assert self._probe is not None
        local = self._probe.stat_tensors()
        if trainer.world_size <= 1:
            return local
        return reduce_across_ranks(local, trainer.strategy.root_device)

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        assert self._probe is not None
        tensors = self._reduced_tensors(trainer)
        stats = self._probe.stats(tensors)
        summary = self._probe.summary(stats)
        summary["step"] = step
        if self.stopped is not None:
            summary["stopped"] = self.stopped
        self._tally.add(summary, stats)
        self._probe.reset()
        self.last_logged_step = step
        if not stats:
            return
        self.last_summary = summary
        if summary.get("primary_nonfinite_sites") and trainer.is_global_zero:
            sites = summary["primary_nonfinite_sites"]
            log.error(
                "step %s: the primary kernel %s returned %s non-finite values from finite inputs at %s "
                "(the baseline's are finite there): a kernel bug; its error ratio does not show it",
                step,
                self.primary,
                summary["primary_nonfinite"],
                ", ".join(sites[:3]) + (f" and {len(sites) - 3} more sites" if len(sites) > 3 else ""),
            )
        ratio = summary.get("limit_ratio")  # the verdict's statistic: error / limit, > 1 fails
        if ratio is not None and math.isfinite(ratio):
            # The progress bar only (logger=False): the loggers get every metric once, below, under
            # the same name and step.
            pl_module.log(
                "probe/limit_ratio",
                float(ratio),
                prog_bar=True,
                logger=False,
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
            )
        if trainer.is_global_zero:
            self._log_to_loggers(trainer, stats, summary, step)
            self._append(step, stats, summary)

    def _log_to_loggers(
        self, trainer: pl.Trainer, stats: dict[str, Any], summary: dict[str, Any], step: int
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

    def _append(self, step: int, stats: dict[str, Any], summary: dict[str, Any]) -> None:
        assert self._writer is not None
        if not self._writer.opened:
            # A fresh run starts a new log; a resumed run drops the records after its checkpoint.
            dropped = self._writer.open(self._resumed_from)
            if dropped:
                log.warning(
                    "AttentionProbe: dropped records of steps %s from %s: they are later than the "
                    "checkpoint training resumed from",
                    dropped,
                    self._writer.path,
                )
        self._writer.append({"step": step, "summary": summary, "sites": stats})
        self.records += 1

    # ---------------------------------------------------------------------------- checkpoints
    _resumed_from: int | None = None

    @override
    def state_dict(self) -> dict[str, Any]:
        failures = self._restored_failures if self._probe is None else self._probe.failures
        # This process's bias sums: exact for one process; under DDP the checkpoint holds the
        # saving rank's, restored there (the other ranks' earlier calls are not in it).
        bias = self._restored_bias if self._probe is None else self._probe.shadow.bias_state()
        return {
            "bias": bias,
            "tally": self._tally.state_dict(),
            "last_logged_step": self.last_logged_step,
            "records": self.records,
            "failures": [
                {k: v for k, v in f.items() if isinstance(v, str | int | float | type(None))}
                for f in failures
            ],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_logged_step = state_dict.get("last_logged_step", -1)
        self.records = state_dict.get("records", 0)
        self._restored_failures = [dict(f) for f in state_dict.get("failures", [])]
        self._restored_bias = {s: list(v) for s, v in state_dict.get("bias", {}).items()}
        self._tally.load_state_dict(state_dict.get("tally", {}))
        self._resumed_from = self.last_logged_step


def verdict_line(summary: Mapping[str, Any], path: Path | None = None) -> str:
    """The run's verdict in one line (the last the callback logs): verdict, sites, the first failure
    or the worst forward error ratio, the most biased direction where one is, and where the records
    are."""
    verdict = str(summary.get("verdict") or "undetermined").upper()
    firsts = [f for f in summary.get("failures") or [] if not f.get("worst")]
    if firsts:
        f = firsts[0]
        detail = f"first failure at {f['site']} {f['direction']}, step {f['step']}: {f['reason']}" + (
            f"; reproducer {f['repro']}" if f.get("repro") else ""
        )
    else:
        ratio = summary.get("max_limit_ratio")
        at = f"{ratio:.3g} at {summary.get('max_limit_ratio_site')}" if ratio is not None else "n/a"
        back = summary.get("max_backward_limit_ratio")
        if back is not None:
            at += f", backward {back:.3g} at {summary.get('max_backward_limit_ratio_site')}"
        detail = f"{summary.get('sites', 0)} sites, worst error / limit {at} (> 1 fails)"
    bias = bias_words(summary)
    detail += f"; {bias}" if bias else ""
    where = f" ({path})" if path is not None else ""
    return f"AttentionProbe: verdict {verdict}: {detail}{where}"


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
