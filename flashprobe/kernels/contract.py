"""The contracts (apis) a kernel is registered with, and one adapter per contract.

* ``sdpa``: ``fn(q, k, v, *, attn_mask=None, is_causal=False, scale=None) -> out`` on ``(B, H, N, D)``
  tensors (:mod:`flashprobe.kernels._inputs`).
* ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``: flash-attn 2.8's
  functions (:data:`API_PARAMETERS`), called by keyword with only the arguments a call uses, plus
  FlashAttention-3's and flash-attention 4's (:data:`FA3_PARAMETERS`).
* ``merge_state``: FlashInfer's ``merge_state(v_a, s_a, v_b, s_b) -> (v, s)`` (``v_x (T, H, D)``,
  ``s_x (T, H)`` float32 LSEs in the kernel's base) on the golden partials of keys ``[0, split_k)``
  and ``[split_k, N_k)``, rounded as a split-KV kernel stores them.

:func:`contract_problem` says why a kernel cannot take a call (feature and fix) before any work;
:func:`run_contract` converts an :class:`~flashprobe.kernels.call.AttentionCall` to the kernel's
arguments (a call already in the api's storage passes as it is), calls it and brings its return to
the logical form; :func:`call_from_arguments` reads a call from a real function's arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from flashprobe.kernels.call import AttentionCall, CallOutput, convert_lse

if TYPE_CHECKING:
    from flashprobe.kernels.registry import KernelCapabilities

__all__ = [
    "APIS",
    "API_PARAMETERS",
    "FA3_PARAMETERS",
    "accepts",
    "call_from_arguments",
    "contract_problem",
    "kernel_align",
    "kernel_arguments",
    "logical_outputs",
    "realign",
    "run_contract",
    "sdpa_arguments",
]

#: the contracts a kernel can be registered with
APIS = ("sdpa", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "merge_state")

#: each api's parameters in order: flashprobe's SDPA kernel signature; flash-attn 2.8.4's
#: ``flash_attn/flash_attn_interface.py``; FlashInfer 0.6's ``flashinfer/cascade.py``
API_PARAMETERS: Mapping[str, tuple[str, ...]] = {
    "sdpa": ("q", "k", "v", "attn_mask", "is_causal", "scale"),
    "flash_attn_func": (
        "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
        "deterministic", "return_attn_probs",
    ),
    "flash_attn_varlen_func": (
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
        "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
        "return_attn_probs", "block_table",
    ),
    "flash_attn_with_kvcache": (
        "q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
        "cache_leftpad", "block_table", "softmax_scale", "causal", "window_size", "softcap",
        "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse",
    ),
    "merge_state": ("v_a", "s_a", "v_b", "s_b"),
}  # fmt: skip
#: the keywords FlashAttention-3 (``hopper/flash_attn_interface.py``) and flash-attention 4
#: (``flash_attn/cute/interface.py``) add to the same entry points, as the adapters pass them
FA3_PARAMETERS = ("q_descale", "k_descale", "v_descale", "learnable_sink", "out", "seqused_q", "seqused_k")

#: the causal alignment of each api's kernels
_ALIGN = {"sdpa": "top_left", "merge_state": "bottom_right"}
#: how each api lays out its LSE (:data:`~flashprobe.kernels.call.LSE_FORMS`)
_LSE_FORM = {"flash_attn_func": "bhn", "flash_attn_varlen_func": "ht", "flash_attn_with_kvcache": "bhn"}
#: the storages each api takes as they are (others are converted through the logical form)
_STORAGES = {
    "flash_attn_func": ("dense",),
    "flash_attn_varlen_func": ("packed", "paged"),
    "flash_attn_with_kvcache": ("cache",),
}


def kernel_align(api: str, caps: KernelCapabilities) -> str:
    """Where the kernel anchors its causal mask: what it declares, else its api's."""
    return caps.causal_align or _ALIGN.get(api, "bottom_right")


