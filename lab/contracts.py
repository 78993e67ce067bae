"""Correct stand-ins of real kernels, with their exact signatures and conventions, in plain PyTorch.

They are the controls that checks of the new contracts must pass (``flashprobe.kernels.contract``):
one per api, each computed differently from the golden (one softmax over the whole score matrix in
float64, :func:`flashprobe.kernels.math.golden_call`):

* :func:`flash_attn_func` (flash-attn 2.8): online softmax over key tiles, fp32 statistics and
  accumulator, the output rescaled as each tile raises the row's maximum (FlashAttention-2).
* :func:`flash_attn_varlen_func` (flash-attn 2.8, with ``block_table``): the same with ``exp2`` on scores
  in ``log2`` units (the base-2 softmax kernels run), the LSE converted to base e on return.
* :func:`flash_attn_with_kvcache` (flash-attn 2.8): the new keys written into the cache in place, then
  split-KV: the keys cut into ``num_splits`` chunks, each a partial output and LSE, merged through
  their LSEs.
* :func:`merge_state` (FlashInfer): the base-2 merge of ``state.cuh``.
* :func:`fa3_flash_attn_func` (FlashAttention-3's ``flash_attn_func``): FP8 inputs with ``(B, H_kv)``
  descales, bfloat16 output; :func:`fa3_pcast_flash_attn_func` the same with P cast to E4M3 after
  FlashAttention-3's ``2^8`` prescale before ``P·V`` (the row sum from the unrounded P), at every
  input dtype.

Each function is a method of a class whose steps are methods too (:class:`FlashAttn`,
:class:`MergeState`), so a planted bug of the mutation suite (:mod:`lab.mutants`) is a subclass that
overrides the one step it breaks.

Conventions are the libraries' (``flashprobe/kernels/call.py`` lists the sources): ``(B, N, H, D)``
and packed ``(total, H, D)`` tensors, causal, windows and ALiBi anchored bottom-right, the LSE
``(B, H, N_q)`` dense and ``(H, total_q)`` packed, ``+inf`` for a row that sees no key (flash-attn 2;
``−inf`` for FlashAttention-3), FlashInfer's LSE in base 2. Malformed index arguments are refused
with ``RuntimeError``, as the libraries' checks do. :data:`CONTROLS` registers them
(:func:`register_controls`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from flashprobe.kernels import KernelCapabilities, register_kernel

__all__ = [
    "CONTROLS",
    "FA3",
    "FlashAttn",
    "MergeState",
    "fa3_flash_attn_func",
    "fa3_pcast_flash_attn_func",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "merge_state",
    "register_controls",
]

_LOG2E = math.log2(math.e)
_INF = float("inf")
#: keys per tile of the online softmax
TILE = 16
#: E4M3's largest value, and FlashAttention-3's prescale of P before its cast to E4M3
E4M3_MAX, P_PRESCALE = 448.0, 256.0


def _refuse(ok: bool, text: str) -> None:
    if not ok:
        raise RuntimeError(text)


def _slopes(alibi_slopes: torch.Tensor | None, b: int) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    return alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]


class FlashAttn:
    """flash-attn 2.8's ``flash_attn_func``, ``flash_attn_varlen_func`` (with ``block_table``) and
    ``flash_attn_with_kvcache`` (without rotary embeddings) in plain PyTorch, one step per method.

    Attributes:
        tile: keys per tile of the online softmax.
        splits: the KV cache's split-KV chunks when ``num_splits=0``.
        empty_lse: the LSE of a row that sees no key (flash-attn 2: ``+inf``).
    """

    tile = TILE
    splits = 3
    empty_lse = _INF

    # ---- the steps a planted bug overrides ------------------------------------------------------

    def kv_heads(self, h: int, h_kv: int, device: torch.device) -> torch.Tensor:
        """The key/value head of each query head: ``h // (H / H_kv)``."""
        return torch.arange(h, device=device) // (h // h_kv)

    def distance(self, n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
        """``(n_q, n_k)`` key minus the row's diagonal, anchored bottom-right: ``j − i − (n_k − n_q)``."""
        return (
            torch.arange(n_k, device=device)[None, :]
            - torch.arange(n_q, device=device)[:, None]
            - (n_k - n_q)
        )

    def keep(self, dist: torch.Tensor, causal: bool, window: tuple[int, int]) -> torch.Tensor:
        """``(n_q, n_k)`` the keys each row keeps: ``−left ≤ dist ≤ right`` (``right = 0`` when causal)."""
        left, right = window
        right = 0 if causal else right
        keep = torch.ones_like(dist, dtype=torch.bool)
        if left >= 0:
            keep &= dist >= -left
        if right >= 0:
            keep &= dist <= right
        return keep

    def alibi(self, slopes: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
        """``(H, n_q, n_k)`` the ALiBi bias ``−slope · |j − i − (n_k − n_q)|``."""
        return -slopes.view(-1, 1, 1) * self.distance(n_q, n_k, slopes.device).abs()

    def cap(self, s: torch.Tensor, softcap: float) -> torch.Tensor:
        """Softcapped scores ``softcap · tanh(s / softcap)``."""
        return softcap * torch.tanh(s / softcap)

    def new_max(self, m: torch.Tensor, tile_max: torch.Tensor) -> torch.Tensor:
        """The running max after a tile: the larger of the two."""
        return torch.maximum(m, tile_max)

    def pv(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``P·V`` of one tile (``p (H, n_q, tile)`` in the accumulator's dtype)."""
        return p @ v

    def store(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The output ``(…, n_q, H, D_v)`` as stored, in ``dtype``."""
        return out.to(dtype)

    def lse_out(self, lse: torch.Tensor) -> torch.Tensor:
        """The LSE as returned: rows without keys ``empty_lse``."""
        return lse.masked_fill(lse == -_INF, self.empty_lse)

    def sequences(self, cu: torch.Tensor, total: int, name: str) -> list[tuple[int, int]]:
        """``(start, end)`` of each packed sequence, refusing offsets that are not ``0 ≤ … ≤ total``,
        non-decreasing."""
        _refuse(cu.dtype == torch.int32 and cu.dim() == 1, f"{name} must be int32 (batch_size + 1,)")
        offsets = cu.tolist()
        _refuse(
            offsets[0] == 0 and all(a <= b for a, b in itertools.pairwise(offsets)),
            f"{name} must be non-decreasing from 0",
        )
        _refuse(total < 0 or offsets[-1] <= total, f"{name} runs past the packed tensor")
        return list(itertools.pairwise(offsets))

    def keys_of(self, k: torch.Tensor, seqs: list[tuple[int, int]], b: int) -> torch.Tensor:
        """Sequence ``b``'s packed keys (or values)."""
        a, z = seqs[b]
        return k[a:z]

    def page_keys(self, pages: torch.Tensor, row: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` keys of one sequence whose block-table row is ``row``: ``(n, H_kv, D)``."""
        page = pages.shape[1]
        used = row[: -(-n // page)].tolist() if n else []
        _refuse(all(0 <= p < pages.shape[0] for p in used), "block_table names a page that does not exist")
        _refuse(len(used) * page >= n, "block_table has too few pages for the sequence")
        return pages[used].flatten(0, 1)[:n] if used else pages.new_zeros(0, *pages.shape[2:])

    def merge(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge partial ``(out (n_q, H, D_v), lse (H, n_q))`` states through their natural LSEs."""
        lses = torch.stack([s for _, s in parts])  # (S, H, n_q)
        top = lses.amax(0)
        top_safe = torch.where(torch.isinf(top), 0.0, top)
        weights = torch.exp(lses - top_safe)  # (S, H, n_q), 0 for an empty partial
        total = weights.sum(0)
        out = sum(w.transpose(0, 1)[..., None] * o for w, (o, _) in zip(weights, parts, strict=True))
        out = out / torch.where(total > 0, total, 1.0).transpose(0, 1)[..., None]
        lse = torch.where(total > 0, top_safe + torch.log(torch.where(total > 0, total, 1.0)), -_INF)
        return out, lse

    def chunk(self, q, keys, values, a, z, keep, dist, scale, softcap, slopes):
        """The partial state of keys ``[a, z)``: one softmax over them in float32 (``−inf`` LSE, zero
        output for a row that keeps none)."""
        heads = self.kv_heads(q.shape[1], keys.shape[1], q.device)
        s = q.float().transpose(0, 1) @ keys[a:z].float().transpose(0, 1)[heads].transpose(1, 2) * scale
        if softcap:
            s = self.cap(s, softcap)
        if slopes is not None:
            s = s + self.alibi(slopes.float(), *dist.shape)[:, :, a:z]
        s = s.masked_fill(~keep[:, a:z], -_INF)
        lse = torch.logsumexp(s, -1)  # (H, n_q)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        out = p @ values[a:z].float().transpose(0, 1)[heads]
        return out.transpose(0, 1), lse

    def attend(
        self, q, k, v, *, scale, causal, window, softcap, slopes, sink=None, base2=False, wide=False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences of one length by online softmax over key tiles, in float32 (``wide``: float64):
        ``q (G, n_q, H, D)``, ``k (G, n_k, H_kv, D)``, ``v (G, n_k, H_kv, D_v)`` → ``out (G, n_q, H,
        D_v)`` and the natural LSE ``(G, H, n_q)`` (``−inf`` for a row without keys); one sequence
        without the leading ``G`` as well. ``slopes`` ``(H,)`` or ``(G, H)``; a ``sink (H,)`` joins the
        denominator (FA4's learnable sink: the running state starts at ``(sink, 1, 0)``). ``base2``:
        ``exp2`` of the scores in ``log2`` units, each taken after the row's running max is subtracted
        (a logit near the dtype's largest value stays finite), the row sum's ``log2`` converted."""
        if q.dim() == 3:  # one sequence
            out, lse = self.attend(
                q[None], k[None], v[None], scale=scale, causal=causal, window=window, softcap=softcap,
                slopes=slopes, sink=sink, base2=base2, wide=wide,
            )  # fmt: skip
            return out[0], lse[0]
        g, n_q, h, _ = q.shape
        n_k, h_kv, d_v = v.shape[1:]
        heads = self.kv_heads(h, h_kv, q.device)
        acc_dtype = torch.float64 if wide else torch.float32
        qf = q.to(acc_dtype).transpose(1, 2)  # (G, H, n_q, D)
        kf, vf = (t.to(acc_dtype).transpose(1, 2)[:, heads] for t in (k, v))  # (G, H, n_k, ·)
        dist = self.distance(n_q, n_k, q.device)
        keep = self.keep(dist, causal, window)  # (n_q, n_k)
        unit = _LOG2E if base2 else 1.0
        exp = torch.exp2 if base2 else torch.exp
        bias = None
        if slopes is not None:  # (H, n_q, n_k) or (G, H, n_q, n_k)
            bias = self.alibi(slopes.to(acc_dtype).reshape(-1), n_q, n_k).view(*slopes.shape, n_q, n_k)
        like = {"device": q.device, "dtype": acc_dtype}
        m = torch.full((g, h, n_q, 1), -_INF, **like)
        l_sum = torch.zeros(g, h, n_q, 1, **like)
        if sink is not None:
            m = sink.to(acc_dtype).view(1, h, 1, 1).expand(g, h, n_q, 1)
            l_sum = torch.ones(g, h, n_q, 1, **like)
        acc = torch.zeros(g, h, n_q, d_v, **like)
        for a in range(0, n_k, self.tile):
            z = min(n_k, a + self.tile)
            s = qf @ kf[:, :, a:z].transpose(-1, -2) * scale  # (G, H, n_q, tile)
            if softcap:
                s = self.cap(s, softcap)
            if bias is not None:
                s = s + bias[..., a:z]
            s = s.masked_fill(~keep[:, a:z], -_INF)
            m_new = self.new_max(m, s.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            p = exp((s - m_safe) * unit)
            rescale = exp((m - m_safe) * unit)
            l_sum = l_sum * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + self.pv(p, vf[:, :, a:z])
            m = m_new
        out = acc / torch.where(l_sum > 0, l_sum, 1.0)
        log = torch.log2 if base2 else torch.log
        lse = torch.where(l_sum > 0, m + log(torch.where(l_sum > 0, l_sum, 1.0)) / unit, -_INF)
        return out.transpose(1, 2), lse[..., 0]

    # ---- flash-attn 2.8's functions -------------------------------------------------------------

    def _common(
        self, q: torch.Tensor, k: torch.Tensor, window_size: Any, dropout_p: float
    ) -> tuple[int, int]:
        _refuse(dropout_p == 0.0, "this stand-in has no dropout")
        _refuse(q.shape[-1] == k.shape[-1], "q and k must share the head dim")
        _refuse(
            k.shape[-2] > 0 and q.shape[-2] % k.shape[-2] == 0,
            "Number of heads in key/value must divide number of heads in query",
        )
        left, right = window_size
        return int(left), int(right)

    def flash_attn_func(
        self,
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):
        """flash-attn 2.8's ``flash_attn_func``: ``q (B, N_q, H, D)``, ``k, v (B, N_k, H_kv, D)`` →
        ``out (B, N_q, H, D)``; with ``return_attn_probs`` ``(out, softmax_lse (B, H, N_q), None)``."""
        window = self._common(q, k, window_size, dropout_p)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out, lse = self.attend(  # every sequence at once: (B, N_q, H, D_v), (B, H, N_q)
            q, k, v, scale=scale, causal=causal, window=window, softcap=softcap, slopes=alibi_slopes
        )
        out = self.store(out, q.dtype)
        return (out, self.lse_out(lse), None) if return_attn_probs else out

    def flash_attn_varlen_func(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
        *,
        out=None,
    ):
        """flash-attn 2.8's ``flash_attn_varlen_func``: packed ``q (total_q, H, D)``, ``k, v (total_k, H_kv,
        D)`` or pages ``(num_blocks, page_block_size, H_kv, D)`` with ``block_table (B, max_blocks)``;
        ``out (total_q, H, D)``, with ``return_attn_probs`` ``(out, softmax_lse (H, total_q), None)``;
        written into a preallocated ``out`` when given (vLLM's fork of the function)."""
        window = self._common(q, k, window_size, dropout_p)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        seq_q = self.sequences(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        seq_k = self.sequences(cu_seqlens_k, -1 if block_table is not None else k.shape[0], "cu_seqlens_k")
        _refuse(len(seq_q) == len(seq_k), "cu_seqlens_q and cu_seqlens_k must have the same length")
        _refuse(
            max((z - a for a, z in seq_q), default=0) <= max_seqlen_q,
            "max_seqlen_q is shorter than a sequence",
        )
        given = out
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), -_INF, device=q.device)
        groups: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for b, (qa, qz) in enumerate(seq_q):  # each sequence's tokens, grouped by their lengths
            if block_table is not None:
                n = seq_k[b][1] - seq_k[b][0]
                keys, values = (self.page_keys(t, block_table[b], n) for t in (k, v))
            else:
                keys, values = (self.keys_of(t, seq_k, b) for t in (k, v))
            rows = q[qa:qz]
            groups.setdefault((rows.shape[0], keys.shape[0]), []).append((b, rows, keys, values))
        for members in groups.values():  # the sequences of one (n_q, n_k) at once
            batch = [b for b, *_ in members]
            slopes = alibi_slopes
            if alibi_slopes is not None and alibi_slopes.dim() == 2:
                slopes = alibi_slopes[batch]  # (G, H)
            o, s = self.attend(
                *(torch.stack([m[i] for m in members]) for i in (1, 2, 3)),
                scale=scale,
                causal=causal,
                window=window,
                softcap=softcap,
                slopes=slopes,
                base2=True,
            )
            for g, b in enumerate(batch):
                qa, qz = seq_q[b]
                out[qa:qz] = o[g]
                lse[:, qa:qz] = s[g]
        out = self.store(out, q.dtype)
        if given is not None:
            out = self.write(given, out, seq_q, seq_k)
        return (out, self.lse_out(lse), None) if return_attn_probs else out

    def write(self, given: torch.Tensor, out: torch.Tensor, seq_q, seq_k) -> torch.Tensor:
        """``out`` written into the preallocated ``given``, every sequence's rows."""
        given.copy_(out)
        return given

    def flash_attn_with_kvcache(
        self,
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        rotary_interleaved=True,
        alibi_slopes=None,
        num_splits=0,
        return_softmax_lse=False,
    ):
        """flash-attn 2.8's ``flash_attn_with_kvcache`` (without rotary embeddings): ``q (B, N_q, H, D)``
        against ``k_cache, v_cache (B_cache, S, H_kv, D)`` or pages with ``block_table``; ``k, v (B, N_new,
        H_kv, D)`` written into the cache at ``cache_seqlens`` in place; ``out (B, N_q, H, D)``, with
        ``return_softmax_lse`` ``(out, softmax_lse (B, H, N_q))``."""
        _refuse(rotary_cos is None and rotary_sin is None, "this stand-in has no rotary embedding")
        _refuse(
            block_table is None or cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx"
        )
        window = self._common(q, k_cache, window_size, 0.0)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        b_size, n_q = q.shape[0], q.shape[1]
        page = k_cache.shape[1]
        slots = block_table.shape[1] * page if block_table is not None else k_cache.shape[1]
        seqlens = (
            [slots] * b_size
            if cache_seqlens is None
            else ([int(cache_seqlens)] * b_size if isinstance(cache_seqlens, int) else cache_seqlens.tolist())
        )
        n_new = 0 if k is None else k.shape[1]
        leftpad = [0] * b_size if cache_leftpad is None else cache_leftpad.tolist()
        rows = list(range(b_size)) if cache_batch_idx is None else cache_batch_idx.tolist()
        splits = self.splits if num_splits == 0 else num_splits
        outs, lses = [], []
        for b in range(b_size):
            end = seqlens[b] + n_new
            _refuse(
                0 <= leftpad[b] <= seqlens[b] and end <= slots, "cache_seqlens + seqlen_new exceed the cache"
            )
            if block_table is not None:
                table = block_table[b].tolist()
                _refuse(
                    all(0 <= p < k_cache.shape[0] for p in table[: -(-end // page)]),
                    "block_table names a page that does not exist",
                )
                where = [(table[s // page], s % page) for s in range(end)]
            else:
                _refuse(
                    0 <= rows[b] < k_cache.shape[0], "cache_batch_idx names a cache row that does not exist"
                )
                where = [(rows[b], s) for s in range(end)]
            self.append(k_cache, v_cache, k, v, b, where[seqlens[b] :])
            idx = where[leftpad[b] :]
            empty = k_cache.new_zeros(0, *k_cache.shape[2:])
            keys = torch.stack([k_cache[r, s] for r, s in idx]) if idx else empty
            values = (
                torch.stack([v_cache[r, s] for r, s in idx])
                if idx
                else v_cache.new_zeros(0, *v_cache.shape[2:])
            )
            n_k = len(idx)
            # split-KV: each chunk a partial state of the same rows (its keys keep their positions)
            dist = self.distance(n_q, n_k, q.device)
            keep = self.keep(dist, causal, window)
            bounds = [(c * n_k // splits, (c + 1) * n_k // splits) for c in range(splits)]
            slopes = _slopes(alibi_slopes, b)
            parts = [
                self.chunk(q[b], keys, values, a, z, keep, dist, scale, softcap, slopes) for a, z in bounds
            ]
            out, lse = self.merge(parts)
            outs.append(out)
            lses.append(lse)
        out = self.store(torch.stack(outs), q.dtype)
        lse = self.lse_out(torch.stack(lses))
        return (out, lse) if return_softmax_lse else out

    def append(self, k_cache, v_cache, k, v, b: int, slots: list[tuple[int, int]]) -> None:
        """Write sequence ``b``'s new keys and values into the cache at ``slots``, in place."""
        for j, (row, slot) in enumerate(slots):
            k_cache[row, slot] = k[b, j]
            v_cache[row, slot] = v[b, j]


class FA3(FlashAttn):
    """FlashAttention-3's ``flash_attn_func`` (``hopper/flash_attn_interface.py``): fp16/bf16, or
    ``float8_e4m3fn`` q, k, v with descales ``(B, H_kv)`` (bfloat16 output); ``−inf`` LSE for a row
    without keys; no ALiBi.

    Attributes:
        p_cast: cast P to E4M3 before ``P·V`` (times ``p_prescale``, the row sum from the unrounded P),
            as its FP8 forward does; off: P in float32.
        p_prescale: the scale of P before its cast (FlashAttention-3: ``2^8``).
    """

    empty_lse = -_INF
    p_cast = False
    p_prescale = P_PRESCALE

    def pv(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.p_cast:
            return p @ v
        scaled = (p * self.p_prescale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return (scaled.to(p.dtype) @ v) / self.p_prescale

    def flash_attn_func(
        self,
        q,
        k,
        v,
        softmax_scale=None,
        causal=False,
        qv=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        sm_margin=0,
        return_attn_probs=False,
    ):
        """FlashAttention-3's ``flash_attn_func``: ``out (B, N_q, H, D)``, with ``return_attn_probs``
        ``(out, softmax_lse (B, H, N_q))`` (``−inf`` for a row without keys)."""
        _refuse(qv is None and attention_chunk == 0, "this stand-in has no qv or attention_chunk")
        window = self._common(q, k, window_size, 0.0)
        fp8 = q.dtype == torch.float8_e4m3fn
        _refuse(fp8 or q_descale is None, "descales are for float8_e4m3fn inputs")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        out_dtype = torch.bfloat16 if fp8 else q.dtype
        if fp8:
            rep = q.shape[2] // k.shape[2]
            ones = torch.ones(q.shape[0], k.shape[2], device=q.device)
            dq, dk, dv = (ones if d is None else d.float() for d in (q_descale, k_descale, v_descale))
            q = q.float() * dq.repeat_interleave(rep, dim=1)[:, None, :, None]
            k, v = k.float() * dk[:, None, :, None], v.float() * dv[:, None, :, None]
        out, lse = self.attend(
            q, k, v, scale=scale, causal=causal, window=window, softcap=softcap, slopes=None
        )
        out = self.store(out, out_dtype)
        return (out, self.lse_out(lse)) if return_attn_probs else out


class FA3PCast(FA3):
    """:class:`FA3` with P cast to E4M3 after the ``2^8`` prescale, at every input dtype (an FP8 kernel:
    ``KernelCapabilities(fp8="e4m3")``)."""

    p_cast = True
    tile = 64


class MergeState:
    """FlashInfer's ``merge_state`` (``include/flashinfer/attention/state.cuh``): base-2 LSEs."""

    def weights(
        self, s_a: torch.Tensor, s_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w_a, w_b, s_max)``: each state's weight ``2^(s − s_max)`` (0 for an empty state) and the
        larger LSE with ``−inf`` read as 0."""
        s_max = torch.maximum(s_a, s_b)
        s_safe = torch.where(torch.isinf(s_max), 0.0, s_max)
        return torch.exp2(s_a - s_safe), torch.exp2(s_b - s_safe), s_safe

    def lse(self, total: torch.Tensor, s_safe: torch.Tensor) -> torch.Tensor:
        """The merged LSE ``log2(total) + s_max`` (``−inf`` for two empty states)."""
        return torch.where(total > 0, torch.log2(torch.where(total > 0, total, 1.0)) + s_safe, -_INF)

    def merge_state(
        self, v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's ``merge_state``: ``v_x (seq_len, num_heads, head_dim)``, ``s_x (seq_len,
        num_heads)`` float32 base-2 LSEs → the merged ``(v, s)``; two empty states merge to 0 and
        ``−inf``."""
        _refuse(
            v_a.shape == v_b.shape and s_a.shape == s_b.shape == v_a.shape[:2], "merge_state: shapes differ"
        )
        w_a, w_b, s_safe = self.weights(s_a.float(), s_b.float())
        total = w_a + w_b
        inv = torch.where(total > 0, 1.0 / torch.where(total > 0, total, 1.0), 0.0)
        v = (w_a * inv)[..., None] * v_a.float() + (w_b * inv)[..., None] * v_b.float()
        return v.to(v_a.dtype), self.lse(total, s_safe)


_FA2, _FA3, _FA3_PCAST, _MERGE = FlashAttn(), FA3(), FA3PCast(), MergeState()
_attend = _FA2.attend  # one sequence's online softmax (tests/kernels: autograd through it in float64)
flash_attn_func = _FA2.flash_attn_func
flash_attn_varlen_func = _FA2.flash_attn_varlen_func
flash_attn_with_kvcache = _FA2.flash_attn_with_kvcache
merge_state = _MERGE.merge_state
fa3_flash_attn_func = _FA3.flash_attn_func
fa3_pcast_flash_attn_func = _FA3_PCAST.flash_attn_func

_FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32})
#: what each stand-in declares (the mutants of :mod:`lab.mutants` override one step and declare the same)
CAPABILITIES: dict[str, KernelCapabilities] = {
    "flash_attn_func": KernelCapabilities(masks=frozenset({"causal"}), sinks=False, empty_lse=_INF),
    "flash_attn_varlen_func": KernelCapabilities(
        masks=frozenset({"causal", "key_padding"}), sinks=False, empty_lse=_INF
    ),
    "flash_attn_with_kvcache": KernelCapabilities(
        masks=frozenset({"causal"}), sinks=False, empty_lse=_INF, backward_devices=frozenset()
    ),
    "merge_state": KernelCapabilities(lse_base=2, backward_devices=frozenset()),
    "fa3": KernelCapabilities(
        masks=frozenset({"causal"}),
        alibi=False,
        sinks=False,
        backward_devices=frozenset(),
        dtypes=_FP8_DTYPES,
    ),
    "fa3_pcast": KernelCapabilities(
        masks=frozenset({"causal"}),
        alibi=False,
        sinks=False,
        backward_devices=frozenset(),
        dtypes=_FP8_DTYPES,
        fp8="e4m3",
    ),
}

#: the registered controls: name → (function, api, capabilities)
CONTROLS: dict[str, tuple[Callable[..., Any], str, KernelCapabilities]] = {
    "control_flash_attn_func": (flash_attn_func, "flash_attn_func", CAPABILITIES["flash_attn_func"]),
    "control_flash_attn_varlen_func": (
        flash_attn_varlen_func,
        "flash_attn_varlen_func",
        CAPABILITIES["flash_attn_varlen_func"],
    ),
    "control_flash_attn_with_kvcache": (
        flash_attn_with_kvcache,
        "flash_attn_with_kvcache",
        CAPABILITIES["flash_attn_with_kvcache"],
    ),
    "control_merge_state": (merge_state, "merge_state", CAPABILITIES["merge_state"]),
    "control_fa3_flash_attn_func": (fa3_flash_attn_func, "flash_attn_func", CAPABILITIES["fa3"]),
    "control_fa3_pcast": (fa3_pcast_flash_attn_func, "flash_attn_func", CAPABILITIES["fa3_pcast"]),
}


def register_controls(*, overwrite: bool = True) -> list[str]:
    """Register every control (:data:`CONTROLS`) with its api and capabilities; returns their names."""
    for name, (fn, api, caps) in CONTROLS.items():
        register_kernel(name, fn, api=api, capabilities=caps, overwrite=overwrite)
    return list(CONTROLS)
