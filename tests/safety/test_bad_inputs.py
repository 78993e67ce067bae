"""A table of bad inputs across the commands: each is refused with exit 2 and one message that names
the problem (and, where there is one, the fix), without a traceback and before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.safety._runs import fingerprint

T = ["train", "experiment=smoke"]

#: (command line, a phrase the message must contain)
CASES = [
    ([*T, "trainer.max_steps=abc"], "trainer.max_steps='abc' must be an integer"),
    ([*T, "trainer.max_steps=-5"], "trainer.max_steps=-5 must be positive"),
    ([*T, "trainer.max_steps=0"], "trainer.max_steps=0 must be positive"),
    ([*T, "seed=abc"], "seed='abc' must be a non-negative integer"),
    ([*T, "seed=-1"], "seed=-1 must be a non-negative integer"),
    ([*T, "threads=-1"], "threads=-1 must be a positive integer"),
    ([*T, "threads=0"], "threads=0 must be a positive integer"),
    ([*T, "threads=abc"], "threads='abc' must be a positive integer"),
    ([*T, "module.optimizer.lr=abc"], "module.optimizer.lr='abc' must be a positive number"),
    ([*T, "module.optimizer.lr=0"], "module.optimizer.lr=0 must be a positive number"),
    ([*T, "module.optimizer.lr=-1e-3"], "module.optimizer.lr=-0.001 must be a positive number"),
    ([*T, "trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be a positive number"),
    ([*T, "trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0 must be a positive number"),
    ([*T, "trainer.log_every_n_steps=abc"], "trainer.log_every_n_steps='abc' must be a positive"),
    ([*T, "attention.kernel=nosuch"], "unknown kernel 'nosuch'"),
    (
        [*T, "attention.kernel=tiled:nosuch=1"],
        "'attention.kernel=tiled:nosuch=1' is not a valid Hydra override",
    ),
    ([*T, "attention.kernel='tiled:nosuch=1'"], "tiled"),
    ([*T, "attention.probe.baseline=nosuch"], "unknown kernel 'nosuch'"),
    ([*T, "attention=nosuch"], "Could not find 'attention/nosuch'"),
    ([*T, "trainer.max_stepz=3"], "Could not override 'trainer.max_stepz'"),
    ([*T, "data.image_size=100000"], "data.image_size=100000 with data.num_train + data.num_val"),
    ([*T, "data.image_size=abc"], "data.image_size='abc' must be a positive integer"),
    ([*T, "data.batch_size=0"], "data.batch_size=0 must be a positive integer"),
    ([*T, "data.num_train=abc"], "data.num_train='abc' must be a positive integer"),
    ([*T, "data.num_val=-1"], "data.num_val=-1 must be a positive integer"),
    ([*T, "module.prediction=foo"], "unknown prediction 'foo'; choose one of: epsilon, v"),
    ([*T, "module.num_sample_steps=0"], "num_sample_steps (0) must be positive"),
    ([*T, "on_nonfinite=maybe"], "on_nonfinite='maybe' must be stop or continue"),
    ([*T, "ckpt_path=/nonexistent/x.ckpt"], "ckpt_path=/nonexistent/x.ckpt: no such file"),
    ([*T, "run_name=../x"], "run_name '../x' cannot be used in a file name"),
    ([*T, "run_name=.hidden"], "run_name '.hidden' cannot be used"),
    ([*T, "hydra.run.dir="], "hydra.run.dir is empty"),
    ([*T, "hydra.run.dir=a,b"], "must be one directory path, not a sweep"),
    ([*T, "resume="], "resume='' is empty"),
    ([*T, "resume=/nowhere/run"], "no run started by `flashprobe train` there"),
    ([*T, "+callbacks.attention_probe.filename=../x.jsonl"], "must be a file name inside the run directory"),
    ([*T, "callbacks.checkpoint.dirpath=/elsewhere"], "lies outside the run directory"),
    (["study", "--out", "s", "--runs", "nosuch"], "unknown study run 'nosuch'"),
    (["study", "--out", "s", "--runs", "flash,seed1"], "form no like-for-like flash_vs_baseline pair"),
    (["study", "--out", "s", "study.precision=99"], "is not a study precision"),
    (["study", "--out", "s", "study.kernel=nosuch"], "study.kernel: unknown kernel 'nosuch'"),
    (["study", "--out", "s", "trainer.max_steps=abc"], "trainer.max_steps='abc' must be an integer"),
    (["study", "--out", "s", "seed=abc"], "seed='abc' must be a non-negative integer"),
    (["study", "--out", "s", "run_name=../x"], "run_name '../x' cannot be used"),
    (["study", "--out", "s", "attention=nosuch"], "do not compose"),
    (["study", "--out", "s", "--config-dir", "/nowhere"], "--config-dir /nowhere is not a directory"),
    (["study", "--out", ""], "--out is empty"),
    (["compare", "r_list", "r_ok", "--out", "c"], "malformed snapshot manifest"),
    (["compare", "r_escape", "r_ok", "--out", "c"], "is not a plain file name inside"),
    (["compare", "r_nofile", "r_ok", "--out", "c"], "is not a plain file name inside"),
    (["compare", "r_garbage", "r_ok", "--out", "c"], "malformed snapshot manifest"),
    (["compare", "r_ok", "nowhere", "--out", "c"], "no snapshot manifest"),
    (["compare", "r_ok", "--out", "c"], "give at least two run directories"),
    (["compare", "--pair", "a b=r_ok,r_ok"], "--pair name 'a b' cannot be used in a file name"),
    (["compare", "--pair", "x=r_ok"], "--pair wants NAME=RUN_A,RUN_B"),
    (["compare", "r_ok", "r_ok", "--group-depth", "-1"], "--group-depth must be >= 0"),
    (["compare", "r_ok", "r_ok", "--out", ""], "--out is empty"),
    (["report", ""], "DIR is empty"),
    (["report", "nowhere"], "nowhere is not a directory"),
    (["report", "a_file"], "a_file is not a directory"),
    (["report", "r_ok"], "study.json not found"),
    (["fuzz", "--kernel", "nosuch"], "unknown kernel 'nosuch'"),
    (["fuzz", "--kernel", "math", "--budget", "-1"], "--budget -1: must be"),
    (["fuzz", "--kernel", "math", "--dtype", "float99"], "--dtype float99: unknown dtype"),
    (["fuzz", "--kernel", "math", "--out", ""], "--out is empty"),
    (["fuzz"], "give at least one --kernel SPEC"),
    (["bench", "wasserstein", "--out", ""], "empty"),
    (["bench", "nosuch"], "unknown command 'nosuch'"),
    (["nosuch"], "unknown command 'nosuch'"),
]


def _inputs(where: Path) -> None:
    """The files the compare and report cases read: good, malformed and escaping snapshot manifests."""
    for name, manifest in {
        "r_list": "[1, 2]",
        "r_garbage": '{"format": "flashprobe.snap',
        "r_escape": json.dumps(
            {
                "format": "flashprobe.snapshots/1",
                "tensors": [],
                "snapshots": [{"step": 0, "file": "/etc/hosts"}],
            }
        ),
        "r_nofile": json.dumps(
            {"format": "flashprobe.snapshots/1", "tensors": [], "snapshots": [{"step": 0}]}
        ),
        "r_ok": json.dumps({"format": "flashprobe.snapshots/1", "tensors": [], "snapshots": []}),
    }.items():
        (where / name / "snapshots").mkdir(parents=True)
        (where / name / "snapshots" / "manifest.json").write_text(manifest)
    (where / "a_file").write_text("x")


@pytest.mark.parametrize(("args", "phrase"), CASES, ids=[" ".join(a[:1] + a[-1:]) for a, _ in CASES])
def test_a_bad_input_is_one_message_exit_2_and_nothing_written(tmp_path: Path, cli, args, phrase) -> None:
    _inputs(tmp_path)
    before = fingerprint(tmp_path)
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert phrase in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert fingerprint(tmp_path) == before


def test_the_table_holds_many_distinct_inputs() -> None:
    assert len({tuple(a) for a, _ in CASES}) == len(CASES) >= 60
