"""``flashprobe bench verdicts`` at a tiny budget: torch's correct kernels on every model of the
calibration never fail the verdict's rule (the full 200-step measurement is in docs/probe.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashprobe.bench.verdicts import MODELS, calibrate
from flashprobe.cli import main as cli_main


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_torch_kernels_never_fail(model: str, precision: str) -> None:
    if model != "t2i":
        pytest.importorskip("transformers" if model in ("gpt2", "llama", "bert", "vit") else "diffusers")
    row = calibrate(model, precision, steps=3)
    assert row["failed_calls"] == 0 and row["first_failure"] is None, row
    assert row["out_calls"] > 0 and row["out_max_l2_ratio"] > 0  # something was judged
    if model != "t2i":  # (the DiT's gates start at zero: its attention gradients are zero at first)
        assert row["dq_calls"] > 0 and row["dq_max_l2_ratio"] > 0


def test_the_command_writes_its_rows_and_checks(tmp_path: Path) -> None:
    assert (
        cli_main(["bench", "verdicts", "--steps", "2", "--models", "t2i", "--check", "--out", str(tmp_path)])
        == 0
    )
    rows = json.loads((tmp_path / "verdicts.json").read_text())["rows"]
    assert [(r["model"], r["precision"]) for r in rows] == [("t2i", "fp32"), ("t2i", "bf16")]
    assert cli_main(["bench", "verdicts", "--models", "nope", "--out", str(tmp_path)]) == 2
