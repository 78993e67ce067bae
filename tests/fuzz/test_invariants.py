"""Invariants (flashprobe.fuzz.invariants): each fails the kernels that break its relation and passes
correct kernels computed differently; the declared-precision check gives its own verdict.

Independent oracles: the relation itself evaluated here on the kernel's outputs (V = 1 gives rows of
1; a one-hot V against a float64 softmax written here; bits compared with ``torch.equal``) and the
error of an FP8 P cast computed here from its definition.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from flashprobe.fuzz import CHECKS, INVARIANTS
from flashprobe.fuzz.cli import main
from flashprobe.kernels import get_kernel


@pytest.fixture
def planted():
    import lab.sequence_mutants as m

    m.register()
    m.register_heldout()
    return m


def run(kernel: str, check: str, dtype=torch.bfloat16, seed: int = 0):
    return CHECKS[check].run(get_kernel(kernel), dtype, seed, "math", True, "cpu")


def softmax64(q, k, v, causal=False) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def diffuse_rows(n_k: int = 512, d: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One query whose logits are 0 for key 0 and −7 for the rest, V = 1 (the FP8 P-cast class)."""
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = 7.0 * d**0.5
    k = torch.zeros(1, 1, n_k, d)
    k[..., 0, 0] = 1.0
    return q, k, torch.ones(1, 1, n_k, d)


def test_fp8_p_cast_without_prescale_fails_unit_values_on_the_first_seed() -> None:
    bug, ok = "tiled:preset=fa3_fp8,p_scale=1", "tiled:preset=fa3_fp8"
    found = run(bug, "inv_unit_values", seed=0)
    assert found.verdict == "fail" and "V = 1" in found.reason
    assert run(ok, "inv_unit_values", seed=0).verdict == "pass"
    # the oracle, by hand: with V = 1 every output is 1. One query, key 0 at logit 0, 511 keys at −7,
    # 128-key tiles: without the prescale e^−7 = 9.1e−4 (under half E4M3's least subnormal 2^−9) rounds
    # to 0 in P·V of the first tile (whose max is 0) but stays in the row sum, so
    # out = (1 + 384·e^−7) / (1 + 511·e^−7) = 0.921; with P·2^8 it is kept (0.233 → 0.234)
    q, k, v = (t.to(torch.bfloat16) for t in diffuse_rows())
    spec = ",block_k=128"
    want = (1 + 384 * math.exp(-7)) / (1 + 511 * math.exp(-7))
    assert (get_kernel(bug + spec)(q, k, v).double() - want).abs().max() < 0.004
    assert (get_kernel(ok + spec)(q, k, v).double() - 1.0).abs().max() < 0.004


def test_heldout_fp8_kernels_with_fp8_inputs(planted) -> None:
    for name in ("heldout_fa3_fp8_no_prescale", "heldout_fa4_fp8_lazy_rescale"):
        assert run(name, "inv_unit_values").verdict == "fail", name
    for name in ("heldout_fa3_fp8_prescale", "heldout_fa4_fp8_lazy_bounded"):
        assert run(name, "inv_unit_values").verdict == "pass", name
        assert run(name, "inv_declared_precision").verdict == "pass", name


@pytest.mark.parametrize("name", ["plant_tile_transposed", "heldout_fa2_tile_transposed",
                                  "heldout_fa2_tile_rows_permuted"])  # fmt: skip
def test_tile_permuted_output_fails_positions(planted, name) -> None:
    found = run(name, "inv_positions")
    assert found.verdict == "fail", found.reason
    # the oracle: a one-hot V makes out the attention matrix folded into D columns; the kernel's
    # output differs from the float64 one by far more than bf16 rounding, with its norm kept
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(2))
    v = torch.eye(64).expand(1, 2, 64, 64).contiguous()
    out, want = get_kernel(name)(q, k, v).double(), softmax64(q, k, v)
    assert (out - want).norm() / want.norm() > 0.1
    assert abs(out.norm() / want.norm() - 1) < 0.05


