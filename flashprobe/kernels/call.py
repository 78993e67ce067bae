"""One attention call as data (:class:`AttentionCall`), as the contracts of real kernels describe it.

A call's **storage** is dense (SDPA's ``bhnd`` or flash-attn's ``bnhd`` layout), packed varlen
sequences, a paged key/value cache, or a KV cache with appended keys. :meth:`AttentionCall.logical`
turns any call into its **logical form**: dense ``bhnd``, sequences padded to the longest, with
per-sequence lengths ``q_lens``/``k_lens``; the references take that form
(:func:`flashprobe.kernels.math.call_reference`) and each contract's adapter
(:mod:`flashprobe.kernels.contract`) converts to and from it. :meth:`~AttentionCall.packed`,
:meth:`~AttentionCall.paged` and :meth:`~AttentionCall.cached` go the other way.

Conventions (``i`` a query row, ``j`` a key of a sequence with ``n_q`` queries and ``n_k`` keys;
``off = n_k − n_q`` when aligned bottom-right, 0 top-left):

* **causal** keeps ``j ≤ i + off``. SDPA aligns top-left; flash-attn ≥ 2.1, FlashAttention-3 and
  FlashInfer bottom-right.
* **window** ``(left, right)`` keeps ``i + off − left ≤ j ≤ i + off + right``; ``-1`` is unbounded;
  ``causal`` sets ``right = 0`` (flash-attn's ``window_size``).
* **softcap** ``c > 0``: the scaled score ``s`` becomes ``c · tanh(s / c)`` before masks and biases.
* **ALiBi** adds ``−slope · |i + off − j|`` to the (softcapped) scaled score; slopes ``(H,)`` or
  ``(B, H)`` float32.
* **sinks**: one logit per query head ``(H,)`` in each row's softmax denominator only:
  ``out = Σ_j e^{s_j} v_j / (e^{sink} + Σ_j e^{s_j})``; the LSE includes it.
* **GQA**: query head ``h`` uses key/value head ``h // (H / H_kv)``; never expanded in the call.
* **LSE** ``log Σ_j exp(s_j)`` over the keys a row sees (and the sink), base ``e`` (flash-attn) or 2
  (FlashInfer); ``−inf`` for a row that sees no key (kernels declare theirs:
  :class:`~flashprobe.kernels.registry.KernelCapabilities`). Logical LSE is ``(B, H, N_q)``.
* **FP8** (FlashAttention-3): q, k, v in ``float8_e4m3fn`` with descales ``(B, H_kv)`` float32 (the
  real values are ``q · q_descale[b, h // rep]``); the output is bfloat16.
* **varlen**: ``cu_seqlens_q/k (B + 1,)`` int32 offsets into packed ``(total, H, D)`` tensors.
  **Paged**: sequence ``b``'s key ``j`` is row ``j % page_size`` of page
  ``block_table[b, j // page_size]``. **KV cache** (``flash_attn_with_kvcache``): sequence ``b``
  holds slots ``[cache_leftpad[b], cache_seqlens[b])`` of cache row ``cache_batch_idx[b]``, then the
  new keys ``k_new`` written at ``cache_seqlens[b]`` onwards (in place, by the kernel).

Sources: flash-attn 2.8.4 (``flash_attn/flash_attn_interface.py``, ``csrc/flash_attn``, ``hopper/``),
FlashInfer 0.6.18 (``flashinfer/cascade.py``, ``flashinfer/prefill.py``), torch 2.13.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from flashprobe.kernels._inputs import KernelInputError, default_scale, dtype_name

__all__ = [
    "ALIGNS",
    "FP8_INPUT_DTYPES",
    "KV_LAYOUTS",
    "LAYOUTS",
    "LSE_BASES",
    "LSE_FORMS",
    "STORAGES",
    "AttentionCall",
    "CallOutput",
    "convert_lse",
]

#: layouts of dense q, k, v: ``bhnd`` = ``(B, H, N, D)`` (SDPA), ``bnhd`` = ``(B, N, H, D)`` (flash-attn)
LAYOUTS = ("bhnd", "bnhd")
#: layouts of a page of keys/values: ``(page_size, H_kv, D)`` or ``(H_kv, page_size, D)``
KV_LAYOUTS = ("NHD", "HND")
#: where a causal mask (and a window, ALiBi) is anchored when N_q != N_k
ALIGNS = ("top_left", "bottom_right")
#: bases of a log-sum-exp
LSE_BASES = ("e", 2)
#: how a kernel lays out its LSE: ``bhn`` ``(B, H, N_q)``, ``ht`` ``(H, total_q)``, ``th`` ``(total_q, H)``
LSE_FORMS = ("bhn", "ht", "th")
#: where a call's tensors are (:attr:`AttentionCall.storage`)
STORAGES = ("dense", "packed", "paged", "cache")
#: FP8 input dtypes (with descales)
FP8_INPUT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

#: fields that only some storages have
_STORAGE_ONLY = {
    "q_lens": ("dense",), "k_lens": ("dense",), "attn_mask": ("dense",),
    "cu_seqlens_q": ("packed", "paged"), "cu_seqlens_k": ("packed", "paged"),
    "max_seqlen_q": ("packed", "paged"), "max_seqlen_k": ("packed", "paged"),
    "block_table": ("paged", "cache"), "k_new": ("cache",), "cache_batch_idx": ("cache",),
    "cache_leftpad": ("cache",),
}  # fmt: skip


def convert_lse(lse: torch.Tensor, base_from: str | int, base_to: str | int) -> torch.Tensor:
    """An LSE in base ``base_from`` expressed in base ``base_to`` (``"e"`` or 2); ``±inf`` stay."""
    if base_from == base_to:
        return lse
    return lse * math.log2(math.e) if base_to == 2 else lse * math.log(2.0)


@dataclass(frozen=True)
class CallOutput:
    """What a call gave, in the logical form: ``out (B, H, N_q, D_v)`` (rows past a sequence's length
    are 0) and, when the call asked for it, ``lse (B, H, N_q)`` in base ``lse_base``."""

    out: torch.Tensor
    lse: torch.Tensor | None = None
    lse_base: str | int = "e"


def _problem(text: str) -> KernelInputError:
    return KernelInputError(f"AttentionCall: {text}")


def _sequences(cu_seqlens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(starts (B,), valid (B, n), lens (B,))`` of packed sequences: position ``p`` of sequence
    ``b`` is valid when ``p < lens[b]``."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    return cu[:-1], torch.arange(n, device=cu.device)[None, :] < lens[:, None], lens


def _gather_tokens(packed: torch.Tensor, starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``packed (T, H, D)`` rows ``starts[b] + p`` for the valid ``(B, n)`` positions as ``(B, H, n, D)``,
    0 elsewhere."""
    b, n = valid.shape
    if packed.shape[0] == 0:
        return packed.new_zeros(b, packed.shape[1], n, packed.shape[2])
    index = torch.where(valid, starts[:, None] + torch.arange(n, device=valid.device), 0)
    index = index.clamp(0, packed.shape[0] - 1)
    rows = packed[index].masked_fill(~valid[:, :, None, None], 0)  # (B, n, H, D)
    return rows.transpose(1, 2)


