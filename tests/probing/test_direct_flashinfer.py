"""FlashInfer called directly inside a model: ``single_prefill_with_kv_cache``,
``single_decode_with_kv_cache`` and the three batch wrappers (ragged prefill, paged prefill, paged
decode; ``plan`` then ``run``, and the deprecated ``forward``). FlashInfer needs CUDA: the library here
is a stand-in with its signatures and semantics (``_standins``). Each call is a site compared forward
(FlashInfer has no backward), the model gets the library's own output, the conversion (NHD/HND,
bottom-right causal, ragged sequences, page tables) equals a hand conversion, and the library's
known bug classes — the −50,000 mask sentinel, attending across requests, reading past a request's
last page — fail where the correct library passes."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from flashprobe.kernels import AttentionCall
from flashprobe.probing import ProbeWarning, probe
from flashprobe.probing.flashinfer import _block_table, _flat_mask

from ._standins import Bugs, flashinfer_modules, install

QO = torch.tensor([0, 3, 8, 10], dtype=torch.int32)  # three requests of 3, 5 and 2 queries
KV = torch.tensor([0, 4, 9, 12], dtype=torch.int32)  # ragged keys: 4, 5 and 3
# Paged keys: pages of 4 slots; request 0 has page 5 (4 slots used), request 1 pages 2, 6 (4 + 2),
# request 2 page 3 (2): 4, 6 and 2 keys.
PAGES = (torch.tensor([0, 1, 3, 4], dtype=torch.int32), torch.tensor([5, 2, 6, 3], dtype=torch.int32),
         torch.tensor([4, 2, 2], dtype=torch.int32))  # fmt: skip


def _paged_cache(layout: str = "NHD") -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_cache, v_cache)`` of 7 pages; the slots no request uses hold NaN."""
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.full((7, 4, 2, 16), float("nan")) for _ in range(2))  # (pages, page_size, H_kv, D)
    for page, used in ((5, 4), (2, 4), (6, 2), (3, 2)):
        k[page, :used] = torch.randn(used, 2, 16, generator=gen)
        v[page, :used] = torch.randn(used, 2, 16, generator=gen)
    if layout == "HND":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    return k, v


