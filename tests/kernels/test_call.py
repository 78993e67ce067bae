"""The attention call as data (flashprobe.kernels.call): validation, and every storage to the logical
form and back.

The oracle of a conversion is the per-sequence tensors the call was built from: each storage
(packed, paged in either page layout with shuffled pages, a KV cache with appended keys, left
padding, cache rows and pages) must give back exactly those, with unused slots (poisoned with NaN)
never read.
"""

from __future__ import annotations

import pytest
import torch

from flashprobe.kernels import KernelInputError
from flashprobe.kernels.call import AttentionCall, convert_lse
from tests.kernels._oracle import random_sequences


def dense_call(seqs, **features):
    """The logical call of per-sequence ``(q (n_q, H, D), k, v)``: padded with zeros, with lengths."""
    b = len(seqs)
    n_q, n_k = max(s[0].shape[0] for s in seqs), max(s[1].shape[0] for s in seqs)
    h, d = seqs[0][0].shape[1:]
    h_kv, d_v = seqs[0][2].shape[1:]
    dtype = seqs[0][0].dtype
    q = torch.zeros(b, h, n_q, d, dtype=dtype)
    k = torch.zeros(b, h_kv, n_k, d, dtype=dtype)
    v = torch.zeros(b, h_kv, n_k, d_v, dtype=dtype)
    for i, (qs, ks, vs) in enumerate(seqs):
        q[i, :, : qs.shape[0]] = qs.transpose(0, 1)
        k[i, :, : ks.shape[0]] = ks.transpose(0, 1)
        v[i, :, : vs.shape[0]] = vs.transpose(0, 1)
    q_lens = torch.tensor([s[0].shape[0] for s in seqs], dtype=torch.int32)
    k_lens = torch.tensor([s[1].shape[0] for s in seqs], dtype=torch.int32)
    return AttentionCall(q=q, k=k, v=v, q_lens=q_lens, k_lens=k_lens, **features)


def _same_logical(a: AttentionCall, b: AttentionCall) -> None:
    """Two logical calls hold the same valid values, zeros elsewhere, and the same lengths."""
    assert a.storage == b.storage == "dense" and a.layout == b.layout == "bhnd"
    for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v)):
        n = min(x.shape[2], y.shape[2])
        assert torch.equal(x[:, :, :n], y[:, :, :n])
        assert not x[:, :, n:].any() and not y[:, :, n:].any()
    for x, y in ((a.q_lens, b.q_lens), (a.k_lens, b.k_lens)):
        if x is not None and y is not None:
            assert torch.equal(x.long(), y.long())


SEQS = random_sequences([3, 0, 5, 1], [7, 4, 0, 9], 4, 2, 8, 6, seed=0)


def test_packed_round_trip():
    dense = dense_call(SEQS, causal=True, align="bottom_right")
    packed = dense.packed()
    assert packed.storage == "packed" and packed.q.shape == (9, 4, 8) and packed.k.shape == (20, 2, 8)
    assert packed.cu_seqlens_q.tolist() == [0, 3, 3, 8, 9] and packed.cu_seqlens_k.tolist() == [
        0,
        7,
        11,
        11,
        20,
    ]
    assert (packed.max_seqlen_q, packed.max_seqlen_k) == (5, 9)
    assert packed.causal and packed.align == "bottom_right"
    _same_logical(packed.logical(), dense)
    out = torch.randn(9, 4, 5)  # an output in the packed form
    assert torch.equal(packed.q_from_logical(packed.q_to_logical(out)), out)
    lse = torch.randn(4, 9)
    logical = packed.lse_to_logical(lse, "ht")
    assert (
        logical.shape == (4, 4, 5) and torch.isinf(logical[1]).all() and torch.isinf(logical[0, :, 3:]).all()
    )
    assert torch.equal(packed.lse_from_logical(logical, "ht"), lse)
    assert torch.equal(packed.lse_to_logical(lse.t(), "th"), logical)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_keys_are_read_through_the_block_table(page_size, kv_layout):
    dense = dense_call(SEQS)
    paged = dense.paged(
        page_size, kv_layout=kv_layout, generator=torch.Generator().manual_seed(1), fill=float("nan")
    )
    assert paged.storage == "paged" and paged.page_size == page_size
    pages = paged.k if kv_layout == "NHD" else paged.k.transpose(1, 2)  # (P, page_size, H_kv, D)
    for b, (_, keys, _) in enumerate(SEQS):
        used = -(-keys.shape[0] // page_size)
        assert torch.isnan(pages[paged.block_table[b, used:].long()]).all()  # the table's tail: poison only
        rows = pages[paged.block_table[b, :used].long()].flatten(0, 1)
        assert torch.equal(rows[: keys.shape[0]], keys) and torch.isnan(rows[keys.shape[0] :]).all()
    _same_logical(paged.logical(), dense)


@pytest.mark.parametrize(
    ("new", "leftpad", "rows", "page_size"),
    [(0, None, None, None), (2, None, None, None), (1, [1, 0, 0, 3], None, None),
     (2, None, [5, 0, 2, 3], None),
     (1, None, None, 4), (0, [0, 2, 0, 1], None, 2)],
)  # fmt: skip
def test_a_kv_cache_gives_its_cached_then_appended_keys(new, leftpad, rows, page_size):
    seqs = random_sequences([2, 2, 2, 2], [7, 4, 2, 9], 4, 2, 8, 8, seed=3)
    dense = dense_call(seqs, causal=True, align="bottom_right").replace(q_lens=None)
    pad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32)
    idx = None if rows is None else torch.tensor(rows, dtype=torch.int32)
    cache = dense.cached(new=new, leftpad=pad, batch_idx=idx, page_size=page_size, fill=float("nan"))
    assert cache.storage == "cache" and cache.layout == "bnhd" and cache.n_new == new
    cache.check_values()
    _same_logical(cache.logical(), dense.replace(k=dense.k[:, :, : cache.n_k], v=dense.v[:, :, : cache.n_k]))
    assert not torch.isnan(cache.logical().k).any()


