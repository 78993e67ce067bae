"""The probe on compiled models: ``torch.compile`` with the probe attached before or after
compiling, backends eager, aot_eager (and inductor, slow), several attention modules. Same sites
and statistics as in eager mode, training bit-identical to the compiled model without the probe,
graph breaks only at attention calls, and a clear error at attach time for ``fullgraph=True``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.probing import ProbeCompileError, ProbeWarning, ShadowAttention, probe, use_kernel

from ._models import GQAAttention, TinyTransformer, train
from .test_identity import _assert_identical

BACKENDS = ["eager", "aot_eager"]


class Attn(nn.Module):
    """The issue's reproducer: self-attention with q = k = v."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x)


class Stack(nn.Module):
    """Residual GQA blocks (several attention modules sharing one forward's code)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GQAAttention(16, 4, 2) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _fresh(**kwargs) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(**kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_reproducer_runs_and_names_sites(backend: str) -> None:
    model = nn.Sequential(Attn(), Attn())
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(1, 2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeWarning)  # no shadow error, nothing skipped
        with probe(model) as p:
            out = compiled(x)
    assert torch.equal(out, model(x))
    assert p.sites == ["0", "1"] and p.calls == {"0": 1, "1": 1}
    assert p.summary().forward_calls == 2


@pytest.mark.parametrize(
    ("backend", "autocast"),
    [
        ("eager", False),
        ("aot_eager", False),
        ("eager", True),
        pytest.param("aot_eager", True, marks=pytest.mark.slow),
    ],
    ids=["eager-fp32", "aot_eager-fp32", "eager-autocast-bf16", "aot_eager-autocast-bf16"],
)
def test_compiled_training_is_bit_identical_with_the_same_statistics(backend: str, autocast: bool) -> None:
    plain_model = _fresh()
    plain = train(torch.compile(plain_model, backend=backend), autocast=autocast)
    torch._dynamo.reset()
    model = _fresh()
    compiled = torch.compile(model, backend=backend)
    with probe(compiled, golden=True, backward=True) as p:  # attached to the compiled wrapper
        probed = train(compiled, autocast=autocast)
    _assert_identical(plain, probed)
    eager_model = _fresh()
    with probe(eager_model, golden=True, backward=True) as eager:
        train(eager_model, autocast=autocast)
    assert p.sites == eager.sites == ["encoder.self_attn", "block"]
    eager_plain = train(_fresh(), autocast=autocast)["outputs"]
    if all(torch.equal(a, b) for a, b in zip(plain["outputs"], eager_plain, strict=True)):
        assert p.stats() == eager.stats()  # same kernels on the same tensors: the same numbers
    else:  # the compiled graph itself rounds differently from eager (aot_eager under autocast)
        assert p.calls == eager.calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_attached_after_compiling_and_detached_again(backend: str) -> None:
    model = Stack()
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 6, 16)
    plain = compiled(x)  # compiled (and cached) without the probe
    with probe(model) as p:  # Dynamo's guards see the swapped SDPA and recompile
        assert torch.equal(compiled(x), plain)
    assert p.calls == {f"blocks.{i}": 1 for i in range(3)}
    assert torch.equal(compiled(x), plain)  # detached: the first graph again
    assert p.calls == {f"blocks.{i}": 1 for i in range(3)}
    model.compile(backend=backend)  # compiled in place
    with probe(model) as p:
        model(x)
    assert p.sites == [f"blocks.{i}" for i in range(3)]


def test_compiled_stock_encoder_under_aot_eager() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    compiled = torch.compile(encoder, backend="aot_eager")
    x = torch.randn(2, 6, 16)
    with probe(compiled, backward=True) as p:
        compiled(x).sum().backward()
        compiled(x).sum().backward()
    sites = [f"layers.{i}.self_attn" for i in range(3)]
    assert p.sites == sites and p.calls == dict.fromkeys(sites, 2)  # named, counted once each
    summary = p.summary()
    assert summary.forward_calls == summary.backward_calls == 6
    assert summary.shadow_errors == 0 and 0 < summary.max_error_ratio < 2


def test_no_graph_break_one_opaque_op_per_attention_call() -> None:
    model = Stack(4)
    x = torch.randn(2, 6, 16)
    plain = torch._dynamo.explain(model)(x)
    assert plain.graph_break_count == 0
    torch._dynamo.reset()
    with probe(model):
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    code = explained.graphs[0].code
    assert code.count("torch.ops.flashprobe.attention(") == 4  # one op per attention call
    assert "scaled_dot_product_attention" not in code


def test_a_call_the_op_cannot_express_is_a_graph_break() -> None:
    """A mask that needs a gradient: the op gives none, so the call takes the eager graph break."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(6, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 2
            return F.scaled_dot_product_attention(x, x, x, attn_mask=self.bias) + 1

    model = Masked()
    x = torch.randn(1, 2, 6, 8)
    with probe(model, backward=True) as p:
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 1
        assert "flashprobe" in explained.break_reasons[0].reason
        torch._dynamo.reset()
        torch.compile(model, backend="aot_eager")(x).sum().backward()
    assert model.bias.grad is not None and p.sites == ["<root>"]


