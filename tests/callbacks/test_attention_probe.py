"""AttentionProbe in a plain user Trainer (the example), checked against an independent computation."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.callbacks import AttentionProbe
from flashprobe.cli import main as cli_main
from flashprobe.formats.probe_log import read_probe_log
from flashprobe.kernels import (
    KernelCapabilities,
    KernelSpecError,
    get_kernel,
    golden_attention,
    math_attention,
    register_kernel,
)

ROOT = Path(__file__).resolve().parents[2]


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "lightning_callbacks", ROOT / "examples" / "lightning_callbacks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trainer_writes_probe_jsonl(tmp_path: Path) -> None:
    records = _load_example().main(tmp_path, steps=10)
    assert [r["step"] for r in records] == [5, 10]
    sites = set(records[0]["sites"])
    assert sites == {"encoder.layers.0.self_attn", "encoder.layers.1.self_attn"}
    for r in records:
        s = r["summary"]
        assert s["forward_calls"] == 2 * 5  # two layers, five steps per record
        assert s["backward_calls"] == 2 * 5
        assert s["nonfinite"] == 0
        assert 0 < s["max_error_ratio"] < 10 and 0 < s["max_backward_error_ratio"] < 10
    manifest = json.loads((tmp_path / "snapshots" / "manifest.json").read_text())
    assert [m["step"] for m in manifest["snapshots"]] == [0, 10]


class _Sdpa(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class _OneAttention(L.LightningModule):
    """One SDPA call per step on fixed inputs: the probe's numbers can be recomputed by hand."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        super().__init__()
        self.q, self.k, self.v = q, k, v
        self.w = nn.Parameter(torch.ones(()))
        self.attn = _Sdpa()

    def training_step(self, batch, batch_idx):
        out = self.attn(self.q * self.w, self.k, self.v)
        return out.sum() * 0.0 + (self.w - 1) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1)


def _trainer(callback: AttentionProbe, *, max_steps: int = 3, **kwargs) -> L.Trainer:
    """A quiet CPU Trainer with one callback (no logger, checkpoints or progress bar)."""
    return L.Trainer(
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **kwargs,
    )


def test_logged_statistics_match_a_direct_fp64_computation(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g) for _ in range(3))
    trainer = _trainer(
        AttentionProbe(primary="tiled:block_k=8", dirpath=tmp_path), max_steps=2, log_every_n_steps=2
    )
    trainer.fit(_OneAttention(q, k, v))
    record = json.loads((tmp_path / "probe.jsonl").read_text().splitlines()[0])
    ((site, entry),) = record["sites"].items()
    assert site == "attn"
    out = entry["forward"]["out"]
    primary = get_kernel("tiled:block_k=8")(q, k, v)
    golden = golden_attention(q, k, v)
    baseline = math_attention(q, k, v)
    expect_pg = (primary.double() - golden).abs().max().item()
    expect_bg = (baseline.double() - golden).abs().max().item()
    assert out["primary_golden"]["max_abs"] == pytest.approx(expect_pg, rel=1e-12)
    assert out["baseline_golden"]["max_abs"] == pytest.approx(expect_bg, rel=1e-12)
    assert out["error_ratio"] == pytest.approx(expect_pg / expect_bg, rel=1e-12)
    assert entry["forward"]["calls"] == 2


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(KernelSpecError, match="unknown kernel"):
        AttentionProbe(primary="nope")
    with pytest.raises(ValueError, match=r"every_n_steps=0 must be an int >= 1"):
        AttentionProbe(every_n_steps=0)
    for name in ("../x.jsonl", "/tmp/x.jsonl", "sub/x.jsonl", "..", ""):
        with pytest.raises(ValueError, match="must be a plain file name inside dirpath"):
            AttentionProbe(filename=name)


