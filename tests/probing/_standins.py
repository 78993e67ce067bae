"""Stand-ins for flash-attn 2, FlashAttention-3 and FlashInfer on the CPU: the libraries' signatures (as
of flash-attn 2.8, FlashAttention-3's ``hopper/flash_attn_interface.py`` and FlashInfer 0.6) and their
semantics (layouts, bottom-right causal, grouped key/value heads, packed sequences, page tables),
written with plain torch ops one sequence at a time, plus the bugs the tests plant in them: two classes
of the mutation suite (:mod:`lab.mutants`: the −5e4 sentinel, an ignored scale) in these
libraries' call forms, and two that only packed and paged forms have (attention across packed
sequences, a last page read whole)."""

from __future__ import annotations

import functools
import itertools
import sys
import types
from dataclasses import dataclass

import torch

from lab.mutants import MASK_SENTINEL

__all__ = ["Bugs", "attend", "flash_attention_3", "flash_attn_2", "flashinfer_modules", "install"]


@dataclass(frozen=True)
class Bugs:
    """Bugs a stand-in can have (all off: a correct library)."""

    cross_sequence: bool = False  # packed/batched calls: every query attends to every key of the batch
    sentinel: bool = False  # masked logits set to MASK_SENTINEL (-5e4, FlashInfer PR 4401) instead of -inf
    ignore_scale: bool = False  # an explicit softmax scale ignored
    whole_last_page: bool = False  # paged: the last page attended whole, past the sequence's length
    stale_cache: bool = False  # KV cache: attends before appending the new keys (reads stale rows)


def attend(q, k, v, scale=None, causal=False, mask=None, *, fill=float("-inf"), dropout_p=0.0):
    """``q (N_q, H, D)``, ``k``/``v (N_k, H_kv, D)`` → ``(N_q, H, D_v)``: causal aligned bottom-right,
    ``mask (N_q, N_k)`` bool (True: attend), masked logits set to ``fill``; dropout on the
    probabilities with torch's RNG."""
    h, h_kv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // h_kv, dim=1), v.repeat_interleave(h // h_kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if causal:
        allowed = allowed.tril(k.shape[0] - q.shape[0])
    if mask is not None:
        allowed = allowed & mask
    p = scores.masked_fill(~allowed, fill).softmax(-1)
    if dropout_p:
        p = torch.nn.functional.dropout(p, dropout_p)
    return torch.einsum("hqk,khd->qhd", p, v)


def _fill(bugs: Bugs) -> float:
    return MASK_SENTINEL if bugs.sentinel else float("-inf")


def _per_sequence(q, k, v, cu_q, cu_k, bugs: Bugs, **kw):
    """Each packed sequence attended on its own (or, with the cross-sequence bug, the whole pack)."""
    if bugs.cross_sequence:
        return attend(q, k, v, **kw)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    outs = [
        attend(q[a:b], k[c:d], v[c:d], **kw)
        for (a, b), (c, d) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k), strict=False)
    ]
    return torch.cat(outs)


