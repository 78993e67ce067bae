"""The probe compares the calls real kernels take: a model calling ``flash_attn.flash_attn_func`` with
causal, GQA, a (left, right) window, softcap and ALiBi trains with every call compared (no "runs
unchanged"), the correct library passes 10 steps and each bug class that fires there fails; PyTorch's
``varlen_attn``, FlashInfer's ``merge_state`` (base-2 LSE), flash-attention 4's ``learnable_sink`` and
a KV cache's LSE are compared, correct stand-ins passing and planted bugs failing.

The libraries are CPU stand-ins with their exact signatures (``_standins``): correct ones are
``lab/contracts.py``'s controls (online softmax over key tiles, exp2, split-KV merges), buggy ones plain
attention with one planted bug."""

from __future__ import annotations

import math
import sys
import types
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from flashprobe.probing import ProbeWarning, probe
from lab import contracts

from ._standins import (
    CORRECT,
    Bugs,
    flash_attention_4,
    flash_attn_2,
    flashinfer_modules,
    install,
    varlen_module,
)

_MODEL_CODE = '''
import torch
from torch import nn
from flash_attn import flash_attn_func

SOFTCAP = 0.1


class Block(nn.Module):
    """4 query and 2 key/value heads of 8 (GQA), softcap, ALiBi; causal against a learned prefix of
    ``prefix`` keys (N_k = N_q + prefix: anchored bottom-right), or a (left, right) window."""

    def __init__(self, prefix=0, causal=False, window=(-1, -1)):
        super().__init__()
        self.q, self.kv = nn.Linear(32, 32), nn.Linear(32, 32)
        self.prefix = nn.Parameter(torch.randn(1, prefix, 32)) if prefix else None
        self.causal, self.window = causal, window
        self.register_buffer("slopes", torch.tensor([0.5, 0.25, 0.125, 0.0625]))

    def forward(self, h):
        b, n, _ = h.shape
        memory = h if self.prefix is None else torch.cat([self.prefix.expand(b, -1, -1), h], dim=1)
        q = self.q(h).view(b, n, 4, 8)
        k, v = self.kv(memory).view(b, memory.shape[1], 2, 2, 8).unbind(2)
        out = flash_attn_func(q, k, v, softmax_scale=2.0, causal=self.causal, window_size=self.window,
                              softcap=SOFTCAP, alibi_slopes=self.slopes)
        return h + out.reshape(b, n, 32)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([Block(prefix=4, causal=True), Block(window=(3, 1))])
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)
'''


def _model_module(monkeypatch: pytest.MonkeyPatch, bugs: Bugs = CORRECT) -> types.ModuleType:
    """``flash_attn`` (the stand-in) and a model module that did ``from flash_attn import
    flash_attn_func``."""
    install(monkeypatch, {"flash_attn": flash_attn_2(bugs)})
    models = types.ModuleType("flash_model")
    exec(_MODEL_CODE, models.__dict__)
    monkeypatch.setitem(sys.modules, "flash_model", models)
    return models


