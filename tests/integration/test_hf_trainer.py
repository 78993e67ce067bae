"""flashprobe.integrations.hf: the probe in a real ``transformers.Trainer`` (tiny GPT-2, 5 steps:
probe.jsonl, verdict, scalars in the Trainer's logs, training bit-identical to the run without it),
``attn_implementation="probe_kernel"`` (a tiny Llama trains with a flashprobe kernel that the probe
compares as its primary) and the attach-time warning for eager attention."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from flashprobe.bench import tiny_models as tiny
from flashprobe.bench.tiny_models import TOKENS
from flashprobe.formats.probe_log import read_probe_log
from flashprobe.probing import ProbeWarning, probe
from tests import _zygote as zygote

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("flashprobe.integrations.hf")
needs_accelerate = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="transformers.Trainer needs accelerate"
)

STEPS = 5


def _gpt2(attn: str = "sdpa") -> torch.nn.Module:
    """The shared tiny GPT-2 with no dropout at all."""
    return tiny.gpt2(attn, resid_pdrop=0.0, embd_pdrop=0.0)


class _Recorder(transformers.TrainerCallback):
    """Stands for a ``report_to`` logger: keeps every ``logs`` dict it is given."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _train(
    model: torch.nn.Module,
    out: Path,
    callbacks: list | None = None,
    *,
    evaluate: bool = False,
    max_steps: int = STEPS,
    save_steps: int | None = None,
    resume: Path | None = None,
):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=2, learning_rate=1e-3,
        logging_steps=2, report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
        eval_strategy="steps" if evaluate else "no", eval_steps=2, per_device_eval_batch_size=2,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        restore_callback_states_from_checkpoint=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=tiny.TokenDataset(2 * STEPS),
        eval_dataset=tiny.TokenDataset(2) if evaluate else None, callbacks=callbacks,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


