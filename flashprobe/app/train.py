"""``flashprobe train``: the Hydra app that trains the text-to-image model.

:func:`train` builds everything from a composed config and returns ``(metrics, objects)``;
:func:`cli_main` is the ``@hydra.main`` entry point of the command (``-m`` multiruns included).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from flashprobe.app.compose import CONF_DIR, compose, lazy_sources
from flashprobe.app.console import StepProgressBar, quiet_third_party
from flashprobe.app.fit import fit
from flashprobe.app.imports import command_options, import_modules, imported_modules
from flashprobe.app.launch import as_train_app, run_hydra_job
from flashprobe.app.run_dir import RunDir, RunStoppedError
from flashprobe.app.schema import RunSchema, check_sites
from flashprobe.app.train_checks import (
    REFUSALS,
    check_config,
    command_line,
    instantiation_reason,
    is_refusal,
    job_config,
    precheck,
    refusal_paragraph,
    refusals,
)
from flashprobe.formats.run_dir import RUN_OUTPUTS, existing_run, last_checkpoint
from flashprobe.t2i.precision import trainer_precision

__all__ = [
    "CONF_DIR",
    "REFUSALS",
    "RUN_OUTPUTS",
    "RunStoppedError",
    "check_config",
    "cli_main",
    "command_line",
    "compose",
    "existing_run",
    "last_checkpoint",
    "train",
]

log = logging.getLogger(__name__)


def _trainer_arguments(cfg: DictConfig, callbacks: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Trainer's config and extra arguments: exact precision on CPU, atomic checkpoints."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from flashprobe.formats.checkpoint_io import AtomicCheckpointIO

    config = OmegaConf.to_container(cfg.trainer, resolve=True)
    config.setdefault("enable_progress_bar", sys.stdout.isatty())  # a bar in a terminal, none in logs
    extra = trainer_precision(config.pop("precision", "32-true"), config.get("accelerator", "cpu"))
    extra["plugins"] = [*extra.get("plugins", []), AtomicCheckpointIO()]
    if not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        config["enable_checkpointing"] = False  # callbacks.checkpoint=null means no checkpoints
    return config, extra


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Train the text-to-image model described by ``cfg``.

    A directory holding a run is refused unless ``resume`` (``"auto"``: continue, skip if finished,
    else start) or ``overwrite=true`` is set. The run holds its directory's lock throughout and
    stops with :class:`RunStoppedError` at a non-finite value (``on_nonfinite``), Ctrl-C or a full
    disk. A resumed run gives the same bits as an uninterrupted one (:mod:`flashprobe.t2i.steps`).

    Args:
        cfg: a composed config (:func:`compose`), with ``run_dir`` set outside a Hydra app.

    Returns:
        ``(metrics, objects)``: the trainer's final callback metrics as floats, and the built
        ``datamodule``, ``module``, ``trainer``, ``callbacks``, ``loggers`` and ``run_dir``
        (only ``run_dir`` and ``skipped`` when the run had finished already).

    Raises:
        FileExistsError: see :meth:`RunDir.start`; nothing is written then.
        DirectoryLockedError: another process is writing into the run directory.
        CheckpointError: the checkpoint to continue from is unsafe, truncated or not a checkpoint.
        ValueError: a configuration value is invalid (see :func:`check_config`).
        RunStoppedError: the run stopped early (non-finite values, Ctrl-C, a full disk).
    """
    with contextlib.ExitStack() as stack:
        with refusals():
            run = RunDir.of(cfg)
            schema = RunSchema.from_config(cfg, run.path, source=_job_sources())
            stack.enter_context(run.locked())
            start = run.start(cfg)
            if start.skipped:
                log.info("skipping the run: %s", start.skipped)
                return {}, {"run_dir": run.path, "skipped": start.skipped}
        os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network unless asked for
        callers_threads = torch.get_num_threads()
        if schema.threads:
            torch.set_num_threads(schema.threads)  # CPU reductions (and so the last bits) depend on it
        try:
            with refusals():
                built = _build(cfg, run.path)
            run.record_start(cfg)
            return fit(cfg, run, start, built)
        finally:
            torch.set_num_threads(callers_threads)  # an in-process run leaves the caller's setting as it was


def _job_sources() -> Any:
    """Where each value of this Hydra job's config came from (composed only for a refusal's message)."""
    return lazy_sources(list(HydraConfig.get().overrides.task)) if HydraConfig.initialized() else None


