"""The owner of a training run's directory (:class:`RunDir`): created, locked, started, recorded and
described when the run stops here only; the files themselves are read and written by
:mod:`flashprobe.formats`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from flashprobe.app.imports import imported_modules
from flashprobe.errors import FlashprobeError
from flashprobe.formats.atomic import DiskFullError, atomic_write_text, disk_full, exception_chain, free_space
from flashprobe.formats.lock import directory_lock
from flashprobe.formats.paths import check_output_dir
from flashprobe.formats.run_dir import (
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
from flashprobe.formats.run_record import claim_outputs, owned_outputs, read_run_record

__all__ = ["RunDir", "RunStart", "RunStoppedError", "launched_rank", "start_step"]

log = logging.getLogger(__name__)


class RunStoppedError(RuntimeError, FlashprobeError):
    """A run that ended before its ``max_steps`` (Ctrl-C, a full disk, non-finite loss or weights).

    Its message says why, what was saved and how to continue; ``flashprobe train`` exits with
    :attr:`exit_code`.
    """

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def launched_rank() -> bool:
    """Whether this process is a rank other than zero (Lightning's launcher, torchrun or a SLURM task
    of a multi-task job); rank zero decides how the run starts and writes its records."""
    ranks = ["LOCAL_RANK", "NODE_RANK", "RANK"]
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        ranks.append("SLURM_PROCID")
    return any(int(os.environ.get(var, "0") or 0) > 0 for var in ranks)


def start_step(cfg: DictConfig, checkpoint: str | None) -> int:
    """The step a run continues from: ``checkpoint``'s ``global_step`` (read safely), else 0.

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


@dataclass(frozen=True)
class RunStart:
    """How a run starts in its directory (:meth:`RunDir.start`): from ``checkpoint`` (None: step 0)
    at ``from_step``, or ``skipped`` (why it is not trained: it finished already)."""

    checkpoint: str | None = None
    from_step: int = 0
    skipped: str | None = None