def _train(model: nn.Module, steps: int, after: Callable[[], object] = lambda: None) -> list[torch.Tensor]:
    """``steps`` steps of SGD on a fixed regression batch (``after`` run after each); the weights after."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 12, 8, generator=gen), torch.randn(2, 12, 8, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        after()
    return [p.detach().clone() for p in model.parameters()]


def test_a_flash_attn_model_with_every_feature_trains_10_steps_every_call_compared(monkeypatch) -> None:
    models = _model_module(monkeypatch)
    torch.manual_seed(0)
    plain = models.Model()
    torch.manual_seed(0)
    model = models.Model()
    want = _train(plain, 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe(model, backward=True) as p:
            got = _train(model, 10, p.next_step)
    assert not [w for w in caught if issubclass(w.category, ProbeWarning)], [str(w.message) for w in caught]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))  # bit-identical training
    stats = p.stats()
    assert sorted(stats) == ["blocks.0", "blocks.1"]
    for site, entry in stats.items():
        assert entry["shadow_errors"] == 0
        assert entry["forward"]["calls"] == 10 and entry["backward"]["calls"] == 10, site
        assert entry["verdict"] == "pass", (site, entry["verdict_reason"])
    assert p.summary().verdict == "pass"


@pytest.mark.parametrize(
    ("bugs", "sites"),
    [
        (Bugs(softcap_exp=True), {"blocks.0"}),  # NaN once |s / cap| > 44 (blocks.1 then gets NaN inputs)
        (Bugs(symmetric_window=True), {"blocks.1"}),  # (3, 1) read as (3, 3)
        (Bugs(alibi_top_left=True), {"blocks.0"}),  # N_k = N_q + 4 there
        (Bugs(gqa_head_mod=True), {"blocks.0", "blocks.1"}),  # query head 1 reads K/V head 1, not 0
    ],
    ids=["softcap_through_exp", "symmetric_window", "alibi_misaligned", "gqa_kv_by_query_head"],
)
def test_each_bug_class_that_fires_in_the_model_fails_where_it_fires(
    monkeypatch, bugs: Bugs, sites: set
) -> None:
    models = _model_module(monkeypatch, bugs)
    torch.manual_seed(0)
    model = models.Model()
    with probe(model, backward=True, on_failure="ignore") as p:
        _train(model, 1)
    stats = p.stats()
    failed = {site for site, entry in stats.items() if entry["verdict"] == "fail"}
    assert failed == sites, {s: e["verdict_reason"] for s, e in stats.items()}
    assert all(e["shadow_errors"] == 0 for e in stats.values())
    assert p.summary().verdict == "fail"


# --- PyTorch's varlen_attn ---

CU_Q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)  # three packed sequences of 3, 5 and 2 queries
CU_K = torch.tensor([0, 4, 9, 12], dtype=torch.int32)  # ... and 4, 5 and 3 keys


class Varlen(nn.Module):
    """``varlen_attn`` on three packed sequences, 4 query and 2 key/value heads, causal (its
    ``window_size=(-1, 0)``) and windowed, the LSE asked for."""

    def __init__(self, window: tuple[int, int]) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 64)
        self.window = window

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        varlen = sys.modules["torch.nn.attention.varlen"]
        q = self.qkv(x)[:, :32].reshape(10, 4, 8)
        k, v = self.qkv(memory)[:, 32:].reshape(12, 2, 2, 8).unbind(1)
        out, lse = varlen.varlen_attn(q, k, v, CU_Q, CU_K, 5, 5, return_aux=varlen.AuxRequest(lse=True),
                                      scale=0.3, window_size=self.window, enable_gqa=True)  # fmt: skip
        return out.reshape(10, 32) + lse.sum()


@pytest.mark.parametrize("window", [(-1, 0), (2, 1)], ids=["causal", "window"])
def test_varlen_attn_is_compared_with_its_lse_and_gradients(monkeypatch, window: tuple[int, int]) -> None:
    """torch's ``varlen_attn`` raises NotImplementedError on the CPU (torch 2.13): a stand-in with its
    exact signature takes its place. The correct one passes (forward, LSE and gradients compared);
    a symmetric window or attention across sequences fails."""
    install(monkeypatch, {"torch.nn.attention.varlen": varlen_module()})
    gen = torch.Generator().manual_seed(2)
    x, memory = torch.randn(10, 8, generator=gen), torch.randn(12, 8, generator=gen)
    torch.manual_seed(0)
    model = Varlen(window)
    with probe(model, backward=True) as p:
        model(x, memory).square().sum().backward()
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 1 and entry["backward"]["calls"] == 1
    assert entry["verdict"] == "pass", entry["verdict_reason"]
    bug = Bugs(symmetric_window=True) if window == (2, 1) else Bugs(cross_sequence=True)
    install(monkeypatch, {"torch.nn.attention.varlen": varlen_module(bug)})
    with probe(model, backward=True, on_failure="ignore") as p:
        model(x, memory).square().sum().backward()
    assert p.stats()["<root>"]["verdict"] == "fail"


# --- FlashInfer's merge_state: base-2 LSEs ---


class Cascade(nn.Module):
    """Split-KV attention as inference engines run it: the two halves of the keys attended separately
    (FlashInfer's ``single_prefill_with_kv_cache_return_lse``: base-2 LSEs), then merged."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        fi = sys.modules["flashinfer"]
        a = fi.single_prefill_with_kv_cache_return_lse(q, k[:7], v[:7])
        b = fi.single_prefill_with_kv_cache_return_lse(q, k[7:], v[7:])
        return fi.merge_state(*a, *b)


def test_merge_state_is_compared_in_base_2_and_a_natural_merge_fails(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, 4, 16, generator=gen), *(torch.randn(13, 2, 16, generator=gen) for _ in range(2))
    install(monkeypatch, flashinfer_modules())
    want = Cascade()(q, k, v)
    with probe(Cascade()) as p:
        got = p.model(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0 and entry["forward"]["calls"] == 3
    assert entry["verdict"] == "pass", entry["verdict_reason"]
    install(monkeypatch, flashinfer_modules(Bugs(natural_merge=True)))
    with probe(Cascade(), on_failure="ignore") as p:
        p.model(q, k, v)
    assert p.stats()["<root>"]["verdict"] == "fail"


def test_merge_of_two_empty_states_is_zero_with_an_empty_lse(monkeypatch) -> None:
    """Two states whose LSEs are −inf (empty KV chunks) merge to 0 and −inf, not NaN (vllm 27491)."""
    install(monkeypatch, flashinfer_modules())

    class Merge(nn.Module):
        def forward(self, v_a, s_a, v_b, s_b):  # type: ignore[no-untyped-def]
            return sys.modules["flashinfer"].merge_state(v_a, s_a, v_b, s_b)

    v = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(4))
    s = torch.tensor([[1.0, -math.inf], [0.5, 2.0], [-math.inf, -math.inf]])
    empty = torch.full_like(s, -math.inf)
    with probe(Merge()) as p:
        merged_v, merged_s = p.model(v, s, v.flip(0), empty)
    assert torch.equal(merged_s[2], s[2]) and not merged_v[2].any()
    assert p.stats()["<root>"]["verdict"] == "pass", p.stats()["<root>"]["verdict_reason"]


class OtherMerges(nn.Module):
    """FlashInfer's other merge forms: ``merge_states`` over three states, then ``merge_state_in_place``
    of the result with a fourth (``mask`` passed to the in-place merge when given)."""

    def __init__(self, mask: torch.Tensor | None = None) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, v: torch.Tensor, s: torch.Tensor) -> tuple:  # v (T, 4, H, D), s (T, 4, H)
        fi = sys.modules["flashinfer"]
        merged_v, merged_s = fi.merge_states(v[:, :3], s[:, :3])
        fi.merge_state_in_place(merged_v, merged_s, v[:, 3], s[:, 3], mask=self.mask)
        return merged_v, merged_s


