"""How ``flashprobe train`` runs its Hydra job: a single run's job on the config composed once
(:func:`run_hydra_job`), and the one place flashprobe sets ``sys.argv`` and ``__main__.__spec__``:
Hydra reads its command line there, and Lightning's DDP launcher starts ranks 1… by re-running the
main module with ``sys.argv[1:]``, so the ranks re-run :mod:`flashprobe.app.train`'s Hydra app, not
the CLI.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, read_write

from flashprobe.app.run_dir import launched_rank

__all__ = ["TRAIN_APP", "as_train_app", "ranks_rerun_this_job", "run_hydra_job"]

#: The module whose Hydra app ``flashprobe train`` runs, and its ranks re-run.
TRAIN_APP = "flashprobe.app.train"

#: The variables Lightning's DDP launcher sets in the launching process (rank zero).
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextlib.contextmanager
def as_train_app(args: Sequence[str], *, spec: bool = False) -> Iterator[None]:
    """For the ``with`` block: ``sys.argv`` is ``[<train app's file>, *args]`` and ``__main__.__spec__``
    the train app's (when ``__main__`` has a spec, or ``spec``).

    Args:
        args: the Hydra command line (overrides and Hydra's flags).
        spec: set ``__main__.__spec__`` even where ``__main__`` has none (a script, not ``python -m``).
    """
    import __main__

    train_app = importlib.util.find_spec(TRAIN_APP)
    assert train_app is not None and train_app.origin is not None
    saved_argv, saved_spec = sys.argv, getattr(__main__, "__spec__", None)
    sys.argv = [train_app.origin, *args]
    if spec or saved_spec is not None:
        __main__.__spec__ = train_app
    try:
        yield
    finally:
        sys.argv = saved_argv
        if spec or saved_spec is not None:
            __main__.__spec__ = saved_spec


def run_hydra_job(cfg: DictConfig, task: Callable[[DictConfig], Any]) -> Any:
    """Run ``task`` as the Hydra job of a single run, as ``@hydra.main`` does, on ``cfg``: the run's
    config composed once, with Hydra's section (:func:`~flashprobe.app.train_checks.precheck`).

    Hydra's job creates the run directory (``hydra.run.dir``), configures logging (``train.log``),
    calls Hydra's callbacks and reports an exception of ``task`` as ``@hydra.main`` does (exit 1; the
    whole traceback with ``HYDRA_FULL_ERROR=1``).

    Returns:
        What ``task`` returned.
    """
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    def run() -> Any:
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name="config")
        ret = run_job(
            task_function=task,
            config=cfg,
            job_dir_key="hydra.run.dir",
            job_subdir_key=None,
            # run_job reads only the callbacks: the config is composed already
            hydra_context=HydraContext(config_loader=None, callbacks=callbacks),  # type: ignore[arg-type]
        )
        callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
        return ret.return_value  # raises the task's exception

    return run_and_report(run)


@contextlib.contextmanager
def ranks_rerun_this_job(run_dir: Path) -> Iterator[None]:
    """In a multirun job, make DDP ranks re-run exactly this job in its directory (not the sweep);
    afterwards remove Lightning's rendezvous variables and destroy the process group, so the next job
    launches its own ranks. Outside a multirun nothing changes."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        yield
        return
    hydra_cfg = HydraConfig.get()
    saved_dir = hydra_cfg.run.dir
    with read_write(hydra_cfg.run):
        hydra_cfg.run.dir = str(run_dir)
    environment = {var: os.environ.get(var) for var in _RENDEZVOUS}
    try:
        with as_train_app(hydra_cfg.overrides.task, spec=True):
            yield
    finally:
        with read_write(hydra_cfg.run):
            hydra_cfg.run.dir = saved_dir
        if not launched_rank():
            for var, value in environment.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
