"""The Triton example kernel, fuzzed on the CPU under Triton's interpreter (docs/fuzz.md).

Skipped where triton is not installed (``pip install 'flashprobe[triton]'``). Oracle: the fuzzer's
FP64 golden; the kernel passes the cases posed within its declared limits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _fuzz(tmp_path: Path, cases: str, dtypes: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    argv = ["--import", "examples.triton_attention", "--kernel", "triton_attention", "--dtype", dtypes]
    argv += ["--case", cases, "--quiet", "--out", str(tmp_path / "fuzz")]
    done = subprocess.run(
        [sys.executable, "-m", "flashprobe.cli", "fuzz", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    payload = json.loads((tmp_path / "fuzz" / "fuzz.json").read_text()) if done.returncode in (0, 1) else {}
    return done, payload


def test_the_triton_example_passes_left_padding_under_the_interpreter(tmp_path):
    done, payload = _fuzz(tmp_path, "left_padding", "fp32")
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = payload["rows"]
    assert row["verdict"] == "no_backward" and "N_q 64→320" in row["fitted"], row  # forward passes


@pytest.mark.slow
def test_the_triton_example_passes_its_cases_at_fp16_and_fp32(tmp_path):
    done, payload = _fuzz(
        tmp_path, "odd_shapes,sentinel_*,padding_mask,odd_shapes_causal,poisoned_*", "fp16,fp32"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert {r["verdict"] for r in payload["rows"]} <= {"pass", "no_backward", "skip"}  # pass: forward only
    assert payload["properties"]["triton_attention"]["partial tile"]["status"] == "tested"
