"""``flashprobe train``: the Hydra app that trains the text-to-image model.

``train(cfg)`` builds everything from a composed config and returns ``(metrics, objects)`` so tests
and the study call it directly; :func:`cli_main` is the thin ``@hydra.main`` entry point used by
the ``flashprobe train`` command (``-m`` multirun sweeps included).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.trainer.states import TrainerStatus
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from flashprobe.app.console import StepProgressBar, quiet_third_party
from flashprobe.app.machine import machine_facts
from flashprobe.app.overrides import (
    RecordedOverrideError,
    config_groups,
    override_key,
    override_path,
    override_value,
    recorded_overrides,
)
from flashprobe.callbacks.attention_probe import AttentionProbe
from flashprobe.callbacks.nonfinite_guard import NonFiniteGuard
from flashprobe.formats.atomic import FULL_BELOW, DiskFullError, atomic_write_text, disk_full, free_space
from flashprobe.formats.lock import DirectoryLockedError, directory_lock
from flashprobe.formats.paths import OutputPathError, check_output_dir, library_path, safe_name
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

#: The packaged Hydra configs.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


#: What a run writes into its directory; a directory holding any of these holds a run.
RUN_OUTPUTS = (
    "run.json",
    "config.yaml",
    "snapshots",
    "probe.jsonl",
    "probe.png",
    "checkpoints",
    "samples",
    "csv",
    "wandb",
)


def _run_dir(cfg: DictConfig) -> Path:
    """The run directory: Hydra's output dir inside a Hydra app, else ``cfg.run_dir``."""
    if cfg.get("run_dir"):
        return Path(cfg.run_dir)
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    raise ValueError("train: no run directory; set run_dir=... when calling train() outside Hydra")


#: what a run directory holds: flashprobe's outputs, Hydra's record, the lock and the log of a run
#: (one killed in its start-up has only some of these); a directory holding none of them is not one
RUN_DIR_NAMES = (*RUN_OUTPUTS, ".hydra", ".flashprobe.lock", "train.log")


def existing_run(run_dir: Path) -> list[str]:
    """The outputs of an earlier run found in ``run_dir`` (empty when there is none)."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def last_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a resume continues from: ``checkpoints/last.ckpt``, else the newest ``*.ckpt``."""
    directory = run_dir / "checkpoints"
    if (directory / "last.ckpt").is_file():
        return directory / "last.ckpt"
    found = sorted(directory.glob("*.ckpt"), key=lambda p: p.stat().st_mtime) if directory.is_dir() else []
    return found[-1] if found else None


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


def _refusal(run_dir: Path, found: list[str]) -> str:
    return (
        f"{run_dir} already holds a run ({', '.join(found)}); flashprobe never deletes a run it did not "
        f"create. Continue it with `flashprobe train resume={run_dir}`, start afresh there with "
        "overwrite=true (deletes those outputs), or choose another directory"
    )


def _start(cfg: DictConfig, run_dir: Path) -> tuple[str | None, str | None]:
    """Decide how the run starts: ``(checkpoint to resume from or None, why it is skipped or None)``.

    Raises:
        FileExistsError: a fresh start in a directory that holds a run (no resume, no overwrite).
        FileNotFoundError: ``resume`` names a run without a checkpoint.
        ValueError: ``resume`` names another directory than the run directory.
    """
    resume, found = cfg.get("resume"), existing_run(run_dir)
    if _launched_rank():  # a DDP rank started by rank zero, which has decided already
        checkpoint = _resume_point(run_dir, cfg.trainer.get("max_steps", -1)) if resume is not None else None
        return (str(checkpoint) if checkpoint else cfg.get("ckpt_path")), None
    if resume not in (None, "auto") and Path(str(resume)).resolve() != run_dir.resolve():
        raise ValueError(
            f"resume={resume} but the run directory is {run_dir}; use `flashprobe train resume=DIR` "
            "(it trains in DIR) or set run_dir to the same directory"
        )
    if resume is not None:
        _remove_stray_temporaries(run_dir)
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
        checkpoint = _resume_point(run_dir, max_steps)
        if missing:
            log.warning(
                "%s finished but lacks %s: training it again from %s to rebuild %s (the same bits)",
                run_dir,
                ", ".join(missing),
                f"{checkpoint.relative_to(run_dir)}" if checkpoint else "step 0",
                "them" if len(missing) > 1 else "it",
            )
        if checkpoint is not None:
            _remove_later_checkpoints(run_dir, _step_of(checkpoint))
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
        _remove_outputs(run_dir, found)  # this run's own outputs, written before its first checkpoint
        return None, None
    if found and not cfg.get("overwrite"):
        raise FileExistsError(_refusal(run_dir, found))
    _remove_outputs(run_dir, found)
    return cfg.get("ckpt_path"), None


