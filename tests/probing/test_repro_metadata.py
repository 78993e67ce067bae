"""A reproducer's metadata is data handed in by someone else: each field is checked for its type
before it is used, and a bad one is refused with the field named (issue 42, item 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

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
