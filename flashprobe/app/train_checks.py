"""What ``flashprobe train`` checks before Hydra starts (:func:`command_line`, :func:`precheck`), and
how it words a refusal: one paragraph without a traceback (:func:`is_refusal`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from flashprobe.app.compose import CONF_DIR, check_paths, compose_with_sources
from flashprobe.app.imports import imported_modules
from flashprobe.app.overrides import (
    RecordedOverrideError,
    config_groups,
    override_path,
    override_value,
    recorded_overrides,
)
from flashprobe.app.run_dir import RunDir
from flashprobe.app.schema import RunSchema, check_sites
from flashprobe.errors import FlashprobeError
from flashprobe.formats.atomic import FULL_BELOW, free_space
from flashprobe.formats.lock import DirectoryLockedError
from flashprobe.formats.paths import OutputPathError, check_output_dir, printable
from flashprobe.formats.run_dir import RUN_DIR_NAMES, check_links
from flashprobe.formats.run_record import read_run_record

__all__ = [
    "REFUSALS",
    "check_config",
    "command_line",
    "instantiation_reason",
    "is_refusal",
    "precheck",
    "refusal_paragraph",
    "refusals",
]

#: Errors that, raised where flashprobe checks a run, are refusals: printed without a traceback
#: (``-v`` or ``HYDRA_FULL_ERROR=1``: with it).
REFUSALS = (ValueError, FileExistsError, FileNotFoundError, DirectoryLockedError)


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """Mark a :data:`REFUSALS` error raised in the block as flashprobe's own (printed without traceback)."""
    try:
        yield
    except REFUSALS as err:
        err.flashprobe_refusal = True  # type: ignore[attr-defined]
        raise


def is_refusal(err: BaseException) -> bool:
    """Whether ``err`` is flashprobe's own refusal: marked by :func:`refusals`, or a
    :class:`FlashprobeError` wherever raised. Anything else is a bug and keeps its traceback."""
    return bool(getattr(err, "flashprobe_refusal", False)) or isinstance(err, FlashprobeError)


def refusal_paragraph(err: BaseException) -> str:
    """``err``'s message as one printable paragraph (its lines joined, escape sequences escaped)."""
    return printable(" ".join(line.strip() for line in str(err).splitlines() if line.strip()))


def instantiation_reason(err: Exception) -> str:
    """Hydra's ``InstantiationException`` as ``KEY: the object's reason``, or its own message (one
    line) where it names no key or no cause."""
    lines = str(err).splitlines()
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None)
    if key is None or err.__cause__ is None:
        return " ".join(str(err).split())
    return f"{key}: {refusal_paragraph(err.__cause__)}"


def check_config(
    cfg: DictConfig, run_dir: str | Path | None = None, source: Callable[[str], str] | None = None
) -> RunSchema:
    """Check every setting of a composed run config before any work: the schemas
    (:meth:`~flashprobe.app.schema.RunSchema.from_config`) and ``attention.probe.sites`` against the
    model's module paths (the LightningModule is built for it; nothing is written).

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
            raise ValueError(instantiation_reason(err)) from err
        check_sites(cfg.attention.probe.sites, module)
    return schema


def command_line(args: Sequence[str]) -> list[str]:
    """The Hydra command line of ``flashprobe train ARGS``; checked before Hydra writes anything.

    ``resume=DIR`` becomes the run's recorded overrides (``DIR/.hydra/overrides.yaml``), those given
    now on top, and ``hydra.run.dir=DIR``.

    Raises:
        FileNotFoundError: ``resume=DIR`` where ``DIR`` holds no run started by ``flashprobe train``.
        FileExistsError: ``hydra.run.dir=DIR`` where ``DIR`` holds a run, without resume or overwrite.
        OutputPathError: ``hydra.run.dir`` is empty, a file, lies under one, or is not writable.
        ValueError: ``resume`` or ``hydra.run.dir`` is not one path (a sweep, a list).
        RecordedOverrideError: the recorded overrides ask for more than flashprobe's settings
            (:func:`flashprobe.app.overrides.recorded_overrides`).
    """
    args = list(args)
    resume, run_dir = override_path(args, "resume"), override_path(args, "hydra.run.dir")
    if resume is not None and not resume.strip():
        raise OutputPathError("resume='' is empty; give the run directory to continue: resume=RUN_DIR")
    if resume not in (None, "null", "auto") and run_dir is None:
        return _resumed_command_line(args, resume)
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
        RunDir(run_dir).refuse_occupied()
    return args


def _resumed_command_line(args: list[str], resume: str) -> list[str]:
    """:func:`command_line` of ``resume=DIR``: the run's recorded overrides, ``args`` on top."""
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