def _resume_point(run_dir: Path, max_steps: int | None) -> Path | None:
    """The checkpoint a resume continues from: the newest, unless it holds the last step.

    Lightning does nothing when given a checkpoint of the last step, so whatever the run had still to
    do after saving it (the last probe record, ``probe.png``, the final samples, ``run.json``) would
    never be done. The newest checkpoint of an earlier step is taken instead (training from it gives
    the same bits), or none (train from step 0) when there is none.
    """
    newest = last_checkpoint(run_dir)
    if newest is None or max_steps in (None, -1) or _step_of(newest) != max_steps:
        return newest  # (a checkpoint past max_steps is refused by _checkpoint_step)
    steps = [(p, _step_of(p)) for p in sorted((run_dir / "checkpoints").glob("*.ckpt"))]
    earlier = [(p, step) for p, step in steps if step < max_steps]
    return max(earlier, key=lambda c: (c[1], c[0].stat().st_mtime))[0] if earlier else None


def _remove_later_checkpoints(run_dir: Path, step: int) -> None:
    """Delete this run's checkpoints of steps after ``step``, which a resume from ``step`` writes again
    (Lightning would otherwise save the new ones beside them as ``NAME-v1.ckpt``)."""
    for path in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        if path.name != "last.ckpt" and _step_of(path) > step:
            log.warning("removing %s: training from step %d writes it again", path, step)
            path.unlink()


def _step_of(checkpoint: Path) -> int:
    """A checkpoint's ``global_step`` (read safely; see :func:`_checkpoint_step`)."""
    from flashprobe.formats.checkpoint_io import load_checkpoint

    return int(load_checkpoint(checkpoint)["global_step"])


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
        _integer(max_steps)
        and max_steps > 0
        and _integer(every)
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


def _remove_stray_temporaries(run_dir: Path) -> None:
    """Delete the atomic writer's temporary files a killed run left in its own outputs (the run directory
    is locked: no writer is using them)."""
    from flashprobe.formats.atomic import stray_temporaries

    strays = [p for p in stray_temporaries(run_dir) if p.parent == run_dir]
    for name in owned_outputs(run_dir, RUN_OUTPUTS):
        if (run_dir / name).is_dir() and not (run_dir / name).is_symlink():
            strays += stray_temporaries(run_dir / name)
    for stray in strays:
        log.warning("removing %s, left by an interrupted write", stray)
        stray.unlink(missing_ok=True)


def _refuse_foreign(run_dir: Path, names: list[str]) -> None:
    """Refuse to go on when some of ``names`` in ``run_dir`` were not created by flashprobe.

    Raises:
        FileExistsError: naming them; no ``run.json`` of the directory lists them as a run's outputs.
    """
    owned = owned_outputs(run_dir, RUN_OUTPUTS)
    foreign = [name for name in names if name not in owned]
    if foreign:
        raise FileExistsError(
            f"{run_dir} holds {', '.join(foreign)}, which no flashprobe run recorded as its own (a run's "
            "run.json lists what it created); flashprobe deletes only its own outputs. Move them out of the "
            "directory, or train into another directory"
        )


