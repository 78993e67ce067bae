"""Stand-ins for the attention libraries a model calls directly, on the CPU, with their exact signatures:
flash-attn 2.8 (``flash_attn``), FlashAttention-3 (``flash_attn_interface``), flash-attention 4
(``flash_attn.cute``), FlashInfer 0.6 (``flashinfer``) and PyTorch's ``varlen_attn``.

A correct stand-in delegates to the correct controls of ``lab/contracts.py`` (online softmax over key
tiles, exp2, split-KV merges: computed differently from the golden). A stand-in with :class:`Bugs`
runs :func:`attend`, plain attention one sequence at a time with the planted bugs: classes of the
mutation suite in these libraries' forms (the −5e4 sentinel, an ignored scale), those only packed,
paged and cached calls have (attention across sequences, a last page read whole, a stale cache), and
the field bugs of the features around the scores (softcap through ``exp``, a symmetric window, ALiBi
anchored top-left, K/V indexed by the query head under GQA, a sink left out)."""

from __future__ import annotations

import functools
import itertools
import math
import sys
import types
from dataclasses import dataclass

import torch

from lab import contracts
from lab.mutants import MASK_SENTINEL

__all__ = [
    "Bugs",
    "attend",
    "flash_attention_3",
    "flash_attention_4",
    "flash_attn_2",
    "flashinfer_modules",
    "install",
    "varlen_module",
]


@dataclass(frozen=True)
class Bugs:
    """Bugs a stand-in can have (all off: a correct library)."""

    cross_sequence: bool = False  # packed/batched calls: every query attends to every key of the batch
    sentinel: bool = False  # masked logits set to MASK_SENTINEL (-5e4, FlashInfer PR 4401) instead of -inf
    ignore_scale: bool = False  # an explicit softmax scale ignored
    whole_last_page: bool = False  # paged: the last page attended whole, past the sequence's length
    stale_cache: bool = False  # KV cache: attends before appending the new keys (reads stale rows)
    softcap_exp: bool = False  # softcap's tanh computed through exp: NaN once |s / cap| > 44 (vllm 56578)
    symmetric_window: bool = False  # window_size (left, right) applied as (left, left) (vllm PR 49202)
    alibi_top_left: bool = False  # ALiBi distances anchored top-left when N_q != N_k
    gqa_head_mod: bool = False  # query head h reads K/V head h % H_kv, not h // (H / H_kv) (LMCache 3092)
    sink_ignored: bool = False  # an attention sink left out of the softmax denominator
    natural_merge: bool = False  # a base-2 LSE merged as a natural log (sglang 40903)


CORRECT = Bugs()


def _tanh_through_exp(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(2 * x)  # inf once 2x > 88.7 in float32: inf / inf is NaN
    return (e - 1) / (e + 1)


def attend(q, k, v, scale=None, causal=False, mask=None, *, window=(-1, -1), softcap=0.0, alibi=None,
           sink=None, bugs=CORRECT, dropout_p=0.0):  # fmt: skip
    """One sequence: ``q (N_q, H, D)``, ``k``/``v (N_k, H_kv, D)`` → ``out (N_q, H, D_v)`` and the natural
    LSE ``(H, N_q)`` (``−inf`` for a row that sees no key): causal, windows and ALiBi anchored
    bottom-right, ``mask (N_q, N_k)`` bool (True: attend), softcap, one sink per head; dropout on the
    probabilities with torch's RNG."""
    n_q, h, d = q.shape
    n_k, h_kv = k.shape[:2]
    heads = torch.arange(h) % h_kv if bugs.gqa_head_mod else torch.arange(h) // (h // h_kv)
    k, v = k[:, heads], v[:, heads]
    scale = d**-0.5 if scale is None or bugs.ignore_scale else scale
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * (_tanh_through_exp(s / softcap) if bugs.softcap_exp else torch.tanh(s / softcap))
    offset = n_k - n_q
    i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
    dist = j - i - offset  # key minus the row's diagonal (bottom-right)
    left, right = (int(x) for x in window)
    right = left if bugs.symmetric_window and left >= 0 else right
    right = 0 if causal else right
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        keep &= dist >= -left
    if right >= 0:
        keep &= dist <= right
    if mask is not None:
        keep &= mask
    if alibi is not None:
        anchored = j - i if bugs.alibi_top_left else dist
        s = s - alibi[:, None, None] * anchored.abs()
    s = s.masked_fill(~keep, MASK_SENTINEL if bugs.sentinel else float("-inf"))
    if sink is not None and not bugs.sink_ignored:
        s = torch.cat([s, sink.to(s.dtype)[:, None, None].expand(h, n_q, 1)], dim=-1)
    empty = (s == float("-inf")).all(-1, keepdim=True)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if sink is not None and not bugs.sink_ignored:
        p = p[..., :-1]
    if dropout_p:
        p = torch.nn.functional.dropout(p, dropout_p)
    return torch.einsum("hqk,khd->qhd", p, v), lse


def _slopes(alibi_slopes, b):
    return None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])


