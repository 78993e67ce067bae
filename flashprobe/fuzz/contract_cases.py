"""The contract catalogue: fuzz cases for kernels registered with a real library's api.

A kernel registered with ``api="flash_attn_func"``, ``"flash_attn_varlen_func"``,
``"flash_attn_with_kvcache"`` or ``"merge_state"`` (:mod:`flashprobe.kernels.contract`) gets, beside
the dense catalogue, the cases of :data:`CONTRACT_CASES`: each a :class:`ContractCase`, a call as data
testing one of :data:`CONTRACT_PROPERTIES`. :func:`build_call` poses a case to one kernel as an
:class:`~flashprobe.kernels.AttentionCall` in the kernel's own storage and inside its declared limits,
or raises :class:`~flashprobe.fuzz.fit.NotApplicableError` saying why it cannot. Unused pages, cache
slots and block-table tails hold NaN; FP8 runs (``--dtype e4m3``) give q, k, v in E4M3 with
FlashAttention-3's per-(batch, key/value head) descales.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flashprobe.fuzz.fit import NotApplicableError
from flashprobe.kernels import AttentionCall, KernelCapabilities, dtype_name
from flashprobe.kernels.call import FP8_INPUT_DTYPES
from flashprobe.kernels.contract import kernel_align, realign

__all__ = [
    "CONTRACT_APIS",
    "CONTRACT_CASES",
    "CONTRACT_PROPERTIES",
    "FP8_NAMES",
    "ContractCase",
    "build_call",
    "contract_cases",
    "describe_call",
    "fp8_format",
    "quantize",
    "short_dtype",
    "tiny_call",
]

#: the apis the contract catalogue serves (``sdpa`` kernels get only its FP8 cases, when they declare
#: ``KernelCapabilities.fp8``)
CONTRACT_APIS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_state")
_FLASH = CONTRACT_APIS[:3]
_RAGGED = ("flash_attn_varlen_func", "flash_attn_with_kvcache")
_MERGE = ("merge_state",)
#: the short names of the FP8 input dtypes
FP8_NAMES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: E4M3's and E5M2's largest values (a descale maps each (batch, key/value head)'s amax onto it)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

#: What each property of the contract catalogue is (:attr:`ContractCase.property`).
CONTRACT_PROPERTIES: dict[str, str] = {
    "contract basics": "dense and GQA calls of odd lengths through the api's own storage and conventions",
    "tail tile": "key lengths that are no multiple of 64 or 128: a partial last tile",
    "empty sequence": "a sequence with no queries or no keys inside a batch > 1: rows 0, nothing read "
    "from its neighbours",
    "length one": "one query, or one key",
    "ragged lengths": "sequences of different lengths in one call",
    "page sizes": "pages of 1, 16, 64, 128 and 256 keys, the last one partial",
    "poisoned cache": "NaN in unused cache slots, in pages past a sequence's length and in over-allocated "
    "block-table tails",
    "KV append": "new keys written into the cache at cache_seqlens, left padding, cache rows by index",
    "preallocated out": "a preallocated out= full of NaN, overwritten wherever a row is valid",
    "LSE of empty rows": "rows that see no key: output 0, the LSE the kernel declares (−inf or +inf)",
    "causal alignment": "causal with N_q ≠ N_k, anchored bottom-right and top-left",
    "window": "window edges: (0, 0), (1, 1), (N−1, 0), (0, N−1), left ≠ right, with causal",
    "softcap": "softcapped scores with |s/cap| far past 88, and a moderate cap",
    "ALiBi": "ALiBi slopes with N_q ≠ N_k both ways, with causal",
    "merge": "split-KV partial states merged through their LSEs: halves, one partial empty, rows with "
    "no key at all, one partial dominating; a KV-cache call with num_splits > 1, some splits empty",
    "FP8 P-cast": "V = 1 with peaked, sink, rising and diffuse rows: out = 1 (P cast to FP8 without its "
    "2^8 prescale loses the diffuse mass, a stale max saturates it)",
    "refuses bad calls": "cu_seqlens decreasing or past the tensor, pages that do not exist, cache slots "
    "past the cache, head ratios that do not divide: refused (reject or correct)",
}


@dataclass(frozen=True)
class ContractCase:
    """One case of the contract catalogue: a call as data.

    Attributes:
        property: what it tests, a key of :data:`CONTRACT_PROPERTIES`; apis: those it is posed to.
        b, h, h_kv, d: batch, query heads, key/value heads, head dim (fitted to the kernel's).
        n_q, n_k: query and key lengths: one per sequence (a tuple of ``b``) or one for all.
        causal, align, window, softcap, alibi, scale: the call's features (``alibi``: standard slopes).
        spread: the standard deviation of q's and k's entries.
        page_size: keys on pages of this size; over_allocate: block-table columns added per row,
            pointing at a NaN page.
        new, leftpad, batch_idx: KV cache: keys appended by the call, ``cache_leftpad`` of 3 slots for
            every other sequence, the sequences in rows ``cache_batch_idx`` of a bigger cache.
        out: a preallocated ``out=`` full of NaN.
        split_k: merges: keys ``[0, split_k)`` form the first partial (None: half).
        num_splits: KV cache: ``num_splits`` passed to the kernel (None: not passed).
        refuse: what makes the call one the kernel must refuse (empty: a valid call).
        fp8: posed with FP8 inputs too (``--dtype e4m3``).
        cache_q: a KV cache's query length where the queries are ragged elsewhere (0: ``n_q``).
        make: builds the logical call's float64 ``(q, k, v)`` itself (the FP8 fixture).
        backward: the gradients are judged (where the api has a backward).
    """

    name: str
    property: str
    apis: tuple[str, ...] = _FLASH
    b: int = 2
    h: int = 4
    h_kv: int = 2
    d: int = 64
    n_q: int | tuple[int, ...] = 37
    n_k: int | tuple[int, ...] = 77
    causal: bool = False
    align: str = "bottom_right"
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    scale: float | None = None
    spread: float = 1.0
    page_size: int | None = None
    over_allocate: int = 0
    new: int = 0
    leftpad: bool = False
    batch_idx: bool = False
    out: bool = False
    split_k: int | None = None
    num_splits: int | None = None
    refuse: str = ""
    fp8: bool = False
    make: Callable[[ContractCase, int, torch.Generator], tuple[torch.Tensor, ...]] | None = None
    backward: bool = True
    cache_q: int = 0

    def __post_init__(self) -> None:
        if self.property not in CONTRACT_PROPERTIES:
            raise ValueError(f"case {self.name}: unknown property {self.property!r}")

    def lengths(self, api: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-sequence query and key lengths (for ``api``)."""
        n_q = self.cache_q if self.cache_q and api == "flash_attn_with_kvcache" else self.n_q
        q = n_q if isinstance(n_q, tuple) else (n_q,) * self.b
        k = self.n_k if isinstance(self.n_k, tuple) else (self.n_k,) * self.b
        return q, k


def _fp8_fixture(case: ContractCase, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """V = 1 and exact logits (one-hot queries, ``D ≥ N_q``, scale 1) per row kind: peaked, sink,
    rising tile after tile, and diffuse."""
    n_q, n_k = case.n_q, case.n_k
    assert isinstance(n_q, int) and isinstance(n_k, int) and d >= n_q
    j = torch.arange(n_k, dtype=torch.float64)
    rows = []
    for r in range(n_q):
        kind = r % 4
        if kind == 0:
            z = torch.full((n_k,), -7.0, dtype=torch.float64)
            z[int(torch.randint(n_k, (1,), generator=gen))] = 0.0
        elif kind == 1:
            z = -2.0 * torch.rand(n_k, generator=gen, dtype=torch.float64)
            z[int(torch.randint(n_k, (1,), generator=gen))] = 6.0
        elif kind == 2:
            z = (1 + r % 8) * j / n_k
        else:
            z = -torch.rand(n_k, generator=gen, dtype=torch.float64)
        rows.append(z)
    z = torch.stack(rows)  # (N_q, N_k)
    q = torch.zeros(case.b, case.h, n_q, d, dtype=torch.float64)
    q[:, :, torch.arange(n_q), torch.arange(n_q)] = 1.0
    k = torch.zeros(case.b, case.h_kv, n_k, d, dtype=torch.float64)
    k[..., :n_q] = z.T
    v = torch.ones(case.b, case.h_kv, n_k, d, dtype=torch.float64)
    return q, k, v


def _cases() -> tuple[ContractCase, ...]:
    ragged_q, ragged_k = (1, 17, 64, 33), (77, 5, 130, 200)
    three = dict(b=3, n_q=(13, 9, 20), n_k=(40, 30, 25))  # three ragged sequences
    paged = dict(b=3, n_q=(17, 1, 9), n_k=(77, 5, 40), cache_q=3)
    windows = {
        "window_0_0": dict(n_q=77, n_k=77, window=(0, 0)),
        "window_1_1": dict(n_q=77, n_k=77, window=(1, 1)),
        "window_n_minus_1_left": dict(n_q=77, n_k=77, window=(76, 0)),
        "window_n_minus_1_right": dict(n_q=77, n_k=77, window=(0, 76)),
        "window_left_gt_right": dict(window=(9, 2)),
        "window_right_gt_left": dict(window=(2, 9)),
        "window_causal_left": dict(n_q=77, n_k=77, causal=True, window=(8, 0)),
    }
    pages = [
        ContractCase(
            f"paged_{p}",
            "page sizes",
            _RAGGED,
            **{**paged, **({} if p < 256 else dict(n_q=(9, 1, 5), n_k=(300, 5, 257)))},
            page_size=p,
            fp8=p == 16,
        )
        for p in (1, 16, 64, 128, 256)
    ]
    return (
        ContractCase("contract_dense", "contract basics", (*_FLASH, *_MERGE), n_q=77, n_k=77, fp8=True),
        ContractCase("contract_mqa", "contract basics", h=4, h_kv=1, fp8=True),
        ContractCase("contract_gqa4", "contract basics", h=8, h_kv=2, n_q=45, n_k=45, causal=True),
        ContractCase("tail_tile_200", "tail tile", (*_FLASH, *_MERGE), b=1, n_q=64, n_k=200),
        ContractCase("tail_tile_130_causal", "tail tile", b=1, n_q=130, n_k=130, causal=True),
        ContractCase("length_one_query", "length one", (*_FLASH, *_MERGE), n_q=1, n_k=77, fp8=True),
        ContractCase("length_one_key", "length one", n_q=9, n_k=1),
        ContractCase(
            "empty_keys_in_batch",
            "empty sequence",
            ("flash_attn_varlen_func",),
            b=3,
            n_q=(13, 9, 20),
            n_k=(40, 0, 25),
        ),
        ContractCase(
            "empty_cache_in_batch",
            "empty sequence",
            ("flash_attn_with_kvcache",),
            b=3,
            n_q=9,
            n_k=(40, 0, 25),
        ),
        ContractCase(
            "empty_queries_in_batch", "empty sequence", ("flash_attn_varlen_func",), b=3, n_q=(13, 0, 20),
            n_k=(40, 30, 25),
        ),
        ContractCase(
            "ragged", "ragged lengths", _RAGGED, b=4, n_q=ragged_q, n_k=ragged_k, fp8=True, cache_q=5
        ),
        ContractCase(
            "ragged_causal",
            "ragged lengths",
            _RAGGED,
            b=4,
            n_q=(1, 5, 64, 33),
            n_k=ragged_k,
            causal=True,
            cache_q=5,
        ),
        *pages,
        ContractCase(
            "paged_over_allocated", "poisoned cache", _RAGGED, **paged, page_size=16, over_allocate=2
        ),
        ContractCase("cache_append", "KV append", ("flash_attn_with_kvcache",), n_q=4, n_k=(77, 40), new=3),
        ContractCase(
            "cache_num_splits",
            "merge",
            ("flash_attn_with_kvcache",),
            b=3,
            n_q=4,
            n_k=(77, 2, 40),
            causal=True,
            num_splits=4,
        ),
        ContractCase(
            "cache_leftpad_rows",
            "KV append",
            ("flash_attn_with_kvcache",),
            b=3,
            n_q=2,
            n_k=(50, 20, 33),
            new=2,
            leftpad=True,
            batch_idx=True,
        ),
        ContractCase(
            "cache_paged_append",
            "KV append",
            ("flash_attn_with_kvcache",),
            b=3,
            n_q=3,
            n_k=(50, 3, 33),
            new=3,
            page_size=16,
            causal=True,
        ),
        ContractCase("out_poisoned", "preallocated out", n_q=77, n_k=37, causal=True, out=True),
        ContractCase(
            "out_poisoned_ragged",
            "preallocated out",
            _RAGGED,
            b=3,
            n_q=(13, 9, 20),
            n_k=(40, 0, 25),
            out=True,
            cache_q=4,
        ),
        ContractCase(
            "causal_rows_without_keys",
            "LSE of empty rows",
            (*_FLASH, *_MERGE),
            n_q=77,
            n_k=37,
            causal=True,
            fp8=True,
        ),
        ContractCase("window_rows_without_keys", "LSE of empty rows", n_q=40, n_k=20, window=(2, 3)),
        ContractCase("causal_bottom_right", "causal alignment", causal=True, fp8=True),
        ContractCase("causal_top_left", "causal alignment", n_q=77, n_k=37, causal=True, align="top_left"),
        *(ContractCase(name, "window", **kw) for name, kw in windows.items()),
        ContractCase("softcap_past_88", "softcap", n_q=33, n_k=77, softcap=1.0, scale=1.0, spread=4.0),
        ContractCase("softcap_30_causal", "softcap", n_q=77, n_k=77, softcap=30.0, causal=True, spread=2.0),
        ContractCase("alibi_nq_lt_nk", "ALiBi", alibi=True),
        ContractCase("alibi_nq_gt_nk", "ALiBi", n_q=77, n_k=37, alibi=True),
        ContractCase("alibi_causal_cross", "ALiBi", alibi=True, causal=True),
        ContractCase("merge_halves", "merge", _MERGE),
        ContractCase("merge_first_empty", "merge", _MERGE, split_k=0),
        ContractCase("merge_second_empty", "merge", _MERGE, split_k=77),
        ContractCase("merge_rows_without_keys", "merge", _MERGE, n_q=77, n_k=37, causal=True, split_k=20),
        ContractCase("merge_dominant", "merge", _MERGE, spread=3.0, split_k=9),
        ContractCase(
            "fp8_pcast_fixture",
            "FP8 P-cast",
            (*_FLASH, "sdpa"),
            b=1,
            h=2,
            h_kv=2,
            d=32,
            n_q=32,
            n_k=512,
            scale=1.0,
            make=_fp8_fixture,
            fp8=True,
            backward=False,
        ),
        ContractCase("refuse_head_ratio", "refuses bad calls", _FLASH, refuse="head_ratio", backward=False),
        *(
            ContractCase(
                f"refuse_{how}", "refuses bad calls", ("flash_attn_varlen_func",), **three, refuse=how,
                backward=False,
            )
            for how in ("cu_seqlens_decreasing", "cu_seqlens_past_total")
        ),
        ContractCase(
            "refuse_page_out_of_range", "refuses bad calls", _RAGGED, **three, page_size=16,
            refuse="page_out_of_range", backward=False, cache_q=3,
        ),
        ContractCase(
            "refuse_cache_past_slots",
            "refuses bad calls",
            ("flash_attn_with_kvcache",),
            n_q=3,
            n_k=(40, 30),
            new=2,
            refuse="cache_past_slots",
            backward=False,
        ),
    )


#: The contract catalogue (:class:`ContractCase` by name), in the order it runs.
CONTRACT_CASES: dict[str, ContractCase] = {c.name: c for c in _cases()}


def contract_cases(api: str, caps: KernelCapabilities) -> list[ContractCase]:
    """The cases of the catalogue posed to a kernel of ``api`` (an SDPA kernel: the FP8 ones, when it
    declares ``caps.fp8``)."""
    if api == "sdpa":
        return [c for c in CONTRACT_CASES.values() if "sdpa" in c.apis] if caps.fp8 else []
    return [c for c in CONTRACT_CASES.values() if api in c.apis]


def short_dtype(dtype: torch.dtype) -> str:
    """``e4m3`` for ``float8_e4m3fn`` (``e5m2`` likewise), else :func:`~flashprobe.kernels.dtype_name`."""
    return next((n for n, d in FP8_NAMES.items() if d == dtype), dtype_name(dtype))


def fp8_format(call: AttentionCall, caps: KernelCapabilities) -> str | None:
    """The FP8 format the kernel's judge uses for ``call``: its inputs' (``e4m3``) or the one it declares
    rounding to (``KernelCapabilities.fp8``); None for a kernel without FP8."""
    return short_dtype(call.q.dtype) if call.fp8 else caps.fp8


def quantize(x: torch.Tensor, dtype: torch.dtype, heads_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(B, H, N, D)`` float64 in an FP8 ``dtype``, and FlashAttention-3's ``(B, H_kv)``
    float32 descales mapping each group's amax onto the format's largest value
    (``x ≈ x_fp8 · descale``)."""
    b, h = x.shape[:2]
    groups = x.reshape(b, heads_kv, -1).abs().amax(-1) if x.numel() else x.new_zeros(b, heads_kv)
    descale = torch.where(groups > 0, groups / _FP8_MAX[dtype], 1.0).float()  # (B, H_kv)
    per_head = descale.double().repeat_interleave(h // heads_kv, dim=1)[:, :, None, None]
    return (x / per_head).to(dtype), descale


def _head_dim(d: int, caps: KernelCapabilities) -> int:
    """The head dim nearest ``d`` (preferring larger) the kernel declares."""
    if caps.head_dims is not None:
        dims = sorted(caps.head_dims, key=lambda x: (x < d, abs(x - d)))
        if not dims:
            raise NotApplicableError("it declares no head dim")
        return dims[0]
    m = caps.head_dim_multiple
    found = -(-d // m) * m
    if caps.max_head_dim is not None and found > caps.max_head_dim:
        found = caps.max_head_dim // m * m
    if found < 1:
        raise NotApplicableError(f"no head dim fits its limits (multiple {m}, at most {caps.max_head_dim})")
    return found


def _page_size(case: ContractCase, caps: KernelCapabilities) -> int | None:
    if case.page_size is None:
        return None
    problem = caps.page_problem(case.page_size)
    if problem is None:
        return case.page_size
    if case.property == "page sizes":  # the size is the point
        raise NotApplicableError(f"pages of {case.page_size}: it {problem}")
    allowed = [p for p in (16, 32, 64, 128, 256, 512) if caps.page_problem(p) is None]
    if not allowed:
        raise NotApplicableError(f"no page size fits: it {problem}")
    return allowed[0]


def _alibi(h: int) -> torch.Tensor:
    """The standard ALiBi slopes ``2^(−8(i+1)/H)``, ``(H,)`` float32."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32)


def _tensors(case: ContractCase, d: int, gen: torch.Generator, api: str) -> tuple[torch.Tensor, ...]:
    """``q (B, H, N_q, D)``, ``k``, ``v (B, H_kv, N_k, D)`` in float64, 0 past each length."""
    if case.make is not None:
        return case.make(case, d, gen)
    q_lens, k_lens = case.lengths(api)
    h = max(case.h, case.h_kv) if not case.refuse else 4  # a ratio that does not divide is cut later
    h_kv = case.h_kv if not case.refuse else 2
    nq, nk = max(q_lens, default=0), max(k_lens, default=0)
    q = torch.randn(case.b, h, nq, d, generator=gen, dtype=torch.float64) * case.spread
    k = torch.randn(case.b, h_kv, nk, d, generator=gen, dtype=torch.float64) * case.spread
    v = torch.randn(case.b, h_kv, nk, d, generator=gen, dtype=torch.float64)
    for b, (a, z) in enumerate(zip(q_lens, k_lens, strict=True)):
        q[b, :, a:] = 0.0
        k[b, :, z:] = 0.0
        v[b, :, z:] = 0.0
    return q, k, v


def _logical(
    case: ContractCase, caps: KernelCapabilities, dtype: torch.dtype, gen: torch.Generator, api: str
) -> AttentionCall:
    """The case's logical (dense ``bhnd``) call in ``dtype``, FP8 inputs with their descales."""
    d = _head_dim(case.d, caps)
    if case.make is not None and d < case.d:
        raise NotApplicableError(f"its exact logits need head dim {case.d}; it takes at most {d}")
    q, k, v = _tensors(case, d, gen, api)
    h_kv = k.shape[1]
    descales: dict[str, Any] = {}
    if dtype in FP8_INPUT_DTYPES:
        q, descales["q_descale"] = quantize(q, dtype, h_kv)
        k, descales["k_descale"] = quantize(k, dtype, h_kv)
        v, descales["v_descale"] = quantize(v, dtype, h_kv)
    else:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q_lens, k_lens = case.lengths(api)
    lens = {
        name: torch.tensor(values, dtype=torch.int32)
        for name, values in (("q_lens", q_lens), ("k_lens", k_lens))
        if len(set(values)) > 1
    }
    lse = caps.lse and api != "sdpa"
    call = AttentionCall(
        q=q,
        k=k,
        v=v,
        causal=case.causal,
        align=case.align,
        window=case.window,
        softcap=case.softcap,
        alibi_slopes=_alibi(q.shape[1]) if case.alibi else None,
        scale=case.scale,
        return_lse=lse,
        lse_base=caps.lse_base,
        split_k=case.split_k,
        num_splits=case.num_splits if api == "flash_attn_with_kvcache" else None,
        **lens,
        **descales,
    )
    aligned = realign(call, kernel_align(api, caps)) if api != "merge_state" else call
    if isinstance(aligned, str):
        raise NotApplicableError(f"it {aligned}")
    return aligned


def _over_allocated(call: AttentionCall, columns: int) -> AttentionCall:
    """A paged call with ``columns`` more block-table entries per row, each naming a page of NaN."""
    pages = call.k.shape[0]
    nan_page = [torch.full_like(t[:1], float("nan")) for t in (call.k, call.v)]
    extra = torch.full((call.batch, columns), pages, dtype=torch.int32, device=call.q.device)
    return call.replace(
        k=torch.cat([call.k, nan_page[0]]),
        v=torch.cat([call.v, nan_page[1]]),
        block_table=torch.cat([call.block_table, extra], dim=1),
    )


def _storage(
    case: ContractCase, logical: AttentionCall, api: str, caps: KernelCapabilities, gen: torch.Generator
) -> AttentionCall:
    """The logical call in the storage the api takes, unused memory poisoned with NaN."""
    nan = float("nan")
    page = _page_size(case, caps)
    if api == "flash_attn_func":
        if logical.q_lens is not None or logical.k_lens is not None:
            raise NotApplicableError("flash_attn_func takes sequences of one length; the case needs several")
        dense = logical.with_layout("bnhd")
        return dense.replace(**{n: getattr(dense, n).contiguous() for n in ("q", "k", "v")})
    if api == "flash_attn_varlen_func":
        call = logical.paged(page, generator=gen, fill=nan) if page else logical.packed()
        return _over_allocated(call, case.over_allocate) if case.over_allocate else call
    if api == "flash_attn_with_kvcache":
        if logical.q_lens is not None:
            raise NotApplicableError(
                "flash_attn_with_kvcache takes queries of one length; the case needs several"
            )
        b = logical.batch
        leftpad = torch.tensor([3 * (i % 2) for i in range(b)], dtype=torch.int32) if case.leftpad else None
        rows = torch.arange(b, dtype=torch.int32).flip(0) * 2 if case.batch_idx else None
        _, k_lens = case.lengths(api)
        if case.new and min(k_lens) < case.new:
            raise NotApplicableError(f"every sequence needs {case.new} keys to append")  # (not raised today)
        call = logical.cached(
            new=case.new, leftpad=leftpad, page_size=page, batch_idx=rows, generator=gen, fill=nan
        )
        return _over_allocated(call, case.over_allocate) if case.over_allocate and page else call
    return logical  # merge_state, sdpa: the logical call


def _refused(call: AttentionCall, how: str) -> AttentionCall:
    """``call`` made into one the kernel must refuse (unchecked)."""
    fields = {name: getattr(call, name) for name in call.__dataclass_fields__}
    if how == "head_ratio":  # 3 query heads for 2 key/value heads
        fields["q"] = call.q[..., :3, :]  # (the flash apis' q is (…, H, D))
        fields["return_lse"] = False
    elif how == "cu_seqlens_decreasing":
        cu = call.cu_seqlens_k.clone()
        first, second = int(cu[1]), int(cu[2])
        cu[1], cu[2] = second, first  # one sequence ends before it starts
        fields["cu_seqlens_k"] = cu
    elif how == "cu_seqlens_past_total":
        cu = call.cu_seqlens_k.clone()
        cu[-1] += 16  # the last sequence runs past the packed keys
        fields["cu_seqlens_k"] = cu
        fields["max_seqlen_k"] = max(int(call.max_seqlen_k or 0), int(cu[-1] - cu[-2]))
    elif how == "page_out_of_range":
        table = call.block_table.clone()
        table[0, 0] = call.k.shape[0] + 3  # a page that does not exist
        fields["block_table"] = table
    elif how == "cache_past_slots":
        slots = call.k.shape[1] if call.layout == "bnhd" else call.k.shape[2]
        seqlens = call.cache_seqlens.clone()
        seqlens[-1] = slots  # the appended keys would be written past the cache
        fields["cache_seqlens"] = seqlens
    else:
        raise ValueError(f"unknown refusal {how!r}")
    return AttentionCall.unchecked(**fields)


def build_call(
    case: ContractCase, api: str, caps: KernelCapabilities, dtype: torch.dtype, gen: torch.Generator
) -> AttentionCall:
    """The case as one call to a kernel of ``api`` with ``caps`` at ``dtype``, in the api's storage.

    Raises:
        NotApplicableError: the case cannot be posed inside the kernel's limits without losing its
            point (the message says why), or not at ``dtype`` (a case not posed with FP8 inputs).
    """
    fp8_in = dtype in FP8_INPUT_DTYPES
    if fp8_in and not case.fp8:
        raise NotApplicableError(f"posed at 16 and 32 bits only, not with {short_dtype(dtype)} inputs")
    if case.property == "FP8 P-cast" and not (fp8_in or caps.fp8):
        raise NotApplicableError(
            "only an FP8 kernel casts P to FP8: run it with --dtype e4m3 (FP8 inputs) or declare "
            "KernelCapabilities(fp8=...)"
        )
    logical = _logical(case, caps, dtype, gen, api)
    call = _storage(case, logical, api, caps, gen)
    if case.out:
        call = call.replace(
            out=torch.full((*call.q.shape[:-1], call.head_dim_v), float("nan"), dtype=call.out_dtype)
        )
    return _refused(call, case.refuse) if case.refuse else call


def describe_call(call: AttentionCall) -> str:
    """The call in one line: storage, batch, heads, lengths, head dim and its features."""
    q = tuple(call.q.shape)
    parts = [f"{call.storage} q{q}", f"H={call.heads}/{call.heads_kv}" if call.q.dim() else ""]
    if call.storage == "dense":
        parts.append(f"N_q={call.n_q} N_k={call.n_k}")
    if call.cu_seqlens_q is not None:
        cu_q, cu_k = (t.tolist() for t in (call.cu_seqlens_q, call.cu_seqlens_k))
        parts.append(f"cu_q={cu_q} cu_k={cu_k}")
    if call.block_table is not None:
        parts.append(f"pages {call.page_size} table{tuple(call.block_table.shape)}")
    if call.cache_seqlens is not None:
        seqlens = (
            call.cache_seqlens.tolist()
            if isinstance(call.cache_seqlens, torch.Tensor)
            else call.cache_seqlens
        )
        parts.append(f"cache_seqlens={seqlens} new={call.n_new}")
    flags = [
        "causal" if call.causal else "",
        f"window={tuple(call.window)}" if tuple(call.window) != (-1, -1) else "",
        f"softcap={call.softcap:g}" if call.softcap else "",
        "alibi" if call.alibi_slopes is not None else "",
        f"scale={call.scale:g}" if call.scale is not None else "",
        f"lse base {call.lse_base}" if call.return_lse else "",
        "out=" if call.out is not None else "",
        f"split_k={call.split_k}" if call.split_k is not None else "",
        f"num_splits={call.num_splits}" if call.num_splits is not None else "",
        call.align.replace("_", "-")
        if call.causal or call.alibi_slopes is not None or call.window != (-1, -1)
        else "",
    ]
    return " ".join(p for p in (*parts, *flags) if p)


def tiny_call(
    api: str, caps: KernelCapabilities, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> AttentionCall:
    """The smallest plain call a kernel of ``api`` declares it takes at ``dtype`` (``flashprobe
    kernels``' test call): one sequence and head, lengths ≥ 8 of its multiple, in its storage."""
    d = _head_dim(16, caps)
    n = max(8, caps.seq_multiple)
    gen = torch.Generator().manual_seed(0)
    case = ContractCase("tiny", "contract basics", b=1, h=1, h_kv=1, d=d, n_q=n, n_k=n)
    logical = _logical(case, caps, dtype, gen, api).replace(return_lse=False)
    call = _storage(case, logical, api, caps, gen)
    return _on(call, torch.device(device))


def _on(call: AttentionCall, device: torch.device) -> AttentionCall:
    """``call`` with every tensor moved to ``device``."""
    moved = {
        name: getattr(call, name).to(device)
        for name in call.__dataclass_fields__
        if isinstance(getattr(call, name), torch.Tensor)
    }
    return call.replace(**moved) if moved else call