def test_fullgraph_is_refused_at_attach_time() -> None:
    model = nn.Sequential(Attn(), Attn())
    with pytest.raises(ProbeCompileError, match=r"fullgraph=True.*torch.compile\(model\)"):
        probe(torch.compile(model, backend="eager", fullgraph=True))
    model[1].compile(backend="eager", fullgraph=True)
    with pytest.raises(ProbeCompileError, match="module '1'"):
        probe(model)
    with pytest.raises(ProbeCompileError, match="use_kernel"):
        use_kernel(model, "math")


def test_shadow_attention_inside_a_compiled_module() -> None:
    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attend = ShadowAttention(baseline="math", golden=True, name="own")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attend(x, x, x) + 1

    model = Own()
    x = torch.randn(1, 2, 4, 8)
    assert torch.equal(torch.compile(model, backend="aot_eager")(x), model(x))
    assert model.attend.stats()["own"]["forward"]["calls"] == 2


@pytest.mark.slow  # inductor compiles C++ (about a minute on 2 cores)
def test_inductor_same_sites_and_close_outputs() -> None:
    plain = train(torch.compile(_fresh(), backend="inductor"))
    torch._dynamo.reset()
    model = _fresh()
    compiled = torch.compile(model, backend="inductor")
    with probe(compiled, backward=True) as p:
        probed = train(compiled)
    # Inductor compiles the code between attention calls as separate graphs and may round
    # differently at those boundaries (docs/integrations.md, "with torch.compile"): close, not equal.
    for x, y in zip(plain["outputs"], probed["outputs"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert p.sites == ["encoder.self_attn", "block"] and p.summary().backward_calls == 6


class BreaksItself(nn.Module):
    """A block with a graph break of its own before attention: Dynamo compiles its frame on its own
    and would reuse that code for a sibling block."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        torch._dynamo.graph_break()
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sibling_blocks_compiled_on_their_own_keep_their_sites(backend: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(BreaksItself(), BreaksItself(), BreaksItself())
    x = torch.randn(1, 2, 12, 8)
    with probe(model, backward=True) as eager:
        model(x).sum().backward()
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second pass runs the cached code
        with probe(model, backward=True) as p:
            compiled(x).sum().backward()
        assert p.sites == ["0", "1", "2"]
        assert p.stats() == eager.stats()  # every site's own numbers, not a sibling's


def test_use_kernel_route_inside_a_compiled_graph() -> None:
    """A routed call is one op too: the compiled model gets the routed kernel's output and gradients."""
    torch.manual_seed(0)
    model = Stack(2)
    x = torch.randn(2, 6, 16, requires_grad=True)
    with use_kernel(model, "tiled:block_q=4,block_k=4"):
        eager = model(x)
        (eager_grad,) = torch.autograd.grad(eager.sum(), x)
        explained = torch._dynamo.explain(model)(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")(x)
        (compiled_grad,) = torch.autograd.grad(compiled.sum(), x)
    assert explained.graph_break_count == 0
    assert torch.equal(compiled, eager) and torch.equal(compiled_grad, eager_grad)
    without = model(x)
    assert not torch.equal(without, eager)  # the route did change the kernel
