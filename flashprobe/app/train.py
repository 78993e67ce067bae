"""``flashprobe train``: the Hydra app that trains the text-to-image model.

``train(cfg)`` builds everything from a composed config and returns ``(metrics, objects)`` so tests
and the study call it directly; :func:`cli_main` is the thin ``@hydra.main`` entry point used by
the ``flashprobe train`` command (``-m`` multirun sweeps included).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from flashprobe.app.compose import CONF_DIR, check_paths, compose, compose_with_sources, lazy_sources
from flashprobe.app.console import StepProgressBar, quiet_third_party
from flashprobe.app.imports import command_options, import_modules, imported_modules
from flashprobe.app.machine import machine_facts
from flashprobe.app.overrides import (
    RecordedOverrideError,
    config_groups,
    override_path,
    override_value,
    recorded_overrides,
)
from flashprobe.app.schema import RunSchema, check_sites
from flashprobe.errors import FlashprobeError
from flashprobe.formats.atomic import (
    FULL_BELOW,
    DiskFullError,
    atomic_write_text,
    disk_full,
    exception_chain,
    free_space,
)
from flashprobe.formats.lock import DirectoryLockedError, directory_lock
from flashprobe.formats.paths import OutputPathError, check_output_dir, printable
from flashprobe.formats.run_dir import (
    RUN_DIR_NAMES,
    RUN_OUTPUTS,
    check_links,
    check_resumable,
    checkpoint_step,
    existing_run,
    last_checkpoint,
    occupied,
    refuse_foreign,
    remove_later_checkpoints,
    remove_outputs,
    remove_stray_temporaries,
    resume_point,
)
from flashprobe.formats.run_record import (
    claim_outputs,
    finish_session,
    owned_outputs,
    read_run_record,
    start_session,
)
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

def _run_dir(cfg: DictConfig) -> Path:
    """The run directory: Hydra's output dir inside a Hydra app, else ``cfg.run_dir``."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir)
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise ValueError("train: no run directory; set run_dir=... when calling train() outside Hydra")


def _launched_rank() -> bool:
    """Whether this process is a rank other than zero: started by Lightning's launcher (``LOCAL_RANK``,
    ``NODE_RANK``), by torchrun (``RANK``) or as a SLURM task of a multi-task job (``SLURM_PROCID``),
    where rank zero decides how the run starts and writes its records."""
    ranks = ["LOCAL_RANK", "NODE_RANK", "RANK"]
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        ranks.append("SLURM_PROCID")
    return any(int(os.environ.get(var, "0") or 0) > 0 for var in ranks)


#: The variables Lightning's DDP launcher sets in the launching process (rank zero).
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextlib.contextmanager
def _ranks_rerun_this_job(run_dir: Path) -> Iterator[None]:
    """Point Lightning's DDP launcher at this one job when Hydra runs a multirun (a study).

    Lightning starts ranks 1… by re-running the main module with ``sys.argv[1:]`` and
    ``hydra.run.dir=<HydraConfig run.dir>``. In a multirun job (the study's basic, joblib or
    submitit launcher) that would re-run the whole sweep — or submitit's worker module — in a
    directory of its own. For the duration of ``fit`` the ranks are made to run exactly this job:
    ``python -m flashprobe.app.train <this job's overrides>`` in this job's directory. Afterwards
    the rendezvous variables Lightning set (``LOCAL_RANK``, ...) are removed and the process group
    destroyed, so the next job of the sweep launches its own ranks. Outside a multirun nothing
    changes.
    """
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        yield
        return
    import __main__

    hydra_cfg = HydraConfig.get()
    saved = sys.argv, getattr(__main__, "__spec__", None), hydra_cfg.run.dir
    sys.argv = [__file__, *hydra_cfg.overrides.task]
    __main__.__spec__ = importlib.util.find_spec(__name__)
    with read_write(hydra_cfg.run):
        hydra_cfg.run.dir = str(run_dir)
    environment = {var: os.environ.get(var) for var in _RENDEZVOUS}
    try:
        yield
    finally:
        sys.argv, __main__.__spec__ = saved[0], saved[1]
        with read_write(hydra_cfg.run):
            hydra_cfg.run.dir = saved[2]
        if not _launched_rank():
            for var, value in environment.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _start(cfg: DictConfig, run_dir: Path) -> tuple[str | None, str | None]:
    """Decide how the run starts: ``(checkpoint to resume from or None, why it is skipped or None)``.

    Raises:
        FileExistsError: a fresh start in a directory that holds a run (no resume, no overwrite).
        FileNotFoundError: ``resume`` names a run without a checkpoint.
        ValueError: ``resume`` names another directory than the run directory.
    """
    resume, found = cfg.get("resume"), existing_run(run_dir)
    if _launched_rank():  # a DDP rank started by rank zero, which has decided already
        checkpoint = resume_point(run_dir, cfg.trainer.get("max_steps", -1)) if resume is not None else None
        return (str(checkpoint) if checkpoint else cfg.get("ckpt_path")), None
    if resume not in (None, "auto") and Path(str(resume)).resolve() != run_dir.resolve():
        raise ValueError(
            f"resume={resume} but the run directory is {run_dir}; use `flashprobe train resume=DIR` "
            "(it trains in DIR) or set run_dir to the same directory"
        )
    if resume is not None:
        remove_stray_temporaries(run_dir)
        record = read_run_record(run_dir)
        max_steps = cfg.trainer.get("max_steps", -1)
        finished = (
            record is not None
            and record.get("status") == "finished"
            and record.get("global_step") == max_steps
        )
        missing = _missing_artefacts(cfg, run_dir) if finished else []
        if missing == ["probe.png"] and _redraw_probe_figure(run_dir):
            missing = []
        if finished and not missing:
            return None, f"{run_dir} finished {max_steps} steps already"
        checkpoint = resume_point(run_dir, max_steps)
        if missing:
            log.warning(
                "%s finished but lacks %s: training it again from %s to rebuild %s (the same bits)",
                run_dir,
                ", ".join(missing),
                f"{checkpoint.relative_to(run_dir)}" if checkpoint else "step 0",
                "them" if len(missing) > 1 else "it",
            )
        if checkpoint is not None:
            remove_later_checkpoints(run_dir, checkpoint_step(checkpoint))
            return str(checkpoint), None
        status = None if record is None else record.get("status")
        checkpointing = (cfg.get("callbacks") or {}).get("checkpoint") is not None
        # No checkpoint to continue from: a run killed (or stopped) in its start-up (no record yet, or
        # "starting") or before its first checkpoint, or a finished run to rebuild, trains from step 0.
        killed_early = status in (None, "starting") or (checkpointing and status != "finished")
        killed_early = killed_early or bool(missing)
        if killed_early and not missing and record is not None:  # the only continuation is step 0
            log.warning("%s stopped before its first checkpoint: training it again from step 0", run_dir)
        if resume != "auto" and not killed_early:
            raise FileNotFoundError(
                f"resume={resume}: {run_dir / 'checkpoints'} holds no checkpoint to continue from (the run "
                "saves them with callbacks.checkpoint); start it again with overwrite=true"
            )
        remove_outputs(run_dir, found)  # this run's own outputs, written before its first checkpoint
        return None, None
    if found and not cfg.get("overwrite"):
        raise FileExistsError(occupied(run_dir, found))
    remove_outputs(run_dir, found)
    return cfg.get("ckpt_path"), None


