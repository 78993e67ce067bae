"""``flashprobe study``: the paper's §V weight-deviation study in one command, like for like.

A study trains the text-to-image model several times and compares the runs' weights pairwise. Every
comparison differs in exactly **one** thing, which it names (:class:`Comparison.isolates`):

=========================  ==========================  ===========================================
comparison                 runs (A vs B)               isolates
=========================  ==========================  ===========================================
``flash_vs_baseline``      flash vs baseline           the attention kernel, at the study precision
``identical``              identical vs baseline       nothing (the noise floor: 0 on a CPU)
``seed1_vs_seed0``         seed1 vs baseline           the random seed
``bf16_vs_fp32``           baseline at bf16 vs fp32    training precision (baseline attention)
``fp16_vs_fp32``           baseline at fp16 vs fp32    training precision (baseline attention)
``flash_vs_baseline_fp32`` flash vs baseline, fp32     the attention kernel without low precision
=========================  ==========================  ===========================================

Runs other than the precision pairs train at ``study.precision`` (default ``bf16-mixed``).
Replicate ``r`` (``study.replicates``) is the plan again at seed ``2r``, its names suffixed
``_seed<2r>`` (:func:`replicate_suffix`); comparisons pair runs of one replicate. Runs go through
Hydra multirun with ``resume=auto``, so invoking a study again skips finished runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flashprobe.app.overrides import override_key, override_value
from flashprobe.formats.run_record import RUN_RECORD

__all__ = [
    "DEFAULT_EXPERIMENT",
    "LAUNCHER_PACKAGES",
    "PRECISIONS",
    "Comparison",
    "StudyPlan",
    "StudyRun",
    "main",
    "run_study",
    "study_plan",
]

log = logging.getLogger(__name__)

#: Study precisions → the short name of the baseline run at that precision.
PRECISIONS: dict[str, str] = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}

#: The experiment a study uses unless given another (``flashprobe/conf/experiment/study.yaml``).
DEFAULT_EXPERIMENT = "study"

#: Hydra launcher option → the package that provides it.
LAUNCHER_PACKAGES: dict[str, str] = {
    "joblib": "hydra-joblib-launcher",
    "submitit_local": "hydra-submitit-launcher",
    "submitit_slurm": "hydra-submitit-launcher",
    "ray": "hydra-ray-launcher",
    "ray_aws": "hydra-ray-launcher",
}
_LAUNCHER_MODULES = {
    "hydra-joblib-launcher": "hydra_plugins.hydra_joblib_launcher",
    "hydra-submitit-launcher": "hydra_plugins.hydra_submitit_launcher",
    "hydra-ray-launcher": "hydra_plugins.hydra_ray_launcher",
}


def replicate_seed(replicate: int) -> int:
    """The seed of replicate ``r``'s runs: ``2r`` (its seed pair's other run trains from ``2r + 1``)."""
    return 2 * replicate


def replicate_suffix(replicate: int) -> str:
    """What replicate ``r`` adds to its runs' and comparisons' names: ``""`` for 0, else ``_seed<2r>``."""
    return "" if replicate == 0 else f"_seed{replicate_seed(replicate)}"


@dataclass(frozen=True)
class StudyRun:
    """One training run of a study (``conf/study_run/<role>.yaml`` at one replicate's seed)."""

    name: str
    attention: str
    """``flash`` or ``math`` (the ``attention`` config)."""
    precision: str
    """The Lightning precision it trains at."""
    seed: int
    role: str = ""
    """Its name in replicate 0 (the ``study_run`` option, what ``--runs`` names), e.g. ``seed1``."""
    replicate: int = 0


@dataclass(frozen=True)
class Comparison:
    """A pair of runs that differ in exactly one thing."""

    name: str
    run_a: str
    run_b: str
    kind: str
    """``kernel``, ``noise``, ``seed``, ``precision`` or ``kernel_fp32``."""
    isolates: str
    """What differs between the two runs, in words."""
    group: str = ""
    """The comparison's name in replicate 0: the same comparison at every replicate's seed."""
    replicate: int = 0
    seed: int = 0
    """The replicate's seed: both runs' seed (a seed pair: run B's)."""


@dataclass(frozen=True)
class StudyPlan:
    """The runs a study trains and the comparisons it makes, at each of its replicates."""

    precision: str
    runs: dict[str, StudyRun]
    comparisons: dict[str, Comparison]
    replicates: int = 1

    @property
    def roles(self) -> list[str]:
        """The runs' roles (replicate 0's names), in plan order."""
        return list(dict.fromkeys(r.role for r in self.runs.values()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "replicates": self.replicates,
            "seeds": [replicate_seed(r) for r in range(self.replicates)],
            "runs": {n: asdict(r) for n, r in self.runs.items()},
            "comparisons": {n: asdict(c) for n, c in self.comparisons.items()},
        }


#: Roles trained once, at replicate 0: the noise floor and the fp32 extra line (not part of the rule).
ONCE = ("identical", "flash_fp32")


def _roles(precision: str) -> list[StudyRun]:
    """Replicate 0's runs: each role's attention, precision and seed (the seed pair's other run: +1)."""
    runs = [
        StudyRun("flash", "flash", precision, 0),
        StudyRun("baseline", "math", precision, 0),
        StudyRun("identical", "math", precision, 0),
        StudyRun("seed1", "math", precision, 1),
    ]
    runs += [StudyRun(name, "math", p, 0) for p, name in PRECISIONS.items() if p != precision]
    if precision != "32-true":
        runs.append(StudyRun("flash_fp32", "flash", "32-true", 0))
    return [StudyRun(r.name, r.attention, r.precision, r.seed, role=r.name) for r in runs]


def _at_replicate(run: StudyRun, replicate: int) -> StudyRun:
    seed = replicate_seed(replicate) + run.seed
    name = f"seed{seed}" if run.role == "seed1" else run.role + replicate_suffix(replicate)
    return StudyRun(name, run.attention, run.precision, seed, role=run.role, replicate=replicate)


def _all_comparisons(precision: str, replicate: int) -> list[Comparison]:
    """Replicate ``replicate``'s comparisons, named by its runs (see :func:`_at_replicate`)."""
    seed, sfx, short = replicate_seed(replicate), replicate_suffix(replicate), PRECISIONS[precision]

    def baseline_at(p: str) -> str:
        return "baseline" + sfx if p == precision else PRECISIONS[p] + sfx

    def pair(group: str, a: str, b: str, kind: str, isolates: str, name: str = "") -> Comparison:
        name = name or group + sfx
        return Comparison(name, a, b, kind, isolates, group=group, replicate=replicate, seed=seed)

    kernel = "the attention kernel (under test vs math), at"
    comparisons = [
        pair("flash_vs_baseline", "flash" + sfx, "baseline" + sfx, "kernel", f"{kernel} {short}"),
        pair(
            "seed1_vs_seed0",
            f"seed{seed + 1}",
            "baseline" + sfx,
            "seed",
            f"the random seed, at {short}",
            name=f"seed{seed + 1}_vs_seed{seed}",
        ),
        *(
            pair(
                f"{PRECISIONS[p]}_vs_fp32",
                baseline_at(p),
                baseline_at("32-true"),
                "precision",
                f"training precision ({p} vs 32-true), baseline attention",
            )
            for p in ("bf16-mixed", "16-mixed")
        ),
    ]
    if replicate == 0:
        identical = "nothing: the same configuration trained twice"
        comparisons.insert(1, pair("identical", "identical", "baseline", "noise", identical))
        if precision != "32-true":
            fp32 = f"{kernel} fp32: its deviation without low precision"
            comparisons.append(pair("flash_vs_baseline_fp32", "flash_fp32", "fp32", "kernel_fp32", fp32))
    return comparisons


def study_plan(
    precision: str = "bf16-mixed", runs: Sequence[str] | None = None, replicates: int = 1
) -> StudyPlan:
    """The runs and like-for-like comparisons of a study, at each replicate (roles in :data:`ONCE`
    train at replicate 0 only).

    Args:
        precision: the study precision (a key of :data:`PRECISIONS`).
        runs: roles to train (default: every role); comparisons missing a run are left out.
        replicates: how many replicates (seeds) of the plan.

    Raises:
        ValueError: an unknown precision or role, fewer than one replicate, or roles that form no
            ``flash_vs_baseline`` pair, naming the valid choices.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"study.precision={precision!r} is not a study precision; use one of {', '.join(PRECISIONS)}"
        )
    if isinstance(replicates, bool) or not isinstance(replicates, int) or replicates < 1:
        raise ValueError(f"study.replicates={replicates!r} must be a positive integer (e.g. 3)")
    every = {r.role: r for r in _roles(precision)}
    chosen = list(every) if runs is None else list(dict.fromkeys(runs))
    unknown = [r for r in chosen if r not in every]
    if unknown:
        raise ValueError(
            f"unknown study run {unknown[0]!r} at study.precision={precision}; "
            f"choose from: {', '.join(every)} (each is trained at every replicate's seed: study.replicates)"
        )
    chosen = [r for r in every if r in chosen]  # plan order
    plan_runs = {
        run.name: run
        for i in range(replicates)
        for role in chosen
        if i == 0 or role not in ONCE
        for run in [_at_replicate(every[role], i)]
    }
    comparisons = {
        c.name: c
        for i in range(replicates)
        for c in _all_comparisons(precision, i)
        if c.run_a in plan_runs and c.run_b in plan_runs
    }
    if "flash_vs_baseline" not in comparisons:
        raise ValueError(
            f"runs {', '.join(chosen)} form no like-for-like flash_vs_baseline pair: a study needs the runs "
            "'flash' and 'baseline' (and, for context, 'seed1', 'identical', 'fp32', ...)"
        )
    return StudyPlan(precision, plan_runs, comparisons, replicates)


def check_launcher(overrides: Sequence[str]) -> None:
    """Fail before any training when ``hydra/launcher=NAME`` names a plugin that is not installed.

    Raises:
        ValueError: naming the package to install.
    """
    name = override_value(overrides, "hydra/launcher")
    if name is None or name == "basic":
        return
    package = LAUNCHER_PACKAGES.get(name)
    if package is None:  # another launcher: one of the config options Hydra finds, or refused now
        known = _launcher_options()
        if name not in known:
            raise ValueError(
                f"hydra/launcher={name} is not a Hydra launcher installed here (found: {', '.join(known)}); "
                "choose one of these, or install its plugin (e.g. pip install hydra-joblib-launcher)"
            )
        return
    if importlib.util.find_spec(_LAUNCHER_MODULES[package]) is None:
        raise ValueError(
            f"hydra/launcher={name} needs the Hydra plugin {package}, which is not installed: "
            f"pip install {package} (keep your torch: pip install torch==<your version> {package})"
        )


def _launcher_options() -> list[str]:
    """The ``hydra/launcher`` options Hydra finds: ``basic`` and those of the installed plugins."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from flashprobe.app.train import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return list(GlobalHydra.instance().config_loader().get_group_options("hydra/launcher"))


def study_config(overrides: Sequence[str]) -> Any:
    """The composed config of a study's ``flash`` run.

    Raises:
        ValueError: the overrides do not compose, with Hydra's reason.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from flashprobe.app.train import compose

    try:
        return compose(_flash_run(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ValueError(f"the study's overrides do not compose: {err}") from None


def _flash_run(overrides: Sequence[str]) -> list[str]:
    """The overrides composing the study's ``flash`` run (Hydra's own settings left to the launch)."""
    return ["study_run=flash", *(o for o in overrides if not o.lstrip("+~").startswith("hydra"))]


def run_study(
    out: str | Path,
    runs: Sequence[str] | None = None,
    overrides: Sequence[str] = (),
    *,
    train: bool = True,
) -> Path:
    """Train the study's runs (skipping finished ones) and compare them.

    Args:
        out: the study directory; runs go to ``out/runs/<name>``.
        runs: roles to train (default: the whole plan, :func:`study_plan`).
        overrides: Hydra overrides for every run, e.g. ``study.kernel=tiled:preset=fa2``
            (default ``experiment=study``).
        train: ``False``: only compare the runs already in ``out/runs``.

    Returns:
        The path of ``report.md``.

    Raises:
        ValueError: a bad precision, kernel, run name, launcher or override (before any training).
        DirectoryLockedError: another process is writing into ``out``.
    """
    from flashprobe.formats.atomic import FULL_BELOW, free_space
    from flashprobe.formats.lock import directory_lock
    from flashprobe.formats.paths import (
        OutputPathError,
        check_output_dir,
        prepare_output_dir,
        printable,
        safe_name,
    )
    from flashprobe.formats.run_dir import check_links
    from flashprobe.kernels import KernelSpecError, get_kernel

    check_output_dir(out, owned=STUDY_OWNS)  # a system directory is refused as such, before its free space
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:  # Hydra writes the sweep's paths into YAML, which holds text only
        raise OutputPathError(
            f"--out {printable(out)}: its name holds bytes that are not UTF-8, which Hydra cannot take as "
            "the runs' directory; give a directory whose name is UTF-8 text"
        ) from None
    overrides = list(overrides)
    if override_value(overrides, "experiment") is None:
        overrides.insert(0, f"experiment={DEFAULT_EXPERIMENT}")
    check_launcher(overrides)
    cfg = study_config(overrides)
    plan = study_plan(str(cfg.study.precision), runs, _replicates(cfg.study.get("replicates", 1)))
    try:
        get_kernel(cfg.study.kernel)
    except KernelSpecError as err:
        raise ValueError(f"study.kernel: {err}") from None
    from flashprobe.app.compose import lazy_sources
    from flashprobe.app.train import check_config

    # the flash run's config stands for every run's (the others differ in the plan's keys only)
    check_config(cfg, Path(out) / "runs" / "flash", lazy_sources(_flash_run(overrides)))
    safe_name(str(cfg.run_name), what="run_name")  # it names each run's directory under OUT/runs
    _refuse_study_sets(overrides)
    if not train:  # compare only: the runs must be there already; nothing is created before that
        _check_trained(Path(out) / "runs", plan)
    free = free_space(out)
    if free is not None and free < FULL_BELOW:  # the lock and the first run's files would fail
        raise ValueError(
            f"the disk holding {out} is full ({free / 2**20:.1f} MiB free); free some space or give another "
            "--out, then run the same command again"
        )
    # resolved once: an empty --out fails before it is resolved to the cwd
    out = prepare_output_dir(out, owned=STUDY_OWNS).resolve()
    with directory_lock(out, what="study directory (--out)"):
        check_links(out)
        return _run_locked_study(out, plan, cfg, overrides, train)


def _refuse_study_sets(overrides: Sequence[str]) -> None:
    """Refuse an override of a setting the study gives each run itself (:data:`STUDY_SETS`)."""
    keys = [override_key(o) for o in overrides if "=" in o]
    for key in STUDY_SETS:
        if any(k == key or k.startswith(f"{key}.") for k in keys):
            raise ValueError(
                f"{key}= is set by the study for each run (replicate r trains from seed 2r, its seed pair's "
                f"other run from 2r + 1): leave it out; study.replicates=N sets how many seeds"
            )


#: What a study writes into its ``--out``: a non-empty directory holding none of these is not a study's.
STUDY_OWNS = ("study.json", "runs", "study_settings.json", "report.md", ".flashprobe.lock")

#: Settings the study gives each run itself; an override of them (or of a key under them, such as
#: ``study.replicate.seed``) is refused.
STUDY_SETS = ("seed", "study.replicate")


def _replicates(value: Any) -> int:
    """``study.replicates`` as an int (an override may give text); :func:`study_plan` checks its sign."""
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"study.replicates={value!r} must be a positive integer (e.g. 3)") from None


#: The study's settings, recorded in its directory before any run trains (``OUT/study_settings.json``).
SETTINGS_FILE = "study_settings.json"

#: Settings that change no run (replicate r's runs are the same whatever the number of replicates):
#: not compared with the first invocation's, so a study can be extended with more replicates.
RUN_INDEPENDENT = ("study.replicates",)


def _settings(cfg: Any) -> dict[str, Any]:
    """The composed config without Hydra's section, flattened: ``{"trainer.max_steps": 120, ...}``."""
    from omegaconf import OmegaConf

    from flashprobe.formats.jsonio import flatten

    tree = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(tree, dict)
    tree.pop("hydra", None)
    return flatten(tree)


def check_settings(out: Path, cfg: Any) -> None:
    """Refuse a study directory whose runs were trained with other settings (:data:`SETTINGS_FILE`).

    Not checked without the file, or while no run has started (no ``runs/*/run.json``).

    Raises:
        ValueError: naming each setting that differs, old and new, and the fix.
    """
    path = out / SETTINGS_FILE
    if not path.is_file():
        return
    try:
        before = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err}); move it away to start the study afresh") from None
    now = json.loads(json.dumps(_settings(cfg), default=str))
    differ = sorted(
        k for k in before.keys() | now.keys() if before.get(k) != now.get(k) and k not in RUN_INDEPENDENT
    )
    if differ and any((out / "runs").glob(f"*/{RUN_RECORD}")):
        shown = "; ".join(f"{k}: {before.get(k)!r} then, {now.get(k)!r} now" for k in differ[:8])
        more = f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""
        raise ValueError(
            f"{out} holds a study trained with other settings — {shown}{more}. Its finished runs would "
            "be skipped and reported under the new settings: use another --out for these settings, or "
            "the first invocation's settings to continue it"
        )


