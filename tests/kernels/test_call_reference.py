"""The golden and the baseline of any call (flashprobe.kernels.math.call_reference) against an
independent FP64 oracle written row by row (tests/kernels/_oracle.py), against values computed by
hand, and against SDPA's golden (one implementation: the same bits)."""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.kernels import golden_attention, math_attention
from flashprobe.kernels.call import AttentionCall
from flashprobe.kernels.math import baseline_call, call_gradients, call_reference, golden_call
from tests.kernels._oracle import oracle, random_sequences
from tests.kernels.test_call import dense_call

#: feature sets: each a call's keywords beyond its tensors
FEATURES = {
    "plain": {},
    "causal_br": {"causal": True, "align": "bottom_right"},
    "causal_tl": {"causal": True, "align": "top_left"},
    "window": {"window": (2, 1), "align": "bottom_right"},
    "window_left_causal": {"window": (3, 0), "causal": True, "align": "bottom_right"},
    "window_right_only": {"window": (-1, 2), "align": "top_left"},
    "softcap": {"softcap": 0.7},
    "alibi": {"alibi": "h", "align": "bottom_right"},
    "alibi_batch_causal": {"alibi": "bh", "causal": True, "align": "bottom_right"},
    "sinks": {"sinks": True},
    "sinks_causal_window": {"sinks": True, "causal": True, "window": (1, 0), "align": "bottom_right"},
    "everything": {
        "softcap": 2.0, "alibi": "h", "sinks": True, "causal": True, "window": (4, 0),
        "align": "bottom_right",
    },
}  # fmt: skip
#: per-sequence (query, key) lengths: an empty query sequence, an empty key sequence, length 1,
#: more queries than keys (rows that see nothing when causal), ragged
LENGTHS = ([3, 0, 6, 1, 5], [7, 4, 0, 1, 2])


def _features(name, b, h, seed):
    gen = torch.Generator().manual_seed(seed)
    f = dict(FEATURES[name])
    alibi = f.pop("alibi", None)
    if alibi:
        f["alibi_slopes"] = torch.rand((h,) if alibi == "h" else (b, h), generator=gen) * 0.5
    if f.pop("sinks", False):
        f["sinks"] = torch.randn(h, generator=gen)
    return f


def _oracle_kwargs(f):
    return {
        "causal": f.get("causal", False), "align": f.get("align", "top_left"),
        "window": f.get("window", (-1, -1)),
        "softcap": f.get("softcap", 0.0), "slopes": f.get("alibi_slopes"), "sinks": f.get("sinks"),
        "scale": f.get("scale"),
    }  # fmt: skip


def _assert_matches_oracle(found, expected, call, *, tol=1e-12):
    """The logical output of ``call`` equals the per-sequence oracle (padding rows: 0 and −inf)."""
    q_lens = [e[0].shape[0] for e in expected]
    for b, (out, lse) in enumerate(expected):
        n = q_lens[b]
        torch.testing.assert_close(found.out[b, :, :n], out.transpose(0, 1), rtol=tol, atol=tol)
        assert not found.out[b, :, n:].any()
        if found.lse is not None:
            want = lse if found.lse_base == "e" else lse / math.log(2.0)
            got = found.lse[b, :, :n]
            assert torch.equal(torch.isinf(got), torch.isinf(want)), (b, got, want)
            torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=tol, atol=tol)
            assert (found.lse[b, :, n:] == float("-inf")).all()


STORAGES = ("dense", "packed", "paged", "bnhd")


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("name", list(FEATURES))
def test_golden_of_every_feature_and_storage_matches_the_row_oracle(name, storage):
    seqs = random_sequences(*LENGTHS, h=4, h_kv=2, d=8, d_v=6, seed=11, dtype=torch.float64)
    f = _features(name, len(seqs), 4, seed=5)
    call = dense_call(seqs, return_lse=True, lse_base=2 if storage == "paged" else "e", **f)
    if storage == "packed":
        call = call.packed()
    elif storage == "paged":
        call = call.paged(2, kv_layout="HND", generator=torch.Generator().manual_seed(0), fill=float("nan"))
    elif storage == "bnhd":
        call = call.with_layout("bnhd")
    found = golden_call(call, budget=4096)  # small blocks: rows and heads split
    assert found.out.dtype == torch.float64 and found.lse_base == call.lse_base
    _assert_matches_oracle(found, oracle(seqs, **_oracle_kwargs(f)), call)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(
    "name", ["plain", "causal_br", "window_left_causal", "alibi_batch_causal", "everything"]
)
def test_golden_of_a_kv_cache_call_matches_the_row_oracle(name, paged):
    seqs = random_sequences([3, 3, 3], [5, 9, 3], h=4, h_kv=1, d=8, d_v=8, seed=2, dtype=torch.float64)
    f = _features(name, len(seqs), 4, seed=1)
    call = dense_call(seqs, return_lse=True, **f).replace(q_lens=None)
    cache = call.cached(new=2, leftpad=None if paged else torch.tensor([2, 0, 1], dtype=torch.int32),
                        page_size=4 if paged else None, fill=float("nan"))  # fmt: skip
    _assert_matches_oracle(golden_call(cache), oracle(seqs, **_oracle_kwargs(f)), cache)