def test_merge_states_and_the_in_place_merge_are_compared(monkeypatch) -> None:
    """Both calls compared (the in-place merge read before it runs, its result after), the model's
    results unchanged; a natural-log merge inside both fails; a ``mask`` on the in-place merge is not
    compared: that call runs unchanged, with the warning naming it."""
    gen = torch.Generator().manual_seed(6)
    v, s = torch.randn(5, 4, 2, 8, generator=gen), 3 * torch.randn(5, 4, 2, generator=gen)
    install(monkeypatch, flashinfer_modules())
    want = OtherMerges()(v, s)
    with probe(OtherMerges()) as p:
        got = p.model(v, s)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0 and entry["forward"]["calls"] == 2
    assert entry["verdict"] == "pass", entry["verdict_reason"]
    mask = torch.ones(5, dtype=torch.bool)
    warned = pytest.warns(ProbeWarning, match="uses mask, which flashprobe does not compare")
    with warned, probe(OtherMerges(mask)) as p:
        p.model(v, s)
    assert p.stats()["<root>"]["forward"]["calls"] == 1
    install(monkeypatch, flashinfer_modules(Bugs(natural_merge=True)))
    with probe(OtherMerges(), on_failure="ignore") as p:
        p.model(v, s)
    assert p.stats()["<root>"]["verdict"] == "fail"


# --- Attention sinks: flash-attention 4's learnable_sink ---


class Sinks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sink = nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fa4 = sys.modules["flash_attn.cute"]
        out, _ = fa4.flash_attn_func(q, k, v, causal=True, window_size=(4, None), learnable_sink=self.sink)
        return out