def test_layouts_are_views_of_the_same_tensors():
    dense = dense_call(SEQS).replace(q_lens=None, k_lens=None)
    flash = dense.with_layout("bnhd")
    assert flash.q.shape == (4, 5, 4, 8) and flash.q.data_ptr() == dense.q.data_ptr()
    assert flash.logical().q.data_ptr() == dense.q.data_ptr()
    assert torch.equal(flash.q_to_logical(flash.q), dense.q)


def test_lse_bases():
    lse = torch.tensor([0.0, 1.0, float("-inf")], dtype=torch.float64)
    two = convert_lse(lse, "e", 2)
    assert torch.allclose(two[:2], torch.tensor([0.0, 1.4426950408889634], dtype=torch.float64))
    assert torch.equal(convert_lse(two, 2, "e")[2:], lse[2:]) and torch.allclose(
        convert_lse(two, 2, "e"), lse
    )


def _base(**changes):
    fields = {"q": torch.zeros(2, 4, 5, 8), "k": torch.zeros(2, 2, 6, 8), "v": torch.zeros(2, 2, 6, 8)}
    return {**fields, **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"k": torch.zeros(2, 3, 6, 8), "v": torch.zeros(2, 3, 6, 8)}, "divide the query heads"),
        ({"k": torch.zeros(2, 2, 6, 4)}, "head dims of q"),
        ({"layout": "nhd"}, "layout='nhd' must be one of"),
        ({"window": (2, -3)}, "window=.*ints >= -1"),
        ({"causal": True, "window": (2, 2)}, r"give \(left, 0\)"),
        ({"softcap": -1.0}, "softcap"),
        (
            {"alibi_slopes": torch.zeros(4, dtype=torch.float64)},
            r"alibi_slopes must be a fp32 tensor of shape \(4,\) or \(2, 4\)",
        ),
        ({"sinks": torch.zeros(2)}, r"sinks must be a floating tensor of shape \(4,\)"),
        ({"q_descale": torch.ones(2, 2)}, "q_descale descales FP8 inputs"),
        ({"k_lens": torch.zeros(2)}, "k_lens must be a 1-D int32 tensor, got torch.float32"),
        (
            {"cu_seqlens_q": torch.tensor([0, 5], dtype=torch.int32)},
            "need both cu_seqlens_q and cu_seqlens_k",
        ),
        (
            {
                "cu_seqlens_q": torch.tensor([0, 5], dtype=torch.int32),
                "cu_seqlens_k": torch.tensor([0, 6], dtype=torch.int32),
            },
            r"packed q must be \(total, H, D\)",
        ),
        (
            {"cache_seqlens": 3, "cache_batch_idx": torch.tensor([0, 1])},
            "cache_batch_idx must be a 1-D int32",
        ),
        ({"q_lens": torch.tensor([1, 2, 3], dtype=torch.int32)}, r"q_lens must have 2 entries \(B = 2\)"),
        ({"block_table": torch.zeros(2, 1, dtype=torch.int32)}, "need both cu_seqlens_q and cu_seqlens_k"),
        (
            {"k_new": torch.zeros(2, 2, 1, 8), "v_new": torch.zeros(2, 2, 1, 8)},
            "k_new has no meaning for dense",
        ),
        ({"cache_seqlens": 3, "k_new": torch.zeros(2, 2, 1, 8)}, "k_new and v_new go together"),
        ({"lse_base": 10}, "lse_base=10"),
        ({"out": torch.zeros(2, 4, 5, 7)}, "out must be a fp32 tensor of shape"),
    ],
)
def test_a_malformed_call_is_refused_naming_the_field(changes, message):
    with pytest.raises(KernelInputError, match=message):
        AttentionCall(**_base(**changes))
    AttentionCall.unchecked(**_base(**changes))  # (a call a kernel must refuse can still be built)


def test_index_values_are_checked_on_request():
    packed = dense_call(SEQS).packed()
    packed.check_values()
    bad = packed.replace(cu_seqlens_k=torch.tensor([0, 7, 5, 11, 20], dtype=torch.int32))
    with pytest.raises(KernelInputError, match="never decrease"):
        bad.check_values()
    with pytest.raises(KernelInputError, match="shorter than the longest"):
        packed.replace(max_seqlen_q=4).check_values()
    paged = dense_call(SEQS).paged(4)
    table = paged.block_table.clone()
    table[0, 0] = 1000
    with pytest.raises(KernelInputError, match="outside"):
        paged.replace(block_table=table).check_values()
    cache = dense_call(random_sequences([2, 2], [3, 4], 2, 2, 8, 8, seed=0)).replace(q_lens=None).cached()
    with pytest.raises(KernelInputError, match="within"):
        cache.replace(cache_seqlens=torch.tensor([3, 5], dtype=torch.int32)).check_values()