def _missing_artefacts(cfg: DictConfig, run_dir: Path) -> list[str]:
    """What a finished run must have and ``run_dir`` lacks: ``checkpoints/last.ckpt`` (when the run saves
    it), ``probe.png`` (when probed and plotted), the sample grid of the last step (when the last step
    validates), the snapshot manifest (when snapshots are taken); paths relative to ``run_dir``."""
    callbacks = cfg.get("callbacks") or {}
    max_steps, every = cfg.trainer.get("max_steps", -1), cfg.trainer.get("val_check_interval")
    wanted = []
    checkpoint = callbacks.get("checkpoint")
    if checkpoint is not None and checkpoint.get("save_last"):
        wanted.append(Path(str(checkpoint.get("dirpath") or run_dir / "checkpoints")) / "last.ckpt")
    probe = callbacks.get("attention_probe")
    if cfg.attention.probe.enabled and probe is not None and probe.get("plot", True):
        log_file = Path(str(probe.get("dirpath") or run_dir)) / str(probe.get("filename") or "probe.jsonl")
        wanted.append(log_file.with_suffix(".png"))
    if callbacks.get("weight_snapshot") is not None:
        wanted.append(run_dir / "snapshots" / "manifest.json")
    absent = [p for p in wanted if not p.is_file()]
    missing = [str(p.relative_to(run_dir) if p.is_relative_to(run_dir) else p) for p in absent]
    validates_last = (  # validation counts batches across epochs and falls on the last step
        isinstance(max_steps, int)  # checked by the schema: an int, and every a positive number
        and max_steps > 0
        and isinstance(every, int)
        and max_steps % every == 0
        and cfg.trainer.get("check_val_every_n_epoch") is None
        and cfg.trainer.get("limit_val_batches", 1) not in (0, 0.0)
        and ((cfg.get("data") or {}).get("num_val") or 0) > 0
    )
    if validates_last:
        grid = f"step_{max_steps:07d}.png"  # in the logger's directory (csv/version_N/samples/...)
        if not any(run_dir.glob(f"**/samples/{grid}")):
            missing.append(f"samples/{grid}")
    return missing


def _redraw_probe_figure(run_dir: Path) -> bool:
    """Draw a finished run's missing ``probe.png`` from its ``probe.jsonl``; whether it was drawn."""
    from flashprobe.report.probe_figures import plot_probe

    probe_log = run_dir / "probe.jsonl"
    if not probe_log.is_file() or not probe_log.stat().st_size:
        return False
    figure = plot_probe(probe_log, run_dir / "probe.png")
    log.warning("%s finished without probe.png: drew it from probe.jsonl (%s)", run_dir, figure)
    return True


