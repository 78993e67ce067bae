"""AttentionProbe in a ``max_epochs`` run whose last step is not a logging step: the steps since the
last record are written at the end of training (where Lightning refuses ``self.log``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from flashprobe.callbacks import AttentionProbe
from flashprobe.formats.probe_log import read_probe_log
from tests.callbacks.test_attention_probe import _OneAttention


def test_the_steps_after_the_last_logging_step_are_recorded_at_the_end(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    callback = AttentionProbe(dirpath=tmp_path, log_every_n_steps=3, plot=False, console=False)
    trainer = L.Trainer(
        max_epochs=1,  # four batches: records at step 3 and, at the end of training, step 4
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(_OneAttention(q, k, v))
    records = read_probe_log(tmp_path / "probe.jsonl").records
    assert [r["step"] for r in records] == [3, 4]
    assert [r["summary"]["forward_calls"] for r in records] == [3, 1]