def _fixed_lengths(call: AttentionCall) -> bool:
    """Every sequence has the same lengths (known without reading a tensor)."""
    return call.storage == "dense" and call.q_lens is None and call.k_lens is None


def realign(call: AttentionCall, align: str) -> AttentionCall | str:
    """``call`` with its causal mask, window and ALiBi anchored at ``align`` (a dense call of one
    length moves its window by ``N_k − N_q``), or why it cannot be."""
    if call.align == align:
        return call
    left, right = call.window
    right = 0 if call.causal else right
    moved = (left, right) != (-1, -1) or call.alibi_slopes is not None
    if not moved or (_fixed_lengths(call) and call.n_q == call.n_k):
        return call.replace(align=align)
    ours, theirs = align.replace("_", "-"), call.align.replace("_", "-")
    where = f"anchors causal, windows and ALiBi at {ours}, this call at {theirs}"
    if call.alibi_slopes is not None or not _fixed_lengths(call):
        return f"{where} with lengths per sequence or ALiBi (no window expresses that)"
    shift = call.n_k - call.n_q if align == "bottom_right" else call.n_q - call.n_k  # its diagonal minus ours
    left2 = left + shift if left >= 0 else -1
    right2 = right - shift if right >= 0 else -1
    if (left >= 0 and left2 < 0) or (right >= 0 and right2 < 0):
        return f"{where}; with N_q={call.n_q}, N_k={call.n_k} no window of it is this mask"
    causal = right2 == 0
    return call.replace(align=align, causal=causal, window=(left2, 0 if causal else right2))


def _windowed(call: AttentionCall) -> bool:
    left, right = call.window
    return left >= 0 or (right >= 0 and not call.causal)


def contract_problem(api: str, call: AttentionCall, caps: KernelCapabilities) -> str | None:
    """Why a kernel of ``api`` with ``caps`` cannot take ``call`` (the feature and the fix), or None.
    Reads shapes, dtypes and flags only: no host synchronisation."""
    problem = caps.setting_problem(call.q.device, call.q.dtype)
    if problem is not None:
        return problem
    if torch.is_grad_enabled() and any(t.requires_grad for t in (call.q, call.k, call.v)):
        if api in ("flash_attn_with_kvcache", "merge_state"):
            return f"inputs require grad, but {api} has no backward; compare it forward only"
        problem = caps.setting_problem(call.q.device, call.q.dtype, backward=True)
        if problem is not None:
            return f"inputs require grad, but it {problem}"
    problem = caps.head_problem(call.head_dim, call.head_dim_v, call.heads, call.heads_kv)
    if problem is not None:
        return problem
    if api == "merge_state":
        return None
    if api == "sdpa":
        return _sdpa_problem(call, caps)
    for flag, wanted, what in (
        ("window", tuple(call.window) != (-1, -1), "windows (window_size)"),
        ("softcap", bool(call.softcap), "softcap"),
        ("alibi", call.alibi_slopes is not None, "ALiBi"),
        ("sinks", call.sinks is not None, "attention sinks"),
        ("lse", call.return_lse, "an LSE output"),
        ("preallocated_out", call.out is not None, "a preallocated out="),
        ("cache_leftpad", call.cache_leftpad is not None, "cache_leftpad"),
    ):
        if wanted and not getattr(caps, flag):
            return f"does not declare {what}; compare calls without it, or declare {flag}=True if it has it"
    if call.fp8 and not (caps.dtypes and call.q.dtype in caps.dtypes):
        return "takes no FP8 inputs (declare float8_e4m3fn among its dtypes for FlashAttention-3's descales)"
    if call.attn_mask is not None and not (api == "flash_attn_varlen_func" and _key_padding(call)):
        return (
            f"{api} takes no attn_mask (only a bool key-padding mask becomes varlen lengths); "
            "use lengths, causal or a window"
        )
    found = realign(call, kernel_align(api, caps))
    if isinstance(found, str):
        return found
    if _windowed(found) and not caps.window:
        return "does not declare windows; a causal mask at another anchor needs one"
    causal = found.causal
    storage = call.storage
    if api == "flash_attn_func" and not _fixed_lengths(call):
        return "flash_attn_func takes sequences of one length; give ragged calls to flash_attn_varlen_func"
    if api == "flash_attn_with_kvcache" and (storage in ("packed", "paged") or call.q_lens is not None):
        return (
            "flash_attn_with_kvcache takes queries of one length (dense q); "
            "give packed calls to flash_attn_varlen_func"
        )
    if api == "flash_attn_varlen_func" and storage == "cache":
        return (
            "flash_attn_varlen_func takes no KV cache with appended keys; give it to flash_attn_with_kvcache"
        )
    if call.page_size is not None:
        problem = caps.page_problem(call.page_size)
        if problem is not None:
            return problem
    if _fixed_lengths(call):
        problem = caps.length_problem(call.n_q, call.n_k, bool(causal))
        if problem is not None:
            return problem
    elif caps.same_length or caps.seq_multiple > 1:
        return f"takes {caps.describe_lengths()} only, not lengths per sequence; choose a kernel without it"
    if causal and storage == "dense" and call.n_q != call.n_k and not caps.causal_cross:
        return f"does not support causal with N_q != N_k (N_q={call.n_q}, N_k={call.n_k})"
    return None