@dataclass(frozen=True, kw_only=True, eq=False)
class AttentionCall:
    """One attention call: its tensors where the kernel sees them, the keys each query sees, what is
    added to the scores, and the outputs wanted (conventions: module docstring).

    The :attr:`storage` follows from the fields given. Shapes and dtypes are checked when the call
    is built (:class:`~flashprobe.kernels.KernelInputError` naming the field and the fix), with no
    host synchronisation; :meth:`check_values` checks the index tensors' values;
    :meth:`unchecked` builds a call a kernel must refuse.

    Attributes:
        q: ``(B, H, N_q, D)`` (``bhnd``), ``(B, N_q, H, D)`` (``bnhd``) or packed ``(total_q, H, D)``.
        k: like ``q`` with ``H_kv`` heads and ``N_k`` keys; pages ``(P, page_size, H_kv, D)`` (NHD) or
            ``(P, H_kv, page_size, D)`` (HND) with ``block_table``; a cache ``(B_cache, S, H_kv, D)``
            in ``layout`` with ``cache_seqlens``.
        v: like ``k`` with head dim ``D_v``.
        layout: of dense q, k, v, caches and ``k_new``/``v_new``, of :data:`LAYOUTS`.
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` int32 offsets of packed queries and keys (paged:
            the keys' lengths).
        max_seqlen_q, max_seqlen_k: the longest sequences (default: read from ``cu_seqlens``, a
            host sync).
        q_lens, k_lens: dense storage: ``(B,)`` valid queries and keys per sequence.
        block_table: ``(B, max_pages)`` int32 page of each sequence's ``j // page_size``-th keys.
        kv_layout: of a page, of :data:`KV_LAYOUTS`.
        cache_seqlens: ``(B,)`` int32 (or an int) keys in the cache before ``k_new``.
        k_new, v_new: ``(B, N_new, H_kv, D|D_v)`` (in ``layout``) keys appended at ``cache_seqlens``.
        cache_batch_idx: ``(B,)`` int32 cache row of each sequence (not with pages).
        cache_leftpad: ``(B,)`` int32 first valid cache slot of each sequence.
        attn_mask: dense storage: SDPA's bool (True = attend) or additive mask broadcastable to
            ``(B, H, N_q, N_k)``.
        align: anchors ``causal``, ``window`` and ALiBi, of :data:`ALIGNS`.
        scale: softmax scale (default ``1 / sqrt(D)``).
        q_descale, k_descale, v_descale: FP8 inputs: ``(B, H_kv)`` float32 (default 1).
        lse_base: the base the LSE is wanted in, of :data:`LSE_BASES`.
        split_k: for ``merge_state``: the partials are keys ``[0, split_k)`` and ``[split_k, N_k)``
            (default ``N_k // 2``).
        num_splits: a KV-cache call's ``num_splits`` (0: the kernel's heuristic, 1: no split; None:
            not passed); it does not change the exact result.
        out: a preallocated output in ``q``'s form with head dim ``D_v`` and :attr:`out_dtype`.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str = "bhnd"
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    q_lens: torch.Tensor | None = None
    k_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    kv_layout: str = "NHD"
    cache_seqlens: torch.Tensor | int | None = None
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    cache_leftpad: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None
    causal: bool = False
    align: str = "top_left"
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    scale: float | None = None
    q_descale: torch.Tensor | None = None
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    return_lse: bool = False
    lse_base: str | int = "e"
    split_k: int | None = None
    num_splits: int | None = None
    out: torch.Tensor | None = None

    # ---- construction and validation -------------------------------------------------------

    @classmethod
    def unchecked(cls, **fields: Any) -> AttentionCall:
        """A call built without validation: one a kernel must refuse (a head ratio that does not
        divide, ``cu_seqlens`` of the wrong dtype, ...). :meth:`logical` may fail on it."""
        call = object.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(call, f.name, fields.pop(f.name, f.default))
        if fields:
            raise TypeError(f"AttentionCall has no field {sorted(fields)[0]!r}")
        return call

    def replace(self, **changes: Any) -> AttentionCall:
        """This call with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    @property
    def storage(self) -> str:
        """``dense``, ``packed``, ``paged`` (packed queries, paged keys) or ``cache`` (module docstring)."""
        if self.cache_seqlens is not None:
            return "cache"
        if self.block_table is not None:
            return "paged"
        if self.cu_seqlens_q is not None or self.cu_seqlens_k is not None:
            return "packed"
        return "dense"

    def _dims(self, t: torch.Tensor, name: str, kind: str) -> tuple[int, int, int, int]:
        """``(B, H, N, D)`` of a ``dense`` tensor in ``layout``, ``(1, H, total, D)`` of a ``packed``
        one, ``(P, H_kv, page_size, D)`` of ``pages`` in ``kv_layout``."""
        shape = tuple(t.shape)
        if kind == "packed":
            if len(shape) != 3:
                raise _problem(f"packed {name} must be (total, H, D), got {shape}")
            return 1, shape[1], shape[0], shape[2]
        if len(shape) != 4:
            want = "(P, page_size, H_kv, D) or (P, H_kv, page_size, D) pages" if kind == "pages" else (
                f"(B, H, N, D) or (B, N, H, D) for layout={self.layout!r}"
            )  # fmt: skip
            raise _problem(f"{name} must be {want}, got {shape}")
        swapped = self.kv_layout == "NHD" if kind == "pages" else self.layout == "bnhd"
        return (shape[0], shape[2], shape[1], shape[3]) if swapped else shape

    def _kinds(self) -> tuple[str, str]:
        """How q and the keys are stored: ``dense`` or ``packed``; ``dense``, ``packed`` or ``pages``."""
        storage = self.storage
        q_kind = "packed" if storage in ("packed", "paged") else "dense"
        return q_kind, "pages" if self.block_table is not None else q_kind

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("layout", self.layout, LAYOUTS),
            ("kv_layout", self.kv_layout, KV_LAYOUTS),
            ("align", self.align, ALIGNS),
            ("lse_base", self.lse_base, LSE_BASES),
        ):
            if value not in allowed:
                raise _problem(f"{name}={value!r} must be one of {', '.join(repr(a) for a in allowed)}")
        w = self.window
        if not (
            isinstance(w, tuple | list) and len(w) == 2 and all(isinstance(x, int) and x >= -1 for x in w)
        ):
            raise _problem(f"window={w!r} must be (left, right), ints >= -1 (-1: unbounded)")
        if self.causal and w[1] > 0:
            raise _problem(
                f"causal=True keeps no key right of the diagonal, not window={tuple(w)}; give (left, 0)"
            )
        if not (isinstance(self.softcap, int | float) and math.isfinite(self.softcap) and self.softcap >= 0):
            raise _problem(f"softcap={self.softcap!r} must be a finite number >= 0 (0: off)")
        if self.split_k is not None and self.split_k < 0:
            raise _problem(f"split_k={self.split_k} must be >= 0")
        if self.num_splits is not None and not (isinstance(self.num_splits, int) and self.num_splits >= 0):
            raise _problem(f"num_splits={self.num_splits!r} must be an int >= 0 (0: the kernel's choice)")
        for name in ("q", "k", "v", "k_new", "v_new"):
            t = getattr(self, name)
            if t is None and name in ("k_new", "v_new"):
                continue
            if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.dtype in FP8_INPUT_DTYPES):
                raise _problem(
                    f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}"
                )
            if t.dtype != self.q.dtype or t.device != self.q.device:
                raise _problem(
                    f"{name} is {dtype_name(t.dtype)} on {t.device}, q is {dtype_name(self.q.dtype)} on "
                    f"{self.q.device}; give every tensor q's dtype and device"
                )
        if (self.k_new is None) != (self.v_new is None):
            raise _problem("k_new and v_new go together; give both or neither")
        self._check_storage()
        self._check_features()

    def _check_storage(self) -> None:
        storage = self.storage
        for name in _STORAGE_ONLY:
            if getattr(self, name) is not None and storage not in _STORAGE_ONLY[name]:
                raise _problem(f"{name} has no meaning for {storage} storage; leave it out")
        if storage in ("packed", "paged") and (self.cu_seqlens_q is None or self.cu_seqlens_k is None):
            raise _problem("packed calls need both cu_seqlens_q and cu_seqlens_k, (B + 1,) int32 offsets")
        if storage == "cache" and self.block_table is not None and self.cache_batch_idx is not None:
            raise _problem("a paged cache has no cache_batch_idx (flash-attn refuses both); leave it out")
        q_kind, kv_kind = self._kinds()
        b, h, _, d = self._dims(self.q, "q", q_kind)
        if q_kind == "packed":
            b = self.cu_seqlens_q.shape[0] - 1 if isinstance(self.cu_seqlens_q, torch.Tensor) else -1
        bk, h_kv, n_k, d_k = self._dims(self.k, "k", kv_kind)
        bv, h_v, n_v, _ = self._dims(self.v, "v", kv_kind)
        if (bk, n_k) != (bv, n_v) or (storage == "dense" and bk != b):
            raise _problem(
                f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must hold the same keys of q's batch"
            )
        if h_kv < 1 or h % h_kv or h_v != h_kv:
            raise _problem(
                f"{h} query heads for {h_kv} key and {h_v} value heads: the key/value heads must be "
                "equal and divide the query heads (grouped-query attention)"
            )
        if d != d_k:
            raise _problem(f"head dims of q ({d}) and k ({d_k}) differ; they must match")
        for name, dims, size in (
            ("cu_seqlens_q", 1, b + 1), ("cu_seqlens_k", 1, b + 1), ("q_lens", 1, b), ("k_lens", 1, b),
            ("cache_seqlens", 1, b), ("cache_batch_idx", 1, b), ("cache_leftpad", 1, b),
            ("block_table", 2, b),
        ):  # fmt: skip
            t = getattr(self, name)
            if t is None or (name == "cache_seqlens" and isinstance(t, int) and not isinstance(t, bool)):
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dims:
                got = f"{t.dtype} of {t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__
                raise _problem(
                    f"{name} must be a {dims}-D int32 tensor, got {got}; build it with dtype=torch.int32"
                )
            if t.shape[0] != size or t.device != self.q.device:
                raise _problem(
                    f"{name} must have {size} entries (B = {b}) on q's device, got {tuple(t.shape)}"
                )
        if self.k_new is not None:
            bn, hn, nn, dn = self._dims(self.k_new, "k_new", "dense")
            if (bn, hn, dn) != (b, h_kv, d) or self._dims(self.v_new, "v_new", "dense")[:3] != (b, h_kv, nn):
                raise _problem(
                    f"k_new, v_new must be (B, N_new, H_kv, ·) like the cache, got {tuple(self.k_new.shape)}"
                )
        if self.attn_mask is not None:
            m, target = self.attn_mask, (b, h, self.n_q, n_k)
            try:
                fits = torch.broadcast_shapes(m.shape, target) == target
            except (RuntimeError, AttributeError):
                fits = False
            if not fits or not (m.dtype == torch.bool or m.is_floating_point()) or m.device != self.q.device:
                raise _problem(
                    f"attn_mask must be bool (True = attend) or floating, broadcast to {target} on q's device"
                )

    def _check_features(self) -> None:
        h, b, h_kv = self.heads, self.batch, self.heads_kv
        for name, shapes, dtype in (
            ("alibi_slopes", ((h,), (b, h)), torch.float32), ("sinks", ((h,),), None),
            ("q_descale", ((b, h_kv),), torch.float32), ("k_descale", ((b, h_kv),), torch.float32),
            ("v_descale", ((b, h_kv),), torch.float32),
            ("out", ((*self.q.shape[:-1], self.head_dim_v),), self.out_dtype),
        ):  # fmt: skip
            t = getattr(self, name)
            if t is None:
                continue
            if name.endswith("descale") and not self.fp8:
                raise _problem(f"{name} descales FP8 inputs; q is {dtype_name(self.q.dtype)}: leave it out")
            good = isinstance(t, torch.Tensor) and tuple(t.shape) in shapes and t.device == self.q.device
            if not good or not (t.dtype == dtype if dtype is not None else t.is_floating_point()):
                kind = dtype_name(dtype) if dtype is not None else "floating"
                raise _problem(
                    f"{name} must be a {kind} tensor of shape {' or '.join(map(str, shapes))} on q's device"
                )

    def check_values(self) -> None:
        """Check the index tensors' values (a host synchronisation): offsets, lengths, pages, cache rows.

        Raises:
            KernelInputError: naming the first problem and the fix.
        """
        storage = self.storage
        if storage in ("packed", "paged"):
            totals = (self.q.shape[0], None if storage == "paged" else self.k.shape[0])
            for name, cu, total in zip(
                ("cu_seqlens_q", "cu_seqlens_k"), (self.cu_seqlens_q, self.cu_seqlens_k), totals, strict=True
            ):
                if (
                    int(cu[0]) != 0
                    or bool((cu[1:] < cu[:-1]).any())
                    or (total is not None and int(cu[-1]) != total)
                ):
                    raise _problem(f"{name} must start at 0, never decrease and end at the total ({total})")
                most = getattr(self, name.replace("cu_seqlens", "max_seqlen"))
                if most is not None and most < self._longest(cu):
                    raise _problem(f"max_seqlen {most} is shorter than the longest sequence of {name}")
        lens = self._key_lens_values()
        if self.block_table is not None:
            p, _, page, _ = self._dims(self.k, "k", "pages")
            pages_used = (lens + page - 1) // page
            if bool((pages_used > self.block_table.shape[1]).any()):
                raise _problem("a sequence has more keys than its block_table row has pages; add pages")
            used = torch.arange(self.block_table.shape[1], device=lens.device)[None, :] < pages_used[:, None]
            if bool((used & ((self.block_table < 0) | (self.block_table >= p))).any()):
                raise _problem(f"block_table names pages outside [0, {p}); give existing pages")
        if storage == "cache":
            seqlens, rows, pad = self._cache_seqlens(), self.cache_batch_idx, self.cache_leftpad
            if bool((seqlens < 0).any()) or bool((lens > self.n_k).any()):
                raise _problem(f"cache_seqlens + N_new must be within [0, {self.n_k}], the cache's slots")
            if pad is not None and bool(((pad < 0) | (pad > seqlens)).any()):
                raise _problem("cache_leftpad must be within [0, cache_seqlens] for every sequence")
            if rows is not None and bool(((rows < 0) | (rows >= self.k.shape[0])).any()):
                raise _problem(f"cache_batch_idx names cache rows outside [0, {self.k.shape[0]})")
        if storage == "dense":
            for name, t, n in (("q_lens", self.q_lens, self.n_q), ("k_lens", self.k_lens, self.n_k)):
                if t is not None and bool(((t < 0) | (t > n)).any()):
                    raise _problem(f"{name} must be within [0, {n}]")

    # ---- sizes ----------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        """B: sequences in the call."""
        return self.cu_seqlens_q.shape[0] - 1 if self.q.dim() == 3 else self.q.shape[0]

    @property
    def heads(self) -> int:
        """H: query heads."""
        return self._dims(self.q, "q", self._kinds()[0])[1]

    @property
    def heads_kv(self) -> int:
        """H_kv: key/value heads."""
        return self._dims(self.k, "k", self._kinds()[1])[1]

    @property
    def head_dim(self) -> int:
        """D: the head dim of q and k."""
        return self.q.shape[-1]

    @property
    def head_dim_v(self) -> int:
        """D_v: the head dim of v."""
        return self.v.shape[-1]

    @property
    def n_q(self) -> int:
        """Query rows of the logical form: the longest query sequence (``max_seqlen_q``, else read
        from ``cu_seqlens_q``: a host sync)."""
        if self.q.dim() == 3:
            return self.max_seqlen_q if self.max_seqlen_q is not None else self._longest(self.cu_seqlens_q)
        return self._dims(self.q, "q", "dense")[2]

    @property
    def n_k(self) -> int:
        """Key slots of the logical form: the longest key sequence (packed: ``max_seqlen_k``, else read
        from ``cu_seqlens_k``), a dense cache's slots, or a block-table row's."""
        storage, kind = self.storage, self._kinds()[1]
        if storage in ("packed", "paged") and self.max_seqlen_k is not None:
            return self.max_seqlen_k
        if storage == "packed":
            return self._longest(self.cu_seqlens_k)
        if kind == "pages":
            return self.block_table.shape[1] * self._dims(self.k, "k", "pages")[2]
        return self._dims(self.k, "k", "dense")[2]

    @property
    def n_new(self) -> int:
        """Keys appended to the cache (0 without ``k_new``)."""
        return 0 if self.k_new is None else self._dims(self.k_new, "k_new", "dense")[2]

    @property
    def page_size(self) -> int | None:
        """Keys per page (None without pages)."""
        return None if self.block_table is None else self._dims(self.k, "k", "pages")[2]

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.heads_kv

    @property
    def fp8(self) -> bool:
        """The inputs are FP8 (with descales)."""
        return self.q.dtype in FP8_INPUT_DTYPES

    @property
    def out_dtype(self) -> torch.dtype:
        """The output's dtype: the inputs', bfloat16 for FP8 inputs (FlashAttention-3)."""
        return torch.bfloat16 if self.fp8 else self.q.dtype

    @property
    def softmax_scale(self) -> float:
        """The scale: ``scale`` or ``1 / sqrt(D)``."""
        return default_scale(self.head_dim, self.scale)

    @property
    def is_sdpa(self) -> bool:
        """Expressible as SDPA's ``(q, k, v, attn_mask, is_causal, scale)`` as it is: dense ``bhnd``,
        no lengths, causal top-left (or N_q = N_k), no window, softcap, ALiBi, sinks, FP8 or LSE."""
        return (
            self.storage == "dense" and self.layout == "bhnd" and self.q_lens is None and self.k_lens is None
            and (not self.causal or self.align == "top_left" or self.n_q == self.n_k)
            and (not self.causal or self.attn_mask is None)
            and tuple(self.window) == (-1, -1) and not self.softcap and self.alibi_slopes is None
            and self.sinks is None and not self.fp8 and not self.return_lse
        )  # fmt: skip

    @staticmethod
    def _longest(cu: torch.Tensor) -> int:
        return int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0

    def _cache_seqlens(self) -> torch.Tensor:
        if isinstance(self.cache_seqlens, torch.Tensor):
            return self.cache_seqlens.to(device=self.q.device, dtype=torch.int64)
        return torch.full((self.batch,), int(self.cache_seqlens), device=self.q.device, dtype=torch.int64)

    def _key_lens_values(self) -> torch.Tensor:
        """``(B,)`` int64 key slots each sequence uses in its storage (a cache: up to its end)."""
        storage = self.storage
        if storage in ("packed", "paged"):
            return _sequences(self.cu_seqlens_k, 0)[2]
        if storage == "cache":
            return self._cache_seqlens() + self.n_new
        if self.k_lens is not None:
            return self.k_lens.long()
        return torch.full((self.batch,), self.n_k, device=self.q.device)

    # ---- the logical form ---------------------------------------------------------------------

    def _to_bhnd(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.layout == "bhnd" else t.transpose(1, 2)

    def logical(self) -> AttentionCall:
        """This call in its logical form (module docstring): dense ``bhnd``, ``n_q`` rows and ``n_k`` keys
        padded with 0, ``q_lens``/``k_lens`` where needed, a cache's new keys appended (the cache is
        not touched) and its left padding removed; every feature kept. No host synchronisation when
        ``max_seqlen_q/k`` are given (or the storage is dense or a cache)."""
        storage = self.storage
        if storage == "dense" and self.layout == "bhnd":
            return self
        dropped = (
            "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "block_table", "kv_layout",
            "cache_seqlens", "k_new", "v_new", "cache_batch_idx", "cache_leftpad", "out", "layout",
        )  # fmt: skip
        fields = self._fields(*dropped)
        if storage == "dense":
            q, k, v = (self._to_bhnd(t) for t in (self.q, self.k, self.v))
        else:
            q = self.q_to_logical(self.q)
            q_lens = None if self.q.dim() == 4 else _sequences(self.cu_seqlens_q, 0)[2].int()
            (k, v), k_lens = self._logical_kv()
            fields.update(q_lens=q_lens, k_lens=k_lens.int())
        return AttentionCall(**{**fields, "q": q, "k": k, "v": v})

    def _logical_kv(self) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        storage, n = self.storage, self.n_k
        if storage == "packed":
            starts, valid, lens = _sequences(self.cu_seqlens_k, n)
            return (_gather_tokens(self.k, starts, valid), _gather_tokens(self.v, starts, valid)), lens
        if self.block_table is not None:
            slots = self._paged_slots()  # (B, S, H_kv, D) each, S = max_pages * page_size
        else:
            rows = (
                torch.arange(self.batch, device=self.q.device)
                if self.cache_batch_idx is None
                else self.cache_batch_idx.long()
            )
            slots = tuple(self._to_bhnd(t)[rows].transpose(1, 2) for t in (self.k, self.v))
        if storage == "paged":
            _, valid, lens = _sequences(self.cu_seqlens_k, n)
            return tuple(
                t[:, :n].masked_fill(~valid[:, :n, None, None], 0).transpose(1, 2) for t in slots
            ), lens
        # a cache: logical key j is slot j + leftpad: cached below cache_seqlens, then the new keys
        seqlens = self._cache_seqlens()
        start = torch.zeros_like(seqlens) if self.cache_leftpad is None else self.cache_leftpad.long()
        end = seqlens + self.n_new
        slot = torch.arange(n, device=seqlens.device)[None, :] + start[:, None]  # (B, n)
        valid = slot < end[:, None]
        cached = slot < seqlens[:, None]
        parts = []
        for t, new in zip(slots, (self.k_new, self.v_new), strict=True):
            x = (
                t.gather(1, slot.clamp(max=t.shape[1] - 1)[:, :, None, None].expand(-1, -1, *t.shape[2:]))
                if t.shape[1]
                else t.new_zeros(t.shape[0], n, *t.shape[2:])
            )
            if new is not None and self.n_new:
                new = new.transpose(1, 2) if self.layout == "bhnd" else new  # (B, N_new, H_kv, D)
                rel = (slot - seqlens[:, None]).clamp(0, self.n_new - 1)
                x = torch.where(
                    cached[:, :, None, None],
                    x,
                    new.gather(1, rel[:, :, None, None].expand(-1, -1, *new.shape[2:])),
                )
            parts.append(x.masked_fill(~valid[:, :, None, None], 0).transpose(1, 2))
        return (parts[0], parts[1]), end - start

    def _paged_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's key slots through its block table: ``(B, max_pages · page_size, H_kv, D)``."""
        out = []
        for t in (self.k, self.v):
            pages = t if self.kv_layout == "NHD" else t.transpose(1, 2)  # (P, page, H_kv, D)
            table = self.block_table.long().clamp(0, max(pages.shape[0] - 1, 0))
            if pages.shape[0] == 0:
                out.append(pages.new_zeros(self.batch, table.shape[1] * pages.shape[1], *pages.shape[2:]))
                continue
            out.append(pages[table].flatten(1, 2))
        return out[0], out[1]

    # ---- outputs between the kernel's form and the logical form -----------------------------

    def q_to_logical(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor in ``q``'s form (the output, ``dq``; any last dim) as ``(B, H, n_q, ·)``, padding 0."""
        if x.dim() == 4:
            return self._to_bhnd(x)
        starts, valid, _ = _sequences(self.cu_seqlens_q, self.n_q)
        return _gather_tokens(x, starts, valid)

    def kv_to_logical(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor in dense or packed ``k``'s form (``dk``, ``dv``) as ``(B, H_kv, n_k, ·)``, padding 0."""
        if self.storage == "dense":
            return self._to_bhnd(x)
        if self.storage != "packed":
            raise _problem(f"kv_to_logical takes dense or packed keys, not {self.storage} ones")
        starts, valid, _ = _sequences(self.cu_seqlens_k, self.n_k)
        return _gather_tokens(x, starts, valid)

    def q_from_logical(self, x: torch.Tensor) -> torch.Tensor:
        """A logical ``(B, H, n_q, ·)`` tensor in ``q``'s form (the inverse of :meth:`q_to_logical`)."""
        if self.q.dim() == 4:
            return self._to_bhnd(x)
        seq, pos = self._token_positions()
        return x.transpose(1, 2)[seq, pos]  # (total_q, H, ·)

    def _token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each packed query token: its sequence and its position in it."""
        cu = self.cu_seqlens_q.long()
        total = self.q.shape[0]
        seq = torch.repeat_interleave(
            torch.arange(self.batch, device=cu.device), cu[1:] - cu[:-1], output_size=total
        )
        return seq, torch.arange(total, device=cu.device) - cu[seq]

    def lse_to_logical(self, lse: torch.Tensor, form: str) -> torch.Tensor:
        """A kernel's LSE laid out as ``form`` (:data:`LSE_FORMS`) as logical ``(B, H, n_q)``; the
        rows past a sequence's length are ``−inf``."""
        if form not in LSE_FORMS:
            raise ValueError(f"form={form!r} must be one of {', '.join(LSE_FORMS)}")
        if form == "bhn":
            return lse
        per_token = lse if form == "th" else lse.transpose(0, 1)  # (total, H)
        if self.q.dim() == 4:
            return per_token.reshape(self.batch, self.n_q, self.heads).transpose(1, 2)
        starts, valid, _ = _sequences(self.cu_seqlens_q, self.n_q)
        found = _gather_tokens(per_token[:, :, None], starts, valid)[..., 0]  # (B, H, n_q)
        return found.masked_fill(~valid[:, None, :], float("-inf"))

    def lse_from_logical(self, lse: torch.Tensor, form: str) -> torch.Tensor:
        """A logical ``(B, H, n_q)`` LSE laid out as ``form`` (the inverse of :meth:`lse_to_logical`)."""
        if form == "bhn":
            return lse
        if self.q.dim() == 4:
            per_token = lse.transpose(1, 2).reshape(-1, self.heads)
        else:
            seq, pos = self._token_positions()
            per_token = lse.transpose(1, 2)[seq, pos]
        return per_token if form == "th" else per_token.transpose(0, 1)

    # ---- the scores of a block of the logical form (the references' masks and biases) -----

    def score_terms(
        self, batch: slice, q_heads: slice, rows: slice, keys: int, dtype: torch.dtype
    ) -> dict[str, Any]:
        """What the logical call adds to the block of its scores at ``batch``, ``q_heads``, ``rows`` and
        keys ``[0, keys)``, as keyword arguments of :func:`flashprobe.kernels.math.plain_attention`:
        those on of ``valid`` ``(B_b, 1, rows, keys)`` bool, ``bias`` (ALiBi, ``(B_b or 1, H_b, rows,
        keys)`` in ``dtype``), ``softcap`` and ``sinks`` ``(H_b,)``."""
        device = self.q.device
        i = torch.arange(rows.start, rows.stop, device=device)[None, None, :, None]
        j = torch.arange(keys, device=device)[None, None, None, :]
        q_lens = None if self.q_lens is None else self.q_lens[batch].long()[:, None, None, None]
        k_lens = None if self.k_lens is None else self.k_lens[batch].long()[:, None, None, None]
        terms: dict[str, Any] = {}
        valid = None
        if k_lens is not None:
            valid = j < k_lens
        if q_lens is not None:
            valid = (i < q_lens) if valid is None else valid & (i < q_lens)
        left, right = self.window
        right = 0 if self.causal else right
        if left >= 0 or right >= 0 or self.alibi_slopes is not None:
            if self.align == "top_left":
                offset: Any = 0
            else:
                n_q = q_lens if q_lens is not None else self.n_q
                offset = (k_lens if k_lens is not None else self.n_k) - n_q
            d = j - i - offset  # key minus the row's diagonal
            for keep in ((d >= -left) if left >= 0 else None, (d <= right) if right >= 0 else None):
                if keep is not None:
                    valid = keep if valid is None else valid & keep
            if self.alibi_slopes is not None:
                slopes = self.alibi_slopes.to(dtype)
                slopes = slopes[q_heads][None] if slopes.dim() == 1 else slopes[batch, q_heads]
                terms["bias"] = -slopes[:, :, None, None] * d.abs().to(dtype)
        if valid is not None:
            terms["valid"] = valid
        if self.softcap:
            terms["softcap"] = float(self.softcap)
        if self.sinks is not None:
            terms["sinks"] = self.sinks[q_heads].to(dtype)
        return terms

    @property
    def positional(self) -> bool:
        """The logical call masks or biases by position beyond SDPA's top-left causal mask: lengths,
        a window, bottom-right causal with N_q != N_k, ALiBi."""
        return (
            self.q_lens is not None or self.k_lens is not None or tuple(self.window) != (-1, -1)
            or self.alibi_slopes is not None
            or (self.causal and self.attn_mask is not None)
            or (self.causal and self.align == "bottom_right" and self.n_q != self.n_k)
        )  # fmt: skip

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logical call's q, k, v in ``dtype``; FP8 inputs times their descales first (computed
        in ``dtype``, at least float32), as FlashAttention-3's reference does."""
        q, k, v = self.q, self.k, self.v
        if not self.fp8:
            return q.to(dtype), k.to(dtype), v.to(dtype)
        wide = torch.promote_types(dtype, torch.float32)
        rep = self.group
        found = []
        for t, descale, per_query in (
            (q, self.q_descale, True),
            (k, self.k_descale, False),
            (v, self.v_descale, False),
        ):
            x = t.to(wide)
            if descale is not None:
                d = descale.to(wide)
                d = d.repeat_interleave(rep, dim=1) if per_query else d
                x = x * d[:, :, None, None]
            found.append(x.to(dtype))
        return found[0], found[1], found[2]

    # ---- builders: from the logical form to each storage -----------------------------------

    def _fields(self, *dropped: str, **changes: Any) -> dict[str, Any]:
        """This call's fields without ``dropped`` (back to their defaults), with ``changes``."""
        found = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in dropped}
        return {**found, **changes}

    def _lens_list(self) -> tuple[list[int], list[int]]:
        """Per-sequence query and key lengths of a dense call (a host sync)."""
        q_lens = [self.n_q] * self.batch if self.q_lens is None else [int(x) for x in self.q_lens.tolist()]
        k_lens = [self.n_k] * self.batch if self.k_lens is None else [int(x) for x in self.k_lens.tolist()]
        return q_lens, k_lens

    def _require_dense(self, what: str) -> AttentionCall:
        if self.storage != "dense":
            raise _problem(f"{what} builds from a dense call (call.logical()), not a {self.storage} one")
        if self.attn_mask is not None:
            raise _problem(f"{what}: an SDPA attn_mask has no packed form; use lengths, causal or a window")
        return self.with_layout("bhnd")

    def with_layout(self, layout: str) -> AttentionCall:
        """A dense or cache call (and its ``out``) in ``layout``: views of the same storage."""
        if layout == self.layout:
            return self
        names = {"dense": ("q", "k", "v", "out"), "cache": ("q", "k_new", "v_new", "out")}.get(self.storage)
        if names is None:
            raise _problem(f"with_layout takes a dense or cache call, not a {self.storage} one")
        if self.storage == "cache" and self.block_table is None:
            names = (*names, "k", "v")
        swapped = {n: getattr(self, n).transpose(1, 2) for n in names if getattr(self, n) is not None}
        return self.replace(layout=layout, **swapped)

    def packed(self, *, max_seqlen: bool = True) -> AttentionCall:
        """The dense call's sequences packed as varlen ``(total, H, D)`` tensors with ``cu_seqlens``
        (a host sync); ``max_seqlen=False`` leaves ``max_seqlen_q/k`` out."""
        call = self._require_dense("packed()")
        q_lens, k_lens = call._lens_list()

        def pack(t: torch.Tensor, lens: list[int]) -> torch.Tensor:  # (B, H, N, D) → (total, H, D)
            return torch.cat(
                [t[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)]
                + [t.new_zeros(0, t.shape[1], t.shape[3])]
            )

        cu_q, cu_k = (
            torch.tensor([0, *x], dtype=torch.int64).cumsum(0).to(device=self.q.device, dtype=torch.int32)
            for x in (q_lens, k_lens)
        )
        most = (max(q_lens, default=0), max(k_lens, default=0)) if max_seqlen else (None, None)
        return AttentionCall(**call._fields(
            "q_lens", "k_lens", "out", "layout",
            q=pack(call.q, q_lens), k=pack(call.k, k_lens), v=pack(call.v, k_lens),
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=most[0], max_seqlen_k=most[1],
        ))  # fmt: skip

    def _pages(
        self,
        k_lens: list[int],
        page_size: int,
        kv_layout: str,
        generator: torch.Generator | None,
        fill: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_pages, v_pages, block_table)`` of a dense call: each sequence's keys on pages of their
        own, in an order drawn by ``generator`` (None: in order); the unused rows of partial pages, one
        spare page and the table's tail entries (pointing at the spare page) hold ``fill``."""
        counts = [-(-n // page_size) for n in k_lens]
        total = sum(counts) + 1
        order = (
            torch.randperm(total, generator=generator).tolist()
            if generator is not None
            else list(range(total))
        )
        table = torch.full((self.batch, max(max(counts, default=0), 1)), order[-1], dtype=torch.int32)
        pages = [t.new_full((total, page_size, t.shape[1], t.shape[3]), fill) for t in (self.k, self.v)]
        used = iter(order)
        for b, (n, count) in enumerate(zip(k_lens, counts, strict=True)):
            for slot in range(count):
                table[b, slot] = page = next(used)
                a, z = slot * page_size, min(n, (slot + 1) * page_size)
                for p, t in zip(pages, (self.k, self.v), strict=True):
                    p[page, : z - a] = t[b, :, a:z].transpose(0, 1)
        if kv_layout == "HND":
            pages = [p.transpose(1, 2).contiguous() for p in pages]
        return pages[0], pages[1], table.to(self.q.device)

    def paged(
        self,
        page_size: int,
        *,
        kv_layout: str = "NHD",
        generator: torch.Generator | None = None,
        fill: float = 0.0,
    ) -> AttentionCall:
        """The dense call as flash-attn's paged varlen call: packed queries, keys on pages of
        ``page_size`` in ``kv_layout`` (their order drawn by ``generator``), ``block_table`` and
        ``cu_seqlens_k`` (a host sync). Unused page rows, a spare page and the table's tail entries
        hold ``fill`` (NaN poisons what a kernel must not read)."""
        packed = self._require_dense("paged()").packed()
        k, v, table = self.with_layout("bhnd")._pages(
            self._lens_list()[1], page_size, kv_layout, generator, fill
        )
        return packed.replace(k=k, v=v, block_table=table, kv_layout=kv_layout)

    def cached(
        self,
        *,
        new: int = 0,
        leftpad: torch.Tensor | None = None,
        page_size: int | None = None,
        kv_layout: str = "NHD",
        batch_idx: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        fill: float = 0.0,
    ) -> AttentionCall:
        """The dense call as ``flash_attn_with_kvcache``'s (``bnhd``; a host sync): each sequence's last
        ``new`` keys as ``k_new``/``v_new``, the others in a cache after ``leftpad`` empty slots; paged
        with ``page_size`` (as :meth:`paged`) or in rows ``batch_idx`` of a bigger cache; unused rows
        and slots hold ``fill``. Queries must all be valid."""
        call = self._require_dense("cached()")
        if call.q_lens is not None:
            raise _problem("cached(): flash_attn_with_kvcache takes queries of one length; drop q_lens")
        if page_size is not None and batch_idx is not None:
            raise _problem("cached(): a paged cache has no batch_idx")
        _, k_lens = call._lens_list()
        if any(n < new for n in k_lens):
            raise _problem(f"cached(new={new}): every sequence needs at least {new} keys")
        pad = [0] * call.batch if leftpad is None else [int(x) for x in leftpad.tolist()]
        slots = max([p + n for p, n in zip(pad, k_lens, strict=True)], default=0)
        index = list(range(call.batch)) if batch_idx is None else [int(x) for x in batch_idx.tolist()]
        caches, news = [], []
        for t in (call.k, call.v):  # (B, H_kv, N_k, D)
            c = t.new_full((max(index, default=-1) + 1, slots, t.shape[1], t.shape[3]), fill)
            for b, (p, n) in enumerate(zip(pad, k_lens, strict=True)):
                c[index[b], p : p + n - new] = t[b, :, : n - new].transpose(0, 1)
            caches.append(c)
            news.append(
                torch.stack([t[b, :, n - new : n].transpose(0, 1) for b, n in enumerate(k_lens)])
                if new
                else None
            )
        fields = call._fields(
            "q_lens", "k_lens", "out", q=call.q.transpose(1, 2), k=caches[0], v=caches[1], layout="bnhd",
            k_new=news[0], v_new=news[1], cache_leftpad=None if leftpad is None else leftpad.to(torch.int32),
            cache_seqlens=torch.tensor([p + n - new for p, n in zip(pad, k_lens, strict=True)]).int(),
            cache_batch_idx=None if batch_idx is None else batch_idx.to(torch.int32),
        )  # fmt: skip
        fields["cache_seqlens"] = fields["cache_seqlens"].to(self.q.device)
        if page_size is not None:
            whole = AttentionCall(q=call.q, k=caches[0].transpose(1, 2), v=caches[1].transpose(1, 2))
            fields["k"], fields["v"], fields["block_table"] = whole._pages(
                [slots] * call.batch, page_size, kv_layout, generator, fill
            )
            fields["kv_layout"] = kv_layout
        return AttentionCall(**fields)
