"""A kernel that returns NaN at step 3 of 8 leaves no checkpoint or snapshot holding a non-finite weight;
the run says which step holds its last finite weights; ``flashprobe train --import MODULE`` finds the
user's kernel, ``resume=`` without it says which module to give, and with the kernel fixed the run
continues from its last finite checkpoint to the end."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from flashprobe.formats.checkpoint_io import load_checkpoint
from flashprobe.formats.run_record import read_run_record
from tests.app._study import flashprobe_cli

#: 8 steps, a checkpoint, a snapshot, a probe record and a validation every step.
RUN = [
    "experiment=smoke",
    "threads=1",
    "trainer.max_steps=8",
    "trainer.val_check_interval=1",
    "trainer.log_every_n_steps=1",
    "callbacks.weight_snapshot.every_n_steps=1",
    "attention.kernel=nan_at_step",
]
IMPORT = ["--import", "tests.app._nan_kernel"]


def _every_weight_finite(run) -> list[str]:
    """The checkpoints and snapshots of ``run`` whose weights are all finite (each file read)."""
    finite = []
    for path in sorted((run / "checkpoints").glob("*.ckpt")):
        state = load_checkpoint(path)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path
        finite.append(f"checkpoints/{path.name}")
    for path in sorted((run / "snapshots").glob("*.safetensors")):
        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path
        finite.append(f"snapshots/{path.name}")
    return finite


def test_a_kernel_nan_at_step_3_leaves_no_nonfinite_weights_and_resume_says_what_it_needs(tmp_path) -> None:
    run = tmp_path / "run"
    stopped = flashprobe_cli("train", *IMPORT, *RUN, f"hydra.run.dir={run}")
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    assert "the last finite weights: checkpoint checkpoints/last.ckpt (step 3)" in stopped.stderr
    assert f"flashprobe train --import tests.app._nan_kernel resume={run}" in stopped.stderr
    kept = _every_weight_finite(run)
    assert "checkpoints/step0000003.ckpt" in kept and "snapshots/step_0000003.safetensors" in kept
    assert not (run / "checkpoints" / "step0000004.ckpt").exists()  # step 4's weights are NaN: not written
    record = read_run_record(run)
    assert record["status"] == "failed" and record["imports"] == ["tests.app._nan_kernel"]
    manifest = (run / "snapshots" / "manifest.json").read_text()
    assert '"nonfinite_step": 4' in manifest

    refused = flashprobe_cli("train", f"resume={run}")  # the run needs its kernel: nothing imported for it
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"give it again: flashprobe train --import tests.app._nan_kernel resume={run}" in refused.stderr

    fixed = flashprobe_cli("train", *IMPORT, f"resume={run}", env={"NAN_AT_STEP": "1000"})
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    record = read_run_record(run)
    assert record["status"] == "finished" and record["global_step"] == 8
    assert [s["from_step"] for s in record["sessions"]] == [0, 3]  # from the last finite checkpoint
    assert "snapshots/step_0000008.safetensors" in _every_weight_finite(run)
    assert "nonfinite_step" not in (run / "snapshots" / "manifest.json").read_text()  # that timeline is gone