def _key_padding(call: AttentionCall) -> bool:
    """The call's mask is a bool key-padding mask and nothing depends on key positions."""
    m = call.attn_mask
    return (
        m is not None and m.dtype == torch.bool and m.dim() >= 3 and all(s == 1 for s in m.shape[1:-1])
        and not call.causal and tuple(call.window) == (-1, -1) and call.alibi_slopes is None
    )  # fmt: skip


def _sdpa_problem(call: AttentionCall, caps: KernelCapabilities) -> str | None:
    """The features SDPA's signature cannot carry (the masks it can are checked on its arguments)."""
    for wanted, what in (
        (bool(call.softcap), "softcap"),
        (call.sinks is not None, "attention sinks"),
        (call.return_lse, "an LSE output"),
        (call.fp8, "FP8 inputs with descales"),
        (call.out is not None, "a preallocated out="),
    ):
        if wanted:
            return (
                f"the SDPA contract has no {what}; register a kernel that has it with its own api "
                "(e.g. api='flash_attn_func')"
            )
    return None


def sdpa_arguments(call: AttentionCall, caps: KernelCapabilities) -> dict[str, Any]:
    """SDPA's ``q, k, v, attn_mask, is_causal, scale`` expressing ``call`` (positional masks as a bool
    mask, ALiBi as an additive one; grouped heads repeated unless the kernel declares ``gqa="native"``)."""
    from flashprobe.kernels.registry import ANY_CAPABILITIES  # (the registry imports this module)

    logical = call.logical()
    q, k, v = logical.q, logical.k, logical.v
    if logical.group > 1 and (caps.gqa != "native" or caps is ANY_CAPABILITIES):  # as SDPA without enable_gqa
        k, v = (t.repeat_interleave(logical.group, dim=1) for t in (k, v))
    mask = logical.attn_mask
    if not logical.is_sdpa:
        terms = logical.score_terms(
            slice(0, logical.batch), slice(0, logical.heads), slice(0, logical.n_q), logical.n_k, q.dtype
        )
        valid, bias = terms.get("valid"), terms.get("bias")
        if bias is not None:
            extra = bias if valid is None else bias.masked_fill(~valid, float("-inf"))
            mask = (
                extra
                if mask is None
                else (extra.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else extra + mask)
            )
        elif valid is not None:
            mask = _restrict(mask, valid)
    causal = logical.causal and logical.is_sdpa
    return {"q": q, "k": k, "v": v, "attn_mask": mask, "is_causal": causal, "scale": logical.scale}


def _restrict(mask: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor:
    """``mask`` (None, bool or additive) with the positions where ``keep`` is False masked too."""
    if mask is None:
        return keep
    return mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))