def _build(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Seed and build the run's objects (nothing is written yet).

    Raises:
        ValueError: an object refused its configuration (naming the config key and its reason).
    """
    import lightning as L
    from hydra.errors import InstantiationException
    from lightning.pytorch.callbacks import ProgressBar

    from flashprobe.callbacks.attention_probe import AttentionProbe
    from flashprobe.callbacks.nonfinite_guard import NonFiniteGuard

    quiet_third_party()  # after Lightning's import, which adds its own console handler
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    try:
        datamodule = hydra.utils.instantiate(cfg.data)
        module = hydra.utils.instantiate(cfg.module)
        callbacks = [
            hydra.utils.instantiate(c)
            for name, c in (cfg.get("callbacks") or {}).items()
            if c is not None and (name != "attention_probe" or cfg.attention.probe.enabled)
        ]
        if not any(isinstance(c, NonFiniteGuard) for c in callbacks):
            callbacks.append(NonFiniteGuard(action=str(cfg.get("on_nonfinite") or "stop")))
        # the probe's callbacks last: their summary is what the run prints last
        callbacks.sort(key=lambda c: isinstance(c, AttentionProbe))
        loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None]
        trainer_config, extra = _trainer_arguments(cfg, callbacks)
        if trainer_config["enable_progress_bar"] and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())  # "train 3/5" instead of Lightning's "Epoch 0/-2"
        trainer: L.Trainer = hydra.utils.instantiate(
            trainer_config,
            default_root_dir=str(run_dir),
            callbacks=callbacks,
            logger=loggers or False,
            **extra,
        )
    except InstantiationException as err:
        raise ValueError(instantiation_reason(err)) from err
    probing = cfg.attention.probe.enabled and (cfg.get("callbacks") or {}).get("attention_probe") is not None
    check_sites(cfg.attention.probe.get("sites") if probing else None, module)
    return {
        "datamodule": datamodule,
        "module": module,
        "trainer": trainer,
        "callbacks": callbacks,
        "loggers": loggers,
    }


def _check_build(cfg: DictConfig, run_dir: Path) -> None:
    """Build the run's objects and let them go, before the run directory exists: an object that
    refuses its configuration refuses the run before anything is written. The build logs nothing
    and leaves the process's environment, warnings and logging as they were; the run builds its
    own objects (and logs) in its job.

    Raises:
        ValueError: an object refused its configuration (see :func:`_build`).
    """
    environment, disabled = dict(os.environ), logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), refusals():
            warnings.simplefilter("ignore")
            _build(cfg, run_dir)
    finally:
        logging.disable(disabled)
        for name in set(os.environ) - set(environment):  # set by the build (the seed, W&B's homes)
            del os.environ[name]
        os.environ.update({k: v for k, v in environment.items() if os.environ.get(k) != v})


class _TrainJob:
    """The Hydra task of one ``flashprobe train`` command, run for each job of a multirun: it trains,
    and prints a stop or refusal in one paragraph (exit 1/130 or 2).

    Args:
        verbose: ``flashprobe train -v``: tracebacks of flashprobe's own errors too.
    """

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose

    def traceback_wanted(self) -> bool:
        """Whether flashprobe's own errors keep their traceback (``-v`` or ``HYDRA_FULL_ERROR=1``)."""
        return self.verbose or os.environ.get("HYDRA_FULL_ERROR") == "1"

    def task(self, cfg: DictConfig) -> float | None:
        """Train one job's run; its validation loss (what a Hydra sweeper would minimise)."""
        try:
            import_modules(imported_modules())  # a rank or a launcher's job: the modules --import named
            metrics, _ = train(cfg)
        except RunStoppedError as err:
            if self.traceback_wanted():
                raise
            print(f"flashprobe train: {err}", file=sys.stderr, flush=True)
            raise SystemExit(err.exit_code) from None
        except Exception as err:
            if not is_refusal(err) or self.traceback_wanted():
                raise
            print(f"flashprobe train: error: {refusal_paragraph(err)}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        return metrics.get("val/loss")

    def run_hydra(self) -> None:
        """Run Hydra's app on ``sys.argv`` (Hydra reads its command line there only) with :meth:`task`."""
        hydra.main(config_path="../conf", config_name="config", version_base="1.3")(self.task)()

    def refused(self, err: Exception) -> bool:
        """Print ``err`` as a refusal (one paragraph) and say so; False: ``err`` is to be raised."""
        if not (isinstance(err, REFUSALS) or is_refusal(err)) or self.traceback_wanted():
            return False
        print(f"flashprobe train: error: {refusal_paragraph(err)}", file=sys.stderr)
        return True


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe train [-v] [--import MODULE] [--config-dir DIR] [overrides]``.

    A single run's config is composed once, every setting and path checked and the run's objects
    built once on trial before its directory exists: a refused run writes nothing. Its Hydra job
    then runs on that config with the directory locked (:func:`~flashprobe.app.launch.run_hydra_job`);
    a finished run that ``resume=`` skips runs none. ``-m`` and Hydra's other flags run Hydra's app
    (a multirun checked for its first job). flashprobe's own errors print one message and return 2
    (``-v`` or ``HYDRA_FULL_ERROR=1``: with the traceback). Hydra runs inside
    :func:`~flashprobe.app.launch.as_train_app`, so DDP ranks re-run this module.
    """
    given = list(sys.argv[1:] if argv is None else argv)
    job = _TrainJob(verbose=any(a in ("-v", "--verbose") for a in given))
    given = [a for a in given if a not in ("-v", "--verbose")]
    HydraConfig.instance().cfg = None  # a job that ended earlier in this process is not this command's
    with contextlib.ExitStack() as stack:
        try:
            given = stack.enter_context(command_options(given))
            args = command_line(given)
            cfg, run_dir = precheck(args, given)
            skipped = None
            if cfg is not None and run_dir is not None:
                task_cfg = job_config(cfg, run_dir)
                skipped = RunDir(run_dir).skipped(task_cfg)
                if not skipped:
                    _check_build(task_cfg, run_dir)
                stack.enter_context(RunDir(run_dir).locked())
        except Exception as err:
            if not job.refused(err):
                raise
            return 2
        with as_train_app(args):
            if cfg is None:
                job.run_hydra()
            elif skipped:
                print(f"flashprobe train: skipping the run: {skipped}", flush=True)
            else:
                run_hydra_job(cfg, job.task)
    return 0


if __name__ == "__main__":  # a rank Lightning's DDP launcher started, or `python -m flashprobe.app.train`
    _TrainJob().run_hydra()