def _dense(q, k, v, bugs, *, empty_lse=math.inf, **kw):
    """``(B, N, H, D)`` tensors one batch entry at a time: ``out (B, N_q, H, D_v)``, ``lse (B, H, N_q)``."""
    alibi = kw.pop("alibi_slopes", None)
    parts = [attend(q[b], k[b], v[b], alibi=_slopes(alibi, b), bugs=bugs, **kw) for b in range(q.shape[0])]
    lse = torch.stack([s for _, s in parts])
    return torch.stack([o for o, _ in parts]), lse.masked_fill(lse == -math.inf, empty_lse)


def _per_sequence(q, k, v, cu_q, cu_k, bugs: Bugs, alibi=None, **kw):
    """Each packed sequence attended on its own (or, with the cross-sequence bug, the whole pack):
    ``out (total_q, H, D_v)``, ``lse (H, total_q)``."""
    if bugs.cross_sequence:
        return attend(q, k, v, bugs=bugs, **kw)
    parts = [
        attend(q[a:z], k[c:e], v[c:e], alibi=_slopes(alibi, b), bugs=bugs, **kw)
        for b, ((a, z), (c, e)) in enumerate(
            zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=False)
        )
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts], dim=1)


def _module(name: str, *functions) -> types.ModuleType:
    module = types.ModuleType(name)
    for fn in functions:
        fn.__module__ = name
        setattr(module, fn.__name__, fn)
    return module