def check_config(
    cfg: DictConfig, run_dir: str | Path | None = None, source: Callable[[str], str] | None = None
) -> RunSchema:
    """Check every setting of a composed run config before any work (what ``flashprobe train`` and
    ``flashprobe study`` do first): the schemas (:class:`~flashprobe.app.schema.RunSchema`: steps,
    intervals, seeds, threads, learning rate, data sizes against the machine's memory, names that become
    paths, kernels and their placement, the probe's settings; given ``run_dir``, that every callback
    writes inside it), and ``attention.probe.sites`` against the model's module paths (the LightningModule
    is built for it, on its own, which also checks its arguments; nothing is written).

    Returns:
        The validated schema.

    Raises:
        ValueError: naming the setting, the value and what to give instead.
    """
    from hydra.errors import InstantiationException

    if run_dir is not None:  # where ${run_dir} points
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    schema = RunSchema.from_config(cfg, run_dir, source)
    if schema.attention.probing and cfg.attention.probe.get("sites") is not None:
        try:
            module = hydra.utils.instantiate(cfg.module)
        except InstantiationException as err:
            raise ValueError(_instantiation_reason(err)) from err
        check_sites(cfg.attention.probe.sites, module)
    return schema


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

    A run directory that already holds a run is refused unless ``resume`` (continue it from its
    last checkpoint; ``"auto"``: continue if it can, skip it if it finished, else start it) or
    ``overwrite=true`` (delete its outputs — only those its ``run.json`` records as flashprobe's)
    is set. The run holds the lock of its directory throughout (one writer per run), reads
    checkpoints with ``weights_only=True`` only, and stops at a non-finite loss or weight
    (``on_nonfinite``), on Ctrl-C or on a full disk with :class:`RunStoppedError`, its session
    recorded in ``run.json``. Every random choice of a training batch is a
    function of ``(seed, batch index)`` (:mod:`flashprobe.t2i.steps`), so a resumed run gives the
    same weights, snapshots and ``probe.jsonl`` as an uninterrupted one.

    Args:
        cfg: a composed ``flashprobe/conf/config.yaml`` (see :func:`compose`), optionally with
            ``run_dir`` set when called outside a Hydra app.

    Returns:
        ``(metrics, objects)``: the trainer's final callback metrics as floats, and the built
        ``datamodule``, ``module``, ``trainer``, ``callbacks``, ``loggers`` and ``run_dir``
        (only ``run_dir`` and ``skipped`` when the run had finished already).

    Raises:
        FileExistsError: see :func:`_start`; nothing is written then.
        DirectoryLockedError: another process is writing into the run directory.
        CheckpointError: the checkpoint to continue from is unsafe, truncated or not a checkpoint.
        ValueError: a configuration value is invalid (see :func:`check_config`).
        RunStoppedError: the run stopped early (non-finite values, Ctrl-C, a full disk).
    """
    with contextlib.ExitStack() as stack:
        with _refusals():
            run_dir = _run_dir(cfg)
            schema = RunSchema.from_config(cfg, run_dir, source=_job_sources())
            if not _launched_rank():  # the ranks run inside rank zero's lock
                stack.enter_context(directory_lock(run_dir, what="run directory"))
                check_links(run_dir)
            checkpoint, skipped = _start(cfg, run_dir)
            if skipped:
                log.info("skipping the run: %s", skipped)
                return {}, {"run_dir": run_dir, "skipped": skipped}
            from_step = _checkpoint_step(cfg, checkpoint)
            if checkpoint and cfg.get("resume") is not None:
                check_resumable(run_dir, from_step)
        os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network unless asked for
        callers_threads = torch.get_num_threads()
        if schema.threads:
            torch.set_num_threads(schema.threads)  # CPU reductions (and so the last bits) depend on it
        try:
            with _refusals():
                built = _build(cfg, run_dir)
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                if not _launched_rank():
                    _write_hydra_record(cfg, run_dir)
                    foreign = set(existing_run(run_dir)) - set(owned_outputs(run_dir, RUN_OUTPUTS))
                    claim_outputs(run_dir, [n for n in RUN_OUTPUTS if n not in foreign])  # before writing any
                    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
            except OSError as err:  # run.json says "starting" (or is as it was): resume= starts it afresh
                if not disk_full(err):
                    raise
                raise _disk_full_stop(run_dir, err) from err
            return _fit(cfg, run_dir, checkpoint, from_step, built)
        finally:
            torch.set_num_threads(callers_threads)  # an in-process run leaves the caller's setting as it was


def _job_sources() -> Any:
    """Where each value of this Hydra job's config came from (composed only for a refusal's message)."""
    return lazy_sources(list(HydraConfig.get().overrides.task)) if HydraConfig.initialized() else None


def _job_of(run_dir: Path) -> bool:
    """Whether the Hydra job this process holds is the one of ``run_dir`` (a job that ran earlier in
    the process leaves its config behind: a later library call of :func:`train` is not that job)."""
    output_dir = OmegaConf.select(HydraConfig.instance().cfg, "hydra.runtime.output_dir")
    return output_dir is not None and Path(str(output_dir)).resolve() == run_dir.resolve()


def _write_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """Write the run's ``.hydra/`` record (its config, Hydra's config, its overrides: what ``resume=``
    reads) as Hydra would, once the run starts: through flashprobe's atomic writer, never through a link
    (Hydra's own writing of it is off: ``hydra.output_subdir: null``); nothing outside a Hydra job."""
    if not HydraConfig.initialized() or not _job_of(run_dir):
        return
    record = run_dir / ".hydra"
    atomic_write_text(record / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write_text(record / "hydra.yaml", OmegaConf.to_yaml(HydraConfig.instance().cfg))
    atomic_write_text(record / "overrides.yaml", OmegaConf.to_yaml(HydraConfig.get().overrides.task))


def _checkpoint_step(cfg: DictConfig, checkpoint: str | None) -> int:
    """The step the run continues from: ``checkpoint``'s ``global_step`` (read safely), else 0.

    Raises:
        CheckpointError: the checkpoint is unsafe to unpickle, truncated or not a checkpoint.
        ValueError: ``trainer.max_steps`` lies below the checkpoint's step.
    """
    if not checkpoint:
        return 0
    step = checkpoint_step(checkpoint)
    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps not in (None, -1) and step > max_steps:
        raise ValueError(
            f"trainer.max_steps={max_steps} lies below the step of the checkpoint it resumes from "
            f"({checkpoint}: step {step}); give trainer.max_steps={step} or more"
        )
    return step


def _instantiation_reason(err: Exception) -> str:
    """Hydra's ``InstantiationException`` as ``KEY: the object's reason`` (one line), or its own message
    where it names no key or no cause (e.g. a ``_target_`` that cannot be imported)."""
    lines = str(err).splitlines()
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None)
    if key is None or err.__cause__ is None:
        return " ".join(str(err).split())
    return f"{key}: {_refusal_paragraph(err.__cause__)}"


def _build(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Seed and build the run's objects (nothing is written yet); a bad setting fails here.

    Raises:
        ValueError: an object refused its configuration (Hydra's ``InstantiationException``, whose
            message names the config key and the object's reason).
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
        # The probe's callbacks last: their end-of-training summary (verdict, worst site) is what
        # the run prints last.
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
        raise ValueError(_instantiation_reason(err)) from err
    probing = cfg.attention.probe.enabled and (cfg.get("callbacks") or {}).get("attention_probe") is not None
    check_sites(cfg.attention.probe.get("sites") if probing else None, module)
    return {
        "datamodule": datamodule,
        "module": module,
        "trainer": trainer,
        "callbacks": callbacks,
        "loggers": loggers,
    }


def _fit(
    cfg: DictConfig, run_dir: Path, checkpoint: str | None, from_step: int, built: dict[str, Any]
) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit the built objects (the body of :func:`train`, threads already set)."""
    from lightning.pytorch.trainer.states import TrainerStatus

    from flashprobe.callbacks.attention_probe import AttentionProbe
    from flashprobe.callbacks.nonfinite_guard import NonFiniteGuard
    from flashprobe.callbacks.weight_snapshot import trained_attention_record

    datamodule, module, callbacks = built["datamodule"], built["module"], built["callbacks"]
    loggers, trainer = built["loggers"], built["trainer"]
    guard = next(c for c in callbacks if isinstance(c, NonFiniteGuard))
    started = time.perf_counter()
    ctrl_c = signal.getsignal(signal.SIGINT)
    failure: RunStoppedError | None = None
    crashed: Exception | None = None
    try:
        if trainer.is_global_zero:
            start_session(
                run_dir,
                from_step=from_step,
                max_steps=trainer.max_steps,
                machine=machine_facts(),
                resumed_from=checkpoint,
                imports=imported_modules(),
            )
            _announce_wandb(loggers)
        with _ranks_rerun_this_job(run_dir):
            trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
    except SystemExit as exit_:  # Lightning's answer to Ctrl-C: sys.exit(1) after a graceful shutdown
        if trainer.state.status != TrainerStatus.INTERRUPTED:
            raise
        failure = RunStoppedError(
            f"interrupted (Ctrl-C) at step {trainer.global_step}; saved: {_saved(run_dir)}. Continue with: "
            f"{_resume_command(run_dir)}",
            exit_code=130,
        )
        failure.__cause__ = exit_
    except Exception as err:  # a full disk stops the run; anything else is recorded, then raised
        if disk_full(err):
            failure = _disk_full_stop(run_dir, err)
        else:
            crashed = err
    finally:
        signal.signal(signal.SIGINT, ctrl_c)  # Lightning ignores Ctrl-C from its first one on
        getattr(module, "unroute_attention", lambda: None)()  # Lightning skips teardown when fit raises
        try:
            for lg in loggers:
                finalize = getattr(lg, "finalize", None)
                if finalize is not None:
                    finalize("success")
        except (OSError, RuntimeError) as err:  # the CSV logger's last rows on a full disk
            if not disk_full(err):
                raise
            failure = failure or _disk_full_stop(run_dir, err)
        if "wandb" in sys.modules:
            import wandb

            if wandb.run is not None:
                wandb.finish()
    if failure is None and guard.reason is not None and guard.action == "stop":
        failure = RunStoppedError(
            f"{guard.reason}: training stopped there (run.json says why); the last finite weights: "
            f"{_saved(run_dir)}. Look at the kernel ({cfg.attention.kernel}) and probe.jsonl's non-finite "
            f"counts; once it is fixed, `{_resume_command(run_dir)}` continues from there "
            "(on_nonfinite=continue trains on)",
            exit_code=1,
        )
    stopped = next((c.stopped for c in callbacks if isinstance(c, AttentionProbe) and c.stopped), None)
    if failure is None and stopped is not None:  # the probe saw the primary's non-finite output first
        failure = RunStoppedError(
            f"AttentionProbe: {stopped}: training stopped there (run.json says why; the reproducer is in "
            f"repro/, see probe.jsonl); the last finite weights: {_saved(run_dir)}",
            exit_code=1,
        )
    if trainer.is_global_zero:
        seconds = time.perf_counter() - started
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
                run_dir,
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
            failure = failure or _disk_full_stop(run_dir, err)
            failure.args = (f"{failure}; run.json could not record it ({err})",)
    if crashed is not None:
        raise crashed
    if failure is not None:
        raise failure
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    return metrics, {**built, "run_dir": run_dir}


def _announce_wandb(loggers: list[Any]) -> None:
    """Say where the W&B run lives before training (so the run's last lines are the probe's summary)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            offline, where = run.settings.mode in ("offline", "dryrun"), Path(run.dir).parent
            upload = f" (upload: wandb sync {where})" if offline else ""
            log.info("W&B run %s: %s%s", "(offline)" if offline else run.url, where, upload)


class RunStoppedError(RuntimeError, FlashprobeError):
    """A run that ended before its ``max_steps``: Ctrl-C, a full disk, or non-finite loss or weights.

    Its message says why, what was saved and the command that continues the run; ``run.json``
    records the same. ``flashprobe train`` prints it and exits with :attr:`exit_code`.
    """

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _resume_command(run_dir: Path) -> str:
    """The command that continues the run in ``run_dir``, with the modules this one was given to import."""
    imports = "".join(f" --import {m}" for m in imported_modules())
    return f"flashprobe train{imports} resume={run_dir}"


def _saved(run_dir: Path) -> str:
    """What a stopped run has on disk to continue from, in words."""
    checkpoint = last_checkpoint(run_dir)
    step = f" (step {checkpoint_step(checkpoint)})" if checkpoint else ""
    parts = [f"checkpoint {checkpoint.relative_to(run_dir)}{step}" if checkpoint else "no checkpoint yet"]
    parts += [name for name in ("snapshots", "probe.jsonl") if (run_dir / name).exists()]
    return ", ".join(parts)


def _disk_full_stop(run_dir: Path, err: BaseException) -> RunStoppedError:
    """The one-line stop of a run whose disk is full: the directory, its free space, the file that could
    not be written, what the run kept, and the command that continues it."""
    target = next((e.path for e in exception_chain(err) if isinstance(e, DiskFullError)), None)
    free = free_space(run_dir)
    writing = ""
    if target is not None:
        writing = f" writing {target.relative_to(run_dir) if target.is_relative_to(run_dir) else target}"
    stop = RunStoppedError(
        f"the disk holding {run_dir} is full ({(free or 0) / 2**20:.1f} MiB free){writing}; kept: "
        f"{_saved(run_dir)}. Free some space (or train on another disk) and continue with: "
        f"{_resume_command(run_dir)}",
        exit_code=1,
    )
    stop.__cause__ = err
    return stop


#: flashprobe's own refusals of a run (bad setting, directory in the way or in use, unsafe checkpoint):
#: the CLI prints their message alone, without a traceback (``-v`` or ``HYDRA_FULL_ERROR=1``: with it).
REFUSALS = (ValueError, FileExistsError, FileNotFoundError, DirectoryLockedError)

#: ``flashprobe train -v``: show tracebacks of flashprobe's own errors too.
_VERBOSE = False

#: The run directory of the Hydra job whose run flashprobe refused or skipped as finished: Hydra's
#: writes into it are undone (see :class:`_HydraRecord`).
_UNDO_RUN_DIR: Path | None = None


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """Mark a :data:`REFUSALS` error raised in the block as flashprobe's own (printed without traceback)."""
    try:
        yield
    except REFUSALS as err:
        err.flashprobe_refusal = True  # type: ignore[attr-defined]
        raise


def _traceback_wanted() -> bool:
    return _VERBOSE or os.environ.get("HYDRA_FULL_ERROR") == "1"


def _refused(err: BaseException) -> bool:
    """Whether ``err`` is flashprobe's own refusal, printed as one paragraph without a traceback: a
    :data:`REFUSALS` error raised where flashprobe checks the run, or a :class:`FlashprobeError` (a
    kernel refusing a call, the probe's failure with ``on_failure=raise``, an unsafe checkpoint, ...),
    wherever raised. Anything else is a bug and keeps its traceback."""
    return bool(getattr(err, "flashprobe_refusal", False)) or isinstance(err, FlashprobeError)


def _refusal_paragraph(err: BaseException) -> str:
    """``err``'s message as one paragraph (its lines joined), printable (text from a file may hold a
    terminal's escape sequences)."""
    return printable(" ".join(line.strip() for line in str(err).splitlines() if line.strip()))


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    global _UNDO_RUN_DIR
    try:
        import_modules(imported_modules())  # a rank or a launcher's job: the modules --import named
        metrics, objects = train(cfg)
    except RunStoppedError as err:
        if _traceback_wanted():
            raise
        print(f"flashprobe train: {err}", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None
    except Exception as err:
        if not _refused(err) or _traceback_wanted():
            raise
        _UNDO_RUN_DIR = _run_dir(cfg)
        print(f"flashprobe train: error: {_refusal_paragraph(err)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if objects.get("skipped"):  # nothing ran: the run's record stays the run's, not this command's
        _UNDO_RUN_DIR = objects["run_dir"]
    return metrics.get("val/loss")


def command_line(args: Sequence[str]) -> list[str]:
    """The Hydra command line of ``flashprobe train ARGS``; checked before Hydra writes anything.

    ``resume=DIR`` continues the run in ``DIR`` with the overrides it was started with
    (``DIR/.hydra/overrides.yaml``), any overrides given now on top, and ``hydra.run.dir=DIR``.
    Paths are read as Hydra reads them (quotes removed).

    Raises:
        FileNotFoundError: ``resume=DIR`` where ``DIR`` holds no run started by ``flashprobe train``.
        FileExistsError: ``hydra.run.dir=DIR`` where ``DIR`` holds a run, without resume or overwrite.
        OutputPathError: ``hydra.run.dir`` is empty, a file, lies under one, or is not writable.
        ValueError: ``resume`` or ``hydra.run.dir`` is not one path (a sweep, a list).
        RecordedOverrideError: the run's recorded overrides ask for more than flashprobe's settings
            (an object to build, a resolver, Hydra's own settings): a run directory is data, never
            instructions (:func:`flashprobe.app.overrides.recorded_overrides`).
    """
    args = list(args)
    resume, run_dir = override_path(args, "resume"), override_path(args, "hydra.run.dir")
    if resume is not None and not resume.strip():
        raise OutputPathError("resume='' is empty; give the run directory to continue: resume=RUN_DIR")
    if resume not in (None, "null", "auto") and run_dir is None:
        saved = Path(resume) / ".hydra" / "overrides.yaml"
        check_links(Path(resume))  # before anything in it is read
        if not saved.is_file():
            raise FileNotFoundError(
                f"resume={resume}: no run started by `flashprobe train` there ({saved} is missing)"
            )
        recorded = (read_run_record(resume) or {}).get("imports")
        needed = [m for m in recorded or [] if isinstance(m, str) and m not in imported_modules()]
        if needed:
            flags = " ".join(f"--import {printable(m)}" for m in needed)
            raise ValueError(
                f"resume={resume}: the run trained with kernels of {', '.join(map(printable, needed))} "
                f"(--import); a run directory never makes flashprobe import anything, so give it again: "
                f"flashprobe train {flags} resume={resume}"
            )
        skip = ("resume", "overwrite", "ckpt_path", "hydra.run.dir")
        from hydra_plugins.flashprobe_searchpath.flashprobe_searchpath import user_config_dirs

        search_path = user_config_dirs()
        inside = [d for d in search_path if d.is_relative_to(Path(resume).resolve())]
        if inside:
            raise RecordedOverrideError(
                f"resume={resume}: the config directory {inside[0]} lies inside the run directory, so its "
                "configs would come from the run; a run directory is data, never instructions: run "
                "flashprobe from another directory"
            )
        try:
            resumed = recorded_overrides(saved, config_groups([CONF_DIR, *search_path]), args, skip)
        except (FileNotFoundError, RecordedOverrideError) as err:
            raise type(err)(f"resume={resume}: {err}") from None
        return [*resumed, f"hydra.run.dir={_quoted(resume)}"]
    overwrite = str(override_value(args, "overwrite")).lower() == "true"
    if run_dir is not None and not run_dir.strip():
        raise OutputPathError(
            "hydra.run.dir is empty (it would write into the working directory); give the run directory, "
            "e.g. hydra.run.dir=outputs/my_run"
        )
    if run_dir is not None and "${" in run_dir:
        return args  # an interpolation: Hydra resolves it; train() checks the directory it gives
    if run_dir is not None:  # a file in the way fails now, not in Hydra; so does a directory of yours
        check_output_dir(run_dir, flag="hydra.run.dir", owned=RUN_DIR_NAMES)
    if run_dir is not None and resume in (None, "null") and not overwrite:
        found = existing_run(Path(run_dir))
        if found:
            raise FileExistsError(occupied(Path(run_dir), found))
    return args


def _quoted(path: str) -> str:
    """``path`` as a Hydra override value: quoted when Hydra would otherwise read it as something else."""
    if all(c.isalnum() or c in "/._-+~@:" for c in path):
        return path
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _precheck(args: Sequence[str], given: Sequence[str] = ()) -> tuple[Path | None, Path | None]:
    """Compose the run's config as Hydra will and check every setting and every path it writes
    (:func:`check_config`, :func:`~flashprobe.app.compose.check_paths`: wherever a value was set, in a
    config file, on the command line or in the run's recorded settings), before Hydra starts (nothing
    is built but, for ``attention.probe.sites``, the LightningModule).

    A multirun (``-m``) is checked for the paths of its first job (a sweep's first value of each
    override); Hydra's other flags (``--cfg``, ``--info``, ...) run no job and are left to Hydra.

    Args:
        args: the Hydra command line (:func:`command_line`).
        given: the overrides the user gave (the others of ``args`` come from ``resume=``'s record).

    Returns:
        ``(run directory, where Hydra creates it)``: the run directory when it is known before Hydra
        runs (``hydra.run.dir`` set, without a time in it), and the directory that is, or will hold, the
        run directory (None when Hydra alone knows it).

    Raises:
        ValueError: a setting or a path is invalid, or the overrides do not compose (Hydra's reason).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flashprobe.app.study import check_launcher

    check_launcher(args)  # a sweep's launcher too: Hydra would fail after making the run directory
    flags = [a for a in args if a.startswith("-")]
    multirun = bool(flags) and set(flags) <= {"-m", "--multirun"}
    if flags and not multirun:
        return None, None
    overrides = [a for a in args if not a.startswith("-")]
    resume = override_path(args, "resume")
    record = f"{resume}/.hydra/overrides.yaml"
    recorded = {o: record for o in overrides if o not in given and not o.startswith("hydra.run.dir=")}
    try:
        cfg, sources = compose_with_sources(
            _first_jobs(overrides) if multirun else overrides, hydra=True, recorded=recorded
        )
        if multirun:
            check_paths(cfg, None, sources)
            return None, None
        named = override_path(args, "hydra.run.dir")
        unresolved = OmegaConf.to_container(cfg.hydra.run, resolve=False).get("dir")
        configured = OmegaConf.select(cfg, "run_dir", default=None, throw_on_resolution_failure=False)
        if isinstance(configured, str) and Path(configured).resolve() != Path(cfg.hydra.run.dir).resolve():
            raise ValueError(
                f"run_dir ({sources('run_dir')}) is {configured}, not the run's directory "
                f"{cfg.hydra.run.dir}: `flashprobe train` writes a run into its Hydra directory; give "
                "hydra.run.dir=DIR instead"
            )
        check_paths(cfg, str(cfg.hydra.run.dir), sources)
        run_dir = Path(str(cfg.hydra.run.dir)) if named or "${now:" not in str(unresolved) else None
        new_runs = Path(str(cfg.hydra.run.dir)).parent  # where Hydra makes a new run directory
        with open_dict(cfg):  # where the callbacks' ${run_dir} points
            del cfg["hydra"]
            cfg.run_dir = str(run_dir or new_runs / "new")
        check_config(cfg, cfg.run_dir, sources)
        if run_dir is not None and run_dir.is_dir():
            if resume not in (None, "null", "auto"):  # (hydra.run.dir: checked by command_line)
                check_output_dir(run_dir, flag="resume")
            check_links(run_dir)
        free = free_space(cfg.run_dir)
        if free is not None and free < FULL_BELOW:  # Hydra's own first writes would fail with a traceback
            raise ValueError(
                f"the disk holding {cfg.run_dir} is full ({free / 2**20:.1f} MiB free); free some space or "
                "train on another disk (hydra.run.dir=...)"
            )
        resumed = None
        if run_dir is not None:
            resumed = last_checkpoint(run_dir) if cfg.get("resume") is not None else None
            starts_afresh = (cfg.get("resume") == "auto" and resumed is None) or (
                cfg.get("resume") is None and cfg.get("overwrite")
            )
            if starts_afresh:  # it would delete what is there: only flashprobe's own outputs
                refuse_foreign(run_dir, existing_run(run_dir))
        step = _checkpoint_step(cfg, str(resumed) if resumed else cfg.get("ckpt_path"))  # unsafe files: now
        if resumed:
            check_resumable(run_dir, step)
    except (HydraException, OmegaConfBaseException) as err:
        reason = " ".join(str(err).split())
        bad = next((o for o in args if not _parses(o)), None)
        if bad is not None:
            raise ValueError(
                f"{bad!r} is not a valid Hydra override ({reason.split(' See ')[0]}); quote a value that "
                "holds '=' or ',', as in attention.kernel='tiled:block_q=32,block_k=64'"
            ) from None
        raise ValueError(reason) from None
    return run_dir, (run_dir if run_dir is not None else new_runs)


def _first_jobs(overrides: Sequence[str]) -> list[str]:
    """A multirun's overrides with each sweep replaced by its first value (its first job's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, first = OverridesParser.create(), []
    for text in overrides:
        override = parser.parse_override(text)
        if override.is_sweep_override():
            value = next(iter(override.sweep_string_iterator()), None)
            key = override.get_key_element()
            text = f"{key}={value}" if value is not None else key
        first.append(text)
    return first


class _HydraRecord:
    """What Hydra creates for a single run before flashprobe's checks inside it — the run directory (if
    need be) and ``train.log`` — removed when the run is refused there before it starts, so a refused
    setting leaves nothing behind. (The run's ``.hydra/`` record is written by flashprobe once the run
    starts, so a refused or skipped run's record stays the run's.)"""

    def __init__(self, where: Path | None, named: bool) -> None:
        """``where``: the run directory (``named``) or the directory Hydra creates it in; None: unknown."""
        self.where, self.named = where, named
        self.absent = _absent(where) if where is not None else []
        self.before = set(os.listdir(where)) if where is not None and where.is_dir() else set()

    def undo(self, run_dir: Path | None) -> None:
        """Undo Hydra's writes into ``run_dir``: the directory itself and the empty ones above it when this
        command created it (it then holds only a ``train.log``), else a ``train.log`` it did not hold."""
        if run_dir is None or self.where is None or not run_dir.is_dir():
            return
        run_dir, where = run_dir.absolute(), self.where.absolute()
        created = (
            run_dir in self.absent
            if self.named
            else (run_dir.parent == where and run_dir.name not in self.before)
        )
        if created and {p.name for p in run_dir.iterdir()} <= {"train.log"}:
            shutil.rmtree(run_dir)
            for parent in self.absent:  # deepest first
                if parent.is_dir() and not any(parent.iterdir()):
                    parent.rmdir()
        elif self.named and run_dir == where and "train.log" not in self.before:
            log_file = run_dir / "train.log"
            if log_file.is_file() and not log_file.is_symlink():
                log_file.unlink()


def _absent(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist, deepest first (absolute)."""
    missing, path = [], path.absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _parses(override: str) -> bool:
    """Whether Hydra's override grammar accepts ``override``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(override)
    except HydraException:
        return False
    return True


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe train [-v] [--import MODULE] [--config-dir DIR] [overrides]``: run the Hydra app with
    ``argv`` as its command line.

    ``--import MODULE`` (repeatable) imports a module that registers kernels first (its ranks and
    launcher jobs import it too); ``--config-dir DIR`` is searched before ``./conf`` (as
    ``$FLASHPROBE_CONFIG_DIR``). Every setting and path is checked and the run directory locked before
    Hydra starts; flashprobe's own errors print one message and return 2 (``-v`` or
    ``HYDRA_FULL_ERROR=1``: with the traceback).

    Lightning's DDP launcher starts the other ranks by re-running the main script with
    ``sys.argv[1:]``; ``sys.argv`` and ``__main__.__spec__`` are pointed at this module, so the
    ranks re-run this Hydra app (``python -m flashprobe.app.train OVERRIDES``), not the CLI.
    """
    global _VERBOSE, _UNDO_RUN_DIR
    given = list(sys.argv[1:] if argv is None else argv)
    _VERBOSE = any(a in ("-v", "--verbose") for a in given)
    given = [a for a in given if a not in ("-v", "--verbose")]
    _UNDO_RUN_DIR, record = None, _HydraRecord(None, named=False)
    HydraConfig.instance().cfg = None  # a job that ended earlier in this process is not this command's
    try:
        with contextlib.ExitStack() as stack:
            try:
                given = stack.enter_context(command_options(given))
                args = command_line(given)
                run_dir, where = _precheck(args, given)
                record = _HydraRecord(where, named=run_dir is not None)  # before the lock makes run_dir
                if run_dir is not None and not _launched_rank():
                    stack.enter_context(directory_lock(run_dir, what="run directory"))
            except Exception as err:
                if not (isinstance(err, REFUSALS) or _refused(err)) or _traceback_wanted():
                    raise
                print(f"flashprobe train: error: {_refusal_paragraph(err)}", file=sys.stderr)
                return 2
            sys.argv = [__file__, *args]
            main_module = sys.modules.get("__main__")
            if main_module is not None and getattr(main_module, "__spec__", None) is not None:
                main_module.__spec__ = importlib.util.find_spec(__name__)
            _hydra_main()
    except SystemExit as exit_:  # 2: refused inside the job (any other code: the run's own outcome)
        if exit_.code == 2:
            _undo(record)
        raise
    _undo(record)  # a finished run that resume= skipped (else nothing is marked)
    return 0


def _undo(record: _HydraRecord) -> None:
    """Undo Hydra's writes into the run directory :func:`_hydra_main` marked (:data:`_UNDO_RUN_DIR`)."""
    if not _launched_rank():
        record.undo(_UNDO_RUN_DIR)


if __name__ == "__main__":
    _hydra_main()
