"""Bad input fails at attach time with a clear message; shadow failures never reach the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashprobe.kernels import (
    KernelOutputError,
    KernelSpecError,
    KernelUnavailableError,
    register_kernel,
    unregister_kernel,
)
from flashprobe.probing import ProbeWarning, ShadowAttention, probe, use_kernel

from ._models import TinyTransformer
from .test_sites import Direct

_ORIGINAL = F.scaled_dot_product_attention


@pytest.mark.parametrize("attach", [lambda m, s: probe(m, primary=s), lambda m, s: use_kernel(m, s)])
def test_kernel_errors_at_attach_time(attach) -> None:
    model = TinyTransformer()
    with pytest.raises(KernelUnavailableError, match=r"flash_attn.*(CUDA|not installed)"):
        attach(model, "flash_attn")
    with pytest.raises(KernelUnavailableError, match="sdpa_efficient"):
        attach(model, "sdpa_efficient")
    with pytest.raises(KernelSpecError, match=r"unknown kernel 'flash'.*available:"):
        attach(model, "flash")
    with pytest.raises(KernelSpecError, match="no option 'block'"):
        attach(model, "tiled:block=4")
    assert F.scaled_dot_product_attention is _ORIGINAL  # nothing was attached


def test_bad_probe_arguments() -> None:
    model = Direct()
    with pytest.raises(KernelSpecError):
        probe(model, baseline="nope")
    with pytest.raises(ValueError, match="every_n_calls"):
        probe(model, every_n_calls=0)
    with pytest.raises(ValueError, match="dropout"):
        probe(model, dropout="ignore")
    with pytest.raises(ValueError, match="sites"):
        probe(model, sites=["!"])
    with pytest.raises(ValueError, match="memory_budget"):
        probe(model, memory_budget=0)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        probe(lambda x: x)  # type: ignore[arg-type]
    assert F.scaled_dot_product_attention is _ORIGINAL


def test_failing_shadow_is_counted_not_raised() -> None:
    def broken(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        raise RuntimeError("boom")

    register_kernel("broken_for_probe_test", broken, overwrite=True)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    shadow = ShadowAttention(baseline="broken_for_probe_test")
    with pytest.warns(ProbeWarning, match="failed and was skipped.*boom"):
        out = shadow(q, k, v)
    shadow(q, k, v)
    assert torch.equal(out, _ORIGINAL(q, k, v))
    entry = shadow.stats()["attention"]  # the site is listed, with its failures counted
    assert entry["forward"]["calls"] == 0 and entry["shadow_errors"] == 2
    assert shadow.summary().shadow_errors == 2


def test_grouped_heads_that_do_not_divide_are_refused_not_passed() -> None:
    """``enable_gqa`` with query heads no multiple of the key/value heads: torch's SDPA refuses it, and
    so does the probe's preparation of a call (it used to compare no head at all and pass)."""
    from flashprobe.probing.call import SdpaCall, prepare

    q, k, v = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    call = SdpaCall(q, k, v, None, 0.0, False, None, True)
    with pytest.raises(ValueError, match="3 query heads and 2 key/value heads"):
        prepare(call)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        ShadowAttention(primary="math")(q, k, v, enable_gqa=True)  # a flashprobe primary: same refusal
    good = SdpaCall(q, k[:, :1], v[:, :1], None, 0.0, False, None, True)
    assert prepare(good).rep == 3


def test_an_empty_batch_with_gradients_is_no_shadow_error() -> None:
    """A batch of 0 sequences gives a backward with nothing to compare: no shadow error, no warning."""
    import warnings

    model = Direct()
    q, k, v = (torch.randn(0, 2, 5, 8, requires_grad=True) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeWarning)
        with probe(model, backward=True, golden=True) as p:
            model(q, k, v).sum().backward()
            stats = p.stats()
    entry = stats["<root>"]  # the site is listed; nothing was compared, and nothing failed
    assert entry["shadow_errors"] == 0 and entry["forward"]["calls"] == entry["backward"]["calls"] == 0


def _transposed_output(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """A layout bug: returns ``(B, N_q, H, D)`` where SDPA returns ``(B, H, N_q, D)``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal).transpose(1, 2)


def _upcast_output(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """A dtype bug: computes in fp32 and forgets to cast back."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal)


@pytest.mark.parametrize(
    ("bug", "words"),
    [
        (
            _transposed_output,
            r"returned shape \(2, 16, 2, 16\), expected \(B, H, N_q, D_v\) = \(2, 2, 16, 16\)",
        ),
        (_upcast_output, "returned fp32 for bf16 inputs; cast its output back"),
    ],
)
def test_a_kernel_output_of_the_wrong_shape_or_dtype_is_refused_with_its_name(bug, words) -> None:
    """The kernel's output is checked right after it returns (metadata only), before the model or
    the comparison uses it: a transposed output of a square head would otherwise reshape silently."""
    register_kernel("bad_output", bug, overwrite=True)
    model = _TwoHeads().to(torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    try:
        with (
            probe(model, primary="bad_output"),
            pytest.raises(KernelOutputError, match=f"'bad_output' {words}"),
        ):
            model(x)
    finally:
        unregister_kernel("bad_output")


class _TwoHeads(torch.nn.Module):
    """x ``(B, N, 32)`` → q, k, v ``(B, 2, N, 16)`` → SDPA → ``(B, N, 32)``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 32)