class _NoAttention(L.LightningModule):
    """A linear model: no SDPA call anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)


def test_a_model_without_attention_fails_after_its_first_batch(tmp_path: Path) -> None:
    trainer = _trainer(AttentionProbe(dirpath=tmp_path))
    with pytest.raises(
        RuntimeError, match=r"_NoAttention made no torch\.nn\.functional\.scaled_dot_product_attention"
    ):
        trainer.fit(_NoAttention())
    assert trainer.global_step == 1  # stopped after the first batch, not at the end (3 steps)
    assert not (tmp_path / "probe.jsonl").exists()
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # detached


def test_site_patterns_that_match_nothing_fail_early(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    with pytest.raises(
        ValueError, match=r"sites=\['blocks\.\*'\] matches none of the model's attention sites \(attn\)"
    ):
        _trainer(AttentionProbe(sites="blocks.*", dirpath=tmp_path)).fit(_OneAttention(q, k, v))


def test_a_plotting_error_does_not_fail_the_finished_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import flashprobe.report.probe_figures as probe_figures

    def broken(*args, **kwargs):
        raise RuntimeError("no display")

    monkeypatch.setattr(probe_figures, "plot_probe", broken)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    trainer = _trainer(AttentionProbe(dirpath=tmp_path, log_every_n_steps=1))
    trainer.fit(_OneAttention(q, k, v))
    assert trainer.global_step == 3
    assert len((tmp_path / "probe.jsonl").read_text().splitlines()) == 3
    assert not (tmp_path / "probe.png").exists()
    assert "could not draw" in caplog.text and "no display" in caplog.text


class _ScaledLoss(L.LightningModule):
    """One SDPA call per step on fixed inputs, with a fixed non-zero output gradient."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.q, self.k, self.v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
        self.target = torch.randn(1, 2, 16, 8, generator=gen)
        self.w = nn.Parameter(torch.ones(()))
        self.attn = _Sdpa()

    def training_step(self, batch, batch_idx):
        out = self.attn(self.q * self.w, self.k * self.w, self.v * self.w)
        return (out.float() * self.target).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=1)


