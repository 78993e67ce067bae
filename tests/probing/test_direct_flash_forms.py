"""The flash-attn forms beyond ``flash_attn_func``: the varlen packed calls, FlashAttention-3's varlen
call (its positional order differs from flash-attn 2's), a paged KV cache (``block_table``), attention
dropout and extra outputs. Stand-in libraries (``_standins``) with the real signatures; every test
checks training is unchanged, every call is a site, and a buggy library fails where a correct one
passes."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from flashprobe.probing import probe

from ._standins import Bugs, flash_attention_3, flash_attn_2, install

CU_Q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)  # three packed sequences of 3, 5 and 2 queries
CU_K = torch.tensor([0, 4, 9, 12], dtype=torch.int32)  # ... and 4, 5 and 3 keys


class PackedForms(nn.Module):
    """The two varlen packed calls on three sequences, 4 query and 2 key/value heads of 8."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(8, 64)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        fa = sys.modules["flash_attn"]
        h = self.qkv(x)  # (10, 64)
        qkv = h[:, :48].reshape(10, 3, 2, 8)  # (total, 3, H, D): self-attention, equal lengths
        cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
        out1 = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, softmax_scale=0.4, causal=self.causal)
        q = torch.cat([out1.reshape(10, 16), h[:, 48:]], dim=1).reshape(10, 4, 8)  # (total_q, H, D)
        kv = self.qkv(extra)[:, :32].reshape(12, 2, 2, 8)  # (total_k, 2, H_kv, D)
        out2 = fa.flash_attn_varlen_kvpacked_func(q, kv, CU_Q, CU_K, 5, 5, 0.0, 0.3, self.causal)
        return out2.reshape(10, 32)


def _run(model: nn.Module, *, grad: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, extra = torch.randn(10, 8, generator=gen), torch.randn(12, 8, generator=gen)
    out = model(x, extra)
    if not grad:
        return [out.detach()]
    out.square().mean().backward()
    return [out.detach(), *(p.grad.clone() for p in model.parameters())]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "bottom_right_causal"])
def test_varlen_packed_calls_are_sites_with_unchanged_training(monkeypatch, causal: bool) -> None:
    install(monkeypatch, {"flash_attn": flash_attn_2()})
    torch.manual_seed(0)
    plain = PackedForms(causal)
    torch.manual_seed(0)
    model = PackedForms(causal)
    want = _run(plain)
    with probe(model) as p:  # backward="auto": gradients compared too
        got = _run(model)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 2 and entry["backward"]["calls"] == 2
    assert entry["verdict"] == "pass", entry["verdict_reason"]


def test_a_varlen_packed_library_attending_across_sequences_fails(monkeypatch) -> None:
    install(monkeypatch, {"flash_attn": flash_attn_2(Bugs(cross_sequence=True))})
    model = PackedForms(causal=False)
    with probe(model, on_failure="ignore") as p, torch.no_grad():
        _run(model, grad=False)
    assert p.stats()["<root>"]["verdict"] == "fail"


class Fa3Varlen(nn.Module):
    """FlashAttention-3's varlen call with its positional arguments: ``seqused_q, seqused_k`` come before
    ``softmax_scale`` and ``causal`` (flash-attn 2 has ``dropout_p`` there)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fa3 = sys.modules["flash_attn_interface"]
        return fa3.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 5, 5, None, None, 0.25, True)


def _qkv_packed(n_q: int = 10, n_k: int = 12) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n_q, 4, 8, generator=gen), *(torch.randn(n_k, 2, 8, generator=gen) for _ in range(2))


def test_flash_attention_3_varlen_is_bound_by_its_own_signature(monkeypatch) -> None:
    install(monkeypatch, {"flash_attn_interface": flash_attention_3()})
    q, k, v = _qkv_packed()
    want = Fa3Varlen()(q, k, v)
    with probe(Fa3Varlen()) as p, torch.no_grad():
        got = p.model(q, k, v)
    assert torch.equal(got, want)
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 1 and entry["verdict"] == "pass", entry["verdict_reason"]
    # read in flash-attn 2's order, 0.25 would be the dropout and True the scale: the references would
    # differ from the library, and a correct library would fail
    install(monkeypatch, {"flash_attn_interface": flash_attention_3(Bugs(ignore_scale=True))})
    with probe(Fa3Varlen(), on_failure="ignore") as p, torch.no_grad():
        p.model(q, k, v)
    assert p.stats()["<root>"]["verdict"] == "fail"


def test_flash_attention_3_extra_outputs_and_packed_heads(monkeypatch) -> None:
    """The first FlashAttention-3 releases returned ``(out, lse)``: the model gets both unchanged; its
    ``qkvpacked`` call with ``num_heads_q`` packs ``(B, N, H + 2 H_kv, D)``."""
    install(monkeypatch, {"flash_attn_interface": flash_attention_3(returns_lse=True)})

    class Block(nn.Module):
        def forward(self, qkv: torch.Tensor) -> tuple:
            fa3 = sys.modules["flash_attn_interface"]
            first = fa3.flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4)  # 4 + 2 + 2 heads
            second = fa3.flash_attn_func(first[0], first[0], first[0], softmax_scale=0.5)
            return first, second

    qkv = torch.randn(2, 6, 8, 8, generator=torch.Generator().manual_seed(2))
    want = Block()(qkv)
    with probe(Block()) as p, torch.no_grad():
        got = p.model(qkv)
    for a, b in zip(want, got, strict=True):
        assert isinstance(b, tuple) and len(b) == 2
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 2 and entry["verdict"] == "pass", entry["verdict_reason"]


class Paged(nn.Module):
    """flash-attn 2's varlen call on a paged KV cache: 3 sequences of 3/5/2 queries and 4/5/3 keys in
    blocks of 4 rows, scattered over 7 blocks; unused rows hold NaN."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        table = torch.tensor([[5, 0], [2, 6], [3, 1]], dtype=torch.int32)  # (B, max_blocks)
        fa = sys.modules["flash_attn"]
        return fa.flash_attn_varlen_func(
            q, k_cache, v_cache, CU_Q, CU_K, 5, 5, causal=self.causal, block_table=table
        )


