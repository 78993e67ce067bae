"""``flashprobe bench verdicts`` at a tiny budget: torch's correct kernels on every model of the
calibration never fail the verdict's rule nor read biased, and the suite's truncating kernel
(``--import lab.mutants --kernel bug_output_truncated``) reads biased with no call failing (the full 200-step
measurements are in docs/calibration.md)."""

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
    assert row["biased"] == 0 and row["biased_sites"] is None, row
    assert row["kernel"] == "model"
    if precision == "fp32":  # the bias is judged at 16 bits only (flashprobe.bias.LOW_PRECISION)
        assert row["bias_replicates"] == 0
    else:
        assert row["bias_replicates"] > 0 and row["out_bias_z"] is not None
    assert 0 <= row["undetermined_share"] <= 1
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


def test_a_truncating_kernel_reads_biased_and_fails_no_call(tmp_path: Path) -> None:
    """GPT-2 in bf16, 12 steps (96 replicates per site): the output's bias is toward zero at every
    site; torch's own kernel on the same run is not biased."""
    pytest.importorskip("transformers")
    from lab.mutants import register_mutants

    register_mutants()  # in this process lab.mutants may be imported already (--import registers once)
    argv = ["bench", "verdicts", "--steps", "12", "--models", "gpt2", "--precision", "bf16"]
    argv += ["--import", "lab.mutants", "--kernel", "model", "--kernel", "bug_output_truncated"]
    argv += ["--out", str(tmp_path)]
    assert cli_main([*argv, "--check"]) == 1  # a biased site fails the check
    correct, truncating = json.loads((tmp_path / "verdicts.json").read_text())["rows"]
    assert correct["kernel"] == "model" and correct["biased"] == 0
    assert truncating["kernel"] == "bug_output_truncated" and truncating["failed_calls"] == 0
    assert truncating["biased"] == truncating["sites"] == 2
    assert truncating["biased_sites"] == "transformer.h.0.attn:out transformer.h.1.attn:out"
    assert truncating["out_bias_z"] <= -5 and truncating["bias_replicates"] == 12 * 2 * 4


def test_bad_kernel_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "verdicts", "--kernel", "bug_nope", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "verdicts.json").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--import lab.mutants" in err[0], err  # where the suite's bug_ kernels are
    assert cli_main(["bench", "verdicts", "--import", "no_such_module", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "verdicts.json").exists()


def _judged(undetermined: dict[str, int], bias: dict | None = None) -> dict:
    return {
        "verdict": "pass",
        "failed_calls": 0,
        "undetermined_calls": undetermined,
        "limit_ratio": 0.1,
        "l2_error_ratio": 0.5,
        "max_call_error_ratio": 1.0,
        "bias": bias,
    }


def _bias_entry(z: float, mean: float, verdict: str) -> dict:
    return {
        "replicates": 40,
        "z": z,
        "verdict": verdict,
        "offset": {"mean": mean},
        "magnitude": {"mean": 0.01},
    }


def test_rows_sum_undetermined_reasons_and_read_the_bias_of_every_site() -> None:
    """Two sites by hand: the undetermined calls per reason add up over sites and directions, and
    the bias columns take the largest |z| and |mean| with their signs and list the biased pairs."""
    from flashprobe.bench.verdicts import _bias, _fold

    none = {"verdict": None, "bias": None}
    stats = {
        "a": {
            "forward": {"calls": 4, "out": _judged({"ill_conditioned": 1, "unrepresentable": 0},
                                                   _bias_entry(-7.0, -0.6, "biased"))},
            "backward": {"calls": 4, "dq": _judged({"ill_conditioned": 0, "unrepresentable": 2}),
                         "dk": none, "dv": none},
        },
        "b": {
            "forward": {"calls": 4, "out": _judged({"ill_conditioned": 3, "unrepresentable": 0},
                                                   _bias_entry(0.0, 0.2, "unbiased"))},
            "backward": {"calls": 0, "dq": none, "dk": none, "dv": none},
        },
    }  # fmt: skip
    zero = dict.fromkeys(("out", "dq", "dk", "dv"), 0)
    worst, worst_max, score, judged, failed = (dict(zero) for _ in range(5))
    undetermined: dict[str, int] = {}
    _fold(stats, worst, worst_max, score, judged, failed, undetermined)
    assert undetermined == {"ill_conditioned": 4, "unrepresentable": 2}
    assert judged == {"out": 8, "dq": 4, "dk": 0, "dv": 0}
    row = _bias(stats)
    assert row["out_bias_z"] == -7.0 and row["out_bias_mean"] == -0.6 and row["dq_bias_z"] is None
    assert row["biased"] == 1 and row["biased_sites"] == "a:out" and row["bias_replicates"] == 40