def test_gradients_are_compared_by_default_where_both_kernels_have_a_backward(tmp_path: Path) -> None:
    """The default ``backward="auto"``: torch's SDPA and math have a backward on the CPU, so dq, dk,
    dv are compared at every step; against a baseline declaring no backward there the probe compares
    outputs only, and training runs all the same."""
    trainer = _trainer(AttentionProbe(dirpath=tmp_path / "auto", plot=False), log_every_n_steps=3)
    trainer.fit(_ScaledLoss())
    (record,) = read_probe_log(tmp_path / "auto" / "probe.jsonl").records
    assert (record["summary"]["forward_calls"], record["summary"]["backward_calls"]) == (3, 3)
    assert record["sites"]["attn"]["backward"]["dq"]["verdict"] == "pass"

    def forward_only(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    register_kernel(
        "declared_forward_only", forward_only, capabilities=KernelCapabilities(backward_devices=frozenset())
    )
    callback = AttentionProbe(baseline="declared_forward_only", dirpath=tmp_path / "fwd", plot=False)
    trainer = _trainer(callback, log_every_n_steps=3)
    trainer.fit(_ScaledLoss())
    assert trainer.global_step == 3
    (record,) = read_probe_log(tmp_path / "fwd" / "probe.jsonl").records
    assert (record["summary"]["forward_calls"], record["summary"]["backward_calls"]) == (3, 0)
    assert record["summary"]["verdict"] == "pass"


def test_gradient_statistics_are_in_the_models_units_under_16_mixed(tmp_path: Path) -> None:
    """16-mixed with a GradScaler: the output gradient the kernels see carries the loss scale; the
    probe divides it out. At scales where fp16 rounding commutes with the scale (powers of two, no
    overflow, no subnormals) the statistics are the same; without the division they would grow with
    the scale (sums of squares with its square)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def run(scale: float) -> dict:
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        callback = AttentionProbe(dirpath=tmp_path / str(scale), backward=True, plot=False)
        precision = MixedPrecision("16-mixed", "cpu", scaler)
        trainer = _trainer(callback, max_steps=2, log_every_n_steps=2, plugins=[precision])
        trainer.fit(_ScaledLoss())
        lines = (tmp_path / str(scale) / "probe.jsonl").read_text().splitlines()
        (record,) = [json.loads(line) for line in lines]
        return record["sites"]["attn"]["backward"]

    one, eight, thirty_two = run(1.0), run(8.0), run(32.0)
    for grad in ("dq", "dk", "dv"):
        for pair in ("primary_baseline", "primary_golden", "baseline_golden"):
            for stat in ("max_abs", "mean_abs", "rel_l2"):
                want = one[grad][pair][stat]
                assert eight[grad][pair][stat] == pytest.approx(want, rel=1e-12), (grad, pair, stat)
                assert thirty_two[grad][pair][stat] == pytest.approx(want, rel=1e-12), (grad, pair, stat)
            assert one[grad][pair]["nonfinite"] == 0
        assert one[grad]["primary_golden"]["max_abs"] > 0  # something was compared


# ---------------------------------------------------------------------------------- verdicts
class _Scheduled(L.LightningModule):
    """tests/probing/test_verdicts.py's two-site model and shape schedule, one batch per step."""

    def __init__(self) -> None:
        super().__init__()
        from tests.probing.test_verdicts import TwoSites

        torch.manual_seed(0)
        self.model = TwoSites()

    def training_step(self, batch, batch_idx):
        from tests.probing.test_verdicts import SCHEDULE, _padding_mask

        b, n, padded = SCHEDULE[batch_idx % len(SCHEDULE)]
        x = torch.randn(b, n, 4, generator=torch.Generator().manual_seed(batch_idx))
        return self.model(x, _padding_mask(b, n) if padded else None).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(6, 1), batch_size=1)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_stop_writes_the_failing_record_saves_the_call_and_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lab.mutants import register_mutants

    register_mutants()
    callback = AttentionProbe(
        primary="bug_batch_kv_mixup", backward=True, dirpath=tmp_path, on_failure="stop", log_every_n_steps=10
    )
    trainer = _trainer(callback, max_steps=6)
    with pytest.warns(UserWarning, match=r"FAIL at site 'model.attn1', out, step 1: .*flashprobe replay"):
        trainer.fit(_Scheduled())
    assert trainer.global_step == 2  # the batch of step 1 finished, then training stopped
    record = _records(tmp_path / "probe.jsonl")[-1]
    assert record["summary"]["verdict"] == "fail"
    firsts = {(f["site"], f["direction"]): f for f in record["summary"]["failures"] if not f.get("worst")}
    assert firsts[("model.attn1", "out")]["step"] == firsts[("model.attn0", "out")]["step"] == 1
    assert record["sites"]["model.attn0"]["verdict"] == "fail"
    repro = Path(firsts[("model.attn1", "out")]["repro"])
    assert repro.parent == tmp_path / "repro" and repro.is_file()
    assert cli_main(["replay", str(repro), "--kernel", "bug_none"]) == 0
    assert cli_main(["replay", str(repro)]) == 1  # the recorded primary, bug_batch_kv_mixup
    # flashprobe report shows the verdict and the first failures (and redraws probe.png)
    capsys.readouterr()
    assert cli_main(["report", str(tmp_path)]) == 1  # the FAIL verdict's exit code
    out = capsys.readouterr().out
    assert "| fail |" in out and "flashprobe report: verdict FAIL: failed at model.attn0" in out
    # the per-site table: both sites' failing out rows, with the criterion, its value and limit
    rows = {tuple(line.split()[:4]) for line in out.splitlines() if line.startswith("  model.attn")}
    assert {("model.attn0", "out", "fail", "relative"), ("model.attn1", "out", "fail", "relative")} <= rows
    assert f"reproducer: {repro} (flashprobe replay {repro})" in out
    assert (tmp_path / "probe.png").is_file()
    from flashprobe.report.study_report import _probe_lines

    runs = tmp_path / "study" / "runs"
    runs.mkdir(parents=True)
    (runs / "flash").symlink_to(tmp_path, target_is_directory=True)
    table = "\n".join(_probe_lines(tmp_path / "study", {"flash": {}}))
    assert "| flash | fail |" in table and "model.attn0 out, step 1: relative L2 error" in table