def flash_attn_2(bugs: Bugs = CORRECT) -> types.ModuleType:
    """A ``flash_attn`` module with flash-attn 2's entry points (signatures of 2.8)."""
    correct = bugs == CORRECT

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False,
                        return_attn_probs=False):  # fmt: skip
        if correct and not dropout_p:
            return contracts.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap,
                                             alibi_slopes, deterministic, return_attn_probs)  # fmt: skip
        out, lse = _dense(q, k, v, bugs, scale=softmax_scale, causal=causal, window=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p)  # fmt: skip
        return (out, lse, None) if return_attn_probs else out

    def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False):  # fmt: skip
        return flash_attn_func(*qkv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs)  # fmt: skip

    def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, deterministic=False,
                                 return_attn_probs=False):  # fmt: skip
        return flash_attn_func(q, *kv.unbind(2), dropout_p, softmax_scale, causal, window_size, softcap,
                               alibi_slopes, deterministic, return_attn_probs)  # fmt: skip

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None):  # fmt: skip
        if correct and not dropout_p:
            return contracts.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
            )  # fmt: skip
        if block_table is not None:  # paged: (num_blocks, page_size, H_kv, D)
            page = k.shape[1]
            lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
            ks, vs = [], []
            for i, n in enumerate(lengths):
                blocks = block_table[i, : -(-n // page)]
                keep = len(blocks) * page if bugs.whole_last_page else n
                ks.append(k[blocks].flatten(0, 1)[:keep])
                vs.append(v[blocks].flatten(0, 1)[:keep])
            cu_seqlens_k = torch.tensor([0, *torch.tensor([len(t) for t in ks]).cumsum(0).tolist()])
            k, v = torch.cat(ks), torch.cat(vs)
        out, lse = _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, bugs, alibi_slopes, scale=softmax_scale,
                                 causal=causal, window=window_size, softcap=softcap,
                                 dropout_p=dropout_p)  # fmt: skip
        return (out, lse.masked_fill(lse == -math.inf, math.inf), None) if return_attn_probs else out

    def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False):  # fmt: skip
        q, k, v = qkv.unbind(1)
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                      softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic,
                                      return_attn_probs)  # fmt: skip

    def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                        softcap=0.0, alibi_slopes=None, deterministic=False,
                                        return_attn_probs=False):  # fmt: skip
        k, v = kv.unbind(1)
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, return_attn_probs)  # fmt: skip

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                                block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):  # fmt: skip
        """``q (B, N_q, H, D)``; the cache ``(B_cache, S, H_kv, D)`` (rows ``cache_batch_idx``) or, with
        ``block_table (B, max_blocks)``, ``(num_blocks, page_size, H_kv, D)``; ``k``/``v (B, N_new, H_kv,
        D)`` written into the cache in place at ``cache_seqlens``, then attended with it."""
        if correct:
            return contracts.flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                alibi_slopes,
                num_splits, return_softmax_lse,
            )  # fmt: skip
        b, slots = q.shape[0], k_cache.shape[1]
        rows = list(range(b)) if cache_batch_idx is None else cache_batch_idx.tolist()
        if block_table is not None:
            slots *= block_table.shape[1]
        lengths = [slots] * b if cache_seqlens is None else cache_seqlens.tolist()

        def where(i, p):  # the cache entry of position p of sequence i
            if block_table is None:
                return rows[i], p
            return int(block_table[i, p // k_cache.shape[1]]), p % k_cache.shape[1]

        def attend_cached(i, n):
            keys = torch.stack([k_cache[where(i, p)] for p in range(n)])  # (n, H_kv, D)
            values = torch.stack([v_cache[where(i, p)] for p in range(n)])
            return attend(q[i], keys, values, softmax_scale, causal, bugs=bugs)[0]

        n_new = 0 if k is None else k.shape[1]
        if bugs.stale_cache:
            outs = [attend_cached(i, lengths[i] + n_new) for i in range(b)]
        for i in range(b):
            for j in range(n_new):
                k_cache[where(i, lengths[i] + j)] = k[i, j]
                v_cache[where(i, lengths[i] + j)] = v[i, j]
        if not bugs.stale_cache:
            outs = [attend_cached(i, lengths[i] + n_new) for i in range(b)]
        return torch.stack(outs)

    return _module(
        "flash_attn", flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
        flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func,
        flash_attn_with_kvcache,
    )  # fmt: skip


def flash_attention_3(bugs: Bugs = CORRECT, *, returns_lse: bool = False) -> types.ModuleType:
    """A ``flash_attn_interface`` module (FlashAttention-3): no dropout, ``seqused_q``/``seqused_k``
    before ``softmax_scale`` in the varlen call, ``num_heads_q`` for a ``(B, N, H + 2 H_kv, D)`` qkv, the
    LSE ``−inf`` for a row without keys; ``returns_lse``: ``(out, lse)`` always, as its first releases
    returned."""

    def result(out, lse, asked):
        return (out, lse) if returns_lse or asked else out

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0,
                        return_attn_probs=False):  # fmt: skip
        if bugs == CORRECT:
            out, lse = contracts.fa3_flash_attn_func(
                q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                attention_chunk, softcap, num_splits, pack_gqa, deterministic, sm_margin, True,
            )  # fmt: skip
        else:
            out, lse = _dense(q, k, v, bugs, empty_lse=-math.inf, scale=softmax_scale, causal=causal,
                              window=window_size, softcap=softcap)  # fmt: skip
        return result(out, lse, return_attn_probs)

    def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                                  v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                                  deterministic=False, num_heads_q=None, sm_margin=0,
                                  return_attn_probs=False):  # fmt: skip
        if qkv.dim() == 5:
            q, k, v = qkv.unbind(2)
        else:
            h_kv = (qkv.shape[2] - num_heads_q) // 2
            q, k, v = qkv.split([num_heads_q, h_kv, h_kv], dim=2)
        return flash_attn_func(q, k, v, softmax_scale, causal, window_size=window_size, softcap=softcap,
                               return_attn_probs=return_attn_probs)  # fmt: skip

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, qv=None,
                               q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
                               attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                               deterministic=False, sm_margin=0, return_attn_probs=False):  # fmt: skip
        if seqused_k is not None:  # each sequence uses its first seqused_k keys
            starts = cu_seqlens_k[:-1].tolist()
            keep = torch.cat(
                [torch.arange(a, a + int(n)) for a, n in zip(starts, seqused_k.tolist(), strict=True)]
            )
            cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0), (1, 0)).to(torch.int32)
            k, v = k[keep], v[keep]
        if bugs == CORRECT:
            out, lse, _ = contracts.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, softmax_scale, causal,
                window_size, softcap, None, False, True,
            )  # fmt: skip
            lse = lse.masked_fill(lse == math.inf, -math.inf)
        else:
            out, lse = _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, bugs, scale=softmax_scale,
                                     causal=causal, window=window_size, softcap=softcap)  # fmt: skip
        return result(out, lse, return_attn_probs)

    return _module("flash_attn_interface", flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func)


