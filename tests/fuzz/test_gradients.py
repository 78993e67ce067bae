"""Gradient references, layouts and the new axes, against oracles computed apart from the fuzzer.

Oracles: torch autograd through torch SDPA's math backend in float64 (golden gradients), the
definition of each layout (strides, storage offset, values), torch SDPA with ``enable_gqa`` against
explicitly repeated k/v heads.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashprobe.fuzz import CATALOGUE, CaseInputs, check_case, references
from flashprobe.fuzz.cli import main
from flashprobe.fuzz.layouts import LAYOUTS, apply_layout
from flashprobe.fuzz.references import grad_output
from flashprobe.kernels import KernelCapabilities, get_kernel
from flashprobe.kernels.flash_form import flash_form_attention

from ._helpers import case


def _autograd64(inputs: CaseInputs, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """dq, dk, dv by autograd through torch's math SDPA in float64 (its GQA, its safe softmax)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    mask = inputs.attn_mask
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=inputs.is_causal, scale=inputs.scale, enable_gqa=True
        )
    return list(torch.autograd.grad(out, (q, k, v), grad_out.double()))


@pytest.mark.parametrize("name", ["gqa_broadcast", "padding_mask", "fully_masked_additive", "mqa"])
def test_golden_gradients_equal_autograd_through_torch_math_in_float64(name):
    inputs = case(name)
    refs = references(inputs, backward=True)
    expected = _autograd64(inputs, refs.grad_out)
    for n, want in zip(("dq", "dk", "dv"), expected, strict=True):
        got = refs.gradients[n].golden
        assert got.shape == want.shape
        torch.testing.assert_close(got, torch.nan_to_num(want), rtol=1e-10, atol=1e-12)


def test_fully_masked_rows_and_unseen_keys_must_have_zero_gradients():
    inputs = case("padding_mask")  # batch 0 has length 0, batch 1 length 1
    refs = references(inputs, backward=True)
    assert refs.gradients["dq"].zero_rows[0].all() and not refs.gradients["dq"].zero_rows[1].any()
    unseen = refs.gradients["dk"].zero_rows  # (B, H_kv, N_k)
    assert unseen[0].all() and unseen[1, :, 1:].all() and not unseen[1, :, 0].any()
    assert torch.equal(
        refs.gradients["dk"].golden[unseen], torch.zeros_like(refs.gradients["dk"].golden[unseen])
    )


def test_the_output_gradient_is_fixed_and_in_the_dtype():
    a = grad_output((2, 3, 4, 5), torch.bfloat16, "cpu")
    assert a.dtype == torch.bfloat16 and torch.equal(a, grad_output((2, 3, 4, 5), torch.bfloat16, "cpu"))