def test_a_sinks_call_is_compared_and_a_dropped_sink_fails(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(2, 9, 4, 16, generator=gen),
        *(torch.randn(2, 9, 2, 16, generator=gen) for _ in range(2)),
    )
    install(monkeypatch, {"flash_attn.cute": flash_attention_4()})
    with probe(Sinks()) as p, torch.no_grad():
        p.model(q, k, v)
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0 and entry["forward"]["calls"] == 1
    assert entry["verdict"] == "pass", entry["verdict_reason"]
    install(monkeypatch, {"flash_attn.cute": flash_attention_4(Bugs(sink_ignored=True))})
    with probe(Sinks(), on_failure="ignore") as p, torch.no_grad():
        p.model(q, k, v)
    assert p.stats()["<root>"]["verdict"] == "fail"


# --- An SDPA call adapted to the primary's declared contract ---


def _additive_only(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """A kernel that takes additive masks only and grouped K/V heads natively."""
    assert attn_mask is None or attn_mask.is_floating_point(), "a bool mask reached an additive-only kernel"
    rep = q.shape[1] // k.shape[1]
    assert rep == 2, "its K/V heads were repeated though it takes them natively"
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale) + attn_mask
    return scores.softmax(-1) @ v


def _mask_ignored(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """The same kernel with its mask dropped (a planted bug)."""
    return _additive_only(q, k, v, attn_mask=torch.zeros_like(attn_mask), scale=scale)


@pytest.mark.parametrize(("fn", "verdict"), [(_additive_only, "pass"), (_mask_ignored, "fail")])
def test_a_bool_mask_given_to_an_additive_mask_kernel_is_converted_and_compared(fn, verdict: str) -> None:
    from flashprobe.kernels import KernelCapabilities, register_kernel, unregister_kernel

    caps = KernelCapabilities(masks=frozenset({"float"}), gqa="native")
    register_kernel("additive_only", fn, capabilities=caps, overwrite=True)
    try:

        class Padded(nn.Module):
            def forward(self, q, k, v, keep):  # type: ignore[no-untyped-def]
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=keep, enable_gqa=True
                )

        gen = torch.Generator().manual_seed(6)
        q, k, v = (
            torch.randn(2, 4, 5, 8, generator=gen),
            *(torch.randn(2, 2, 7, 8, generator=gen) for _ in range(2)),
        )
        keep = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
        keep[..., 0] = True
        with probe(Padded(), primary="additive_only", on_failure="ignore") as p:
            out = p.model(q, k, v, keep)
        assert out.shape == (2, 4, 5, 8)
        entry = p.stats()["<root>"]
        assert entry["forward"]["calls"] == 1 and entry["shadow_errors"] == 0
        assert entry["verdict"] == verdict, entry["verdict_reason"]
    finally:
        unregister_kernel("additive_only")


# --- The LSE a library returns ---


def _lse_in_base_2(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
    """flash-attn 2's ``flash_attn_func`` whose output is right and whose LSE is in base 2 (a planted bug:
    flash-attn's is natural)."""
    out, lse, probs = contracts.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size,
                                                softcap, alibi_slopes, deterministic, True)  # fmt: skip
    return (out, lse * math.log2(math.e), probs) if return_attn_probs else out


@pytest.mark.parametrize("bug", [False, True], ids=["correct", "lse_in_base_2"])
def test_the_lse_a_library_returns_is_compared(monkeypatch, bug: bool) -> None:
    library = flash_attn_2()
    if bug:
        library.flash_attn_func = _lse_in_base_2
    install(monkeypatch, {"flash_attn": library})

    class Block(nn.Module):
        def forward(self, q, k, v):  # type: ignore[no-untyped-def]
            out, lse, _ = sys.modules["flash_attn"].flash_attn_func(
                q, k, v, causal=True, return_attn_probs=True
            )
            return out, lse

    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(2, 5, 4, 8, generator=gen),
        *(torch.randn(2, 9, 2, 8, generator=gen) for _ in range(2)),
    )
    with probe(Block(), on_failure="ignore") as p, torch.no_grad():
        p.model(q, k, v)
    entry = p.stats()["<root>"]
    lse = entry["forward"]["lse"]
    assert entry["shadow_errors"] == 0 and lse["calls"] == 1
    assert entry["forward"]["out"]["verdict"] == "pass"  # the output is right either way
    assert lse["verdict"] == ("fail" if bug else "pass"), lse
    assert entry["verdict"] == ("fail" if bug else "pass")
    if bug:
        assert [f.direction for f in p.failures] == ["lse"]
        assert p.failures[0].kind == "lse" and "LSE off the golden" in p.failures[0].reason