def _run_locked_study(out: Path, plan: StudyPlan, cfg: Any, overrides: list[str], train: bool) -> Path:
    """The body of :func:`run_study`, run while this process holds the lock of ``out``."""
    from flashprobe.formats.atomic import atomic_write_text

    check_settings(out, cfg)
    if train:  # the first invocation's settings (only a RUN_INDEPENDENT one can have changed)
        atomic_write_text(
            out / SETTINGS_FILE, json.dumps(_settings(cfg), default=str, indent=1, sort_keys=True)
        )
    from flashprobe.app.study_progress import StudyProgress
    from flashprobe.app.train import cli_main
    from flashprobe.formats.study_file import write_study
    from flashprobe.report.study_report import write_report
    from flashprobe.report.study_verdict import comparison_groups
    from flashprobe.report.weights_figures import plot_study_figures
    from flashprobe.weights import compare_runs

    runs_dir = out / "runs"
    if train:
        argv = [f"hydra.sweep.dir={runs_dir}", "hydra.sweep.subdir=${run_name}", "resume=auto"]
        argv += [
            f"{group}=study"
            for group in ("hydra/job_logging", "hydra/hydra_logging")
            if override_value(overrides, group) is None
        ]
        console = "callbacks.attention_probe.console"
        if "attention_probe" in (cfg.get("callbacks") or {}) and override_value(overrides, console) is None:
            argv.append(f"{console}=false")  # the study's progress prints each run's verdict instead
        kernel = str(cfg.study.kernel)
        labels = {
            n: f"{kernel if r.attention == 'flash' else 'math'}, {r.precision}, seed {r.seed}"
            for n, r in plan.runs.items()
        }
        seeds = ", ".join(str(replicate_seed(r)) for r in range(plan.replicates))
        print(
            f"flashprobe study: {len(plan.runs)} runs ({plan.replicates} replicate"
            f"{'s' * (plan.replicates != 1)}, seeds {seeds}) into {runs_dir} (each run's log: "
            "runs/<run>/train.log; interrupted? run the same command again to resume)",
            flush=True,
        )
        with _quiet_runs(), StudyProgress(runs_dir, labels):
            for sweep in _sweeps(plan):
                code = cli_main(["-m", *sweep, *argv, *overrides])
                if code:  # refused before training (its message printed): the study stops with it
                    raise SystemExit(code)
    _check_trained(runs_dir, plan)
    comparison = compare_runs(
        {n: (runs_dir / c.run_a, runs_dir / c.run_b) for n, c in plan.comparisons.items()}
    )
    meta = {
        **plan.as_dict(),
        "kernel": str(cfg.study.kernel),
        "warmup_steps": int(cfg.module.get("warmup_steps") or 0),
        "overrides": overrides,
        "machine": _runs_machine(runs_dir, plan.runs),
    }
    doc = {**comparison.as_dict(), "study": meta}
    write_study(out, doc, comparison.rows())
    plot_study_figures(doc["pairs"], out, groups=comparison_groups(doc))
    return write_report(out)