def test_the_flash_form_backward_is_exact_in_float64():
    inputs = case("fully_masked_rows", torch.float64)
    q, k, v = (t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    out = flash_form_attention(q, k, v, attn_mask=inputs.attn_mask)
    go = grad_output(out.shape, torch.float64, "cpu")
    got = torch.autograd.grad(out, (q, k, v), go)
    want = _autograd64(inputs, go)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, torch.nan_to_num(w), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_keep_the_values_and_have_the_layout_they_name(layout):
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    lq, lk, lv = apply_layout(q, k, v, layout)
    if layout == "expanded_kv":
        assert lk.stride()[:2] == (0, 0) and torch.equal(lk, k[:1, :1].expand_as(k))
        assert torch.equal(lq, q)
        return
    assert torch.equal(lq, q) and torch.equal(lk, k) and torch.equal(lv, v)
    if layout in ("kv_strides", "mixed"):  # k's pointers built from v's strides read other keys
        assert lk.stride() != lv.stride()
        if layout == "mixed":
            assert len({lq.stride(), lk.stride(), lv.stride()}) == 3 and lk.storage_offset() > 0
        return
    contiguous = layout in ("contiguous", "offset")
    assert all(t.is_contiguous() is contiguous for t in (lq, lk, lv))
    if layout == "offset":
        assert all(t.storage_offset() > 0 for t in (lq, lk, lv))
    if layout == "fused_qkv":  # one buffer holds q, k and v
        assert (
            lq.untyped_storage().data_ptr()
            == lk.untyped_storage().data_ptr()
            == lv.untyped_storage().data_ptr()
        )


def test_a_kernel_receives_the_case_layout_and_clones_keep_it(register):
    seen = {}

    def spy(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        seen["strides"] = (q.stride(), k.stride(), q.storage_offset())
        return get_kernel("sdpa_math")(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    kernel = register("user_spy", spy)
    for name, check in (
        ("layout_bnhd", lambda s: s[0][1] < s[0][2]),  # heads are the fastest dim after D
        ("layout_expanded_kv", lambda s: s[1][:2] == (0, 0)),
        ("layout_offset", lambda s: s[2] > 0),
    ):
        result = check_case(kernel, case(name), case=name)
        assert result.verdict == "pass" and result.layout == name.removeprefix("layout_"), result.reason
        assert check(seen["strides"]), (name, seen)


def test_sdpa_kernels_accept_gqa_as_torch_does():
    inputs = case("gqa_broadcast")
    k, v = inputs.reference_kv()
    for name in ("sdpa_math", "sdpa_flash"):
        out = get_kernel(name)(inputs.q, inputs.k, inputs.v, is_causal=True)
        want = get_kernel(name)(inputs.q, k, v, is_causal=True)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        assert check_case(name, inputs).verdict == "pass"


def test_the_new_axes_are_in_the_default_profile():
    default = [c for c in CATALOGUE.values() if "default" in c.profiles]
    shapes = {
        c.name: c.build(torch.float32)
        for c in default
        if c.name.startswith(("head_dim", "long", "large", "keys"))
    }
    assert max(i.q.shape[-1] for i in shapes.values()) == 256
    assert shapes["keys_mod128_64"].k.shape[2] % 128 == 64
    assert shapes["long_context_8k"].k.shape[2] > 4096
    assert shapes["large_grid"].q.shape[0] * shapes["large_grid"].q.shape[1] >= 1024
    full = {c.name for c in CATALOGUE.values() if c.profiles == ("full",)}
    assert {"long_context_16k", "decode_32k"} <= full


def test_cli_reports_coverage_profile_and_gradients(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--kernel", "sdpa_math", "--dtype", "fp32", "--case", "layout_*,gqa_broadcast,mqa,head_dim_256"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "coverage (values exercised per axis):" in printed and "with gradients" in printed
    payload = json.loads((out / "fuzz.json").read_text())
    cover = payload["coverage"]
    assert set(cover["layout"]) == set(LAYOUTS)
    assert cover["gqa_ratio"] == [1, 4, 6] and 256 in cover["head_dim"] and cover["gradients"] == ["checked"]
    assert payload["backward"] is True and payload["profile"] == "default"
    assert all(r["backward"] == "pass" and set(r["gradients"]) == {"dq", "dk", "dv"} for r in payload["rows"])
    assert main([*argv, "--no-backward", "--out", str(out)]) == 0
    payload = json.loads((out / "fuzz.json").read_text())
    assert payload["backward"] is False and all(r["backward"] is None for r in payload["rows"])
    assert payload["coverage"]["gradients"] == ["forward only"]
    assert main([*argv, "--profile", "huge", "--out", str(out)]) == 2
    assert "--profile huge: unknown profile; use one of default, full" in capsys.readouterr().err


def _forward_only(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _detached(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    return _forward_only(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale).detach()


def test_a_kernel_without_backward_is_not_said_to_be_fuzzed_with_gradients(register, tmp_path, capsys):
    """The header and fuzz.json said "with gradients" (``coverage`` ``gradients: checked``) for a
    kernel declaring no backward, whose every row was no_backward: they say outputs only, and why."""
    name = register(
        "user_forward_only", _forward_only, capabilities=KernelCapabilities(backward_devices=frozenset())
    )
    argv = ["--dtype", "fp32", "--case", "odd_shapes,mqa", "--out", str(tmp_path)]
    assert main(["--kernel", name, *argv]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "with gradients" not in header and f"outputs only ({name}: no backward on cpu)" in header, header
    payload = json.loads((tmp_path / "fuzz.json").read_text())
    assert {r["verdict"] for r in payload["rows"]} == {"no_backward"}  # asked for, not checked
    assert payload["outputs_only"] == {name: "no backward on cpu"}
    assert payload["coverage"]["gradients"] == ["forward only"]
    assert main(["--kernel", "sdpa_math", "--kernel", name, *argv]) == 0  # one with, one without
    header = capsys.readouterr().out.splitlines()[0]
    assert f"with gradients (outputs only for {name}: no backward on cpu)" in header, header
    payload = json.loads((tmp_path / "fuzz.json").read_text())
    assert payload["outputs_only"] == {name: "no backward on cpu"}
    assert payload["coverage"]["gradients"] == ["checked", "forward only"]
    detached = register("user_detached", _detached)  # declares nothing: a backward is assumed
    assert main(["--kernel", detached, *argv]) == 0
    assert f"outputs only ({detached}: no backward in the calls run)" in capsys.readouterr().out
    assert main(["--kernel", "sdpa_math", *argv, "--no-backward"]) == 0
    assert ", outputs only (seed 0" in capsys.readouterr().out
    assert json.loads((tmp_path / "fuzz.json").read_text())["outputs_only"] == {"sdpa_math": "--no-backward"}
