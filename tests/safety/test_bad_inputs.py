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
    ([*T, "trainer.precision=abc"], "unknown precision 'abc'; choose one of"),
    ([*T, "trainer.accelerator=nosuch"], "invalid accelerator name"),
    ([*T, "trainer.devices=abc"], "`devices` selected with `CPUAccelerator` should be an int > 0"),
    ([*T, "trainer.strategy=nosuch"], "invalid strategy name"),
    ([*T, "trainer.max_epochs=abc"], "trainer.max_epochs='abc' must be an integer"),
    ([*T, "trainer=nosuch"], "Could not find 'trainer/nosuch'"),
    ([*T, "model=nosuch"], "Could not find 'model/nosuch'"),
    ([*T, "logger=nosuch"], "Could not find 'logger/nosuch'"),
    ([*T, "experiment=nosuch"], "Could not find 'experiment/nosuch'"),
    ([*T, "callbacks.weight_snapshot.every_n_steps=0"], "every_n_steps must be a positive int"),
    ([*T, "callbacks.weight_snapshot.every_n_steps=abc"], "every_n_steps must be a positive int"),
    ([*T, "callbacks.checkpoint.every_n_train_steps=-3"], "Invalid value for every_n_train_steps=-3"),
    ([*T, "attention.probe.every_n_steps=0"], "every_n_steps=0 must be an int >= 1"),
    ([*T, "attention.probe.enabled=maybe"], "attention.probe.enabled='maybe' must be true or false"),
    ([*T, "overwrite=maybe"], "overwrite='maybe' must be true or false"),
    ([*T, "module.guidance_scale=abc"], "module.guidance_scale='abc' must be a number"),
    ([*T, "module.warmup_steps=-1"], "warmup_steps (-1) non-negative"),
    ([*T, "data.seed=abc"], "data.seed='abc' must be a non-negative integer"),
    ([*T, "data.shuffle_seed=-2"], "data.shuffle_seed=-2 must be a non-negative integer"),
    ([*T, "trainer.max_steps=1.5"], "trainer.max_steps=1.5 must be an integer"),
    ([*T, "seed=1.5"], "seed=1.5 must be a non-negative integer"),
    ([*T, "threads=2.5"], "threads=2.5 must be a positive integer"),
    ([*T, "data.batch_size=-4"], "data.batch_size=-4 must be a positive integer"),
    ([*T, "data.image_size=0"], "data.image_size=0 must be a positive integer"),
    ([*T, "data.num_train=0"], "data.num_train=0 must be a positive integer"),
    ([*T, "run_name=a b"], "run_name 'a b' cannot be used"),
    ([*T, "run_name=-x"], "run_name '-x' cannot be used"),
    ([*T, "run_name=x/../../y"], "run_name 'x/../../y' cannot be used"),
    ([*T, "hydra.run.dir='  '"], "hydra.run.dir is empty"),
    ([*T, "hydra.run.dir=[a,b]"], "must be one directory path"),
    ([*T, "hydra.run.dir=a_file"], "hydra.run.dir a_file is a file"),
    ([*T, "hydra.run.dir=a_file/run"], "lies under a_file, which is a file"),
    ([*T, "hydra.run.dir=r_ok"], "already holds a run"),
    ([*T, "resume=r_ok"], "no run started by `flashprobe train` there"),
    ([*T, "ckpt_path=a_file"], "checkpoint a_file is refused: torch.load(weights_only=True) cannot read it"),
    ([*T, "+callbacks.attention_probe.filename=/abs.jsonl"], "must be a file name inside the run directory"),
    ([*T, "+callbacks.attention_probe.filename=."], "must be a file name inside the run directory"),
    ([*T, "callbacks.weight_snapshot.dirpath=/tmp"], "lies outside the run directory"),
    ([*T, "attention.probe.baseline=tiled:block_q=abc"], "not a valid Hydra override"),
    # issue 42's table: an infinite learning rate trained to NaN weights; an unknown launcher failed
    # inside Hydra (exit 1) after it had made the run directory
    ([*T, "module.optimizer.lr=1e400"], "module.optimizer.lr=inf must be a positive number (finite)"),
    ([*T, "hydra/launcher=nosuch"], "hydra/launcher=nosuch is not a Hydra launcher installed here"),
    (["train", "-m", "experiment=smoke", "hydra/launcher=nosuch"], "is not a Hydra launcher installed"),
    (
        [*T, "hydra.run.dir=users"],
        "hydra.run.dir users holds files flashprobe did not write there (notes.txt)",
    ),
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
    (["study", "--out", "a_file"], "--out a_file is a file"),
    (["study", "--out", "a_file/s"], "lies under a_file, which is a file"),
    (["study", "--out", "s", "--runs", "flash"], "form no like-for-like flash_vs_baseline pair"),
    (["study", "--out", "s", "study.precision=bf16"], "is not a study precision"),
    (["study", "--out", "s", "hydra/launcher=ray"], "needs the Hydra plugin hydra-ray-launcher"),
    (["study", "--out", "s", "threads=-1"], "threads=-1 must be a positive integer"),
    (["study", "--out", "s", "data.image_size=100000"], "data.image_size=100000 with"),
    (["study", "--out", "s", "trainer.max_stepz=3"], "do not compose"),
    (["study", "--out", "s", "--compare-only"], "has no snapshots of the runs"),
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
    (["compare", "r_ok", "r_ok", "--out", "a_file"], "--out a_file is a file"),
    (["compare", "r_ok", "r_ok", "--fig7-pair", "nosuch"], "--fig7-pair 'nosuch' is not one of"),
    (["compare", "--pair", "../x=r_ok,r_ok"], "--pair name '../x' cannot be used"),
    (["compare", "--pair", "a=r_ok,r_ok", "--pair", "a=r_ok,r_ok"], "--pair a given twice"),
    (["compare"], "nothing to compare"),
    (["report", ""], "DIR is empty"),
    (["report", "nowhere"], "nowhere is not a directory"),
    (["report", "a_file"], "a_file is not a directory"),
    (["report", "r_ok"], "study.json not found"),
    (["fuzz", "--kernel", "nosuch"], "unknown kernel 'nosuch'"),
    (["fuzz", "--kernel", "math", "--budget", "-1"], "--budget -1: must be"),
    (["fuzz", "--kernel", "math", "--dtype", "float99"], "--dtype float99: unknown dtype"),
    (["fuzz", "--kernel", "math", "--out", ""], "--out is empty"),
    (["fuzz"], "give at least one --kernel SPEC"),
    (["fuzz", "--kernel", "math", "--out", "a_file"], "--out a_file is a file"),
    (["fuzz", "--kernel", "math", "--baseline", "nosuch"], "unknown kernel 'nosuch'"),
    (["fuzz", "--kernel", "math", "--import", "no_such_module_xyz"], "--import no_such_module_xyz"),
    (["bench", "bias", "--out", "a_file"], "a_file is a file"),
    (["bench", "precision", "--kernel", "nosuch"], "unknown kernel 'nosuch'"),
    (["bench", "bias", "--out", ""], "empty"),
    (["bench", "nosuch"], "unknown command 'nosuch'"),
    (["nosuch"], "unknown command 'nosuch'"),
    # issue 53: numbers past the machine, the options before Hydra, files of another version or damaged
    ([*T, "threads=100000"], "threads=100000 must be a positive integer, at most"),
    ([*T, "data.num_workers=100000"], "data.num_workers=100000 must be an integer from 0 to"),
    (["study", "--out", "s", "threads=100000"], "threads=100000 must be a positive integer, at most"),
    ([*T, "--config-dir", "a_file"], "--config-dir a_file is not a directory (a file)"),
    ([*T, "--import", "raising_kernels"], "--import raising_kernels: importing it raised RuntimeError: "),
    ([*T, "--import"], "--import needs a value"),
    ([*T, "-cp", "elsewhere"], "-cp would replace flashprobe's packaged configs"),
    ([*T, "hydra.output_subdir=elsewhere"], "hydra.output_subdir (given on the command line) is 'elsewhere'"),
    (["study", "--out", "s", "--import", "raising_kernels"], "importing it raised RuntimeError: "),
    (["fuzz", "--kernel", "math", "--import", "raising_kernels"], "importing it raised RuntimeError: "),
    (["study", "--out", "/proc/x"], "--out /proc/x is inside the system's /proc"),
    (["report", "s_strings"], "pair 'p' 'steps' holds '2'; steps are distinct non-negative integers"),
    (["report", "s_version"], "was written by flashprobe 9.0, in format 'flashprobe.compare/2'"),
    (["compare", "r_v9", "r_ok", "--out", "c"], "was written by flashprobe 9.0, in format 'flashprobe.snap"),
    (["compare", "r_size", "r_size_other", "--out", "c"], "w has shape (5,), but r_size_other/snapshots"),
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
    for name, doc in {
        "r_v9": {"format": "flashprobe.snapshots/2", "flashprobe": "9.0", "snapshots": []},
    }.items():
        (where / name / "snapshots").mkdir(parents=True)
        (where / name / "snapshots" / "manifest.json").write_text(json.dumps(doc))
    pair = {"steps": ["2"], "model": {"wasserstein": [0.5], "max_abs": [0.5]}}
    for name, doc in {
        "s_strings": {"format": "flashprobe.compare/1", "pairs": {"p": pair}},
        "s_version": {"format": "flashprobe.compare/2", "flashprobe": "9.0", "pairs": {}},
    }.items():
        (where / name).mkdir()
        (where / name / "study.json").write_text(json.dumps(doc))
    (where / "raising_kernels.py").write_text("raise RuntimeError('this module fails as it is imported')\n")
    _sized_runs(where)
    (where / "users").mkdir()  # a directory of the user's own: no run of flashprobe's
    (where / "users" / "notes.txt").write_text("keep")


def _sized_runs(where: Path) -> None:
    """Two snapshot runs, the second with a snapshot file of the wrong size for its manifest."""
    import torch
    from safetensors.torch import save_file

    from tests.weights._helpers import write_run

    weights = {0: {"w": torch.arange(6.0)}, 2: {"w": torch.arange(6.0) + 1}}
    write_run(where / "r_size", weights, seed=0)
    other = write_run(where / "r_size_other", weights, seed=1)
    save_file({"w": torch.zeros(5)}, str(other / "snapshots" / "step_0000002.safetensors"))


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
    assert len({tuple(a) for a, _ in CASES}) == len(CASES) >= 120