def _replicate_value(replicate: int) -> str:
    """``study.replicate`` of replicate ``r``'s runs, as a Hydra override value."""
    seed = replicate_seed(replicate)
    return f"{{seed:{seed},seed_pair:{seed + 1},suffix:'{replicate_suffix(replicate)}'}}"


def _sweeps(plan: StudyPlan) -> list[list[str]]:
    """The Hydra multiruns that train ``plan``: replicate 0's runs, then the others' as one sweep."""
    first = [r.role for r in plan.runs.values() if r.replicate == 0]
    sweeps = [[f"study.replicate={_replicate_value(0)}", f"study_run={','.join(first)}"]]
    if plan.replicates > 1:
        values = ",".join(_replicate_value(i) for i in range(1, plan.replicates))
        roles = [r for r in first if r not in ONCE]
        sweeps.append([f"study.replicate={values}", f"study_run={','.join(roles)}"])
    return sweeps


def _check_trained(runs_dir: Path, plan: StudyPlan) -> None:
    """Raise ``ValueError`` naming the runs of ``plan`` without snapshots in ``runs_dir``."""
    missing = sorted(r for r in plan.runs if not (runs_dir / r / "snapshots").is_dir())
    if missing:
        raise ValueError(f"{runs_dir} has no snapshots of the runs {', '.join(missing)}; train them first")