@needs_accelerate
def test_trainer_callback_writes_records_and_training_is_bit_identical(tmp_path: Path) -> None:
    plain = _train(_gpt2(), tmp_path / "plain", evaluate=True)
    callback, recorder = hf.AttentionProbeCallback(golden=True, backward=True), _Recorder()
    probed = _train(_gpt2(), tmp_path / "probed", [recorder, callback], evaluate=True)
    for (name, a), b in zip(plain.model.named_parameters(), probed.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs after training with the probe"
    assert callback.probe is None and not (tmp_path / "plain" / "probe.jsonl").exists()
    assert (tmp_path / "probed" / "probe.png").is_file()  # the per-site deviation plot

    records = read_probe_log(tmp_path / "probed" / "probe.jsonl").records
    assert [r["step"] for r in records] == [2, 4, 5]  # every logging_steps, and the last step
    for record in records:
        assert set(record["sites"]) == {"transformer.h.0.attn", "transformer.h.1.attn"}
        assert record["summary"]["verdict"] == "pass" and record["summary"]["failures"] == []
    # Two layers per training step (steps 1-2, 3-4, 5); the evaluations at steps 2 and 4 are not probed.
    assert [r["summary"]["forward_calls"] for r in records] == [4, 4, 2]
    assert [r["summary"]["backward_calls"] for r in records] == [4, 4, 2]
    # The summary's scalars are in the Trainer's logs (every report_to logger gets these).
    logged = [e for e in probed.state.log_history if "probe/max_error_ratio" in e]
    assert [e["step"] for e in logged] == [2, 4, 5] and all(e["probe/failed"] == 0.0 for e in logged)
    assert all("loss" in e for e in logged)
    # A logger listed before the callback gets the scalars too (the callback moves ahead of it).
    assert [e["probe/max_error_ratio"] for e in recorder.logs if "probe/max_error_ratio" in e] == [
        e["probe/max_error_ratio"] for e in logged
    ]


@needs_accelerate
def test_trainer_callback_stop_and_raise_on_a_buggy_kernel(tmp_path: Path) -> None:
    from flashprobe.cli import main as cli_main
    from flashprobe.probing import ProbeFailureError
    from lab.mutants import register_mutants

    register_mutants()
    callback = hf.AttentionProbeCallback(
        plot=False, primary="bug_batch_kv_mixup", on_failure="stop", log_every_n_steps=10, backward=False
    )  # forward only: the output's failures alone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _train(_gpt2(), tmp_path / "stop", [callback])
    fails = sorted(str(w.message).split(":")[1] for w in caught if "FAIL at site" in str(w.message))
    assert fails == [
        " FAIL at site 'transformer.h.0.attn', out, step 0",
        " FAIL at site 'transformer.h.1.attn', out, step 0",
    ]
    assert trainer.state.global_step == 1  # the failing step finished, then training stopped
    (record,) = read_probe_log(tmp_path / "stop" / "probe.jsonl").records
    assert record["step"] == 1 and record["summary"]["verdict"] == "fail"
    first = next(f for f in record["summary"]["failures"] if not f.get("worst"))
    repro = Path(first["repro"])
    assert repro.parent == tmp_path / "stop" / "repro" and repro.is_file()
    assert cli_main(["replay", str(repro)]) == 1  # the recorded primary fails again
    with pytest.raises(ProbeFailureError, match="out, step 0"):
        _train(
            _gpt2(),
            tmp_path / "raise",
            [
                hf.AttentionProbeCallback(
                    plot=False, primary="bug_batch_kv_mixup", on_failure="raise", backward=False
                )
            ],
        )


@needs_accelerate
def test_a_resumed_run_continues_the_log_and_keeps_its_failures(tmp_path: Path) -> None:
    old = {"site": "transformer.h.0.attn", "direction": "dq", "step": 1, "kind": "l2", "value": 40.0,
           "limit": 1.0, "reason": "x", "repro": None}  # fmt: skip
    first = hf.AttentionProbeCallback(plot=False, backward=True)
    first._restored_failures = [old]  # as if seen before: goes into the checkpoint's state
    _train(_gpt2(), tmp_path, [first], save_steps=2, max_steps=4)  # restored failures: not warned again
    assert [r["step"] for r in read_probe_log(tmp_path / "probe.jsonl").records] == [2, 4]
    given = hf.AttentionProbeCallback(plot=False, backward=True)
    trainer = _train(_gpt2(), tmp_path, [given], save_steps=2, max_steps=4, resume=tmp_path / "checkpoint-2")
    # restore_callback_states_from_checkpoint: the Trainer rebuilt the callback from its state
    (resumed,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, hf.AttentionProbeCallback)]
    assert resumed is not given and resumed.last_logged_step == 4
    records = read_probe_log(tmp_path / "probe.jsonl").records
    assert [r["step"] for r in records] == [2, 4]  # step 4 of the first run dropped, written again
    assert records[-1]["summary"]["verdict"] == "fail" and records[-1]["summary"]["failures"] == [old]
    state = resumed.state()
    assert state["args"]["backward"] is True and state["attributes"]["_restored_failures"] == [old]


def test_trainer_callback_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="on_failure='halt' must be"):
        hf.AttentionProbeCallback(on_failure="halt")
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        hf.AttentionProbeCallback(log_every_n_steps=0)
    with pytest.raises(ValueError, match="plain file name"):
        hf.AttentionProbeCallback(filename="logs/probe.jsonl")


def test_llama_with_probe_kernel_attention_is_probed() -> None:
    from lab.mutants import register_mutants

    register_mutants()
    hf.register_attention("probe_kernel", "tiled:block_q=4,block_k=4")
    model = tiny.llama("probe_kernel")
    assert model.config._attn_implementation == "probe_kernel"
    ids = tiny.TokenDataset(2 * STEPS)[0]["input_ids"][None]
    with probe(model, backward=True) as p:
        out = model(input_ids=ids).logits
        out.square().mean().backward()
    assert p.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    summary = p.summary()
    assert summary.forward_calls == summary.backward_calls == 2
    # The primary is the registered kernel (tiled, fp32): close to, not equal to, the math baseline.
    assert 0 < summary.max_abs["primary_baseline"] < 1e-5
    assert summary.verdict == "pass"
    # A buggy registered kernel is what the probe judges.
    hf.register_attention("probe_kernel", "bug_batch_kv_mixup")
    batch = torch.cat([ids, ids.flip(1)])
    with probe(model, on_failure="ignore") as p:
        model(input_ids=batch)
    assert p.summary(p.stats()).verdict == "fail"
    hf.register_attention("probe_kernel", "tiled:block_q=4,block_k=4")
    # A model's config can name its own kernel spec.
    model.config.flashprobe_kernel = "bug_batch_kv_mixup"
    with probe(model, on_failure="ignore") as p:
        model(input_ids=batch)
    assert p.summary(p.stats()).verdict == "fail"
    del model.config.flashprobe_kernel
    # Without a probe the kernel runs too, and gives what sdpa gives up to rounding (GQA, left padding).
    mask = torch.ones(2, TOKENS, dtype=torch.long)
    mask[0, :3] = 0
    reference = tiny.llama("sdpa")(input_ids=batch, attention_mask=mask).logits
    probed = tiny.llama("probe_kernel")(input_ids=batch, attention_mask=mask).logits
    torch.testing.assert_close(probed, reference)