class Serving(nn.Module):
    """One step of an inference engine: the five FlashInfer entry points, 4 query and 2 key/value
    heads of 16. The ragged wrapper is planned here (inside the model), the paged ones by the caller."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        fi = sys.modules["flashinfer"]
        self.layout = layout
        workspace = torch.empty(8)
        self.ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout=layout)
        self.paged = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout=layout)
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout=layout)

    def plan_pages(self) -> None:
        self.paged.plan(QO, *PAGES, 4, 2, 16, 4, causal=True, sm_scale=0.3)
        self.decode.plan(*PAGES, 4, 2, 16, 4, sm_scale=0.2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple) -> list:
        fi = sys.modules["flashinfer"]
        kv = (k, v) if self.layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
        out = [
            fi.single_prefill_with_kv_cache(q[:3], kv[0][:6] if self.layout == "NHD" else kv[0][:, :6],
                                            kv[1][:6] if self.layout == "NHD" else kv[1][:, :6],
                                            causal=True, kv_layout=self.layout),  # append: 3 queries, 6 keys
            fi.single_prefill_with_kv_cache_return_lse(q[:4], *kv, kv_layout=self.layout, sm_scale=0.5),
            fi.single_decode_with_kv_cache(q[0], *kv, kv_layout=self.layout),
        ]  # fmt: skip
        self.ragged.plan(QO, KV, 4, 2, 16, causal=True)
        out.append(self.ragged.run(q, *kv))
        out.append(self.paged.run(q, cache))
        out.append(self.decode.run(q[:3], torch.stack(cache, dim=1)))  # one 5-D cache tensor
        return out


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return (
        torch.randn(10, 4, 16, generator=gen),
        torch.randn(12, 2, 16, generator=gen),
        torch.randn(12, 2, 16, generator=gen),
    )


def _flat(outs: list) -> list[torch.Tensor]:
    return [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_every_flashinfer_entry_point_is_a_site_with_unchanged_outputs(monkeypatch, layout: str) -> None:
    install(monkeypatch, flashinfer_modules())
    q, k, v = _inputs()
    cache = _paged_cache(layout)
    plain = Serving(layout)
    plain.plan_pages()
    want = plain(q, k, v, cache)
    model = Serving(layout)
    with probe(model) as p:  # FlashInfer has no backward: compared forward (backward="auto")
        model.plan_pages()  # planned by the caller, while the probe is attached
        got = model(q, k, v, cache)
    assert isinstance(got[1], tuple)  # return_lse: (out, lse), both as the library gave them
    for a, b in zip(_flat(want), _flat(got), strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(t).all() for t in _flat(got))  # unused cache slots never read
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 6 and entry["backward"]["calls"] == 0
    assert entry["nonfinite_inputs"]["k"] == 0  # unused slots of the gathered pages are zeroed
    assert entry["verdict"] == "pass", entry["verdict_reason"]


def test_the_deprecated_forward_sets_runs_settings(monkeypatch) -> None:
    """``forward(q, k, v, causal=..., sm_scale=...)`` overrides the plan's settings, for that run and
    later ones."""
    install(monkeypatch, flashinfer_modules())
    fi = sys.modules["flashinfer"]
    q, k, v = _inputs()

    class Ragged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8))

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
            self.wrapper.plan(QO, KV, 4, 2, 16, causal=False)
            first = self.wrapper.forward(q, k, v, causal=True, sm_scale=0.25)
            return first, self.wrapper.run(q, k, v)  # still causal, scale 0.25

    want = Ragged()(q, k, v)
    with probe(Ragged()) as p:
        got = p.model(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 2 and entry["verdict"] == "pass", entry["verdict_reason"]


@pytest.mark.parametrize(
    ("bug", "entry"),
    [
        (Bugs(sentinel=True), "single_prefill"),
        (Bugs(cross_sequence=True), "ragged"),
        (Bugs(whole_last_page=True), "decode"),
    ],
    ids=["mask_sentinel", "across_requests", "past_the_last_page"],
)
def test_flashinfer_bugs_fail_the_verdict(monkeypatch, bug: Bugs, entry: str) -> None:
    """The −50,000 sentinel: logits of every allowed key below −5e4, so the masked-out keys win; a
    ragged batch attending across requests; a decode reading the unused slots of a last page."""
    install(monkeypatch, flashinfer_modules(bug))
    fi = sys.modules["flashinfer"]
    q, k, v = _inputs()
    k_cache, v_cache = (t.nan_to_num(2.0) for t in _paged_cache())  # the bug reads unused slots

    class Model(nn.Module):
        def forward(self) -> torch.Tensor:
            if entry == "single_prefill":  # append: 3 queries, 6 keys, all logits about -2e5
                return fi.single_prefill_with_kv_cache(
                    200 * q[:3].abs(), -200 * k[:6].abs(), v[:6], causal=True
                )
            if entry == "ragged":
                wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8))
                wrapper.plan(QO, KV, 4, 2, 16)
                return wrapper.run(q, k, v)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8))
            wrapper.plan(*PAGES, 4, 2, 16, 4)
            return wrapper.run(q[:3], (k_cache, v_cache))

    with probe(Model(), on_failure="ignore") as p:
        p.model()
    assert p.stats()["<root>"]["verdict"] == "fail"
    install(monkeypatch, flashinfer_modules())  # the correct library passes the same calls
    fi = sys.modules["flashinfer"]
    with probe(Model()) as p:
        p.model()
    assert p.stats()["<root>"]["verdict"] == "pass"


def test_page_table_conversion_matches_a_hand_conversion() -> None:
    """FlashInfer's page table (pages per request, the last one filled to ``last_page_len``) read as
    flash-attn's block table and sequence lengths, which the kernels layer gathers the keys through."""
    indptr, indices, last = PAGES
    table, cu_k, longest = _block_table(indptr, indices, last, 4, torch.device("cpu"))
    assert table.tolist() == [[5, 0], [2, 6], [3, 0]]  # a request's pages in order, padded
    assert cu_k.tolist() == [0, 4, 10, 12] and longest == 6  # 4, 4 + 2 and 2 keys
    k, v = _paged_cache()
    call = AttentionCall(q=torch.zeros(10, 4, 16), k=k, v=v, cu_seqlens_q=QO, cu_seqlens_k=cu_k,
                         block_table=table, max_seqlen_q=5, max_seqlen_k=longest)  # fmt: skip
    keys = call.logical().k  # (B, H_kv, 6, D)
    for i, pages in enumerate(([5], [2, 6], [3])):
        rows = torch.cat([k[page] for page in pages])[: (4, 6, 2)[i]]  # (n, H_kv, D)
        assert torch.equal(keys[i, :, : len(rows)], rows.transpose(0, 1))
        assert not keys[i, :, len(rows) :].any()  # past the request's length: zero, never NaN


def test_a_ragged_custom_mask_matches_a_hand_conversion() -> None:
    """FlashInfer's batch ``custom_mask``: each request's ``(len_q, len_k)`` block, row-major, one after
    the other; read as the logical call's ``(B, 1, n_q, n_k)`` mask."""
    blocks = [torch.rand(n_q, n_k) > 0.5 for n_q, n_k in ((3, 4), (5, 5), (2, 3))]
    flat = torch.cat([b.reshape(-1) for b in blocks])
    q, k = torch.zeros(10, 4, 16), torch.zeros(12, 2, 16)
    logical = AttentionCall(q=q, k=k, v=k, cu_seqlens_q=QO, cu_seqlens_k=KV).logical()
    got = _flat_mask(flat, logical)
    want = torch.zeros(3, 1, 5, 5, dtype=torch.bool)
    for i, block in enumerate(blocks):
        want[i, 0, : block.shape[0], : block.shape[1]] = block
    assert torch.equal(got, want)


def test_calls_it_cannot_compare_run_unchanged_with_one_warning(monkeypatch) -> None:
    install(monkeypatch, flashinfer_modules())
    fi = sys.modules["flashinfer"]
    q, k, v = _inputs()
    planned = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8))
    planned.plan(QO, KV, 4, 2, 16, causal=True)  # before the probe is attached: its plan is unknown

    class Model(nn.Module):
        def forward(self) -> list:
            return [
                planned.run(q, k, v),
                fi.single_prefill_with_kv_cache(q[:3], k[:6], v[:6], pos_encoding_mode="ROPE_LLAMA"),
            ]

    want = Model()()
    with pytest.warns(ProbeWarning) as caught, probe(Model()) as p:
        got = p.model()
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    messages = [str(w.message) for w in caught]
    assert any("plan() made before the probe was attached" in m for m in messages)
    assert any("uses pos_encoding_mode, which flashprobe does not compare" in m for m in messages)
    assert p.sites == []