@contextlib.contextmanager
def _quiet_runs() -> Iterator[None]:
    """While the runs train: warnings to the runs' train.log, W&B silent; afterwards the root
    logger (which Hydra pointed at the last run's log) prints warnings to the console again."""
    silent = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = silent or "true"
    logging.captureWarnings(True)
    try:
        yield
    finally:
        logging.captureWarnings(False)
        if silent is None:
            os.environ.pop("WANDB_SILENT", None)
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(console)
        root.setLevel(logging.WARNING)


def _runs_machine(runs_dir: Path, names: Sequence[str]) -> dict[str, Any]:
    """The machine facts the runs trained with (their ``run.json``) when they agree; otherwise
    ``{"differ": {run: facts}}``, with a warning (a pair's deviation then includes that difference)."""
    from flashprobe.app.machine import machine_facts
    from flashprobe.formats.run_record import read_run_record

    facts = {}
    for name in names:
        record = read_run_record(runs_dir / name) or {}
        facts[name] = record.get("machine") or machine_facts()  # runs from before run.json: this process
    distinct = {json.dumps(f, sort_keys=True) for f in facts.values()}
    if len(distinct) == 1:
        return next(iter(facts.values()))
    log.warning(
        "the study's runs trained on different machines or settings (torch build, threads, CPU): "
        "a pair's deviation then includes that difference; see study.json's study.machine.differ"
    )
    return {"differ": facts}


