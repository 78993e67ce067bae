"""After one NaN: a real Lightning Trainer on a tiny model whose kernel returns NaN at step 3 only.

The run's records must agree with each other (the non-finite counts kept over the run, the worst
failure the failing call, a record's reason matching its verdict) and, by default, the probe stops
training instead of training on NaN weights to a quiet end.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.callbacks import AttentionProbe
from flashprobe.kernels import math_attention, register_kernel

NAN_STEP = 3


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class _Tiny(L.LightningModule):
    """A projection to q, k, v and one attention site; one batch per step, no dropout."""

    def __init__(self, blow_up_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 24)
        self.attn = _Attention()
        self.blow_up_at = blow_up_at

    def training_step(self, batch, batch_idx):
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(batch_idx))
        q, k, v = self.proj(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)  # 3 x (B, H, N, D)
        loss = self.attn(q, k, v).square().mean()
        if batch_idx == self.blow_up_at:  # the loss, not the kernel, makes the weights non-finite
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(8, 1), batch_size=1)


def _nan_at_step(name: str, step: int) -> str:
    """Register ``name``: the baseline, except one output element is NaN at the call of ``step``
    (one call per step), through an addition so the NaN reaches the gradients and the weights."""
    calls = {"n": 0}

    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
        calls["n"] += 1
        if calls["n"] == step + 1:
            poison = torch.zeros_like(out)
            poison[0, 0, 0, 0] = float("nan")
            out = out + poison
        return out

    register_kernel(name, kernel, overwrite=True)
    return name


def _fit(callback: AttentionProbe, module: _Tiny, max_steps: int = 6) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    with pytest.warns(UserWarning):  # the failure's one line
        trainer.fit(module)
    return trainer


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_after_one_nan_every_later_record_agrees_with_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernel = _nan_at_step("nan_at_step_continue", NAN_STEP)
    callback = AttentionProbe(
        primary=kernel, backward=True, dirpath=tmp_path, log_every_n_steps=1, on_nonfinite="continue"
    )
    module = _Tiny()
    trainer = _fit(callback, module)
    assert trainer.global_step == 6 and not _finite(module)  # it trained on, on NaN weights
    # the verdict block on stdout: at the first failure, then at the end (with the run's reason)
    blocks = capsys.readouterr().out.split("AttentionProbe: verdict ")[1:]
    assert len(blocks) == 2 and blocks[0].startswith("FAIL: failed at attn\n")
    assert blocks[1].startswith(f"FAIL: failed at step {NAN_STEP} (attn out: NaN/Inf")
    records = _records(tmp_path / "probe.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    failing = records[NAN_STEP]  # the record written after the step-3 batch
    assert failing["summary"]["primary_nonfinite"] == 1
    for r in records[NAN_STEP:]:
        s = r["summary"]
        assert s["verdict"] == "fail"
        assert not s["verdict_reason"].startswith("every site passed")
        # the non-finite values the primary returned are kept over the run, where they first appeared
        assert s["run_primary_nonfinite"] == 1
        assert s["first_primary_nonfinite_step"] == NAN_STEP
        assert s["first_primary_nonfinite_sites"] == ["attn"]
        # the worst failure is the failing call, not a passing value
        worst = s["worst_failure"]
        assert (worst["site"], worst["direction"], worst["step"], worst["kind"]) == (
            "attn",
            "out",
            NAN_STEP,
            "nonfinite",
        )
        assert worst["limit_ratio"] == "inf"  # jsonio's infinity: ranked above any finite ratio
    for r in records[NAN_STEP + 1 :]:
        assert r["summary"]["verdict_reason"].startswith(f"failed at step {NAN_STEP} (attn out: NaN/Inf")
        assert r["summary"]["primary_nonfinite"] == 0  # the interval's: the inputs are NaN by then
    # the run's non-finite total only grows
    totals = [r["summary"]["run_nonfinite"] for r in records]
    assert totals == sorted(totals) and totals[-1] == sum(r["summary"]["nonfinite"] for r in records)
    for r in records[:NAN_STEP]:
        assert r["summary"]["verdict"] == "pass" and r["summary"]["worst_failure"] is None


def test_by_default_the_probe_stops_at_a_nonfinite_primary_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kernel = _nan_at_step("nan_at_step_stop", NAN_STEP)
    callback = AttentionProbe(primary=kernel, backward=True, dirpath=tmp_path, log_every_n_steps=10)
    trainer = _fit(callback, _Tiny())
    assert trainer.global_step == NAN_STEP + 1  # the failing step finished, then training stopped
    assert callback.stopped is not None and "non-finite values at attn out, step 3" in callback.stopped
    (record,) = _records(tmp_path / "probe.jsonl")  # the failing step's record was written first
    assert record["step"] == NAN_STEP + 1 and record["summary"]["verdict"] == "fail"
    assert "on_nonfinite='continue'" in record["summary"]["stopped"]
    out = capsys.readouterr().out
    assert "AttentionProbe: verdict FAIL" in out and "training stopped: the primary returned" in out
    assert f"attn.step{NAN_STEP:07d}.safetensors" in out  # the evidence: its reproducer


def test_by_default_the_probe_stops_on_nonfinite_weights(tmp_path: Path) -> None:
    """The kernel is fine (torch's own); the loss blows up at step 2 and the weights become NaN."""
    module = _Tiny(blow_up_at=2)
    callback = AttentionProbe(backward=True, dirpath=tmp_path, log_every_n_steps=10, console=False)
    trainer = L.Trainer(
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module)
    assert not _finite(module)
    assert trainer.global_step == 3  # stopped after the step that made them NaN
    assert callback.stopped is not None
    assert "values of the weight proj." in callback.stopped and "after step 2" in callback.stopped
    summary = _records(tmp_path / "probe.jsonl")[-1]["summary"]
    assert summary["stopped"] == callback.stopped


def test_nonfinite_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"on_nonfinite='ignore' must be one of stop, continue"):
        AttentionProbe(on_nonfinite="ignore")