def _remove_outputs(run_dir: Path, names: list[str]) -> None:
    """Delete the outputs ``names`` of an earlier run — only those its ``run.json`` records as its own.

    Raises:
        FileExistsError: some of ``names`` were not created by flashprobe (no ``run.json`` lists them);
            nothing is deleted then.
    """
    _refuse_foreign(run_dir, names)
    for name in names:
        path = run_dir / name
        if not path.exists() and not path.is_symlink():
            continue
        log.warning("removing %s of the earlier run in %s", name, run_dir)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()  # a link is removed, never what it points to


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(cfg: DictConfig) -> None:
    """Refuse a configuration value that would fail (or write somewhere it must not) later, before any work.

    Raises:
        ValueError: naming the setting, the value and what to give instead.
        KernelSpecError: an unknown kernel or kernel option.
    """
    from flashprobe.kernels import get_kernel

    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps is not None and not _integer(max_steps):
        raise ValueError(f"trainer.max_steps={max_steps!r} must be an integer (or -1 for max_epochs)")
    if max_steps is not None and max_steps != -1 and max_steps <= 0:
        raise ValueError(f"trainer.max_steps={max_steps} must be positive (or -1 for max_epochs)")
    if not _integer(cfg.get("seed")) or cfg.seed < 0:
        raise ValueError(f"seed={cfg.get('seed')!r} must be a non-negative integer, e.g. seed=0")
    threads = cfg.get("threads")
    if threads is not None and (not _integer(threads) or threads <= 0):
        raise ValueError(f"threads={threads!r} must be a positive integer (or null: torch's default)")
    for key in ("log_every_n_steps", "val_check_interval"):
        value = cfg.trainer.get(key)
        if value is not None and (not _number(value) or value <= 0):
            raise ValueError(
                f"trainer.{key}={value!r} must be a positive number of steps, e.g. trainer.{key}=25"
            )
    lr = ((cfg.get("module") or {}).get("optimizer") or {}).get("lr")
    if lr is not None and (not _number(lr) or not 0 < lr < math.inf):
        raise ValueError(
            f"module.optimizer.lr={lr!r} must be a positive number (finite), e.g. module.optimizer.lr=2e-3"
        )
    for key, value in (
        ("overwrite", cfg.get("overwrite")),
        ("attention.probe.enabled", cfg.attention.probe.enabled),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r} must be true or false")
    max_epochs = cfg.trainer.get("max_epochs")
    if max_epochs is not None and not _integer(max_epochs):
        raise ValueError(f"trainer.max_epochs={max_epochs!r} must be an integer (-1: no limit)")
    for key in ("seed", "shuffle_seed"):
        value = (cfg.get("data") or {}).get(key)
        if value is not None and (not _integer(value) or value < 0):
            raise ValueError(f"data.{key}={value!r} must be a non-negative integer, e.g. data.{key}=0")
    for key in ("guidance_scale",):
        value = (cfg.get("module") or {}).get(key)
        if value is not None and not _number(value):
            raise ValueError(f"module.{key}={value!r} must be a number, e.g. module.{key}=3.0")
    for key in ("num_train", "num_val", "batch_size", "image_size"):
        value = (cfg.get("data") or {}).get(key)
        if value is not None and (not _integer(value) or value <= 0):
            raise ValueError(f"data.{key}={value!r} must be a positive integer, e.g. data.{key}=16")
    _check_memory(cfg)
    if str(cfg.get("on_nonfinite", "stop")) not in ("stop", "continue"):
        raise ValueError(f"on_nonfinite={cfg.get('on_nonfinite')!r} must be stop or continue")
    safe_name(str(cfg.get("run_name")), what="run_name")  # it names the run's directory
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is not None and not Path(str(ckpt_path)).is_file():
        raise ValueError(
            f"ckpt_path={ckpt_path}: no such file; give a Lightning .ckpt file (or resume=RUN_DIR)"
        )
    device = _run_device(cfg)
    for key, spec in (
        ("attention.kernel", cfg.attention.kernel),
        ("attention.probe.primary", cfg.attention.probe.get("primary")),
        ("attention.probe.baseline", cfg.attention.probe.get("baseline")),
    ):
        if spec is None:
            continue
        kernel = get_kernel(spec)  # unknown kernels and options fail here, before any work
        devices = kernel.capabilities.devices
        if devices is not None and device not in devices:  # placement: not inside the first batch
            problem = kernel.capabilities.setting_problem(device, torch.float32)
            raise ValueError(
                f"{key}={spec}: {problem}. This run trains on {device} "
                f"(trainer.accelerator={cfg.trainer.get('accelerator')}); for a GPU run give trainer=gpu"
            )
        probed = key == "attention.probe.primary" and cfg.attention.probe.enabled  # the model gets its output
        trains_through = key == "attention.kernel" or probed
        if trains_through and not kernel.capabilities.has_backward(device):  # its first step would fail
            raise ValueError(
                f"{key}={spec} has no backward on {device}, and the model trains through it; "
                "choose a kernel with a backward there (math, tiled or sdpa_math)"
                + (", or train on a GPU (trainer=gpu)" if kernel.capabilities.has_backward("cuda") else "")
            )
    probing = cfg.attention.probe.enabled and (cfg.get("callbacks") or {}).get("attention_probe") is not None
    if probing:  # the probe's settings, as its callback will check them
        from flashprobe.probing import ProbeConfig

        try:
            settings = OmegaConf.to_container(cfg.attention.probe, resolve=True)
            ProbeConfig.from_mapping(settings, ignore=("enabled",))
        except ValueError as err:
            raise ValueError(f"attention.probe: {err}") from None
    checkpoint = (cfg.get("callbacks") or {}).get("checkpoint") or {}
    every, log_every = checkpoint.get("every_n_train_steps"), cfg.trainer.get("log_every_n_steps")
    if probing and every and log_every and every % log_every and (max_steps or 0) >= log_every:
        log.warning(
            "callbacks.checkpoint.every_n_train_steps=%s is not a multiple of trainer.log_every_n_steps=%s: "
            "a run resumed from a checkpoint inside a logging interval loses the probe statistics of that "
            "interval's first steps (weights and snapshots still resume exactly); make it a multiple",
            every,
            log_every,
        )


