"""An FP8 ``tiled`` spec as the probe's primary: forward only.

The model receives the FP8 kernel's output (checked against a direct call), the probe compares it
with the baseline and the golden value, and a backward is refused when the probe is attached.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.kernels import KernelUnsupportedError, get_kernel
from flashprobe.probing import probe

from ..fuzz._fp8_mutants import register_fp8_bugs, unregister_fp8_bugs

FA3 = "tiled:preset=fa3_fp8"


class _Attention(nn.Module):
    """x ``(B, N, 32)`` → q, k, v ``(B, 2, N, 16)`` → SDPA → ``(B, N, 32)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)  # (B, H, N, D) each
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 32)


def test_fp8_primary_under_the_probe_forward():
    torch.manual_seed(0)
    model = _Attention().to(torch.bfloat16)
    x = torch.randn(2, 40, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        q, k, v = model.qkv(x).view(2, 40, 3, 2, 16).permute(2, 0, 3, 1, 4)
        direct = get_kernel(FA3)(q, k, v).transpose(1, 2).reshape(2, 40, 32)
        with probe(model, primary=FA3, golden=True) as p:
            assert p.shadow.backward is False  # "auto": the FP8 spec declares no backward
            out = model(x)
    assert torch.equal(out, direct)  # the model receives the FP8 kernel's output
    (site,) = p.stats().values()
    forward = site["forward"]["out"]
    assert forward["primary_golden"]["nonfinite"] == 0
    # judged as an FP8 kernel: against the FP8 baseline (per-tensor E4M3 inputs), with E4M3's limits
    assert p.config.baseline == "math:fp8=e4m3" and p.config.precision == torch.float8_e4m3fn
    assert forward["verdict"] == "pass" and p.summary().verdict == "pass"


@pytest.fixture
def fp8_bugs():
    yield register_fp8_bugs()
    unregister_fp8_bugs()


def test_an_fp8_primary_with_a_bug_fails_and_a_correct_one_passes(fp8_bugs):
    torch.manual_seed(0)
    x = torch.randn(2, 40, 32, dtype=torch.bfloat16)
    verdicts = {}
    for spec in ("tiled:preset=fa3_fp8,rotation=off", "fp8_bug_no_v_descale", "fp8_bug_rotate_q_only"):
        model = _Attention().to(torch.bfloat16)
        with (
            torch.no_grad(),
            pytest.warns(Warning) if spec.startswith("fp8_bug") else nullcontext(),
            probe(model, primary=spec, golden=True) as p,
        ):
            for _ in range(3):
                model(x)
        summary = p.summary()
        verdicts[spec] = summary.verdict
        for failure in p.shadow.failures.values():  # the reason names the FP8 baseline
            assert "the FP8 baseline" in failure.reason or "FP8 E4M3" in failure.reason, failure
    assert verdicts == {
        "tiled:preset=fa3_fp8,rotation=off": "pass",
        "fp8_bug_no_v_descale": "fail",
        "fp8_bug_rotate_q_only": "fail",
    }


def test_fp8_primary_refuses_a_backward_when_attached():
    with pytest.raises(KernelUnsupportedError, match="has no backward"):
        probe(_Attention().to(torch.bfloat16), primary=FA3, backward=True)
