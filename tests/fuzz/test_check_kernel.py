"""``check_kernel``: the fuzzer as a library call, both ways, with its reproducers on disk."""

from __future__ import annotations

import re

import pytest

from flashprobe import KernelCheck, check_kernel
from flashprobe.formats import OutputPathError
from flashprobe.fuzz import check_case
from flashprobe.fuzz.reproducer import case_inputs
from flashprobe.kernels import golden_attention, register_kernel, unregister_kernel
from flashprobe.probing.repro import load_reproducer


@pytest.fixture
def mask_dropping_kernel():
    """A real bug class: the kernel ignores a boolean mask (attends to padded keys)."""

    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        return golden_attention(q.double(), k.double(), v.double(), is_causal=is_causal, scale=scale).to(
            q.dtype
        )

    register_kernel("drops_mask", kernel, overwrite=True)
    yield "drops_mask"
    unregister_kernel("drops_mask")


def test_a_correct_kernel_passes():
    result = check_kernel("sdpa_math", dtypes=["fp32"], cases=["padding_mask", "odd_shapes"], seeds=2)
    assert isinstance(result, KernelCheck)
    assert result.passed and not result.failures
    assert {(r.case, r.seed) for r in result.results} == {
        (c, s) for c in ("padding_mask", "odd_shapes") for s in (0, 1)
    }
    assert result.summary["pass"] == 4 and result.reproducers == []


def test_a_kernel_that_drops_the_mask_fails_with_reproducers(mask_dropping_kernel, tmp_path):
    result = check_kernel(
        mask_dropping_kernel,
        dtypes=["fp32"],
        cases=["padding_mask", "odd_shapes"],
        backward=False,
        out_dir=tmp_path,
    )
    assert not result.passed
    assert [r.case for r in result.failures] == ["padding_mask"]  # odd_shapes has no mask: it passes
    assert result.reproducers and all(p.is_file() and p.parent == tmp_path for p in result.reproducers)
    # the reproducer is data (safetensors) holding the failing call: judged again, it fails again
    call = load_reproducer(result.reproducers[0])
    assert call.meta["primary"] == mask_dropping_kernel and call.meta["fuzz"]["case"] == "padding_mask"
    inputs = case_inputs(call)
    assert check_case(mask_dropping_kernel, inputs, backward=False).verdict == "fail"
    assert check_case("sdpa_math", inputs, backward=False).verdict == "pass"


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(ValueError, match="seeds=0: must be >= 1"):
        check_kernel("sdpa_math", seeds=0)
    with pytest.raises(ValueError, match="matches no case"):
        check_kernel("sdpa_math", cases=["no_such_case"])
    with pytest.raises(OutputPathError, match="out_dir /etc"):  # checked as the command's --out
        check_kernel("sdpa_math", cases=["odd_shapes"], out_dir="/etc")


def test_a_budget_is_estimated_up_front_and_counted_down():
    lines: list[str] = []
    check_kernel(
        "sdpa_math", dtypes=["fp32"], cases=["odd_shapes"], budget=2, backward=False, progress=lines.append
    )
    assert lines[0].startswith("[1/1] odd_shapes fp32 seed 0: sdpa_math pass")
    assert re.fullmatch(
        r"random search: 2 samples of 1 kernel\(s\), about \d+ s at the catalogue's pace", lines[1]
    )
    assert [
        re.search(r"\[(\d)/2\] random_00\d .*\(\d+ s; about (\d+) s left\)$", x).group(1) for x in lines[2:]
    ] == [
        "1",
        "2",
    ]
    assert lines[-1].endswith("about 0 s left)")