def _run_device(cfg: DictConfig) -> str:
    """The device type a run's model trains on, from ``trainer.accelerator`` (``auto``: CUDA if present)."""
    accelerator = str(cfg.trainer.get("accelerator") or "cpu").lower()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return accelerator if accelerator in ("mps", "xpu") else "cpu"


def _check_sites(cfg: DictConfig, module: torch.nn.Module) -> None:
    """``attention.probe.sites`` must match some module of the model: sites are module paths, so a
    pattern that names no module can never name a site (checked before training, not at its first batch).

    Raises:
        ValueError: naming the patterns and the model's attention modules.
    """
    import fnmatch

    sites = cfg.attention.probe.get("sites") if cfg.attention.probe.enabled else None
    if sites is None or (cfg.get("callbacks") or {}).get("attention_probe") is None:
        return
    patterns = [sites] if isinstance(sites, str) else [str(p) for p in sites]
    include = [p for p in patterns if not p.startswith("!")]
    names = [name for name, _ in module.named_modules() if name]
    if include and not any(fnmatch.fnmatchcase(name, p) for name in names for p in include):
        attention = [name for name in names if name.rsplit(".", 1)[-1] in ("attn", "attention", "self_attn")]
        shown = ", ".join(attention[:6]) + (", ..." if len(attention) > 6 else "")
        raise ValueError(
            f"attention.probe.sites={patterns!r} matches no module of the model, so no attention site: its "
            f"attention modules are {shown or 'unnamed'}; give glob patterns of these names (e.g. "
            f"'{attention[0].rsplit('.', 2)[0] + '.*.attn' if attention else 'blocks.*.attn'}') or "
            "attention.probe.sites=null for all"
        )