def _flash_keywords(api: str, call: AttentionCall) -> dict[str, Any]:
    """The keywords flash-attn's functions take for ``call`` (anchored as the kernel anchors)."""
    kw: dict[str, Any] = {"softmax_scale": call.scale, "causal": call.causal}
    left, right = call.window
    if _windowed(call) or (call.causal and left >= 0):
        kw["window_size"] = (left, 0 if call.causal else right)
    if call.softcap:
        kw["softcap"] = float(call.softcap)
    if call.alibi_slopes is not None:
        kw["alibi_slopes"] = call.alibi_slopes
    if call.sinks is not None:
        kw["learnable_sink"] = call.sinks
    if call.fp8:
        ones = torch.ones(call.batch, call.heads_kv, dtype=torch.float32, device=call.q.device)
        for name in ("q_descale", "k_descale", "v_descale"):
            kw[name] = ones if getattr(call, name) is None else getattr(call, name)
    if call.return_lse:
        kw["return_softmax_lse" if api == "flash_attn_with_kvcache" else "return_attn_probs"] = True
    if call.out is not None:
        kw["out"] = call.out
    if api == "flash_attn_with_kvcache" and call.num_splits is not None:
        kw["num_splits"] = call.num_splits
    return kw


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """``fn`` takes the keyword ``name`` (a parameter of that name, or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): assume it does
        return True
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _key_padding_lengths(call: AttentionCall) -> AttentionCall:
    """A dense call whose bool key-padding mask becomes key lengths: each sequence's kept keys moved
    to its front (a host sync)."""
    logical = call.logical()
    keep = logical.attn_mask.expand(logical.batch, 1, 1, logical.n_k).reshape(logical.batch, logical.n_k)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept keys first, in order
    k, v = (
        t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
        for t in (logical.k, logical.v)
    )
    return logical.replace(attn_mask=None, k=k, v=v, k_lens=keep.sum(1, dtype=torch.int32))


def _kernel_call(api: str, call: AttentionCall) -> AttentionCall:
    """``call`` in the storage the api takes: as it is when it already is, else through its logical form."""
    if call.storage in _STORAGES[api]:
        return call if api == "flash_attn_varlen_func" else call.with_layout("bnhd")
    logical = call.logical()
    if api == "flash_attn_func":
        return logical.with_layout("bnhd")
    if api == "flash_attn_varlen_func":
        return (_key_padding_lengths(logical) if logical.attn_mask is not None else logical).packed()
    seqlens = (
        logical.k_lens
        if logical.k_lens is not None
        else torch.full((logical.batch,), logical.n_k, dtype=torch.int32, device=logical.q.device)
    )
    cache = AttentionCall(**logical._fields("k_lens", cache_seqlens=seqlens.to(torch.int32)))
    return cache.with_layout("bnhd")


def kernel_arguments(
    api: str, call: AttentionCall, caps: KernelCapabilities
) -> tuple[AttentionCall, tuple[Any, ...], dict[str, Any]]:
    """``(kernel_call, args, kwargs)``: the arguments a flash-attn-api kernel gets for ``call`` (checked
    by :func:`contract_problem` first), and the call in the api's storage for :func:`logical_outputs`."""
    aligned = realign(call, kernel_align(api, caps))
    assert not isinstance(aligned, str)  # (contract_problem refused it)
    kcall = _kernel_call(api, aligned)
    kw = _flash_keywords(api, kcall)
    args: tuple[Any, ...] = (kcall.q, kcall.k, kcall.v)
    if api == "flash_attn_varlen_func":
        args += (kcall.cu_seqlens_q, kcall.cu_seqlens_k)
        kw["max_seqlen_q"] = kcall.n_q if kcall.max_seqlen_q is None else kcall.max_seqlen_q
        kw["max_seqlen_k"] = kcall.n_k if kcall.max_seqlen_k is None else kcall.max_seqlen_k
        if kcall.block_table is not None:
            kw["block_table"] = kcall.block_table
    elif api == "flash_attn_with_kvcache":
        for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table"):
            if getattr(kcall, name) is not None:
                kw[name] = getattr(kcall, name)
        if kcall.k_new is not None:
            kw.update(k=kcall.k_new, v=kcall.v_new)
    return kcall, args, kw


