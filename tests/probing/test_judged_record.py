"""Records that cannot mislead: with attention dropout and no kernel named, torch trains those calls on
the backend it picks for a dropout call (MATH on the CPU) while the probe can only judge the call without
dropout, forward only. The verdict judges the same backend (not the FLASH one torch picks without
dropout), and the console block and the record say what was judged, what trained and that the
gradients went unchecked."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from flashprobe.callbacks import AttentionProbe
from flashprobe.formats.probe_log import read_probe_log
from flashprobe.probing import ProbeWarning, probe
from flashprobe.probing.call import SdpaCall
from flashprobe.probing.shadow import _sdpa_backend


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2)


class _DropoutModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)
        self.attn = _Attention()

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        q, k, v = self.proj(batch[0]).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return self.attn(q, k, v).square().mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=1e-2)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        data = torch.utils.data.TensorDataset(
            torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(0))
        )
        return torch.utils.data.DataLoader(data, batch_size=2)


def test_torch_picks_another_backend_for_the_call_without_dropout() -> None:
    """What made the old verdict judge another kernel: on the CPU torch trains a dropout call with MATH
    and runs the same call without dropout with FLASH."""
    q = torch.randn(2, 2, 5, 4)
    assert _sdpa_backend(SdpaCall(q, q, q, dropout_p=0.2)) == SDPBackend.MATH
    assert _sdpa_backend(SdpaCall(q, q, q)) == SDPBackend.FLASH_ATTENTION


def test_a_dropout_run_says_on_the_console_and_in_the_record_what_was_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    L.seed_everything(0, verbose=False)
    callback = AttentionProbe(dirpath=tmp_path, plot=False)
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    with pytest.warns(ProbeWarning, match="uses attention dropout"):
        trainer.fit(_DropoutModel())
    out = capsys.readouterr().out
    judged = [line for line in out.splitlines() if line.startswith("  judged: ")]
    assert judged, out
    assert "training ran torch SDPA (MATH backend) with dropout_p=0.2" in judged[0]
    assert "the verdict judges torch SDPA (MATH backend) without dropout" in judged[0]
    assert "its gradients went unchecked" in judged[0]
    summary = read_probe_log(tmp_path / "probe.jsonl").records[-1]["summary"]
    (note,) = summary["judged"]
    assert note["site"] == "attn" and note["gradients"] == "unchecked" and note["from_step"] == 0
    assert note["trained"] == "torch SDPA (MATH backend) with dropout_p=0.2"
    assert note["judged"] == "torch SDPA (MATH backend) without dropout"


def test_the_dropout_free_call_is_judged_on_the_backend_that_trained(monkeypatch) -> None:
    """The comparison runs torch's SDPA without dropout under the backend the dropout call used."""
    chosen = []
    original = torch.nn.attention.sdpa_kernel

    def spy(backends, *args, **kwargs):  # type: ignore[no-untyped-def]
        chosen.append(backends)
        return original(backends, *args, **kwargs)

    monkeypatch.setattr("flashprobe.probing.shadow.sdpa_kernel", spy)
    q = torch.randn(2, 2, 5, 4, requires_grad=True)
    with pytest.warns(ProbeWarning, match="uses attention dropout"), probe(_Attention(), backward=True) as p:
        p.model(q, q, q).sum().backward()
    assert chosen == [SDPBackend.MATH]
    assert [j["judged"] for j in p.judged] == ["torch SDPA (MATH backend) without dropout"]
    assert p.stats()["<root>"]["forward"]["calls"] == 1 and p.stats()["<root>"]["backward"]["calls"] == 0