def _machine_memory() -> int:
    """Physical memory of this machine in bytes (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _check_memory(cfg: DictConfig) -> None:
    """Refuse sizes whose data and attention alone cannot fit in this machine's memory, before allocating.

    The estimate is a floor: the rendered images (``(num_train + num_val) × 3 × S²`` float32) plus
    one batch's attention scores over the ``(S/p)²`` image tokens, kept for the backward pass.

    Raises:
        ValueError: naming the settings, the estimate and the machine's memory.
    """
    data, model = cfg.get("data") or {}, cfg.get("model") or {}
    size, patch, batch, heads = data.get("image_size"), model.get("patch_size", 2), data.get("batch_size"), 2
    counts = (data.get("num_train"), data.get("num_val") or 0)
    if not all(_integer(v) and v > 0 for v in (size, patch, batch, counts[0])) or not _integer(counts[1]):
        return  # the data module and the model name what is wrong with these
    images = counts[0] + counts[1]
    image_bytes = images * 3 * size * size * 4
    tokens = (size // patch) ** 2
    attention_bytes = batch * heads * tokens * tokens * 4 * 3  # scores, probabilities, their gradient
    memory, needed = _machine_memory(), image_bytes + attention_bytes
    if memory and needed > 0.9 * memory:
        gib = 2**30
        raise ValueError(
            f"data.image_size={size} with data.num_train + data.num_val = {images} images and "
            f"data.batch_size={batch} needs at least {needed / gib:.3g} GiB ({image_bytes / gib:.3g} GiB of "
            f"images, {attention_bytes / gib:.3g} GiB of attention scores over {tokens} image tokens), but "
            f"this machine has {memory / gib:.1f} GiB; lower data.image_size (e.g. 16 or 32), "
            "data.num_train or data.batch_size"
        )


def check_config(cfg: DictConfig, run_dir: str | Path | None = None) -> None:
    """Check every setting of a composed run config before any work (what ``flashprobe train`` and
    ``flashprobe study`` do first): steps, intervals, seed, threads, learning rate, data sizes against
    the machine's memory, names that become paths, kernels; given ``run_dir``, also build the run's
    objects as a run there would (the kernel's placement, the probe's sites, every constructor's
    arguments), writing nothing.

    Raises:
        ValueError: naming the setting, the value and what to give instead.
    """
    _check(cfg)
    if run_dir is not None:
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
        lightning_log = logging.getLogger("lightning.pytorch")
        level = lightning_log.level
        lightning_log.setLevel(logging.WARNING)  # the Trainer's "GPU available" lines come with the run
        try:
            _build(cfg, Path(run_dir))
        finally:
            lightning_log.setLevel(level)


def _check_paths(cfg: DictConfig, run_dir: Path) -> None:
    """Every file a callback writes stays inside the run directory: ``dirpath`` under ``run_dir``,
    ``filename`` a relative name without ``..``.

    Raises:
        ValueError: naming the callback setting and the fix.
    """
    root = run_dir.resolve()
    for name, callback in (cfg.get("callbacks") or {}).items():
        if not isinstance(callback, DictConfig):
            continue
        dirpath, filename = callback.get("dirpath"), callback.get("filename")
        if dirpath is not None and not Path(str(dirpath)).resolve().is_relative_to(root):
            raise ValueError(
                f"callbacks.{name}.dirpath={dirpath} lies outside the run directory {run_dir}; a run writes "
                "only into its own directory: leave dirpath at its default or choose the run directory "
                "with hydra.run.dir"
            )
        if filename is not None:
            parts = Path(str(filename)).parts
            if not parts or Path(str(filename)).is_absolute() or ".." in parts or str(filename) in ("", "."):
                raise ValueError(
                    f"callbacks.{name}.filename={filename!r} must be a file name inside the run directory, "
                    "e.g. probe.jsonl (no absolute path, no '..')"
                )


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
        ValueError: a configuration value is invalid (see :func:`_check`).
        RunStoppedError: the run stopped early (non-finite values, Ctrl-C, a full disk).
    """
    with contextlib.ExitStack() as stack:
        with _refusals():
            _check(cfg)
            quiet_third_party()
            run_dir = _run_dir(cfg)
            _check_paths(cfg, run_dir)
            if not _launched_rank():  # the ranks run inside rank zero's lock
                stack.enter_context(directory_lock(run_dir, what="run directory"))
            checkpoint, skipped = _start(cfg, run_dir)
            if skipped:
                log.info("skipping the run: %s", skipped)
                return {}, {"run_dir": run_dir, "skipped": skipped}
            from_step = _checkpoint_step(cfg, checkpoint)
            if checkpoint and cfg.get("resume") is not None:
                _check_resumable(run_dir, from_step)
        os.environ.setdefault("WANDB_MODE", "offline")  # no account, no network unless asked for
        callers_threads = torch.get_num_threads()
        if cfg.get("threads"):
            torch.set_num_threads(int(cfg.threads))  # CPU reductions (and so the last bits) depend on it
        try:
            with _refusals():
                built = _build(cfg, run_dir)
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                if not _launched_rank():
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