EPILOG = """\
common overrides (Hydra, applied to every run):
  study.precision=bf16-mixed|16-mixed|32-true   precision of flash, baseline, identical, seeds
  study.kernel=SPEC          the kernel under test (flashprobe kernels), e.g. tiled:preset=paper
  study.replicates=N         train the runs at N seeds (replicate r: seed 2r; default 3); each ratio
                             gets its median and min-max over the replicates
  experiment=NAME            the study's settings (default: study; ./conf/experiment/NAME.yaml)
  trainer.max_steps=N        optimizer steps per run (default 100)
  hydra/launcher=joblib|submitit_local|submitit_slurm   run the runs in parallel / on a cluster
  trainer=ddp_cpu            each run as a 2-process DDP run

examples:
  flashprobe study                                    the quick study (out/study; 3 replicates, 100 steps)
  flashprobe study --out out/paper_study experiment=paper_study   5 replicates, 900 steps
  flashprobe study --out out/study_40 --runs flash,baseline,identical trainer.max_steps=40
  flashprobe study --out out/study_submitit hydra/launcher=submitit_local   each run a submitit job
(one --out per set of settings: a study directory refuses other settings than its first invocation's;
study.replicates may change: replicate r's runs are the same whatever the number of replicates)

The first line of the verdict is the answer; the exit code says it (docs/study.md "The answer"):
  0  PASS          at every snapshot step after the warm-up, flash / seed is below 1 in every
                   replicate and flash / the low-precision pair at the precision flash trains at
                   (bf16_vs_fp32 at bf16) is not above 1 in every replicate
  3  LOOK CLOSER   one of these fails at some step (named), or flash's weights turn non-finite
  4  UNDETERMINED  a comparison the rule needs was not trained (e.g. --runs flash,baseline), is
                   undefined in a replicate, or its runs differ in more than the one thing
  1  a run failed (its message above)   2  bad arguments, nothing trained   130  interrupted

Re-running the same command skips finished runs and resumes interrupted ones.
Writes OUT/study.json, study.csv, report.md, fig7_<pair>.png, fig8_wasserstein.png, OUT/runs/<run>/."""