def logical_outputs(api: str, call: AttentionCall, returned: Any, caps: KernelCapabilities) -> CallOutput:
    """What a flash-attn-api kernel returned for ``call`` (in the kernel's storage), in the logical
    form: ``out`` ``(B, H, n_q, D_v)`` and, with ``call.return_lse``, the LSE ``(B, H, n_q)`` in
    ``call.lse_base`` (from the kernel's declared layout, base and empty-row value)."""
    out, lse = (returned[0], returned[1]) if call.return_lse else (returned, None)
    if lse is not None:
        lse = _logical_lse(call.lse_to_logical(lse, _LSE_FORM[api]), caps, call.lse_base)
    return CallOutput(call.q_to_logical(out), lse, call.lse_base)


def run_contract(
    api: str,
    fn: Callable[..., Any],
    call: AttentionCall,
    caps: KernelCapabilities,
    options: Mapping[str, Any],
) -> CallOutput:
    """Run kernel ``fn`` of ``api`` (not ``sdpa``) on ``call`` (checked by :func:`contract_problem`
    first); its output (and LSE) in the logical form."""
    if api == "merge_state":
        return _merge(fn, call, caps, options)
    if api == "flash_attn_with_kvcache" and call.num_splits is not None and not accepts(fn, "num_splits"):
        from flashprobe.kernels.registry import KernelUnsupportedError  # (the registry imports this module)

        raise KernelUnsupportedError(
            f"its signature has no num_splits (flash-attn 2.8's flash_attn_with_kvcache has): a call with "
            f"num_splits={call.num_splits} cannot be posed; leave num_splits out"
        )
    kcall, args, kw = kernel_arguments(api, call, caps)
    return logical_outputs(api, kcall, fn(*args, **kw, **options), caps)


def _logical_lse(lse: torch.Tensor, caps: KernelCapabilities, base: str | int) -> torch.Tensor:
    """A kernel's logical LSE in ``base``, its empty-row value (``caps.empty_lse``) as ``−inf``."""
    if caps.empty_lse != float("-inf"):
        lse = lse.masked_fill(lse == caps.empty_lse, float("-inf"))
    return convert_lse(lse, caps.lse_base, base)


def _merge(
    fn: Callable[..., Any], call: AttentionCall, caps: KernelCapabilities, options: Mapping[str, Any]
) -> CallOutput:
    """``merge_state`` of the golden partials of keys ``[0, split_k)`` and ``[split_k, N_k)``."""
    from flashprobe.kernels.math import golden_call  # (math registers kernels: imported when used)

    logical = call.logical()
    split = logical.n_k // 2 if call.split_k is None else call.split_k
    keys = torch.arange(logical.n_k, device=call.q.device)
    states = []
    for part, sinks in (((keys < split), logical.sinks), ((keys >= split), None)):
        mask = _restrict(logical.attn_mask, part[None, None, None, :])  # part: (1, 1, 1, N_k)
        partial = golden_call(logical.replace(attn_mask=mask, sinks=sinks, return_lse=True, lse_base="e"))
        v_x = (
            partial.out.to(call.out_dtype).permute(0, 2, 1, 3).reshape(-1, logical.heads, logical.head_dim_v)
        )
        s_x = convert_lse(partial.lse, "e", caps.lse_base).float().permute(0, 2, 1).reshape(-1, logical.heads)
        if (s_x.isinf() & partial.lse.isfinite().permute(0, 2, 1).reshape(-1, logical.heads)).any():
            from flashprobe.kernels.registry import KernelUnsupportedError  # (it imports this module)

            low = partial.lse[partial.lse.isfinite()].abs().max().item()
            raise KernelUnsupportedError(
                f"a partial state's LSE (|LSE| up to {low:.3g}) does not fit merge_state's float32 LSE in "
                f"base {caps.lse_base}: this call's states cannot be given to the kernel"
            )
        states += [v_x.contiguous(), s_x.contiguous()]  # (T, H, D_v), (T, H)
    v, s = fn(*states, **options)
    b, n = logical.batch, logical.n_q
    out = v.reshape(b, n, logical.heads, -1).permute(0, 2, 1, 3)  # (B, H, N_q, D_v)
    lse = _logical_lse(s.reshape(b, n, logical.heads).permute(0, 2, 1), caps, call.lse_base)
    return CallOutput(out, lse if call.return_lse else None, call.lse_base)