def test_golden_of_fp8_inputs_with_descales_matches_the_row_oracle():
    seqs = random_sequences([4, 2], [5, 6], h=4, h_kv=2, d=16, d_v=16, seed=3, dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(0)
    descales = [torch.rand(2, 2, generator=gen) + 0.5 for _ in range(3)]
    call = dense_call(seqs, causal=True, align="bottom_right", return_lse=True,
                      q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])  # fmt: skip
    found = golden_call(call)
    _assert_matches_oracle(found, oracle(seqs, causal=True, descales=descales), call)
    base = baseline_call(call)
    assert base.out.dtype == torch.bfloat16 and call.out_dtype == torch.bfloat16


def _hand(n_q, n_k, **features):
    """A call with q = 0 (every logit 0 before ALiBi) and v_j = j, one head, D = 2."""
    q = torch.zeros(1, 1, n_q, 2, dtype=torch.float64)
    k = torch.ones(1, 1, n_k, 2, dtype=torch.float64)
    v = torch.arange(n_k, dtype=torch.float64).view(1, 1, n_k, 1).expand(1, 1, n_k, 2)
    found = golden_call(AttentionCall(q=q, k=k, v=v, return_lse=True, **features))
    return found.out[0, 0, :, 0].tolist(), found.lse[0, 0].tolist()


def test_hand_computed_values():
    inf = float("-inf")
    # bottom-right causal, 2 queries and 5 keys: row 0 sees keys 0..3, row 1 all five
    out, lse = _hand(2, 5, causal=True, align="bottom_right")
    assert out == pytest.approx([1.5, 2.0]) and lse == pytest.approx([math.log(4), math.log(5)])
    # top-left: row 0 sees key 0, row 1 keys 0..1
    out, lse = _hand(2, 5, causal=True, align="top_left")
    assert out == pytest.approx([0.0, 0.5]) and lse == pytest.approx([0.0, math.log(2)])
    # 3 queries, 1 key, bottom-right causal: rows 0 and 1 see no key (0 and -inf), row 2 sees key 0
    out, lse = _hand(3, 1, causal=True, align="bottom_right")
    assert out == [0.0, 0.0, 0.0] and lse[:2] == [inf, inf] and lse[2] == pytest.approx(0.0)
    # window (1, 0) on 4 self-attention rows: row i sees keys i-1 and i
    out, _ = _hand(4, 4, window=(1, 0))
    assert out == pytest.approx([0.0, 0.5, 1.5, 2.5])
    # window (0, 2): row i sees keys i..i+2; base 2
    out, lse = _hand(4, 4, window=(0, 2), lse_base=2)
    assert out == pytest.approx([1.0, 2.0, 2.5, 3.0]) and lse == pytest.approx(
        [math.log2(3)] * 2 + [1.0, 0.0]
    )
    # a sink of logit log 3 with 3 keys: Z = 3 + 3, out = (0 + 1 + 2) / 6, LSE = log 6
    out, lse = _hand(1, 3, sinks=torch.tensor([math.log(3)]))
    assert out == pytest.approx([0.5]) and lse == pytest.approx([math.log(6)])
    # ALiBi slope ln 2, 1 query at the last key: weights 1/4, 1/2, 1 → out (0.5 + 2) / 1.75
    out, lse = _hand(1, 3, alibi_slopes=torch.tensor([math.log(2)]), align="bottom_right")
    assert out == pytest.approx([2.5 / 1.75]) and lse == pytest.approx([math.log(1.75)])