def test_raise_fails_the_fit(tmp_path: Path) -> None:
    from flashprobe.probing import ProbeFailureError
    from lab.mutants import register_mutants

    register_mutants()
    callback = AttentionProbe(
        primary="bug_dk_partial_tile", backward=True, dirpath=tmp_path, on_failure="raise"
    )
    with pytest.raises(ProbeFailureError, match=r"dk, step 2"):
        _trainer(callback, max_steps=6).fit(_Scheduled())


def test_a_correct_kernel_passes_and_a_resumed_run_keeps_its_failures(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callback = AttentionProbe(backward=True, dirpath=tmp_path, on_failure="raise", log_every_n_steps=1)
    with caplog.at_level("INFO", logger="flashprobe.callbacks.attention_probe"):
        _trainer(callback, max_steps=6).fit(_Scheduled())
    assert "AttentionProbe: verdict PASS: 2 sites, worst error / limit" in caplog.text
    records = _records(tmp_path / "probe.jsonl")
    assert [r["summary"]["verdict"] for r in records] == ["pass"] * 6
    assert not (tmp_path / "repro").exists()
    # A failure seen before a checkpoint stays in the verdict after resuming from it.
    old = {
        "site": "model.attn0",
        "direction": "dq",
        "step": 3,
        "kind": "l2",
        "value": 40.0,
        "limit": 1.0,
        "reason": "x",
        "repro": None,
    }
    resumed = AttentionProbe(backward=True, dirpath=tmp_path / "resumed", on_failure="warn")
    resumed.load_state_dict({"last_logged_step": -1, "records": 0, "failures": [old]})
    caplog.clear()
    with caplog.at_level("INFO", logger="flashprobe.callbacks.attention_probe"):
        _trainer(resumed, max_steps=2).fit(_Scheduled())
    assert "AttentionProbe: verdict FAIL: first failure at model.attn0 dq, step 3" in caplog.text
    summary = _records(tmp_path / "resumed" / "probe.jsonl")[-1]["summary"]
    assert summary["verdict"] == "fail" and summary["failures"] == [old]
    assert resumed.state_dict()["failures"] == [old]


def test_a_resumed_run_continues_its_signed_bias(tmp_path: Path) -> None:
    """The bias is the run's: a run resumed from a checkpoint of two steps, then fed the same two
    steps again, holds twice the sums (replicates double, z grows by √2, the mean stays)."""
    # bf16-mixed: the bias is judged at 16 bits only (flashprobe.bias.LOW_PRECISION)
    first = AttentionProbe(backward=True, dirpath=tmp_path / "a", log_every_n_steps=1)
    _trainer(first, max_steps=2, precision="bf16-mixed").fit(_Scheduled())
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint holds plain data
    state.update(last_logged_step=-1, records=0)  # the second fit logs its steps 0 and 1 again
    resumed = AttentionProbe(backward=True, dirpath=tmp_path / "b", log_every_n_steps=1)
    resumed.load_state_dict(state)
    _trainer(resumed, max_steps=2, precision="bf16-mixed").fit(_Scheduled())
    assert set(state["bias"]) == {"model.attn0", "model.attn1"}
    for site, sums in resumed.state_dict()["bias"].items():
        assert sums == pytest.approx([2 * x for x in state["bias"][site]], rel=1e-12)
    before = _records(tmp_path / "a" / "probe.jsonl")[-1]["sites"]
    after = _records(tmp_path / "b" / "probe.jsonl")[-1]["sites"]
    for site in before:
        for d in ("dq", "dk", "dv"):
            b, a = before[site]["backward"][d]["bias"], after[site]["backward"][d]["bias"]
            assert a["replicates"] == 2 * b["replicates"] > 0
            assert a["offset"]["mean"] == pytest.approx(b["offset"]["mean"], rel=1e-9)
            assert a["offset"]["z"] == pytest.approx(2**0.5 * b["offset"]["z"], rel=1e-9)