@needs_accelerate
def test_llama_with_probe_kernel_attention_trains_in_the_trainer(tmp_path: Path) -> None:
    hf.register_attention("probe_kernel", "tiled:block_q=4,block_k=4")
    plain = _train(tiny.llama("probe_kernel"), tmp_path / "plain")
    callback = hf.AttentionProbeCallback(plot=False, backward=True)
    probed = _train(tiny.llama("probe_kernel"), tmp_path / "probed", [callback])
    for a, b in zip(plain.model.parameters(), probed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    records = read_probe_log(tmp_path / "probed" / "probe.jsonl").records
    assert [r["step"] for r in records] == [2, 4, 5]
    assert all(set(r["sites"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"} for r in records)
    assert all(r["summary"]["verdict"] == "pass" for r in records)


def test_register_attention_refuses_names_transformers_reads() -> None:
    with pytest.raises(ValueError, match="must be a new plain name"):
        hf.register_attention("eager")
    with pytest.raises(ValueError, match="would try to load flash-attn"):
        hf.register_attention("flashprobe")


def test_eager_attention_warns_at_attach_time() -> None:
    model = _gpt2(attn="eager")
    with pytest.warns(ProbeWarning, match="attn_implementation='eager'.*attn_implementation='sdpa'"):
        p = probe(model)
    p.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeWarning)
        probe(_gpt2()).detach()  # sdpa: no warning


@needs_accelerate
def test_trainer_callback_on_an_eager_model_stops_with_the_fix(tmp_path: Path) -> None:
    with (
        pytest.warns(ProbeWarning, match="attn_implementation='eager'"),
        pytest.raises(RuntimeError, match="attn_implementation='sdpa'"),
    ):
        _train(_gpt2(attn="eager"), tmp_path, [hf.AttentionProbeCallback(plot=False)])


@pytest.mark.slow
def test_flashprobe_attention_under_torch_compile_is_probed() -> None:
    """Each call of the registered attention is a graph break under torch.compile: same sites and
    outputs as in eager mode."""
    hf.register_attention("probe_kernel", "tiled:block_q=4,block_k=4")
    model = tiny.llama("probe_kernel")
    ids = tiny.TokenDataset(2 * STEPS)[0]["input_ids"][None]
    eager = model(input_ids=ids).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with probe(model, backward=True) as p:
        out = compiled(input_ids=ids).logits
        out.square().mean().backward()
    torch._dynamo.reset()
    assert torch.equal(out, eager)
    assert p.sites == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert p.summary().backward_calls == 2


def test_flashprobe_imports_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import flashprobe, flashprobe.probing, flashprobe.integrations\n"
        "try:\n    import flashprobe.integrations.hf\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('flashprobe.integrations.hf imported without transformers')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@needs_accelerate
def test_trainer_callback_stops_on_a_nonfinite_primary_and_prints_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernel that returns one NaN at its 3rd call (step 1, layer 0): by default the callback saves
    the call, prints the verdict block and stops, instead of training on NaN weights to the end."""
    from flashprobe.kernels import math_attention, register_kernel

    calls = {"n": 0}

    def nan_once(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        calls["n"] += 1
        if calls["n"] == 3:
            poison = torch.zeros_like(out)
            poison[0, 0, 0, 0] = float("nan")
            out = out + poison  # the NaN reaches the loss, the gradients and the weights
        return out

    register_kernel("hf_nan_once", nan_once, overwrite=True)
    callback = hf.AttentionProbeCallback(
        plot=False, primary="hf_nan_once", backward=True, log_every_n_steps=10
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _train(_gpt2(), tmp_path, [callback])
    assert trainer.state.global_step == 2  # step 1 finished, then training stopped
    assert callback.stopped is not None and "transformer.h.0.attn out, step 1" in callback.stopped
    (record,) = read_probe_log(tmp_path / "probe.jsonl").records
    summary = record["summary"]
    assert summary["verdict"] == "fail" and summary["run_primary_nonfinite"] == 1
    assert (summary["worst_failure"]["kind"], summary["worst_failure"]["step"]) == ("nonfinite", 1)
    out = capsys.readouterr().out
    assert "AttentionProbeCallback: verdict FAIL" in out and "training stopped: the primary returned" in out
    assert "transformer.h.0.attn  out  fail     nonfinite" in out


@needs_accelerate
def test_a_plain_script_prints_the_verdict_block(tmp_path: Path) -> None:
    """A script with the HF Trainer and the callback, logging left unconfigured: stdout has the block."""
    import os
    import textwrap

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            sys.path.insert(0, sys.argv[2])
            from tests.integration.test_hf_trainer import _gpt2, _train
            from flashprobe.integrations.hf import AttentionProbeCallback

            _train(_gpt2(), sys.argv[1], [AttentionProbeCallback(plot=False, backward=True)], max_steps=2)
            """
        )
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, str(script), str(tmp_path / "run"), str(root)]
    done = zygote.run(command, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "AttentionProbeCallback: verdict PASS: every site passed (2)" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("  transformer.h.")]
    assert sorted((r[0], r[1], r[2], r[3], r[5]) for r in rows) == sorted(
        (f"transformer.h.{i}.attn", d, "pass", "error/limit", "1")
        for i in (0, 1)
        for d in ("out", "dq", "dk", "dv")
    )
    assert f"records: {tmp_path / 'run' / 'probe.jsonl'}" in done.stdout


@needs_accelerate
def test_trainer_callback_refuses_a_primary_the_model_cannot_train_through(tmp_path: Path) -> None:
    """GPT-2's attention dropout (attn_pdrop): no kernel implements dropout, so a named primary would
    not compute the attention; refused at train begin, before any step, record or snapshot."""
    from flashprobe.kernels import KernelUnsupportedError

    model = _gpt2()
    model.config.attn_pdrop = 0.1
    snapshots = hf.WeightSnapshotCallback(dirpath=tmp_path)
    callback = hf.AttentionProbeCallback(plot=False, primary="tiled")
    with pytest.raises(KernelUnsupportedError, match=r"config\.attn_pdrop\) uses attention dropout \(0\.1\)"):
        _train(model, tmp_path, [callback, snapshots])
    assert not (tmp_path / "probe.jsonl").exists() and not (tmp_path / "snapshots").exists()


@needs_accelerate
def test_the_snapshot_manifest_records_the_primary_of_the_probe_it_is_handed(tmp_path: Path) -> None:
    """``WeightSnapshotCallback(probe=...)``: the manifest's attention is that callback's primary;
    without it, the model's own attention (nothing is looked up on the call stack)."""
    import json

    probe_callback = hf.AttentionProbeCallback(plot=False, console=False, primary="tiled")
    handed = hf.WeightSnapshotCallback(dirpath=tmp_path / "handed", every_n_steps=2, probe=probe_callback)
    _train(_gpt2(), tmp_path / "a", [probe_callback, handed], max_steps=2)
    manifest = json.loads((tmp_path / "handed" / "snapshots" / "manifest.json").read_text())
    assert manifest["attention"] == "tiled"
    alone = hf.WeightSnapshotCallback(dirpath=tmp_path / "alone", every_n_steps=2)
    other_probe = hf.AttentionProbeCallback(plot=False, console=False, primary="tiled")
    _train(_gpt2(), tmp_path / "b", [other_probe, alone], max_steps=2)
    manifest = json.loads((tmp_path / "alone" / "snapshots" / "manifest.json").read_text())
    assert manifest["attention"].startswith("own")
    with pytest.raises(TypeError, match="probe must be the AttentionProbeCallback"):
        hf.WeightSnapshotCallback(probe="tiled")
