"""The verdict on the console: a plain Python script training with ``AttentionProbe``, logging left
unconfigured, prints the verdict block to stdout (the answer, a per-site table, where the records are);
``flashprobe report RUN_DIR`` prints the same table for the finished run."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

from flashprobe.cli import main as cli_main
from tests import _zygote as zygote

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys

    import lightning as L
    import torch
    from torch import nn

    from flashprobe.callbacks import AttentionProbe


    class Encoder(L.LightningModule):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

        def training_step(self, batch, batch_idx):
            return self.encoder(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)


    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 6, 16))
    if sys.argv[2:]:  # a kernel that scales the scores by 1.1: every call is wrong
        from flashprobe import register_kernel
        from flashprobe.kernels import math_attention

        @register_kernel("hot", description="attention with its scores scaled by 1.1 (a bug)")
        def hot(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
            scale = 1.1 * (q.shape[-1] ** -0.5 if scale is None else scale)
            return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    probe = AttentionProbe(dirpath=sys.argv[1], plot=False, primary=(sys.argv[2:] or [None])[0])
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[probe],
    )
    trainer.fit(Encoder(), torch.utils.data.DataLoader(data, batch_size=4))
    """
)

SITES = ("encoder.layers.0.self_attn", "encoder.layers.1.self_attn")


def _table(text: str) -> dict[tuple[str, str], list[str]]:
    """The block's rows: ``(site, direction) -> [verdict, statistic, value, limit, step]``."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if line.startswith("  ") and len(cells) == 7 and cells[0] in SITES:
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def test_a_plain_script_prints_the_verdict_block(tmp_path, capsys) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(tmp_path / "run")]
    done = zygote.run(command, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "AttentionProbe: verdict PASS: every site passed (2)" in out
    rows = _table(out)
    # every site and direction, judged by the verdict's statistic against its limit
    assert set(rows) == {(s, d) for s in SITES for d in ("out", "dq", "dk", "dv")}
    for verdict, statistic, value, limit, step in rows.values():
        assert (verdict, statistic, limit, step) == ("pass", "error/limit", "1", "-")
        assert 0 <= float(value) <= 1
    assert f"records: {tmp_path / 'run' / 'probe.jsonl'}" in out
    # flashprobe report RUN_DIR prints the same table for the finished run and exits 0 (PASS)
    assert cli_main(["report", str(tmp_path / "run")]) == 0
    assert _table(capsys.readouterr().out) == rows


def test_report_of_a_failed_run_exits_1(tmp_path, capsys) -> None:
    """A run whose kernel is wrong at every call: the training script finishes (``on_failure`` warns),
    and ``flashprobe report RUN_DIR`` prints the FAIL block and exits 1, as ``fuzz`` and ``replay``."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(tmp_path / "run"), "hot"]
    done = zygote.run(command, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verdict FAIL" in done.stdout, done.stdout[-2000:]
    assert cli_main(["report", str(tmp_path / "run")]) == 1
    rows = _table(capsys.readouterr().out)
    assert rows and all(r[0] == "fail" for d, r in rows.items() if d[1] == "out"), rows