def test_softcap_caps_huge_logits_without_overflow():
    """|s / cap| = 1e4, far past exp's range: tanh caps the logits at ±cap, so out is the softmax of
    (cap, -cap, 0) (vllm 56578)."""
    cap = 2.0
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[2e4, 0.0], [-2e4, 0.0], [0.0, 0.0]]]])
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]]])
    found = golden_call(AttentionCall(q=q, k=k, v=v, scale=1.0, softcap=cap))
    w = torch.tensor([math.exp(cap), math.exp(-cap), 1.0], dtype=torch.float64)
    torch.testing.assert_close(found.out[0, 0, 0], (w / w.sum())[:2])
    assert torch.isfinite(
        baseline_call(AttentionCall(q=q.half(), k=k.half(), v=v.half(), scale=1.0, softcap=cap)).out
    ).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("kind", "n_q", "n_k", "h_kv"),
    [
        ("none", 9, 13, 2),
        ("causal", 11, 11, 1),
        ("causal", 300, 300, 2),
        ("bool", 7, 10, 4),
        ("float", 7, 10, 2),
    ],
)
def test_sdpa_shaped_calls_give_the_bits_of_sdpas_golden_and_baseline(kind, n_q, n_k, h_kv, dtype):
    """One golden: a call SDPA can express goes through the same blocks and arithmetic as
    ``golden_attention`` and ``math_attention``, bit for bit."""
    gen = torch.Generator().manual_seed(n_q)
    q = torch.randn(2, 4, n_q, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, h_kv, n_k, 16, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if kind == "bool":
        mask = torch.rand(2, 1, n_q, n_k, generator=gen) < 0.5
    elif kind == "float":
        mask = torch.randn(1, 4, n_q, n_k, generator=gen).to(dtype)
    call = AttentionCall(q=q, k=k, v=v, attn_mask=mask, causal=kind == "causal", scale=0.3)
    rep = 4 // h_kv
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    kw = {"attn_mask": mask, "is_causal": kind == "causal", "scale": 0.3}
    assert torch.equal(golden_call(call).out, golden_attention(q, ke, ve, **kw))
    if n_q < 256:  # small blocks; math_attention is one block (a long causal call's baseline is row blocks)
        assert torch.equal(
            golden_call(call, budget=20_000).out, golden_attention(q, ke, ve, budget=20_000, **kw)
        )
        assert torch.equal(baseline_call(call).out, math_attention(q, ke, ve, **kw))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_baseline_rounds_where_the_golden_does_not(dtype):
    seqs = random_sequences(*LENGTHS, h=4, h_kv=2, d=32, d_v=32, seed=4, dtype=dtype)
    call = dense_call(seqs, causal=True, align="bottom_right", softcap=3.0, return_lse=True)
    golden, base = golden_call(call), baseline_call(call)
    assert base.out.dtype == dtype and base.lse.dtype == torch.float32
    err = (base.out.double() - golden.out).abs().max().item()
    assert 0 < err < 0.05
    wide = call_reference(call, dtype=torch.float32)
    assert (wide.out.double() - golden.out).abs().max().item() < err / 10


@pytest.mark.parametrize("name", ["causal_br", "window", "softcap", "alibi_batch_causal", "sinks"])
def test_golden_gradients_of_a_call_match_autograd_through_a_tiled_implementation(name):
    """The golden's dq, dk, dv of a packed call (the row-blocked references, each block on its own
    leaves) against autograd through the online-softmax stand-in in float64 on the same sequences."""
    from lab.contracts import _attend

    seqs = random_sequences([3, 5], [6, 4], h=4, h_kv=2, d=8, d_v=8, seed=7, dtype=torch.float64)
    f = _features(name, 2, 4, seed=2)
    call = dense_call(seqs, **f)
    grad_out = torch.randn(2, 4, 5, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dq, dk, dv = call_gradients(call, grad_out, dtype=torch.float64, budget=4096)
    for b, (q, k, v) in enumerate(seqs):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        slopes = f.get("alibi_slopes")
        out, _ = _attend(
            *leaves, scale=8**-0.5, causal=f.get("causal", False), window=f.get("window", (-1, -1)),
            softcap=f.get("softcap", 0.0), slopes=None if slopes is None else slopes[b], sink=f.get("sinks"),
            wide=True,
        )  # fmt: skip
        n_q, n_k = q.shape[0], k.shape[0]
        grads = torch.autograd.grad(out, leaves, grad_out[b, :, :n_q].transpose(0, 1))
        torch.testing.assert_close(dq[b, :, :n_q].transpose(0, 1), grads[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(dk[b, :, :n_k].transpose(0, 1), grads[1], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(dv[b, :, :n_k].transpose(0, 1), grads[2], rtol=1e-9, atol=1e-10)