def flash_attention_4(bugs: Bugs = CORRECT) -> types.ModuleType:
    """A ``flash_attn.cute`` module (flash-attention 4's ``flash_attn/cute/interface.py``):
    ``flash_attn_func`` with ``window_size=(None, None)``, ``learnable_sink (H,)`` and ``return_lse``,
    returning ``(out, lse)`` (``lse`` None unless asked); correct: an online softmax over key tiles with
    the sink in its running sum (``lab.contracts``)."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                        learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                        mask_mod=None,
                        full_block_cnt=None, full_block_idx=None, mask_block_cnt=None, mask_block_idx=None,
                        block_size=None, return_lse=False):  # fmt: skip
        window = tuple(-1 if x is None else int(x) for x in window_size)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        kw = {"causal": causal, "window": window, "softcap": softcap}
        if bugs == CORRECT:  # an online softmax whose running sum starts at the sink
            parts = [
                contracts._attend(q[b], k[b], v[b], scale=scale, slopes=None, sink=learnable_sink, **kw)
                for b in range(q.shape[0])
            ]
        else:
            parts = [
                attend(q[b], k[b], v[b], scale, sink=learnable_sink, bugs=bugs, **kw)
                for b in range(q.shape[0])
            ]
        out, lse = torch.stack([o for o, _ in parts]).to(q.dtype), torch.stack([s for _, s in parts])
        return out, (lse if return_lse else None)

    return _module("flash_attn.cute", flash_attn_func)


def varlen_module(bugs: Bugs = CORRECT) -> types.ModuleType:
    """A ``torch.nn.attention.varlen`` module whose ``varlen_attn`` has torch 2.13's exact signature (its
    own raises NotImplementedError on the CPU): packed sequences, causal as ``window_size=(-1, 0)``, the
    LSE ``(H, total_q)`` on ``return_aux=AuxRequest(lse=True)``."""
    from torch.nn.attention.varlen import AuxRequest

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                    num_splits=None):  # fmt: skip
        causal = tuple(window_size) == (-1, 0)
        if bugs == CORRECT:
            out, lse, _ = contracts.flash_attn_varlen_func(
                query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, scale, causal, tuple(window_size),
                return_attn_probs=True,
            )  # fmt: skip
        else:
            out, lse = _per_sequence(query, key, value, cu_seq_q, cu_seq_k, bugs, scale=scale, causal=causal,
                                     window=window_size)  # fmt: skip
            lse = lse.masked_fill(lse == -math.inf, math.inf)
        return (out, lse.detach()) if return_aux is not None and return_aux.lse else out  # (no LSE gradient)

    module = _module("torch.nn.attention.varlen", varlen_attn)
    module.AuxRequest = AuxRequest
    return module


def _nhd(t, layout):
    return t if layout == "NHD" else t.transpose(0, 1)


def _pages(cache, layout):
    """``(k_cache, v_cache)`` as ``(num_pages, page_size, H_kv, D)`` each."""
    k, v = cache if isinstance(cache, tuple | list) else cache.unbind(1)
    return (k, v) if layout == "NHD" else (k.transpose(1, 2), v.transpose(1, 2))


def _base2(lse):
    """A natural ``(H, N)`` LSE as FlashInfer returns it: ``(N, H)`` in base 2."""
    return (lse * math.log2(math.e)).transpose(0, 1)


def flashinfer_modules(bugs: Bugs = CORRECT) -> dict[str, types.ModuleType]:
    """``flashinfer``, ``flashinfer.prefill``, ``flashinfer.decode`` and ``flashinfer.cascade``
    (FlashInfer 0.6's signatures for the single prefill/decode functions, the three batch wrappers and
    ``merge_state``), the same objects in each, as the package re-exports them. No autograd (FlashInfer
    has no backward); LSEs in base 2."""

    @torch.no_grad()
    def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None,
                                     custom_mask=None, packed_custom_mask=None, causal=False, kv_layout="NHD",
                                     pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                                     window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                     backend="auto", return_lse=False):  # fmt: skip
        use_causal = causal and custom_mask is None
        out, lse = attend(q, _nhd(k, kv_layout), _nhd(v, kv_layout), sm_scale, use_causal, custom_mask,
                          window=(window_left, -1), softcap=logits_soft_cap or 0.0, bugs=bugs)  # fmt: skip
        return (out, _base2(lse)) if return_lse else out

    @torch.no_grad()
    def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE",
                                    use_tensor_cores=False, q_scale=None, k_scale=None, v_scale=None,
                                    window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                    rope_theta=None, return_lse=False):  # fmt: skip
        out, lse = attend(q[None], _nhd(k, kv_layout), _nhd(v, kv_layout), sm_scale, window=(window_left, -1),
                          softcap=logits_soft_cap or 0.0, bugs=bugs)  # fmt: skip
        return (out[0], _base2(lse)[0]) if return_lse else out[0]

    def batch(q, keys, values, qo, custom, causal, scale, sinks=None):
        """Each request's queries against its own keys (lists of per-request key/value tensors)."""
        if bugs.cross_sequence:
            out, lse = attend(q, torch.cat(keys), torch.cat(values), scale, sink=sinks, bugs=bugs)
            return out, _base2(lse)
        outs, lses, offset = [], [], 0
        for i, (a, b) in enumerate(itertools.pairwise(qo.tolist())):
            n_q, n_k = b - a, keys[i].shape[0]
            mask = None
            if custom is not None:
                mask = custom[offset : offset + n_q * n_k].view(n_q, n_k)
                offset += n_q * n_k
            o, s = attend(
                q[a:b], keys[i], values[i], scale, causal and custom is None, mask, sink=sinks, bugs=bugs
            )
            outs.append(o)
            lses.append(s)
        return torch.cat(outs), _base2(torch.cat(lses, dim=1))

    def paged_keys(cache, layout, indptr, indices, last_page_len):
        k_cache, v_cache = _pages(cache, layout)
        page = k_cache.shape[1]
        keys, values = [], []
        for i, (a, b) in enumerate(itertools.pairwise(indptr.tolist())):
            pages = indices[a:b]
            n = (b - a - 1) * page + int(last_page_len[i]) if b > a else 0
            if bugs.whole_last_page:
                n = (b - a) * page
            keys.append(k_cache[pages].flatten(0, 1)[:n])
            values.append(v_cache[pages].flatten(0, 1)[:n])
        return keys, values

    def result(found, return_lse, out=None):
        if out is not None:
            out.copy_(found[0])
            found = (out, found[1])
        return found if return_lse else found[0]

    class _Wrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, backend="auto"):
            self._kv_layout = kv_layout

    class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
                 custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
                 use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None,
                 rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
                 non_blocking=True):  # fmt: skip
            self._qo, self._kv, self._custom = qo_indptr.cpu(), kv_indptr.cpu(), custom_mask
            self._causal, self._sm_scale = causal, sm_scale

        @torch.no_grad()
        def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None,
                lse=None, return_lse=False, enable_pdl=None):  # fmt: skip
            k, v = _nhd(k, self._kv_layout), _nhd(v, self._kv_layout)
            kv = self._kv.tolist()
            keys = [k[a:b] for a, b in itertools.pairwise(kv)]
            values = [v[a:b] for a, b in itertools.pairwise(kv)]
            found = batch(q, keys, values, self._qo, self._custom, self._causal, self._sm_scale)
            return result(found, return_lse, out)

        run_return_lse = functools.partialmethod(run, return_lse=True)

        def forward(self, q, k, v, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                    window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                    rope_theta=None):  # fmt: skip
            """Deprecated (the ragged wrapper's): sets the settings (kept for later runs), then runs."""
            self._causal, self._sm_scale = causal, sm_scale
            return self.run(q, k, v)

    class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                 num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None,
                 packed_custom_mask=None, causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                 sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                 q_data_type="float16", kv_data_type=None, non_blocking=True):  # fmt: skip
            self._qo = qo_indptr.cpu()
            self._table = (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
            self._custom, self._causal, self._sm_scale = custom_mask, causal, sm_scale

        @torch.no_grad()
        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False, enable_pdl=None, window_left=None, sinks=None):  # fmt: skip
            keys, values = paged_keys(paged_kv_cache, self._kv_layout, *self._table)
            found = batch(q, keys, values, self._qo, self._custom, self._causal, self._sm_scale, sinks)
            return result(found, return_lse, out)

    class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 *deprecated_positional_args, **kwargs):  # fmt: skip
            self._table, self._sm_scale = (indptr, indices, last_page_len), kwargs.get("sm_scale")

        @torch.no_grad()
        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False, enable_pdl=None, window_left=None, sinks=None,
                q_len_per_req=None):  # fmt: skip
            keys, values = paged_keys(paged_kv_cache, self._kv_layout, *self._table)
            qo = torch.arange(q.shape[0] + 1)
            return result(batch(q, keys, values, qo, None, False, self._sm_scale, sinks), return_lse, out)

    def merge_state(v_a, s_a, v_b, s_b):
        if not bugs.natural_merge:
            return contracts.merge_state(v_a, s_a, v_b, s_b)
        s_max = torch.maximum(s_a, s_b)  # the bug: exp and log where the LSEs are base 2
        w_a, w_b = torch.exp(s_a - s_max), torch.exp(s_b - s_max)
        v = (w_a[..., None] * v_a.float() + w_b[..., None] * v_b.float()) / (w_a + w_b)[..., None]
        return v.to(v_a.dtype), torch.log(w_a + w_b) + s_max

    def merge_states(v, s):
        state_v, state_s = v[:, 0], s[:, 0]
        for i in range(1, v.shape[1]):
            state_v, state_s = merge_state(state_v, state_s, v[:, i], s[:, i])
        return state_v, state_s

    def merge_state_in_place(v, s, v_other, s_other, mask=None):
        merged_v, merged_s = merge_state(v, s, v_other, s_other)
        v.copy_(merged_v)
        s.copy_(merged_s)

    modules = {
        "flashinfer.prefill": _module(
            "flashinfer.prefill", single_prefill_with_kv_cache, BatchPrefillWithRaggedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper,
        ),
        "flashinfer.decode": _module(
            "flashinfer.decode", single_decode_with_kv_cache, BatchDecodeWithPagedKVCacheWrapper
        ),
        "flashinfer.cascade": _module("flashinfer.cascade", merge_state, merge_states, merge_state_in_place),
    }  # fmt: skip
    partial = functools.partial(single_prefill_with_kv_cache, return_lse=True)
    modules["flashinfer.prefill"].single_prefill_with_kv_cache_return_lse = partial
    package = types.ModuleType("flashinfer")
    for name, module in modules.items():
        setattr(package, name.rpartition(".")[2], module)
        for attr, value in vars(module).items():
            if not attr.startswith("__"):
                setattr(package, attr, value)
    return {"flashinfer": package, **modules}


def install(monkeypatch, modules: dict[str, types.ModuleType]) -> None:
    """Put stand-in modules into ``sys.modules`` for one test."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
