"""A reproducer's metadata is data handed in by someone else: each field is checked for its type
before it is used, and a bad one is refused with the field named (issue 42, item 7)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flashprobe import __version__, register_kernel
from flashprobe.fuzz.cli import main as fuzz_main
from flashprobe.kernels import unregister_kernel
from flashprobe.probing.replay_cli import main as replay_main
from flashprobe.probing.repro import REPRO_FORMAT, ReproducerError, load_reproducer


def _write(path: Path, info: object, **tensors: torch.Tensor) -> Path:
    x = torch.randn(1, 2, 8, 16)
    tensors = {"q": x, "k": x.clone(), "v": x.clone(), **tensors}
    save_file(tensors, str(path), metadata={"flashprobe": json.dumps(info)})
    return path


def test_a_valid_file_loads_with_its_recorded_arguments(tmp_path: Path) -> None:
    call = load_reproducer(_write(tmp_path / "ok.safetensors", {"format": REPRO_FORMAT, "is_causal": True}))
    assert call.is_causal is True and call.q.shape == (1, 2, 8, 16)


@pytest.mark.parametrize(
    ("info", "tensors", "message"),
    [
        ([REPRO_FORMAT], {}, "metadata is a JSON list, not an object"),
        ({"is_causal": "no"}, {}, "is_causal is 'no', not true or false"),
        ({"scale": "0.1"}, {}, "scale is '0.1', not a number or null"),
        ({"scale": True}, {}, "scale is True, not a number or null"),
        ({"device": "gpu:zero"}, {}, "device 'gpu:zero' is not a torch device"),
        ({"device": 3}, {}, "device is 3, not a string"),
        ({"layout": {"q": [0, 1, 1, 3]}}, {}, r"layout of q is \[0, 1, 1, 3\], not a permutation"),
        ({"layout": [0, 1]}, {}, "layout is .*, not an object of permutations"),
        ({}, {"grad_out": torch.randn(1, 2, 8, 16).half()}, "mix dtypes .*grad_out float16"),
    ],
)
def test_bad_metadata_is_refused_naming_the_field(
    tmp_path: Path, info: object, tensors: dict[str, torch.Tensor], message: str
) -> None:
    if isinstance(info, dict):
        info = {"format": REPRO_FORMAT, **info}
    path = _write(tmp_path / "bad.safetensors", info, **tensors)
    with pytest.raises(ReproducerError, match=message):
        load_reproducer(path)


# ---------------------------------------------------------------------------------------------------
# a file whose tensors are not one attention call, of another format version, or naming a baseline
# that is not here: refused as bad input (exit 2, one paragraph) before any kernel runs


@pytest.fixture
def counting() -> Iterator[list[int]]:
    """A kernel ``counting`` (torch's SDPA) that records each call: ``[calls]``."""
    calls = [0]

    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        calls[0] += 1
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )

    register_kernel("counting", kernel, overwrite=True)
    yield calls
    unregister_kernel("counting")


def _refused(path: Path, capsys: pytest.CaptureFixture[str], calls: list[int]) -> list[str]:
    """The messages ``flashprobe replay`` and ``flashprobe fuzz --from`` end with on ``path``, each
    checked to be one paragraph with exit 2, no kernel run and nothing written."""
    with pytest.raises(SystemExit) as stop:
        replay_main([str(path)])
    messages = [stop.value.code, capsys.readouterr().err.strip().splitlines()[-1]]
    out = path.parent / "fuzz"
    messages += [fuzz_main(["--from", str(path), "--out", str(out)]), capsys.readouterr().err.strip()]
    assert messages[0] == messages[2] == 2, messages
    assert "\n" not in messages[3] and "Traceback" not in messages[1] + messages[3], messages
    assert calls == [0] and not out.exists()
    return [messages[1], messages[3]]


_CALL = {"format": REPRO_FORMAT, "primary": "counting", "baseline": "math"}


