"""What the app tests share: ``flashprobe`` in a subprocess, and the study experiment shrunk to seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests import _zygote as zygote

#: The repository root (on PYTHONPATH of the subprocess, so callbacks in tests/ can be named).
ROOT = Path(__file__).resolve().parents[2]


def flashprobe_cli(
    *args: str, cwd: Path = ROOT, env: Mapping[str, str] | None = None, unset: Sequence[str] = ()
) -> subprocess.CompletedProcess:
    """Run ``flashprobe ARGS`` as a user would (W&B offline, one OMP thread), output captured; a new
    process, forked from one that has imported torch and Lightning (:mod:`tests._zygote`).

    Args:
        env: extra environment variables; ``unset``: variables removed (e.g. ``WANDB_SILENT``).
    """
    environment = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    environment["MKL_NUM_THREADS"] = "1"
    environment.update(env or {})
    for var in unset:
        environment.pop(var, None)
    cmd = [sys.executable, "-m", "flashprobe.cli", *args]
    return zygote.run(cmd, cwd=cwd, env=environment, timeout=600)


#: Overrides that shrink ``experiment=study`` to seconds: one replicate, a tiny model, 4 steps, a
#: snapshot and a checkpoint every 2 steps, a 2-image sample grid, one torch thread (the experiment's
#: two threads, on a CPU whose cores the other test workers use, made each run several times slower).
TINY = [
    "study.replicates=1",
    "threads=1",
    "model=tiny",
    "logger=csv",
    "data.num_train=64",
    "data.num_val=16",
    "data.batch_size=16",
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "callbacks.weight_snapshot.every_n_steps=2",
    "callbacks.checkpoint.every_n_train_steps=2",
    "module.num_samples=2",
    "module.num_sample_steps=2",
    "module.warmup_steps=0",
]