def _check_resumable(run_dir: Path, from_step: int) -> None:
    """A run to continue has a readable record and snapshots: refuse now what would fail or be lost later.

    Raises:
        ValueError: the record, a checkpoint, the snapshot directory or its manifest is a link out of
            the run, ``run.json`` is not flashprobe's record (its sessions would be dropped), the
            snapshot manifest is malformed or names files outside its directory, or a snapshot the
            resumed run keeps (at or before ``from_step``) cannot be read.
    """
    from safetensors import SafetensorError, safe_open

    from flashprobe.weights.store import SNAPSHOT_DIRNAME, read_manifest

    root, checkpoints, snapshots = run_dir.resolve(), run_dir / "checkpoints", run_dir / SNAPSHOT_DIRNAME
    found = [*checkpoints.glob("*.ckpt")] if checkpoints.is_dir() else []
    for path in (run_dir / "run.json", checkpoints, *found, snapshots, snapshots / "manifest.json"):
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            raise ValueError(
                f"{path} is a link to {path.resolve()}, outside the run {run_dir}; a resume reads and writes "
                "only inside its run: copy the file in (cp -L) instead of linking it"
            )
    record = run_dir / "run.json"
    if record.exists() and read_run_record(run_dir) is None:
        raise ValueError(
            f"{record} is not a flashprobe run record (not JSON of format flashprobe.run/1), so the run's "
            "earlier sessions would be lost; restore it, or move it away to continue with a fresh record"
        )
    if not (snapshots / "manifest.json").is_file():
        return
    for entry in read_manifest(snapshots).get("snapshots", []):
        if entry["step"] > from_step or not (snapshots / entry["file"]).is_file():
            continue  # abandoned by the resume, or already gone: the writer drops them
        try:
            with library_path(snapshots / entry["file"]) as name, safe_open(name, framework="pt"):
                pass
        except SafetensorError as err:
            raise ValueError(
                f"snapshot {snapshots / entry['file']} (step {entry['step']}) cannot be read ({err}): it is "
                "truncated or corrupt, and a resume would keep it; restore it, or start the run again with "
                "overwrite=true"
            ) from None


def _checkpoint_step(cfg: DictConfig, checkpoint: str | None) -> int:
    """The step the run continues from: ``checkpoint``'s ``global_step`` (read safely), else 0.

    Raises:
        CheckpointError: the checkpoint is unsafe to unpickle, truncated or not a checkpoint.
        ValueError: ``trainer.max_steps`` lies below the checkpoint's step.
    """
    from flashprobe.formats.checkpoint_io import load_checkpoint

    if not checkpoint:
        return 0
    step = int(load_checkpoint(checkpoint)["global_step"])
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
    from hydra.errors import InstantiationException

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
    _check_sites(cfg, module)
    return {
        "datamodule": datamodule,
        "module": module,
        "callbacks": callbacks,
        "loggers": loggers,
        "trainer": trainer,
    }


def _attention_ran(trainer: L.Trainer, module: L.LightningModule) -> dict[str, Any] | None:
    """What computed the model's attention in this session, for ``run.json``: the probe's primary (or
    the routed kernel), and where it fell back, from which step and why; None if it cannot be said."""
    from flashprobe.callbacks.weight_snapshot import trained_attention_record

    try:
        return trained_attention_record(trainer, module)
    except Exception:  # a record of what ran must not fail the run's bookkeeping
        return None