def main(argv: Sequence[str] | None = None) -> int:
    """``flashprobe study [--out DIR] [--runs a,b,...] [--compare-only] [HYDRA_OVERRIDES...]``."""
    from flashprobe.app.imports import command_options
    from flashprobe.formats.lock import DirectoryLockedError
    from flashprobe.formats.paths import printable
    from flashprobe.kernels.registry import add_import_option

    parser = argparse.ArgumentParser(
        prog="flashprobe study",
        description="Train flash and baseline attention at a training precision (study.precision, default "
        "bf16-mixed), an identical repeat, a seed pair and the baseline at other precisions, at several "
        "seeds (replicates), and answer whether flash attention's weight deviation is within the seed bound "
        "and not above low precision, like for like (paper §V).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="out/study", help="study directory (default: out/study)")
    parser.add_argument(
        "--runs",
        default=None,
        help="comma-separated runs of the plan (flash,baseline,identical,seed1,fp32,fp16,flash_fp32; "
        "default: all), each trained at every replicate's seed (identical, flash_fp32: at the first only)",
    )
    parser.add_argument(
        "--compare-only", action="store_true", help="compare runs already trained in OUT/runs"
    )
    parser.add_argument(
        "--config-dir",
        default=None,
        metavar="DIR",
        help="a conf/ directory of your own, searched before ./conf and the packaged configs",
    )
    add_import_option(parser)
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides for every run, e.g. study.precision=16-mixed"
    )
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))  # options anywhere
    runs = None if args.runs is None else [r for r in args.runs.split(",") if r]
    again = "run the same command again to continue (finished runs are skipped, the others resume)"
    try:
        options = [f for d in [args.config_dir] if d is not None for f in ("--config-dir", d)]
        with command_options([*options, *(f for m in args.imports or [] for f in ("--import", m))]):
            report = run_study(args.out, runs, args.overrides, train=not args.compare_only)
    except (ValueError, DirectoryLockedError) as err:
        print(f"flashprobe study: error: {printable(err)}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk while writing the study's own files
        from flashprobe.formats.atomic import disk_full

        if not disk_full(err):
            raise
        print(f"flashprobe study: error: {err}; {again}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a run's training (which ends with SystemExit(130))
        print(f"flashprobe study: interrupted (Ctrl-C); {again}", file=sys.stderr)
        return 130
    except SystemExit as exit_:
        if exit_.code == 130:
            print(f"flashprobe study: interrupted; {again}", file=sys.stderr)
        elif exit_.code not in (0, None):
            print(f"flashprobe study: a run failed (above); fix it and {again}", file=sys.stderr)
        raise
    text, code = _closing(report)
    print(text)
    return code


def _closing(report: Path) -> tuple[str, int]:
    """The verdict (its answer first) and the paths the study wrote, and the answer's exit code."""
    from flashprobe.formats.study_file import read_study
    from flashprobe.report.study_verdict import answer

    lines, code = answer(read_study(report.parent))
    out = report.parent
    text = "\n".join(
        [
            "",
            *lines,
            "",
            f"report:  {report}",
            f"numbers: {out / 'study.json'}, {out / 'study.csv'}",
            f"figures: {out}/fig7_*.png, {out / 'fig8_wasserstein.png'}",
            f"runs:    {out / 'runs'}/<run> (probe.png, snapshots, samples)",
        ]
    )
    return text, code