class RunDir:
    """One training run's directory (it need not exist yet). Rank zero decides and writes; the other
    ranks of a run only read."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def of(cls, cfg: DictConfig) -> RunDir:
        """The run directory of ``cfg``: ``cfg.run_dir``, else the Hydra job's output directory.

        Raises:
            ValueError: neither is set.
        """
        if cfg.get("run_dir"):
            return cls(cfg.run_dir)
        if HydraConfig.initialized():
            return cls(HydraConfig.get().runtime.output_dir)
        raise ValueError("train: no run directory; set run_dir=... when calling train() outside Hydra")

    # ------------------------------------------------------------------ before Hydra starts

    def refuse_occupied(self) -> None:
        """Refuse a fresh start here (no ``resume``, no ``overwrite``) when the directory holds a run.

        Raises:
            FileExistsError: naming the run's outputs and the ways on.
        """
        found = existing_run(self.path)
        if found:
            raise FileExistsError(occupied(self.path, found))

    def check_contents(self, resume: str | None) -> None:
        """Before Hydra writes into the directory, refuse a link in it, or (``resume=DIR``) a
        directory flashprobe may not write into.

        Raises:
            LinkError: a link in the directory.
            OutputPathError: ``resume`` names a directory flashprobe may not write into.
        """
        if not self.path.is_dir():
            return
        if resume not in (None, "null", "auto"):  # (hydra.run.dir: checked by command_line)
            check_output_dir(self.path, flag="resume")
        check_links(self.path)

    def check_start(self, cfg: DictConfig) -> None:
        """Refuse now what :meth:`start` would refuse later.

        Raises:
            FileExistsError: a fresh start would delete outputs that are not flashprobe's.
            CheckpointError: the checkpoint to continue from is unsafe, truncated or not a checkpoint.
            ValueError: see :func:`start_step` and :func:`~flashprobe.formats.run_dir.check_resumable`.
        """
        resumed = last_checkpoint(self.path) if cfg.get("resume") is not None else None
        starts_afresh = (cfg.get("resume") == "auto" and resumed is None) or (
            cfg.get("resume") is None and cfg.get("overwrite")
        )
        if starts_afresh:  # it would delete what is there: only flashprobe's own outputs
            refuse_foreign(self.path, existing_run(self.path))
        step = start_step(cfg, str(resumed) if resumed else cfg.get("ckpt_path"))
        if resumed:
            check_resumable(self.path, step)

    # ------------------------------------------------------------------ the run

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's lock (created with the directory if need be); other ranks take none.

        Raises:
            DirectoryLockedError: another process is writing into the directory.
        """
        if launched_rank():
            yield
            return
        with directory_lock(self.path, what="run directory"):
            yield

    def start(self, cfg: DictConfig) -> RunStart:
        """Decide how the run starts (the directory locked): fresh, from a checkpoint, or skipped as
        finished; delete the flashprobe outputs that start writes again.

        Raises:
            LinkError: a link in the directory (rank zero checks).
            FileExistsError: a fresh start in a directory that holds a run (no resume, no overwrite).
            FileNotFoundError: ``resume`` names a run without a checkpoint.
            ValueError: ``resume`` names another directory, or as :meth:`check_start`.
            CheckpointError: as :meth:`check_start`.
        """
        if not launched_rank():
            check_links(self.path)
        checkpoint, skipped = self._start_point(cfg)
        if skipped:
            return RunStart(skipped=skipped)
        from_step = start_step(cfg, checkpoint)
        if checkpoint and cfg.get("resume") is not None:
            check_resumable(self.path, from_step)
        return RunStart(checkpoint, from_step)

    def _start_point(self, cfg: DictConfig) -> tuple[str | None, str | None]:
        """``(checkpoint to resume from or None, why the run is skipped or None)``."""
        resume, found = cfg.get("resume"), existing_run(self.path)
        if launched_rank():  # a DDP rank started by rank zero, which has decided already
            max_steps = cfg.trainer.get("max_steps", -1)
            checkpoint = resume_point(self.path, max_steps) if resume is not None else None
            return (str(checkpoint) if checkpoint else cfg.get("ckpt_path")), None
        if resume not in (None, "auto") and Path(str(resume)).resolve() != self.path.resolve():
            raise ValueError(
                f"resume={resume} but the run directory is {self.path}; use `flashprobe train resume=DIR` "
                "(it trains in DIR) or set run_dir to the same directory"
            )
        if resume is not None:
            return self._resume_point(cfg, resume, found)
        if found and not cfg.get("overwrite"):
            raise FileExistsError(occupied(self.path, found))
        remove_outputs(self.path, found)
        return cfg.get("ckpt_path"), None

    def _resume_point(self, cfg: DictConfig, resume: str, found: list[str]) -> tuple[str | None, str | None]:
        """:meth:`_start_point` of ``resume=DIR`` or ``resume=auto``."""
        remove_stray_temporaries(self.path)
        record = read_run_record(self.path)
        max_steps = cfg.trainer.get("max_steps", -1)
        finished = _finished(record, cfg)
        missing = self.missing_artefacts(cfg) if finished else []
        if missing == ["probe.png"] and self._redraw_probe_figure():
            missing = []
        if finished and not missing:
            return None, _finished_already(self.path, cfg)
        checkpoint = resume_point(self.path, max_steps)
        if missing:
            log.warning(
                "%s finished but lacks %s: training it again from %s to rebuild %s (the same bits)",
                self.path,
                ", ".join(missing),
                f"{checkpoint.relative_to(self.path)}" if checkpoint else "step 0",
                "them" if len(missing) > 1 else "it",
            )
        if checkpoint is not None:
            remove_later_checkpoints(self.path, checkpoint_step(checkpoint))
            return str(checkpoint), None
        status = None if record is None else record.get("status")
        checkpointing = (cfg.get("callbacks") or {}).get("checkpoint") is not None
        # no checkpoint: a run stopped in start-up or before its first checkpoint, or one to rebuild, restarts
        killed_early = status in (None, "starting") or (checkpointing and status != "finished")
        killed_early = killed_early or bool(missing)
        if killed_early and not missing and record is not None:  # the only continuation is step 0
            log.warning("%s stopped before its first checkpoint: training it again from step 0", self.path)
        if resume != "auto" and not killed_early:
            raise FileNotFoundError(
                f"resume={resume}: {self.path / 'checkpoints'} holds no checkpoint to continue from (the run "
                "saves them with callbacks.checkpoint); start it again with overwrite=true"
            )
        remove_outputs(self.path, found)  # this run's own outputs, written before its first checkpoint
        return None, None

    def skipped(self, cfg: DictConfig) -> str | None:
        """Why :meth:`start` would skip the run (``resume`` set, it finished and nothing it must have
        is missing), or None; nothing is written.

        Raises:
            LinkError: a link in the directory.
        """
        if cfg.get("resume") is None or not self.path.is_dir() or launched_rank():
            return None
        check_links(self.path)
        if not _finished(read_run_record(self.path), cfg) or self.missing_artefacts(cfg):
            return None
        return _finished_already(self.path, cfg)

    def missing_artefacts(self, cfg: DictConfig) -> list[str]:
        """What a finished run must have and the directory lacks (``checkpoints/last.ckpt``, ``probe.png``,
        the last step's sample grid, the snapshot manifest, each when configured), relative paths."""
        callbacks, run_dir = cfg.get("callbacks") or {}, self.path
        max_steps, every = cfg.trainer.get("max_steps", -1), cfg.trainer.get("val_check_interval")
        wanted = []
        checkpoint = callbacks.get("checkpoint")
        if checkpoint is not None and checkpoint.get("save_last"):
            wanted.append(Path(str(checkpoint.get("dirpath") or run_dir / "checkpoints")) / "last.ckpt")
        probe = callbacks.get("attention_probe")
        if cfg.attention.probe.enabled and probe is not None and probe.get("plot", True):
            log_name = str(probe.get("filename") or "probe.jsonl")
            log_file = Path(str(probe.get("dirpath") or run_dir)) / log_name
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

    def _redraw_probe_figure(self) -> bool:
        """Draw a finished run's missing ``probe.png`` from its ``probe.jsonl``; whether it was drawn."""
        from flashprobe.report.probe_figures import plot_probe

        probe_log = self.path / "probe.jsonl"
        if not probe_log.is_file() or not probe_log.stat().st_size:
            return False
        figure = plot_probe(probe_log, self.path / "probe.png")
        log.warning("%s finished without probe.png: drew it from probe.jsonl (%s)", self.path, figure)
        return True

    def record_start(self, cfg: DictConfig) -> None:
        """Create the directory and, on rank zero, write ``.hydra/`` (in a Hydra job), the outputs it
        owns in ``run.json`` and ``config.yaml``, before any output.

        Raises:
            RunStoppedError: the disk is full.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not launched_rank():
                self._write_hydra_record(cfg)
                foreign = set(existing_run(self.path)) - set(owned_outputs(self.path, RUN_OUTPUTS))
                claim_outputs(self.path, [n for n in RUN_OUTPUTS if n not in foreign])  # before writing any
                atomic_write_text(self.path / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        except OSError as err:
            if not disk_full(err):
                raise
            raise self.disk_full_stop(err) from err

    def _write_hydra_record(self, cfg: DictConfig) -> None:
        """Write the run's ``.hydra/`` record as Hydra would (which has ``hydra.output_subdir: null``),
        atomically; nothing outside a Hydra job or in the job of another directory."""
        if not HydraConfig.initialized():
            return
        output_dir = OmegaConf.select(HydraConfig.instance().cfg, "hydra.runtime.output_dir")
        if output_dir is None or Path(str(output_dir)).resolve() != self.path.resolve():
            return
        record = self.path / ".hydra"
        atomic_write_text(record / "config.yaml", OmegaConf.to_yaml(cfg))
        atomic_write_text(record / "hydra.yaml", OmegaConf.to_yaml(HydraConfig.instance().cfg))
        atomic_write_text(record / "overrides.yaml", OmegaConf.to_yaml(HydraConfig.get().overrides.task))

    # ------------------------------------------------------------------ a stopped run

    def resume_command(self) -> str:
        """The command that continues the run, with the modules this one was given to import."""
        imports = "".join(f" --import {m}" for m in imported_modules())
        return f"flashprobe train{imports} resume={self.path}"

    def saved(self) -> str:
        """What a stopped run has on disk to continue from, in words."""
        checkpoint = last_checkpoint(self.path)
        step = f" (step {checkpoint_step(checkpoint)})" if checkpoint else ""
        kept = f"checkpoint {checkpoint.relative_to(self.path)}{step}" if checkpoint else "no checkpoint yet"
        parts = [kept]
        parts += [name for name in ("snapshots", "probe.jsonl") if (self.path / name).exists()]
        return ", ".join(parts)

    def disk_full_stop(self, err: BaseException) -> RunStoppedError:
        """The one-line stop of a run whose disk is full: free space, the file, what was kept, what next."""
        target = next((e.path for e in exception_chain(err) if isinstance(e, DiskFullError)), None)
        free = free_space(self.path)
        writing = ""
        if target is not None:
            inside = target.is_relative_to(self.path)
            writing = f" writing {target.relative_to(self.path) if inside else target}"
        stop = RunStoppedError(
            f"the disk holding {self.path} is full ({(free or 0) / 2**20:.1f} MiB free){writing}; kept: "
            f"{self.saved()}. Free some space (or train on another disk) and continue with: "
            f"{self.resume_command()}",
            exit_code=1,
        )
        stop.__cause__ = err
        return stop


def _finished(record: Mapping[str, object] | None, cfg: DictConfig) -> bool:
    """Whether a run's record says it finished ``trainer.max_steps``."""
    return (
        record is not None
        and record.get("status") == "finished"
        and record.get("global_step") == cfg.trainer.get("max_steps", -1)
    )


def _finished_already(path: Path, cfg: DictConfig) -> str:
    """Why a finished run is skipped, in words."""
    return f"{path} finished {cfg.trainer.get('max_steps', -1)} steps already"