def test_fp8_claimed_but_computed_in_bf16_is_not_declared(planted, tmp_path, capsys) -> None:
    for name in ("plant_fp8_in_bf16", "heldout_fa3_fp8_computes_bf16"):
        found = run(name, "inv_declared_precision")
        assert found.verdict == "not_declared" and "not the declared precision (e4m3)" in found.reason
    for name in ("tiled:preset=fa3_fp8", "heldout_fa3_fp8_prescale"):
        assert run(name, "inv_declared_precision").verdict == "pass", name
    # the oracle: P rounded to E4M3 (3 mantissa bits) at FA3's 2^8 scale, from its definition, errs
    # by ~1e-2 relative; the bf16 kernel's output is several times closer to the float64 softmax
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 128, 64, generator=g) for _ in range(3))
    want = softmax64(q, k, v, causal=True)
    s = (q.double() @ k.double().transpose(-2, -1) / 8).masked_fill(
        ~torch.ones(128, 128).bool().tril(), -1e300
    )
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p8 = (p * 256).float().to(torch.float8_e4m3fn).double() / 256
    fp8_err = ((p8 @ v.double() / p.sum(-1, keepdim=True) - want).norm() / want.norm()).item()
    found = get_kernel("plant_fp8_in_bf16")(*(t.bfloat16() for t in (q, k, v)), is_causal=True).double()
    assert ((found - want).norm() / want.norm()).item() < fp8_err / 2
    # the command: its own verdict, counted apart from fail, exits 1
    out = tmp_path / "o"
    argv = ["--import", "lab.sequence_mutants", "--kernel", "plant_fp8_in_bf16", "--case", "inv_declared_*",
            "--dtype", "bf16", "--out", str(out)]  # fmt: skip
    assert main(argv) == 1
    printed = capsys.readouterr().out
    assert "0 fail" in printed and "1 not_declared" in printed
    assert "NOT_DECLARED plant_fp8_in_bf16 | inv_declared_precision" in printed
    rows = json.loads((out / "fuzz.json").read_text())["rows"]
    assert [r["verdict"] for r in rows] == ["not_declared"]


def test_batch_invariance_and_determinism_only_when_declared(planted) -> None:
    assert run("plant_batch_variant", "inv_batch").verdict == "fail"
    assert run("plant_batch_loop", "inv_batch").verdict == "pass"
    assert run("plant_nondeterministic", "inv_determinism").verdict == "fail"
    assert run("plant_ordered", "inv_determinism").verdict == "pass"
    for name in ("sdpa_math", "tiled", "plant_nondeterministic"):  # declares no batch invariance
        found = run(name, "inv_batch")
        assert found.verdict == "unsupported" and "does not declare batch_invariant=True" in found.reason
    assert run("sdpa_math", "inv_determinism").verdict == "unsupported"
    # the oracle: the same call twice, bits compared here
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    kernel = get_kernel("plant_nondeterministic")
    assert not torch.equal(kernel(q, k, v), kernel(q, k, v))
    kernel = get_kernel("plant_batch_variant")
    q3, k3, v3 = (torch.randn(3, 2, 40, 16) for _ in range(3))
    assert not torch.equal(kernel(q3, k3, v3)[:1], kernel(q3[:1], k3[:1], v3[:1]))


def test_backward_not_the_forwards_derivative_fails(planted) -> None:
    found = run("plant_delta_stale", "inv_forward_backward", torch.float32)
    assert found.verdict == "fail" and "not the derivative" in found.reason
    # the oracle: its dq against float64 autograd of the definition
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16, requires_grad=True) for _ in range(3))
    d_out = torch.randn(1, 2, 24, 16)
    dq = torch.autograd.grad(get_kernel("plant_delta_stale")(q, k, v), q, d_out)[0]
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(softmax64(*wide), wide[0], d_out.double())[0]
    assert (dq.double() - want).norm() / want.norm() > 0.01


def test_scaling_and_permutation_relations_fail_kernels_that_break_them(register) -> None:
    def v_squared(q, k, v, *, attn_mask=None, is_causal=False, scale=None):  # out not linear in V
        return softmax64(q, k, v * v.abs().clamp(max=2), is_causal).to(q.dtype)

    def position_bias(q, k, v, *, attn_mask=None, is_causal=False, scale=None):  # keys not exchangeable
        s = q.double() @ k.double().transpose(-2, -1) * q.shape[-1] ** -0.5
        s = s + torch.arange(k.shape[-2], dtype=torch.float64) * 0.05
        return (torch.softmax(s, -1) @ v.double()).to(q.dtype)

    register("v_squared", v_squared)
    register("position_bias", position_bias)
    assert run("v_squared", "inv_value_scaling", torch.float32).verdict == "fail"
    assert run("position_bias", "inv_key_permutation", torch.float32).verdict == "fail"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_correct_kernels_pass_every_invariant(dtype) -> None:
    """No false alarm: correct kernels computed differently pass or are not applicable (more seeds:
    the slow test)."""
    for kernel in ("sdpa_math", "tiled", "math"):
        for name in INVARIANTS:
            found = run(kernel, name, dtype, seed=2)
            assert found.verdict in ("pass", "unsupported"), (kernel, name, found.reason)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_correct_kernels_pass_every_invariant_over_seeds(planted, seed) -> None:
    import lab.contracts as contracts

    contracts.register_controls()
    kernels = ("sdpa_math", "sdpa_flash", "tiled", "math", "tiled:preset=fa3_fp8", "plant_batch_loop",
               "plant_ordered", *contracts.CONTROLS)  # fmt: skip
    for kernel in kernels:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for name in INVARIANTS:
                found = run(kernel, name, dtype, seed)
                assert found.verdict in ("pass", "unsupported"), (kernel, name, found.reason)
