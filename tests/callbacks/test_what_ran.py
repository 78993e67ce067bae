"""Record what ran: a requested primary that cannot compute the model's attention is refused when
training begins, or — with ``fallback=True`` — recorded as the fallback, and never named as the
kernel that trained (the trap of issue 40: ``nn.TransformerEncoderLayer``'s default dropout 0.1 with
``primary="tiled"`` trained with torch's SDPA while the manifest said ``tiled``)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.callbacks import AttentionProbe, WeightSnapshot
from flashprobe.cli import main as cli_main
from flashprobe.formats.probe_log import read_probe_log
from flashprobe.kernels import KernelUnsupportedError
from flashprobe.weights import SnapshotStore
from flashprobe.weights.differences import run_differences

SITES = ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]


class _Encoder(L.LightningModule):
    """Two ``nn.TransformerEncoderLayer``s with their default dropout (0.1, attention included)."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def training_step(self, batch, batch_idx):
        return self.encoder(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(
            torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(1))
        )
        return torch.utils.data.DataLoader(data, batch_size=4)


def _fit(module: L.LightningModule, run: Path, probe: AttentionProbe | None, steps: int = 2) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    callbacks = [WeightSnapshot(dirpath=run, every_n_steps=1, seed=0)]
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, *([probe] if probe else [])],
    )
    trainer.fit(module)
    return trainer


def _manifest(run: Path) -> dict:
    return json.loads((run / "snapshots" / "manifest.json").read_text())


def test_dropout_and_a_requested_primary_is_refused_before_any_snapshot(tmp_path: Path) -> None:
    probe = AttentionProbe(primary="tiled", dirpath=tmp_path, plot=False, console=False)
    with pytest.raises(KernelUnsupportedError) as err:
        _fit(_Encoder(), tmp_path, probe)
    message = str(err.value)
    assert (
        "AttentionProbe: encoder.layers.0.self_attn (and 1 more: encoder.layers.1.self_attn) uses attention "
        "dropout (0.1)" in message
    )
    assert "dropout=0.0" in message and "fallback=True" in message  # the two fixes
    assert not (tmp_path / "snapshots" / "manifest.json").exists()  # no record names 'tiled'