def flash_attn_2(bugs: Bugs = Bugs()) -> types.ModuleType:
    """A ``flash_attn`` module with flash-attn 2's entry points (signatures of 2.8)."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False,
                        return_attn_probs=False):  # fmt: skip
        scale = None if bugs.ignore_scale else softmax_scale
        return torch.stack(
            [attend(q[i], k[i], v[i], scale, causal, dropout_p=dropout_p) for i in range(q.shape[0])]
        )

    def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False):  # fmt: skip
        return flash_attn_func(*qkv.unbind(2), dropout_p, softmax_scale, causal)

    def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, deterministic=False,
                                 return_attn_probs=False):  # fmt: skip
        return flash_attn_func(q, *kv.unbind(2), dropout_p, softmax_scale, causal)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None):  # fmt: skip
        scale = None if bugs.ignore_scale else softmax_scale
        if block_table is not None:  # paged: (num_blocks, page_size, H_kv, D)
            page = k.shape[1]
            lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
            ks, vs = [], []
            for i, n in enumerate(lengths):
                blocks = block_table[i, : -(-n // page)]
                keep = len(blocks) * page if bugs.whole_last_page else n
                ks.append(k[blocks].flatten(0, 1)[:keep])
                vs.append(v[blocks].flatten(0, 1)[:keep])
            cu_k = torch.tensor([0, *torch.tensor([len(t) for t in ks]).cumsum(0).tolist()])
            k, v, cu_seqlens_k = torch.cat(ks), torch.cat(vs), cu_k
        return _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, bugs, scale=scale, causal=causal,
                             dropout_p=dropout_p)  # fmt: skip

    def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False):  # fmt: skip
        q, k, v = qkv.unbind(1)
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                      softmax_scale, causal)  # fmt: skip

    def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                        softcap=0.0, alibi_slopes=None, deterministic=False,
                                        return_attn_probs=False):  # fmt: skip
        k, v = kv.unbind(1)
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p, softmax_scale, causal)  # fmt: skip

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                                block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):  # fmt: skip
        """``q (B, N_q, H, D)``; the cache ``(B_cache, S, H_kv, D)`` (rows ``cache_batch_idx``) or, with
        ``block_table (B, max_blocks)``, ``(num_blocks, page_size, H_kv, D)``; ``k``/``v (B, N_new, H_kv,
        D)`` written into the cache in place at ``cache_seqlens``, then attended with it."""
        scale = None if bugs.ignore_scale else softmax_scale
        b, slots = q.shape[0], k_cache.shape[1]
        rows = list(range(b)) if cache_batch_idx is None else cache_batch_idx.tolist()
        if block_table is not None:
            slots *= block_table.shape[1]
        if cache_seqlens is None:
            lengths = [slots] * b
        elif isinstance(cache_seqlens, int):
            lengths = [cache_seqlens] * b
        else:
            lengths = cache_seqlens.tolist()

        def where(i, p):  # the cache entry of position p of sequence i
            if block_table is None:
                return rows[i], p
            page = k_cache.shape[1]
            return int(block_table[i, p // page]), p % page

        def attend_cached(i, n):
            keys = torch.stack([k_cache[where(i, p)] for p in range(n)])  # (n, H_kv, D)
            values = torch.stack([v_cache[where(i, p)] for p in range(n)])
            return attend(q[i], keys, values, scale, causal)

        n_new = 0 if k is None else k.shape[1]
        if bugs.stale_cache:
            outs = [attend_cached(i, lengths[i] + n_new) for i in range(b)]
        for i in range(b):
            for j in range(n_new):
                k_cache[where(i, lengths[i] + j)] = k[i, j]
                v_cache[where(i, lengths[i] + j)] = v[i, j]
        if not bugs.stale_cache:
            outs = [attend_cached(i, lengths[i] + n_new) for i in range(b)]
        out = torch.stack(outs)
        return (out, torch.zeros(b, q.shape[2], q.shape[1])) if return_softmax_lse else out

    library = types.ModuleType("flash_attn")
    for fn in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
               flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func,
               flash_attn_with_kvcache):  # fmt: skip
        fn.__module__ = "flash_attn.flash_attn_interface"
        setattr(library, fn.__name__, fn)
    return library


def flash_attention_3(bugs: Bugs = Bugs(), *, returns_lse: bool = False) -> types.ModuleType:
    """A ``flash_attn_interface`` module (FlashAttention-3): no dropout, ``seqused_q``/``seqused_k``
    before ``softmax_scale`` in the varlen call, ``num_heads_q`` for a ``(B, N, H + 2 H_kv, D)`` qkv;
    ``returns_lse``: ``(out, lse)`` as its first releases returned."""

    def result(out, q):
        return (out, torch.zeros(q.shape[:-1])) if returns_lse else out

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0,
                        return_attn_probs=False):  # fmt: skip
        scale = None if bugs.ignore_scale else softmax_scale
        out = torch.stack([attend(q[i], k[i], v[i], scale, causal) for i in range(q.shape[0])])
        return result(out, q)

    def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                                  v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                                  deterministic=False, num_heads_q=None, sm_margin=0,
                                  return_attn_probs=False):  # fmt: skip
        if qkv.dim() == 5:
            q, k, v = qkv.unbind(2)
        else:
            h_kv = (qkv.shape[2] - num_heads_q) // 2
            q, k, v = qkv.split([num_heads_q, h_kv, h_kv], dim=2)
        return flash_attn_func(q, k, v, softmax_scale, causal)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, qv=None,
                               q_descale=None, k_descale=None, v_descale=None, window_size=(-1, -1),
                               attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                               deterministic=False, sm_margin=0, return_attn_probs=False):  # fmt: skip
        scale = None if bugs.ignore_scale else softmax_scale
        out = _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, bugs, scale=scale, causal=causal)
        return result(out, q)

    library = types.ModuleType("flash_attn_interface")
    for fn in (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func):
        fn.__module__ = "flash_attn_interface"
        setattr(library, fn.__name__, fn)
    return library


def _lse(q, k, scale):
    h = q.shape[1]
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    return (torch.einsum("qhd,khd->qhk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)).logsumexp(
        -1
    )


def _nhd(t, layout):
    return t if layout == "NHD" else t.transpose(0, 1)


def _pages(cache, layout):
    """``(k_cache, v_cache)`` as ``(num_pages, page_size, H_kv, D)`` each."""
    k, v = cache if isinstance(cache, tuple | list) else cache.unbind(1)
    return (k, v) if layout == "NHD" else (k.transpose(1, 2), v.transpose(1, 2))


def flashinfer_modules(bugs: Bugs = Bugs()) -> dict[str, types.ModuleType]:
    """``flashinfer``, ``flashinfer.prefill`` and ``flashinfer.decode`` (FlashInfer 0.6's signatures
    for the single prefill/decode functions and the three batch wrappers), the same objects in
    each, as the package re-exports them. No autograd (FlashInfer has no backward)."""
    fill = _fill(bugs)

    @torch.no_grad()
    def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None, o_dtype=None,
                                     custom_mask=None, packed_custom_mask=None, causal=False, kv_layout="NHD",
                                     pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                                     window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                     backend="auto", return_lse=False):  # fmt: skip
        k, v = _nhd(k, kv_layout), _nhd(v, kv_layout)
        use_causal = causal and custom_mask is None
        out = attend(q, k, v, sm_scale, use_causal, custom_mask, fill=fill)
        return (out, _lse(q, k, sm_scale)) if return_lse else out

    @torch.no_grad()
    def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE",
                                    use_tensor_cores=False, q_scale=None, k_scale=None, v_scale=None,
                                    window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                    rope_theta=None, return_lse=False):  # fmt: skip
        out = attend(q[None], _nhd(k, kv_layout), _nhd(v, kv_layout), sm_scale, fill=fill)[0]
        return (out, _lse(q[None], _nhd(k, kv_layout), sm_scale)[0]) if return_lse else out

    def batch(q, keys, values, qo, custom, causal, scale):
        """Each request's queries against its own keys (lists of per-request key/value tensors)."""
        if bugs.cross_sequence:
            return attend(q, torch.cat(keys), torch.cat(values), scale, fill=fill)
        outs, offset = [], 0
        qo = qo.tolist()
        for i, (a, b) in enumerate(itertools.pairwise(qo)):
            n_q, n_k = b - a, keys[i].shape[0]
            mask = None
            if custom is not None:
                mask = custom[offset : offset + n_q * n_k].view(n_q, n_k)
                offset += n_q * n_k
            outs.append(attend(q[a:b], keys[i], values[i], scale, causal and custom is None, mask, fill=fill))
        return torch.cat(outs)

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
            result = batch(q, keys, values, self._qo, self._custom, self._causal, self._sm_scale)
            return (result, torch.zeros(q.shape[:2])) if return_lse else result

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
            self._qo, self._table = (
                qo_indptr.cpu(),
                (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len),
            )
            self._custom, self._causal, self._sm_scale = custom_mask, causal, sm_scale

        @torch.no_grad()
        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
                return_lse=False, enable_pdl=None, window_left=None, sinks=None):  # fmt: skip
            keys, values = paged_keys(paged_kv_cache, self._kv_layout, *self._table)
            return batch(q, keys, values, self._qo, self._custom, self._causal, self._sm_scale)

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
            result = batch(q, keys, values, qo, None, False, self._sm_scale)
            if out is not None:
                out.copy_(result)
                return out
            return result

    prefill, decode, package = (
        types.ModuleType(n) for n in ("flashinfer.prefill", "flashinfer.decode", "flashinfer")
    )
    for module, objects in (
        (prefill, (single_prefill_with_kv_cache, BatchPrefillWithRaggedKVCacheWrapper,
                   BatchPrefillWithPagedKVCacheWrapper)),
        (decode, (single_decode_with_kv_cache, BatchDecodeWithPagedKVCacheWrapper)),
    ):  # fmt: skip
        for obj in objects:
            obj.__module__ = module.__name__
            setattr(module, obj.__name__, obj)
            setattr(package, obj.__name__, obj)
    partial = functools.partial(single_prefill_with_kv_cache, return_lse=True)
    prefill.single_prefill_with_kv_cache_return_lse = package.single_prefill_with_kv_cache_return_lse = (
        partial
    )
    package.prefill, package.decode = prefill, decode
    return {"flashinfer": package, "flashinfer.prefill": prefill, "flashinfer.decode": decode}


def install(monkeypatch, modules: dict[str, types.ModuleType]) -> None:
    """Put stand-in modules into ``sys.modules`` for one test."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