def _slots(named: Mapping[str, Any]) -> int:
    """The slots of a cache given without ``cache_seqlens`` (flash-attn then uses them all)."""
    table, cache = named.get("block_table"), named["k_cache"]
    return cache.shape[1] if table is None else table.shape[1] * cache.shape[1]


def call_from_arguments(api: str, *args: Any, **kwargs: Any) -> AttentionCall:
    """The call a real function of ``api`` is given, its arguments bound by the api's parameter names,
    as flash-attn reads them (bottom-right, ``causal`` setting ``window_size[1] = 0``; RoPE refused).

    Raises:
        TypeError: an argument the api does not have, or a required one missing.
        KernelInputError: arguments that do not form a call (:class:`AttentionCall`'s checks).
    """
    if api not in APIS or api == "merge_state":
        raise ValueError(
            f"api={api!r}: calls are read from {', '.join(a for a in APIS if a != 'merge_state')}"
        )
    params = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
        for n in API_PARAMETERS[api]
    ]
    if api != "sdpa":
        params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in FA3_PARAMETERS]
    named = {
        n: x for n, x in inspect.Signature(params).bind(*args, **kwargs).arguments.items() if x is not None
    }
    if api == "sdpa":
        return AttentionCall(q=named["q"], k=named["k"], v=named["v"], attn_mask=named.get("attn_mask"),
                             causal=bool(named.get("is_causal")), scale=named.get("scale"))  # fmt: skip
    if named.get("rotary_cos") is not None or float(named.get("dropout_p") or 0.0):
        raise TypeError(f"{api}: rotary embeddings and dropout have no AttentionCall form")
    causal = bool(named.get("causal"))
    left, right = tuple(named.get("window_size") or (-1, -1))
    fields: dict[str, Any] = {
        "layout": "bnhd", "align": "bottom_right", "causal": causal, "window": (left, 0 if causal else right),
        "softcap": float(named.get("softcap") or 0.0), "scale": named.get("softmax_scale"),
        "alibi_slopes": named.get("alibi_slopes"), "sinks": named.get("learnable_sink"),
        "out": named.get("out"),
        "return_lse": bool(named.get("return_attn_probs") or named.get("return_softmax_lse")),
        **{n: named.get(n) for n in ("q_descale", "k_descale", "v_descale", "block_table")},
    }  # fmt: skip
    if causal and fields["window"] == (-1, 0):
        fields["window"] = (-1, -1)
    if api == "flash_attn_with_kvcache":
        fields.update(
            q=named["q"], k=named["k_cache"], v=named["v_cache"], k_new=named.get("k"), v_new=named.get("v"),
            cache_seqlens=named.get("cache_seqlens", _slots(named)),
            cache_batch_idx=named.get("cache_batch_idx"), cache_leftpad=named.get("cache_leftpad"),
            num_splits=named.get("num_splits"),
        )  # fmt: skip
        return AttentionCall(**fields)
    fields.update(q=named["q"], k=named["k"], v=named["v"])
    if api == "flash_attn_varlen_func":
        fields.update(
            {n: named.get(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
        )
    return AttentionCall(**fields)