class _DirectDropout(L.LightningModule):
    """Calls SDPA with ``dropout_p`` itself: nothing to see before it runs, so its first call is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.attn = _Sdpa()

    def training_step(self, batch, batch_idx):
        q, k, v = self.proj(batch[0]).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 5, 8)), batch_size=2)


class _Sdpa(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2)


def test_a_dropout_call_the_model_makes_is_refused_at_its_first_call(tmp_path: Path) -> None:
    probe = AttentionProbe(primary="tiled", dirpath=tmp_path, plot=False, console=False)
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    with pytest.raises(KernelUnsupportedError, match=r"site 'attn' uses attention dropout \(0.2\)"):
        trainer.fit(_DirectDropout())
    assert trainer.global_step == 0  # refused in the first step, before any optimizer step


def test_a_kernel_refused_at_its_first_call_leaves_no_snapshot_and_compare_refuses_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal comes inside the first step, after ``on_train_start``: the initial weights were
    copied there, but no snapshot, manifest or snapshot directory names ``tiled`` for a run that never
    trained with it, so ``compare`` cannot take it and a math run for a kernel pair at distance 0."""
    refused, math_run = tmp_path / "tiled", tmp_path / "math"
    probe = AttentionProbe(primary="tiled", dirpath=refused, plot=False, console=False)
    with pytest.raises(KernelUnsupportedError, match=r"site 'attn' uses attention dropout \(0.2\)"):
        _fit(_DirectDropout(), refused, probe)
    assert not (refused / "snapshots").exists()
    _fit(_DirectDropout(), math_run, None)  # the model's own attention, dropout included
    assert SnapshotStore(math_run).steps == [0, 1, 2]
    capsys.readouterr()
    assert cli_main(["compare", str(refused), str(math_run), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert f"no snapshot manifest at {refused / 'snapshots' / 'manifest.json'}" in err
    assert not (tmp_path / "cmp").exists()


def test_the_initial_snapshot_holds_the_weights_before_the_first_step(tmp_path: Path) -> None:
    """Written after the first batch, the step-0 snapshot still holds the weights training started from."""
    module = _Encoder(dropout=0.0)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    _fit(module, tmp_path, AttentionProbe(primary="tiled", dirpath=tmp_path, plot=False, console=False))
    store = SnapshotStore(tmp_path)
    assert store.steps == [0, 1, 2] and _manifest(tmp_path)["attention"] == "tiled"
    saved = dict(store.iter_tensors(0))
    assert saved.keys() == initial.keys()
    assert all(torch.equal(saved[n], initial[n]) for n in initial)
    assert not all(torch.equal(t, initial[n]) for n, t in store.iter_tensors(1))  # trained after it


def test_with_fallback_the_records_name_what_ran_and_compare_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fell = tmp_path / "tiled_fallback"
    probe = AttentionProbe(primary="tiled", fallback=True, dirpath=fell, plot=False, console=False)
    with pytest.warns(UserWarning, match="torch's SDPA computed the attention"):
        _fit(_Encoder(), fell, probe)
    own = tmp_path / "own"
    _fit(_Encoder(), own, None)
    manifest = _manifest(fell)
    # every site fell back: the model's own attention computed it, and the manifest says so
    assert manifest["attention"] == _manifest(own)["attention"] == "own attention on cpu"
    fallback = manifest["attention_fallback"]
    assert fallback["requested"] == "tiled" and fallback["sites"] == SITES and fallback["every_site"]
    assert fallback["from_step"] == 0 and "attention dropout (dropout_p=0.1)" in fallback["reason"]
    # the probe's summary records it too
    summary = read_probe_log(fell / "probe.jsonl").records[-1]["summary"]
    assert [f["site"] for f in summary["fallbacks"]] == SITES
    # same weights (SDPA with dropout ran in both), but not a kernel comparison: compare names why
    differs = run_differences(SnapshotStore(fell), SnapshotStore(own))["differs"]
    assert list(differs) == ["attention fallback"]
    assert differs["attention fallback"] == ["torch sdpa instead of tiled at every site from step 0", "none"]
    capsys.readouterr()
    # no kernel pair, so no verdict: UNDETERMINED, exit code 4 (docs/study.md "The answer")
    assert cli_main(["compare", str(fell), str(own), "--out", str(tmp_path / "cmp"), "--no-figures"]) == 4
    out = capsys.readouterr().out
    assert "UNDETERMINED: no pair's runs differ in the attention alone" in out
    assert "attention fallback (torch sdpa instead of tiled at every site from step 0 vs none)" in out
    assert "kernel pair (runs that differ in the attention alone): MISSING" in out


def test_flex_attention_without_a_cpu_backward_is_refused_when_training_begins(tmp_path: Path) -> None:
    probe = AttentionProbe(primary="flex:compile=false", dirpath=tmp_path, plot=False, console=False)
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    with pytest.raises(KernelUnsupportedError, match=r"'flex:compile=False', which has no backward on cpu"):
        trainer.fit(_Encoder(dropout=0.0))
    assert trainer.global_step == 0 and probe.probe is None


class _Kill(L.Callback):
    """Ends the run after the first optimizer step (a kill between snapshots)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        raise RuntimeError("killed")


def test_a_fallback_found_while_training_is_in_the_manifest_after_that_step(tmp_path: Path) -> None:
    """A dropout call seen only when the model runs falls back in step 0; the step-0 snapshot was
    written before it with the requested name. Killed after that step, before the next snapshot, the
    manifest must already say what computed the attention (it said ``tiled`` before)."""
    probe = AttentionProbe(primary="tiled", fallback=True, dirpath=tmp_path, plot=False, console=False)
    snapshots = WeightSnapshot(dirpath=tmp_path, every_n_steps=100, seed=0)
    trainer = L.Trainer(
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[probe, snapshots, _Kill()],
    )  # fmt: skip
    with pytest.warns(UserWarning, match="torch's SDPA computed the attention"), pytest.raises(RuntimeError):
        trainer.fit(_DirectDropout())
    manifest = _manifest(tmp_path)
    assert [s["step"] for s in manifest["snapshots"]] == [0]
    assert manifest["attention"] != "tiled"
    assert manifest["attention_fallback"]["requested"] == "tiled"