def _quoted(path: str) -> str:
    """``path`` as a Hydra override value: quoted when Hydra would otherwise read it as something else."""
    if all(c.isalnum() or c in "/._-+~@:" for c in path):
        return path
    return "'" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"


def precheck(args: Sequence[str], given: Sequence[str] = ()) -> tuple[DictConfig | None, Path | None]:
    """Compose the run's config, once, and check every setting and path it writes
    (:func:`check_config`, :func:`~flashprobe.app.compose.check_paths`) before anything is written.

    A multirun (``-m``) is checked for its first job (its jobs are composed by Hydra's launcher);
    Hydra's other flags run no job and are left to it.

    Args:
        args: the Hydra command line (:func:`command_line`).
        given: the overrides the user gave (the others come from ``resume=``'s record).

    Returns:
        ``(config, run directory)`` of a single run: its config as composed, with Hydra's section
        (the config its Hydra job runs, :func:`~flashprobe.app.launch.run_hydra_job`), and the
        directory it writes into (``${now:...}`` resolved once, as the job sees it); ``(None, None)``
        for a multirun or another of Hydra's flags.

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
    try:
        return _check_job(args, given, multirun)
    except (HydraException, OmegaConfBaseException) as err:
        reason = " ".join(str(err).split())
        bad = next((o for o in args if not _parses(o)), None)
        if bad is not None:
            raise ValueError(
                f"{bad!r} is not a valid Hydra override ({reason.split(' See ')[0]}); quote a value that "
                "holds '=' or ',', as in attention.kernel='tiled:block_q=32,block_k=64'"
            ) from None
        raise ValueError(reason) from None


def _check_job(
    args: Sequence[str], given: Sequence[str], multirun: bool
) -> tuple[DictConfig | None, Path | None]:
    """:func:`precheck` of the job (a multirun's first) that ``args`` runs."""
    overrides = [a for a in args if not a.startswith("-")]
    resume = override_path(args, "resume")
    record = f"{resume}/.hydra/overrides.yaml"
    recorded = {o: record for o in overrides if o not in given and not o.startswith("hydra.run.dir=")}
    if multirun:
        cfg, sources = compose_with_sources(_first_jobs(overrides), hydra=True, recorded=recorded)
        check_paths(cfg, None, sources)
        return None, None
    cfg, sources = compose_with_sources([*overrides, "hydra.mode=RUN"], hydra=True, recorded=recorded)
    run_dir = Path(str(cfg.hydra.run.dir))  # ${now:...} resolved once: the config keeps the value
    configured = OmegaConf.select(cfg, "run_dir", default=None, throw_on_resolution_failure=False)
    if isinstance(configured, str) and Path(configured).resolve() != run_dir.resolve():
        raise ValueError(
            f"run_dir ({sources('run_dir')}) is {configured}, not the run's directory "
            f"{cfg.hydra.run.dir}: `flashprobe train` writes a run into its Hydra directory; give "
            "hydra.run.dir=DIR instead"
        )
    check_paths(cfg, str(run_dir), sources)
    job = job_config(cfg, run_dir)
    check_config(job, job.run_dir, sources)
    RunDir(run_dir).check_contents(resume)
    free = free_space(job.run_dir)
    if free is not None and free < FULL_BELOW:  # Hydra's own first writes would fail with a traceback
        raise ValueError(
            f"the disk holding {job.run_dir} is full ({free / 2**20:.1f} MiB free); free some space or "
            "train on another disk (hydra.run.dir=...)"
        )
    RunDir(run_dir).check_start(job)
    return cfg, run_dir


def job_config(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """The config the Hydra job of ``cfg`` trains with: a copy without Hydra's section, its
    ``${run_dir}`` the run's directory."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        del job["hydra"]
        job.run_dir = str(run_dir)
    return job


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


def _parses(override: str) -> bool:
    """Whether Hydra's override grammar accepts ``override``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(override)
    except HydraException:
        return False
    return True