@pytest.mark.parametrize(
    ("tensors", "info", "message"),
    [
        # a 3-D q replayed as `pass` (the kernels took it as (B, N, D) and broadcast)
        ({"q": torch.randn(2, 8, 16)}, {}, r"q must have shape \(B, H, N, D\), got \(2, 8, 16\)"),
        # a mask that does not broadcast was the kernel's ERROR, exit 1
        (
            {"attn_mask": torch.ones(3, 5, dtype=torch.bool)},
            {},
            r"attn_mask of shape \(3, 5\) does not broadcast to \(B, H, N_q, N_k\) = \(1, 2, 8, 8\)",
        ),
        ({"k": torch.randn(1, 2, 8, 12)}, {}, r"head dims of q \(16\) and k \(12\) differ"),
        ({"v": torch.randn(1, 2, 7, 16)}, {}, "k has 8 keys but v has 7 values"),
        ({"k": torch.randn(1, 3, 8, 16), "v": torch.randn(1, 3, 8, 16)}, {}, "head counts differ"),
        ({"q": torch.ones(1, 2, 8, 16, dtype=torch.int32)}, {}, "q must be floating point"),
        ({"grad_out": torch.randn(1, 2, 8, 4)}, {}, r"grad_out has shape \(1, 2, 8, 4\), not the output's"),
        ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, {"is_causal": True}, "either attn_mask or"),
        ({}, {"scale": float("nan")}, "scale is nan, not a finite number"),
    ],
)
def test_tensors_that_are_not_one_attention_call_are_refused_before_any_kernel_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    counting: list[int],
    tensors: dict[str, torch.Tensor],
    info: dict[str, object],
    message: str,
) -> None:
    path = _write(tmp_path / "call.safetensors", {**_CALL, **info}, **tensors)
    with pytest.raises(ReproducerError, match=message):
        load_reproducer(path)
    for said in _refused(path, capsys, counting):
        assert re.search(message, said), said
        assert "not a valid flashprobe reproducer" in said and "save the call again" in said


def test_grouped_query_heads_and_a_broadcast_mask_are_one_call(tmp_path: Path) -> None:
    """The check refuses what no kernel could have been given, not what a kernel call can be."""
    kv = torch.randn(1, 1, 8, 16)
    mask = torch.rand(1, 1, 8) > 0.3  # broadcasts to (B, H, N_q, N_k) = (1, 2, 8, 8)
    path = _write(tmp_path / "call.safetensors", _CALL, k=kv, v=kv.clone(), attn_mask=mask)
    call = load_reproducer(path)
    assert call.k.shape == (1, 1, 8, 16) and call.attn_mask is not None


def test_another_format_version_names_the_version_found_and_the_one_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], counting: list[int]
) -> None:
    """It said ``not a flashprobe reproducer ()``."""
    path = _write(
        tmp_path / "call.safetensors", {**_CALL, "format": "flashprobe-repro-99", "flashprobe": "9.0"}
    )
    for said in _refused(path, capsys, counting):
        assert (
            f"format 'flashprobe-repro-99', written by flashprobe 9.0; this flashprobe ({__version__}) "
            f"reads format {REPRO_FORMAT!r} only" in said
        ), said
    path = _write(tmp_path / "call.safetensors", {**_CALL, "format": None})
    with pytest.raises(ReproducerError, match=f"format is None, not {REPRO_FORMAT!r}"):
        load_reproducer(path)


def test_a_recorded_baseline_that_is_not_here_is_bad_input_naming_the_field_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], counting: list[int]
) -> None:
    """``replay`` reported it as an ERROR of the kernel asked for, exit 1; ``--baseline`` overrides."""
    path = _write(tmp_path / "call.safetensors", {**_CALL, "baseline": "nosuch_baseline"})
    for said in _refused(path, capsys, counting):
        assert "the call's recorded baseline 'nosuch_baseline' cannot be used here" in said, said
        assert "--baseline SPEC, e.g. --baseline math" in said
    assert replay_main([str(path), "--baseline", "math"]) == 0
    assert counting[0] > 0 and "counting: PASS" in capsys.readouterr().out