def _fit(
    cfg: DictConfig, run_dir: Path, checkpoint: str | None, from_step: int, built: dict[str, Any]
) -> tuple[dict[str, float], dict[str, Any]]:
    """Fit the built objects (the body of :func:`train`, threads already set)."""
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
            )
            _announce_wandb(loggers)
        with _ranks_rerun_this_job(run_dir):
            trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
    except SystemExit as exit_:  # Lightning's answer to Ctrl-C: sys.exit(1) after a graceful shutdown
        if trainer.state.status != TrainerStatus.INTERRUPTED:
            raise
        failure = RunStoppedError(
            f"interrupted (Ctrl-C) at step {trainer.global_step}; saved: {_saved(run_dir)}. Continue with: "
            f"flashprobe train resume={run_dir}",
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
            f"{guard.reason}: training stopped there (run.json says why). Look at the kernel "
            f"({cfg.attention.kernel}) and probe.jsonl's non-finite counts; on_nonfinite=continue trains on",
            exit_code=1,
        )
    stopped = next((c.stopped for c in callbacks if isinstance(c, AttentionProbe) and c.stopped), None)
    if failure is None and stopped is not None:  # the probe saw the primary's non-finite output first
        failure = RunStoppedError(
            f"AttentionProbe: {stopped}: training stopped there (run.json says why; the reproducer is in "
            "repro/, see probe.jsonl)",
            exit_code=1,
        )
    if trainer.is_global_zero:
        seconds = time.perf_counter() - started
        note = guard.reason if guard.action == "continue" else None
        failed = None if failure is None else str(failure)
        if crashed is not None:
            failed = f"{type(crashed).__name__}: {(str(crashed).strip().splitlines() or [''])[0]}"
        try:
            finish_session(
                run_dir,
                global_step=trainer.global_step,
                seconds=seconds,
                failed=failed,
                note=note,
                attention=_attention_ran(trainer, module),
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
    objects = {
        "datamodule": datamodule,
        "module": module,
        "trainer": trainer,
        "callbacks": callbacks,
        "loggers": loggers,
        "run_dir": run_dir,
    }
    return metrics, objects


def _announce_wandb(loggers: list[Any]) -> None:
    """Say where the W&B run lives before training (so the run's last lines are the probe's summary)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            offline, where = run.settings.mode in ("offline", "dryrun"), Path(run.dir).parent
            upload = f" (upload: wandb sync {where})" if offline else ""
            log.info("W&B run %s: %s%s", "(offline)" if offline else run.url, where, upload)


class RunStoppedError(RuntimeError):
    """A run that ended before its ``max_steps``: Ctrl-C, a full disk, or non-finite loss or weights.

    Its message says why, what was saved and the command that continues the run; ``run.json``
    records the same. ``flashprobe train`` prints it and exits with :attr:`exit_code`.
    """

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _saved(run_dir: Path) -> str:
    """What a stopped run has on disk to continue from, in words."""
    checkpoint = last_checkpoint(run_dir)
    parts = [f"checkpoint {checkpoint.relative_to(run_dir)}" if checkpoint else "no checkpoint yet"]
    parts += [name for name in ("snapshots", "probe.jsonl") if (run_dir / name).exists()]
    return ", ".join(parts)


def _disk_full_stop(run_dir: Path, err: BaseException) -> RunStoppedError:
    """The one-line stop of a run whose disk is full: the directory, its free space, the file that could
    not be written, what the run kept, and the command that continues it."""
    target = next((e.path for e in _chain(err) if isinstance(e, DiskFullError)), None)
    free = free_space(run_dir)
    writing = ""
    if target is not None:
        writing = f" writing {target.relative_to(run_dir) if target.is_relative_to(run_dir) else target}"
    stop = RunStoppedError(
        f"the disk holding {run_dir} is full ({(free or 0) / 2**20:.1f} MiB free){writing}; kept: "
        f"{_saved(run_dir)}. Free some space (or train on another disk) and continue with: "
        f"flashprobe train resume={run_dir}",
        exit_code=1,
    )
    stop.__cause__ = err
    return stop


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err`` and the exceptions that caused it."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def compose(overrides: Sequence[str] = (), run_dir: str | Path | None = None) -> DictConfig:
    """Compose the packaged config with Hydra overrides, outside a Hydra app (tests, the study).

    Args:
        overrides: Hydra overrides such as ``["attention=math", "trainer.max_steps=5"]``.
        run_dir: the run directory to train into.

    Returns:
        The composed config, with ``run_dir`` set when given.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    if run_dir is not None:
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    return cfg


#: flashprobe's own refusals of a run (bad setting, directory in the way or in use, unsafe checkpoint):
#: the CLI prints their message alone, without a traceback (``-v`` or ``HYDRA_FULL_ERROR=1``: with it).
REFUSALS = (ValueError, FileExistsError, FileNotFoundError, DirectoryLockedError)

#: ``flashprobe train -v``: show tracebacks of flashprobe's own errors too.
_VERBOSE = False


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
    :data:`REFUSALS` error raised where flashprobe checks the run, or an error of a class flashprobe
    defines (a kernel refusing a call, the probe's failure with ``on_failure=raise``, an unsafe
    checkpoint, ...), wherever raised. Anything else is a bug and keeps its traceback."""
    if getattr(err, "flashprobe_refusal", False):
        return True
    return isinstance(err, Exception) and type(err).__module__.split(".")[0] == "flashprobe"


def _refusal_paragraph(err: BaseException) -> str:
    """``err``'s message as one paragraph (its lines joined)."""
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        metrics, _ = train(cfg)
    except RunStoppedError as err:
        if _traceback_wanted():
            raise
        print(f"flashprobe train: {err}", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None
    except Exception as err:
        if not _refused(err) or _traceback_wanted():
            raise
        print(f"flashprobe train: error: {_refusal_paragraph(err)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
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
        if not saved.is_file():
            raise FileNotFoundError(
                f"resume={resume}: no run started by `flashprobe train` there ({saved} is missing)"
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
        except FileNotFoundError as err:
            raise FileNotFoundError(f"resume={resume}: {err}") from None
        except RecordedOverrideError as err:
            raise RecordedOverrideError(f"resume={resume}: {err}") from None
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
            raise FileExistsError(_refusal(Path(run_dir), found))
    return args


def _quoted(path: str) -> str:
    """``path`` as a Hydra override value: quoted when Hydra would otherwise read it as something else."""
    if all(c.isalnum() or c in "/._-+~@:" for c in path):
        return path
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _precheck(args: Sequence[str]) -> Path | None:
    """Compose the run's config as Hydra will and check every setting (:func:`_check`), before Hydra starts.

    Only for a single run given by overrides (no ``-m`` sweep, no Hydra flags, whose composition
    Hydra alone knows); returns the run directory when the command line names it (``hydra.run.dir``).

    Raises:
        ValueError: a setting is invalid, or the overrides do not compose (Hydra's reason).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flashprobe.app.study import check_launcher

    check_launcher(args)  # a sweep's launcher too: Hydra would fail after making the run directory
    if any(a.startswith("-") for a in args):
        return None
    given = override_path(args, "hydra.run.dir")
    run_dir = Path(given) if given and "${" not in given else None
    overrides = [a for a in args if not override_key(a).startswith("hydra")]
    try:
        cfg = compose(overrides)
        with open_dict(cfg):  # where the callbacks' ${run_dir} points (Hydra's default: a new directory)
            cfg.run_dir = str(run_dir or Path(str(cfg.output_root)) / "train" / "new")
        _check(cfg)
        _check_paths(cfg, Path(cfg.run_dir))
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
                _refuse_foreign(run_dir, existing_run(run_dir))
        step = _checkpoint_step(cfg, str(resumed) if resumed else cfg.get("ckpt_path"))  # unsafe files: now
        if resumed:
            _check_resumable(run_dir, step)
        quiet_third_party()
        lightning_log = logging.getLogger("lightning.pytorch")
        level = lightning_log.level
        lightning_log.setLevel(logging.WARNING)  # the Trainer's "GPU available" lines come with the run
        try:
            _build(cfg, Path(cfg.run_dir))  # every constructor checks its arguments; nothing is written
        finally:
            lightning_log.setLevel(level)
    except (HydraException, OmegaConfBaseException) as err:
        reason = " ".join(str(err).split())
        bad = next((o for o in args if not _parses(o)), None)
        if bad is not None:
            raise ValueError(
                f"{bad!r} is not a valid Hydra override ({reason.split(' See ')[0]}); quote a value that "
                "holds '=' or ',', as in attention.kernel='tiled:block_q=32,block_k=64'"
            ) from None
        raise ValueError(reason) from None
    return run_dir


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
    """``flashprobe train [-v] [overrides]``: run the Hydra app with ``argv`` as its command line.

    Every setting is checked and the run directory locked before Hydra starts; flashprobe's own
    errors print one message and return 2 (``-v`` or ``HYDRA_FULL_ERROR=1``: with the traceback).

    Lightning's DDP launcher starts the other ranks by re-running the main script with
    ``sys.argv[1:]``; ``sys.argv`` and ``__main__.__spec__`` are pointed at this module, so the
    ranks re-run this Hydra app (``python -m flashprobe.app.train OVERRIDES``), not the CLI.
    """
    global _VERBOSE
    given = list(sys.argv[1:] if argv is None else argv)
    _VERBOSE = any(a in ("-v", "--verbose") for a in given)
    given = [a for a in given if a not in ("-v", "--verbose")]
    with contextlib.ExitStack() as stack:
        try:
            args = command_line(given)
            run_dir = _precheck(args)
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
    return 0


if __name__ == "__main__":
    _hydra_main()
