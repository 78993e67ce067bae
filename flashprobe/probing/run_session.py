"""``ProbeSession``: one training run's probe, whatever runs the training.

The Lightning :class:`~flashprobe.callbacks.AttentionProbe` and the HF
:class:`~flashprobe.integrations.hf.AttentionProbeCallback` are thin wrappers that translate their
trainer's events into a session's calls::

    session.attach(model, root=run_dir)          # fit / train begins: build the probe, check it can train
    for step in ...:
        session.begin_step(step)                 # a training step: attached, the step counter set
        ...                                      # forward, backward, optimizer step
        result = session.end_step(step + 1, every=log_every, last=...)
        if result.stop: ...                      # ask the trainer to stop
    session.finish(final_step, draw=plot_probe)  # the last record, the verdict block, probe.png

A session owns the settings, the attached :class:`~flashprobe.probing.Probe`, the run's
:class:`~flashprobe.probing.session.RunTally`, ``probe.jsonl`` (written on rank zero), the reactions to
failures and non-finite values, and its checkpoint state. It imports no training framework and draws
nothing itself (``finish`` is handed the drawing function).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashprobe.formats.atomic import DiskFullError
from flashprobe.formats.probe_log import PROBE_LOG_NAME, ProbeLogWriter
from flashprobe.formats.probe_summary import Failure, ProbeSummary
from flashprobe.kernels import KernelUnavailableError
from flashprobe.probing.config import ProbeConfig
from flashprobe.probing.probe import Probe, probe
from flashprobe.probing.session import (
    NONFINITE_ACTIONS,
    RunTally,
    check_trainable,
    verdict_block,
    verdict_line,
)
from flashprobe.probing.shadow import ProbeFailureError, failure_message
from flashprobe.probing.sites import ProbeWarning
from flashprobe.probing.stats import reduce_across_ranks

__all__ = ["ON_FAILURE_ACTIONS", "ProbeSession", "SessionCallback", "SessionField", "StepResult"]

#: What a training callback does at the first failure of a site and direction.
ON_FAILURE_ACTIONS = ("warn", "raise", "stop")

#: ``publish(step, stats, summary)``: hands one record to the trainer's loggers.
Publish = Callable[[int, dict[str, Any], dict[str, Any]], None]


@dataclass(frozen=True)
class StepResult:
    """What :meth:`ProbeSession.end_step` did.

    Attributes:
        flushed: the statistics were read (a logging step, a failure to stop at, the last step).
        stop: training should stop (``on_failure="stop"`` or ``on_nonfinite="stop"``).
        summary: the record's summary when one was written (sites had statistics), else None.
    """

    flushed: bool = False
    stop: bool = False
    summary: ProbeSummary | None = None


class ProbeSession:
    """One training run's probe: settings, attach and detach, reading, reacting, state and the answer.

    Args:
        config: the probe's settings (:class:`~flashprobe.probing.ProbeConfig`; default: its defaults).
        who: the callback's name, which starts its messages (``"AttentionProbe"``).
        log_every_n_steps: read, record and reset the statistics every n steps (None: the trainer's).
        dirpath: directory of ``probe.jsonl`` and ``repro/`` (None: the ``root`` given to :meth:`attach`).
        filename: name of the JSON-lines file.
        plot: at :meth:`finish`, draw ``probe.png`` next to the file.
        on_failure: at the first failure of each site and direction: ``"warn"``, ``"raise"``
            (:class:`~flashprobe.probing.ProbeFailureError`) or ``"stop"`` (write the record, then ask
            the trainer to stop).
        max_reproducers: reproducer files saved in ``repro/`` at most (0: none).
        on_nonfinite: ``"stop"`` (ask the trainer to stop when the primary returns non-finite values
            from finite inputs or the weights become non-finite) or ``"continue"`` (only record it).
        console: print the verdict block to stdout at the first failure and at :meth:`finish`.
        log: the logger the session's records go to.
        **settings: fields of :class:`~flashprobe.probing.ProbeConfig` replacing ``config``'s.

    Raises:
        ProbeConfigError: an unknown setting or a bad value.
        ValueError: a bad ``on_failure``, ``on_nonfinite``, ``max_reproducers``, interval or file name.
        KernelSpecError: an unknown kernel spec.
    """

    def __init__(
        self,
        config: ProbeConfig | None = None,
        /,
        *,
        who: str = "ProbeSession",
        log_every_n_steps: int | None = None,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str = PROBE_LOG_NAME,
        plot: bool = True,
        on_failure: str = "warn",
        max_reproducers: int = 8,
        on_nonfinite: str = "stop",
        console: bool = True,
        log: logging.Logger | None = None,
        **settings: Any,
    ) -> None:
        self.config = ProbeConfig.from_settings(config, **settings)
        if on_failure not in ON_FAILURE_ACTIONS:
            raise ValueError(f"{who}: on_failure={on_failure!r} must be 'warn', 'raise' or 'stop'")
        if on_nonfinite not in NONFINITE_ACTIONS:
            raise ValueError(
                f"{who}: on_nonfinite={on_nonfinite!r} must be one of {', '.join(NONFINITE_ACTIONS)}"
            )
        if isinstance(max_reproducers, bool) or not isinstance(max_reproducers, int) or max_reproducers < 0:
            raise ValueError(f"{who}: max_reproducers={max_reproducers!r} must be an int >= 0")
        every = log_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"{who}: log_every_n_steps={log_every_n_steps!r} must be a positive int (or None: the "
                "trainer's interval)"
            )
        if not isinstance(filename, str) or filename in {"", ".", ".."} or Path(filename).name != filename:
            raise ValueError(
                f"{who}: filename={filename!r} must be a plain file name inside dirpath, e.g. "
                "'probe.jsonl' (no directories: set dirpath for the directory)"
            )
        self.who = who
        self.log = log or logging.getLogger(__name__)
        self.log_every_n_steps = log_every_n_steps
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.filename = filename
        self.plot = bool(plot)
        self.on_failure = on_failure
        self.max_reproducers = max_reproducers
        self.on_nonfinite = on_nonfinite
        self.console = bool(console)
        #: The last step whose statistics were read (-1: none yet).
        self.last_logged_step = -1
        #: Records written to ``probe.jsonl`` by this process.
        self.records = 0
        #: The summary of the last record with statistics (None before the first).
        self.last_summary: ProbeSummary | None = None
        #: Why the session asked to stop training on non-finite values (None: it did not).
        self.stopped: str | None = None
        #: The run's answer so far, across logging intervals (and checkpoints).
        self.tally = RunTally()
        #: The first failures to apply at the next attach (from a checkpoint, or the last fit's).
        self.restored_failures: list[Failure] = []
        #: The signed-bias sums to continue from (from a checkpoint, or the last fit's).
        self.restored_bias: dict[str, list[float]] = {}
        #: The last logged step of the checkpoint restored from (records after it are dropped).
        self.resumed_from: int | None = None
        self._probe: Probe | None = None
        self._writer: ProbeLogWriter | None = None
        self._publish: Publish | None = None
        self._reduce_device: torch.device | None = None
        self._model_name = "the model"
        self._is_zero = True
        self._checked = False
        self._printed_failure = False
        self._reported: set[tuple[str, str]] = set()
        self._fallbacks: list[dict[str, Any]] = []
        self._sites_seen: list[str] = []

    # ---------------------------------------------------------------------------------- views
    @property
    def probe(self) -> Probe | None:
        """The attached probe handle (None outside training)."""
        return self._probe

    @property
    def fallbacks(self) -> list[dict[str, Any]]:
        """:attr:`flashprobe.probing.Probe.fallbacks`, kept after training."""
        return self._fallbacks if self._probe is None else self._probe.fallbacks

    @property
    def sites_seen(self) -> list[str]:
        """Every attention site the probe saw (kept after training)."""
        return self._sites_seen if self._probe is None else sorted(self._probe.calls)

    @property
    def path(self) -> Path | None:
        """The ``probe.jsonl`` being written (None before training)."""
        return None if self._writer is None else self._writer.path

    # ------------------------------------------------------------------------------ lifecycle
    def attach(
        self,
        model: nn.Module,
        *,
        root: str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        is_zero: bool = True,
        reduce_device: torch.device | None = None,
        grad_scale: Callable[[], torch.Tensor | float | None] | None = None,
        resumed_at: int | None = None,
        publish: Publish | None = None,
    ) -> Probe:
        """Build the probe for ``model`` when training begins (detached until :meth:`begin_step`).

        Args:
            root: the directory of ``probe.jsonl`` and ``repro/`` unless ``dirpath`` was given.
            dtype: the autocast dtype the model computes in (None: the model's).
            is_zero: this process writes files and prints (rank zero).
            reduce_device: all-reduce the statistics across ranks on this device (None: one process).
            grad_scale: the current loss scale (``16-mixed``), divided out of the gradient statistics.
            resumed_at: the step training resumes from: later records are dropped (None: the
                checkpoint's last logged step, after :meth:`load_state_dict`).
            publish: hands each record to the trainer's loggers (called on every rank).

        Raises:
            KernelUnavailableError: a kernel that cannot run on the model's device or dtype, or a
                primary the model cannot train through there.
        """
        root = Path(self.dirpath or root)
        self._is_zero = bool(is_zero)
        self._probe = probe(
            model,
            self.config,
            dtype=dtype,
            on_failure="ignore",  # the session reports, once per site and direction
            repro_dir=root / "repro" if self._is_zero and self.max_reproducers else None,
            max_reproducers=self.max_reproducers,
        )
        try:  # a primary without a backward on this device is refused before the first step
            check_trainable(self._probe.shadow.primary, model, self.who, fallback=self.config.fallback)
        except KernelUnavailableError:
            self._probe.detach()
            self._probe = None
            raise
        self._probe.detach()  # only training steps are probed: attached at each step's start
        self._probe.shadow.set_grad_scale(grad_scale)
        self._apply_restored()
        self._writer = ProbeLogWriter(root / self.filename)
        self._model_name = type(model).__name__
        self._reduce_device = reduce_device
        self._publish = publish
        if resumed_at is not None:
            self.resumed_from = resumed_at
        self._checked = False
        return self._probe

    def _apply_restored(self) -> None:
        """Give the probe the failures and signed bias restored from a checkpoint or the last fit."""
        if self._probe is None:
            return
        for failure in self.restored_failures:
            key = (failure.site, failure.direction)
            self._probe.shadow.failures.setdefault(key, dataclasses.replace(failure))
            self._reported.add(key)
        self.restored_failures = []
        if self.restored_bias and self._is_zero:  # the other ranks' sums add from zero
            self._probe.shadow.restore_bias(self.restored_bias)
            self.restored_bias = {}

    def begin_step(self, step: int) -> None:
        """A training step begins: the probe compares its calls, at ``step``."""
        if self._probe is not None:
            self._apply_restored()
            self._probe.attach()
            self._probe.set_step(step)

    def pause(self) -> None:
        """Stop comparing until the next :meth:`begin_step` (evaluation, sampling, saving)."""
        if self._probe is not None:
            self._probe.detach()

    def detach(self) -> None:
        """Detach the probe for good, keeping what :meth:`state_dict` and a next :meth:`attach` need."""
        if self._probe is not None:
            self._probe.detach()
            self.restored_failures = self._probe.failures
            self.restored_bias = self._probe.shadow.bias_state()
            self._fallbacks, self._sites_seen = self._probe.fallbacks, sorted(self._probe.calls)
            self._probe = None

    def end_step(
        self,
        step: int,
        *,
        every: int | None = None,
        last: bool = False,
        weights: Callable[[], str | None] | None = None,
        stopping: bool = False,
    ) -> StepResult:
        """A training step ended: check (after the first) that there was something to probe, read the
        statistics at a logging step, a failure to stop at and the last step, and react.

        Args:
            step: the trainer's global step, after the optimizer step.
            every: the trainer's logging interval (``log_every_n_steps`` takes precedence; default 1).
            last: this is the last training step.
            weights: names the non-finite weights in words, or None when all are finite (e.g.
                :func:`~flashprobe.probing.session.nonfinite_weights`); not given: not checked.
            stopping: the trainer is stopping already (the verdict block waits for :meth:`finish`).

        Raises:
            ProbeFailureError: a new failure with ``on_failure="raise"``.
            RuntimeError: after the first step, when the model made no attention call.
            ValueError: after the first step, when ``sites`` matched none of the model's sites.
        """
        if self._probe is None:
            return StepResult()
        if not self._checked:
            self.check_calls()
        every = self.log_every_n_steps or every or 1
        new = self._new_failures()
        halt = self._nonfinite_stop(step, new, weights)
        flushed, summary = False, None
        if step > self.last_logged_step and (
            (new and self.on_failure == "stop") or halt or not step % every or last
        ):
            flushed, summary = True, self.flush(step)
            new += self._new_failures()  # failures a read on a device found
            halt = self._nonfinite_stop(step, new, None) or halt
        stop = self.react(new) or halt
        if new and not stop and not stopping and self._is_zero and not self._printed_failure:
            self._printed_failure = True
            self.print_block()
        return StepResult(flushed=flushed, stop=stop, summary=summary)

    def finish(self, step: int, *, draw: Callable[[Path, Path], Path] | None = None) -> None:
        """Training ended at ``step``: read what is left, detach, then (rank zero) log the verdict
        line, print the verdict block and, with :attr:`plot`, draw ``probe.png`` with ``draw(jsonl, png)``.

        Raises:
            ProbeFailureError: a new failure with ``on_failure="raise"`` (the probe is detached).
            DiskFullError: the disk filled while drawing the plot.
        """
        try:
            if self._probe is not None and step > self.last_logged_step and self._probe.calls:
                self.flush(step)
                self.react(self._new_failures())
        finally:
            self.detach()
        if not self._is_zero:
            return
        if self.last_summary is not None:
            self.log.info("%s", verdict_line(self.last_summary, self.path, who=self.who))
            self.print_block()
        if draw is not None:
            self._plot(draw)

    # ------------------------------------------------------------------------------ verdicts
    def check_calls(self) -> None:
        """After the first training step: fail early when there is nothing to probe.

        Raises:
            RuntimeError: the model made no attention call the probe can see.
            ValueError: ``sites`` matched none of the model's attention sites.
        """
        assert self._probe is not None
        self._checked = True
        calls = self._probe.calls
        if not calls:
            self.detach()
            raise RuntimeError(
                f"{self.who}: {self._model_name} made no torch.nn.functional.scaled_dot_product_attention "
                "call (nor any other attention call the probe sees) in its first training step, so "
                "there is nothing to probe. Either the model has no attention; or it is a transformers "
                "model loaded with attn_implementation='eager', which computes attention with matmuls "
                "(load it with attn_implementation='sdpa', or register_attention() and 'probe_kernel'); "
                "or it calls a fused kernel flashprobe does not intercept, flash-attn/FlashInfer with "
                "arguments it cannot compare (warned), or nn.MultiheadAttention's inference fast path. "
                "Route its attention through F.scaled_dot_product_attention, or remove the callback "
                "(flashprobe train: attention.probe.enabled=false)."
            )
        sites = self.config.sites
        if sites is not None and not any(self._probe.selects(site) for site in calls):
            self.detach()
            raise ValueError(
                f"{self.who}: sites={list(sites)!r} matches none of the model's attention sites "
                f"({', '.join(sorted(calls))}); fix the patterns or use sites=None for all"
            )

    def _new_failures(self) -> list[Failure]:
        """Failures not reported yet (the shadow's log: at once on the CPU, at reads elsewhere)."""
        assert self._probe is not None
        new = [f for f in self._probe.failures if (f.site, f.direction) not in self._reported]
        self._reported.update((f.site, f.direction) for f in new)
        return new

    def react(self, failures: list[Failure]) -> bool:
        """Report new failures as ``on_failure`` says; returns whether to stop training.

        Raises:
            ProbeFailureError: ``on_failure="raise"``, for the first of ``failures``.
        """
        if not failures:
            return False
        if self.on_failure == "raise":
            raise ProbeFailureError(failure_message(failures[0]), failures[0])
        if self._is_zero:
            for failure in failures:
                warnings.warn(failure_message(failure), ProbeWarning, stacklevel=3)
        if self.on_failure != "stop":
            return False
        if self._is_zero:
            self.log.warning("%s: stopping training (on_failure='stop')", self.who)
        return True

    def _nonfinite_stop(
        self, step: int, new: list[Failure], weights: Callable[[], str | None] | None
    ) -> bool:
        """Whether to stop for a new non-finite failure or non-finite ``weights``; why in :attr:`stopped`."""
        if self.on_nonfinite != "stop" or self.stopped is not None:
            return False
        nonfinite = next((f for f in new if f.kind == "nonfinite"), None)
        why = None
        if nonfinite is not None:
            why = (
                f"the primary returned non-finite values at {nonfinite.site} {nonfinite.direction}, "
                f"step {nonfinite.step}"
            )
        elif weights is not None:
            found = weights()
            if found is not None:
                why = f"{found} are non-finite after step {step - 1}"
        if why is None:
            return False
        self.stopped = f"{why} (on_nonfinite='stop'; pass on_nonfinite='continue' to train on)"
        if self._is_zero:
            self.log.error("%s: stopping training: %s", self.who, self.stopped)
        return True

    # ------------------------------------------------------------------------------- reading
    def flush(self, step: int) -> ProbeSummary | None:
        """Read and reset the statistics, add them to the tally, publish and (rank zero) append the record.

        Returns:
            The record's summary, or None when no site had statistics (nothing is written then).
        """
        assert self._probe is not None
        tensors = self._probe.stat_tensors()
        if self._reduce_device is not None:
            tensors = reduce_across_ranks(tensors, self._reduce_device)  # max of maxima, sum of sums
        stats = self._probe.stats(tensors)
        summary = self._probe.summary(stats)
        summary.step = step
        if self.stopped is not None:
            summary.stopped = self.stopped
        self.tally.add(summary, stats)
        self._probe.reset()
        self.last_logged_step = step
        if not stats:
            return None
        self.last_summary = summary
        sites = summary.primary_nonfinite_sites
        if sites and self._is_zero:
            self.log.error(
                "step %s: the primary kernel %s returned %s non-finite values from finite inputs at %s "
                "(the baseline's are finite there): a kernel bug; its error ratio does not show it",
                step,
                self.config.primary,
                summary.primary_nonfinite,
                ", ".join(sites[:3]) + (f" and {len(sites) - 3} more sites" if len(sites) > 3 else ""),
            )
        if self._publish is not None:
            self._publish(step, stats, summary)
        if self._is_zero:
            self._append(step, stats, summary)
        return summary

    def _append(self, step: int, stats: dict[str, Any], summary: ProbeSummary) -> None:
        assert self._writer is not None
        if not self._writer.opened:
            dropped = self._writer.open(self.resumed_from)
            if dropped:
                self.log.warning(
                    "%s: dropped records of steps %s from %s: they are later than the checkpoint "
                    "training resumed from",
                    self.who,
                    dropped,
                    self._writer.path,
                )
        self._writer.append({"step": step, "summary": summary.to_dict(), "sites": stats})
        self.records += 1

    # ------------------------------------------------------------------------------ the answer
    def print_block(self) -> None:
        """Print the verdict block to stdout (``console=True``)."""
        if self.console and self.last_summary is not None:
            rows = self.tally.rows(self.last_summary.failures)
            block = verdict_block(self.last_summary, rows, who=self.who, path=self.path, stopped=self.stopped)
            print(block, flush=True)

    def _plot(self, draw: Callable[[Path, Path], Path]) -> None:
        """Draw ``probe.png`` from ``probe.jsonl``; an error is logged, not raised, except a full disk."""
        path = self.path
        if not self.plot or path is None or not path.is_file() or not path.stat().st_size:
            return
        try:
            self.log.info("%s: per-site deviation plot %s", self.who, draw(path, path.with_suffix(".png")))
        except DiskFullError:  # the run is not complete without it
            raise
        except Exception as err:
            self.log.warning("%s: could not draw %s: %s", self.who, path.with_suffix(".png"), err)

    # ---------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The session's progress as plain data for a checkpoint (the bias sums are this process's)."""
        failures = self.restored_failures if self._probe is None else self._probe.failures
        bias = self.restored_bias if self._probe is None else self._probe.shadow.bias_state()
        return {
            "bias": bias,
            "tally": self.tally.state_dict(),
            "last_logged_step": self.last_logged_step,
            "records": self.records,
            "failures": plain_failures(failures),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (missing keys: a fresh session's values)."""
        self.last_logged_step = state.get("last_logged_step", -1)
        self.records = state.get("records", 0)
        self.restored_failures = [Failure.from_dict(f) for f in state.get("failures", [])]
        self.restored_bias = {s: list(v) for s, v in state.get("bias", {}).items()}
        self.tally.load_state_dict(state.get("tally", {}))
        self.resumed_from = self.last_logged_step


def plain_failures(failures: list[Failure]) -> list[dict[str, Any]]:
    """Failures as plain data, for a checkpoint."""
    return [f.to_dict() for f in failures]


class SessionField:
    """A callback attribute that reads and writes the ``session``'s attribute of its name."""

    def __init__(self, doc: str, attribute: str = "") -> None:
        self.__doc__ = doc
        self.name = attribute

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.session, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.session, self.name, value)


class SessionCallback:
    """Mixin of the training callbacks: builds ``self.session`` and shows its settings and progress
    as attributes."""

    session: ProbeSession

    def __init__(self, config: ProbeConfig | None = None, /, **options: Any) -> None:
        who, log = type(self).__name__, logging.getLogger(type(self).__module__)
        self.session = ProbeSession(config, who=who, log=log, **options)

    config = SessionField("The probe's settings (:class:`~flashprobe.probing.ProbeConfig`).")
    log_every_n_steps = SessionField("Read and record the statistics every n steps (None: the trainer's).")
    dirpath = SessionField("Directory of ``probe.jsonl`` and ``repro/`` (None: the trainer's).")
    filename = SessionField("Name of the JSON-lines file.")
    plot = SessionField("Draw ``probe.png`` at the end of training.")
    on_failure = SessionField("``warn``, ``raise`` or ``stop`` at the first failure of a site and direction.")
    max_reproducers = SessionField("Reproducer files saved at most.")
    on_nonfinite = SessionField("``stop`` or ``continue`` on non-finite weights or primary output.")
    console = SessionField("Print the verdict block to stdout.")
    last_logged_step = SessionField("The last step whose statistics were read (-1: none).")
    records = SessionField("Records written to ``probe.jsonl`` by this process.")
    last_summary = SessionField("The summary of the last record (``{}`` before the first).")
    stopped = SessionField("Why the callback stopped training on non-finite values (None: it did not).")
    probe = SessionField("The attached probe handle (None outside training).")
    fallbacks = SessionField(
        "Where torch's SDPA computed the attention instead of the primary (kept after training)."
    )
    sites_seen = SessionField("Every attention site the probe saw (kept after training).")
    path = SessionField("The ``probe.jsonl`` being written (None before training).")

    @property
    def primary(self) -> Any:
        """The primary kernel spec (None: the model's own)."""
        return self.session.config.primary

    @property
    def baseline(self) -> Any:
        """The baseline kernel spec."""
        return self.session.config.baseline

    @property
    def sites(self) -> tuple[str, ...] | None:
        """The site patterns (None: every site)."""
        return self.session.config.sites
