"""One training session of a run: fit the built objects, record the session in ``run.json``, and stop
with :class:`~flashprobe.app.run_dir.RunStoppedError` on Ctrl-C, a full disk or non-finite values."""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from flashprobe.app.imports import imported_modules
from flashprobe.app.launch import ranks_rerun_this_job
from flashprobe.app.machine import machine_facts
from flashprobe.app.run_dir import RunDir, RunStart, RunStoppedError
from flashprobe.formats.atomic import disk_full
from flashprobe.formats.run_record import finish_session, start_session

__all__ = ["fit"]

log = logging.getLogger(__name__)


def fit(
    cfg: DictConfig, run: RunDir, start: RunStart, built: dict[str, Any]
) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit the built objects in ``run`` from ``start`` (threads already set) and record the session.

    Args:
        cfg: the run's composed config.
        run: its directory, locked, its records written (:meth:`RunDir.record_start`).
        start: where the run starts (:meth:`RunDir.start`).
        built: the ``datamodule``, ``module``, ``trainer``, ``callbacks`` and ``loggers``.

    Returns:
        ``(metrics, objects)``: the final callback metrics as floats, and ``built`` with ``run_dir``.

    Raises:
        RunStoppedError: the run stopped early (non-finite values, Ctrl-C, a full disk).
        Exception: whatever else training raised, after ``run.json`` recorded it.
    """
    from flashprobe.callbacks.nonfinite_guard import NonFiniteGuard

    trainer = built["trainer"]
    guard = next(c for c in built["callbacks"] if isinstance(c, NonFiniteGuard))
    started = time.perf_counter()
    failure, crashed = _fit_session(run, start, built)
    failure = failure or _stopped_early(cfg, run, built["callbacks"], guard)
    if trainer.is_global_zero:
        seconds = time.perf_counter() - started
        failure = _record_end(run, built, guard, seconds, failure, crashed)
    if crashed is not None:
        raise crashed
    if failure is not None:
        raise failure
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    return metrics, {**built, "run_dir": run.path}


def _fit_session(
    run: RunDir, start: RunStart, built: dict[str, Any]
) -> tuple[RunStoppedError | None, Exception | None]:
    """Record the session's start and run ``trainer.fit``: ``(why it stopped, what it raised)``."""
    from lightning.pytorch.trainer.states import TrainerStatus

    trainer, module, loggers = built["trainer"], built["module"], built["loggers"]
    ctrl_c = signal.getsignal(signal.SIGINT)
    failure: RunStoppedError | None = None
    crashed: Exception | None = None
    try:
        if trainer.is_global_zero:
            start_session(
                run.path,
                from_step=start.from_step,
                max_steps=trainer.max_steps,
                machine=machine_facts(),
                resumed_from=start.checkpoint,
                imports=imported_modules(),
            )
            _announce_wandb(loggers)
        with ranks_rerun_this_job(run.path):
            trainer.fit(module, datamodule=built["datamodule"], ckpt_path=start.checkpoint)
    except SystemExit as exit_:  # Lightning's answer to Ctrl-C: sys.exit(1) after a graceful shutdown
        if trainer.state.status != TrainerStatus.INTERRUPTED:
            raise
        failure = RunStoppedError(
            f"interrupted (Ctrl-C) at step {trainer.global_step}; saved: {run.saved()}. Continue with: "
            f"{run.resume_command()}",
            exit_code=130,
        )
        failure.__cause__ = exit_
    except Exception as err:  # a full disk stops the run; anything else is recorded, then raised
        if disk_full(err):
            failure = run.disk_full_stop(err)
        else:
            crashed = err
    finally:
        signal.signal(signal.SIGINT, ctrl_c)  # Lightning ignores Ctrl-C from its first one on
        getattr(module, "unroute_attention", lambda: None)()  # Lightning skips teardown when fit raises
        failure = _close_loggers(run, loggers, failure)
    return failure, crashed


def _close_loggers(
    run: RunDir, loggers: list[Any], failure: RunStoppedError | None
) -> RunStoppedError | None:
    """Finalize the loggers and W&B's run; returns ``failure``, or the stop of a full disk."""
    try:
        for lg in loggers:
            finalize = getattr(lg, "finalize", None)
            if finalize is not None:
                finalize("success")
    except (OSError, RuntimeError) as err:  # the CSV logger's last rows on a full disk
        if not disk_full(err):
            raise
        failure = failure or run.disk_full_stop(err)
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    return failure


def _stopped_early(cfg: DictConfig, run: RunDir, callbacks: list[Any], guard: Any) -> RunStoppedError | None:
    """The stop of a run the non-finite guard or the probe ended, or None."""
    from flashprobe.callbacks.attention_probe import AttentionProbe

    if guard.reason is not None and guard.action == "stop":
        return RunStoppedError(
            f"{guard.reason}: training stopped there (run.json says why); the last finite weights: "
            f"{run.saved()}. Look at the kernel ({cfg.attention.kernel}) and probe.jsonl's non-finite "
            f"counts; once it is fixed, `{run.resume_command()}` continues from there "
            "(on_nonfinite=continue trains on)",
            exit_code=1,
        )
    stopped = next((c.stopped for c in callbacks if isinstance(c, AttentionProbe) and c.stopped), None)
    if stopped is not None:
        return RunStoppedError(
            f"AttentionProbe: {stopped}: training stopped there (run.json says why; the reproducer is in "
            f"repro/, see probe.jsonl); the last finite weights: {run.saved()}",
            exit_code=1,
        )
    return None


def _record_end(
    run: RunDir,
    built: dict[str, Any],
    guard: Any,
    seconds: float,
    failure: RunStoppedError | None,
    crashed: Exception | None,
) -> RunStoppedError | None:
    """Record the session's end in ``run.json`` (rank zero); returns the run's stop, noting a record
    that could not be written.

    Raises:
        Exception: ``crashed`` when the record failed too; the record's error when the run had not
            stopped and the disk is not full.
    """
    from flashprobe.callbacks.weight_snapshot import trained_attention_record

    trainer, module = built["trainer"], built["module"]
    note = guard.reason if guard.action == "continue" else None
    failed = None if failure is None else str(failure)
    if crashed is not None:
        failed = f"{type(crashed).__name__}: {(str(crashed).strip().splitlines() or [''])[0]}"
    try:  # what computed the attention (the probe's primary or the routed kernel, its fallbacks)
        attention = trained_attention_record(trainer, module)
    except Exception:  # a record of what ran must not fail the run's bookkeeping
        attention = None
    try:
        finish_session(
            run.path,
            global_step=trainer.global_step,
            seconds=seconds,
            failed=failed,
            note=note,
            attention=attention,
        )
    except (OSError, ValueError) as err:
        if crashed is not None:
            raise crashed from None
        if failure is None and not disk_full(err):
            raise
        failure = failure or run.disk_full_stop(err)
        failure.args = (f"{failure}; run.json could not record it ({err})",)
    return failure


def _announce_wandb(loggers: list[Any]) -> None:
    """Say where the W&B run lives before training (so the run's last lines are the probe's summary)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            offline, where = run.settings.mode in ("offline", "dryrun"), Path(run.dir).parent
            upload = f" (upload: wandb sync {where})" if offline else ""
            log.info("W&B run %s: %s%s", "(offline)" if offline else run.url, where, upload)