def _cache() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.full((7, 4, 2, 8), float("nan")) for _ in range(2))  # (num_blocks, page, H_kv, D)
    for seq_rows in ((5, 4), (0, 0), (2, 4), (6, 1), (3, 3), (1, 0)):  # (block, rows in use)
        block, rows = seq_rows
        k[block, :rows] = torch.randn(rows, 2, 8, generator=gen)
        v[block, :rows] = torch.randn(rows, 2, 8, generator=gen)
    return k, v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "bottom_right_causal"])
def test_a_paged_kv_cache_is_gathered_and_compared_forward(monkeypatch, causal: bool) -> None:
    install(monkeypatch, {"flash_attn": flash_attn_2()})
    q = torch.randn(10, 4, 8, generator=torch.Generator().manual_seed(4))
    k, v = _cache()
    want = Paged(causal)(q, k, v)
    assert torch.isfinite(want).all()  # the library reads only rows in use
    with probe(Paged(causal)) as p, torch.no_grad():
        got = p.model(q, k, v)
    assert torch.equal(got, want)
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 1 and entry["verdict"] == "pass", entry["verdict_reason"]
    assert entry["nonfinite_inputs"]["k"] == 0  # unused rows are not compared (zeroed)
    install(monkeypatch, {"flash_attn": flash_attn_2(Bugs(whole_last_page=True))})
    k = k.nan_to_num(3.0)  # the bug reads the unused rows of the last block
    with probe(Paged(causal), on_failure="ignore") as p, torch.no_grad():
        p.model(q, k, v.nan_to_num(3.0))
    assert p.stats()["<root>"]["verdict"] == "fail"


class Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).unbind(2)  # (B, N, H, D)
        return sys.modules["flash_attn"].flash_attn_func(q, k, v, 0.3, causal=True).reshape(2, 5, 16)


def test_direct_calls_with_dropout_keep_training_and_its_random_numbers(monkeypatch) -> None:
    """The model gets the library's dropout output; the comparison reruns the library without dropout,
    drawing no random numbers, so the RNG state after the step is the one without the probe."""
    install(monkeypatch, {"flash_attn": flash_attn_2()})
    torch.manual_seed(0)
    plain = Dropout()
    torch.manual_seed(0)
    model = Dropout()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(5))
    runs = []
    for m, probed in ((plain, False), (model, True)):
        torch.manual_seed(7)
        with probe(m) if probed else torch.enable_grad() as p:
            out = m(x)
            out.square().mean().backward()
        runs.append((out.detach(), [w.grad for w in m.parameters()], torch.get_rng_state(), p))
    (out_a, grads_a, rng_a, _), (out_b, grads_b, rng_b, p) = runs
    assert torch.equal(out_a, out_b) and torch.equal(rng_a, rng_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["dropout_calls"] == 1 and entry["forward"]["calls"] == 1
    assert entry["verdict"] == "pass", entry["verdict_reason"]


def test_direct_calls_not_sampled_run_unconverted(monkeypatch) -> None:
    """With ``every_n_calls=2`` every other call of a site is the library's own call: counted, not
    converted, not compared."""
    install(monkeypatch, {"flash_attn": flash_attn_2()})
    model = PackedForms(causal=True)
    want = _run(model, grad=False)
    with probe(model, every_n_calls=2) as p, torch.no_grad():
        got = _run(model, grad=False)
    assert torch.equal(want[0], got[0])
    assert p.calls == {"<root>": 2}
    assert p.stats()["<root>"]["forward"]["calls"] == 1


def test_both_module_paths_of_a_re_exported_function_are_swapped(monkeypatch) -> None:
    """flash-attn defines its functions in ``flash_attn.flash_attn_interface`` and re-exports them from
    ``flash_attn``: a call through either module is a site."""
    library = flash_attn_2()
    interface = type(library)("flash_attn.flash_attn_interface")
    interface.flash_attn_func = library.flash_attn_func
    install(monkeypatch, {"flash_attn": library, "flash_attn.flash_attn_interface": interface})

    class Both(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first = sys.modules["flash_attn"].flash_attn_func(x, x, x)
            return sys.modules["flash_attn.flash_attn_interface"].flash_attn_func(first, x, x)

    x = torch.randn(1, 4, 2, 8, generator=torch.Generator().manual_seed(6))
    with probe(Both()) as p, torch.no_grad():
        p.model(x)
    assert p.calls == {"<root>": 2}
