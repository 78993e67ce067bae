"""FlashInfer as a source: its single prefill/decode functions, its batch wrappers and its merges.

While a probe is attached and ``flashinfer`` is imported (flashprobe never imports it), its
``single_prefill_with_kv_cache`` (and ``..._return_lse``), ``single_decode_with_kv_cache``, the batch
wrappers' ``plan``/``run``/``forward`` and the merges ``merge_state``, ``merge_states`` and
``merge_state_in_place`` are swapped. Each call is read as an :class:`~flashprobe.kernels.AttentionCall`
(NHD/HND, bottom-right causal, windows, soft cap, sinks, custom masks, ragged and paged sequences, the
LSE in base 2) and compared forward (FlashInfer has no backward). A merge of states is the attention
of one query over the states, each a key whose logit is its LSE and whose value is its output. A
wrapper's ``plan()`` is recorded per instance while a probe is attached; a ``run()`` whose plan was
made before runs unchanged, with a warning. Tested against CPU stand-ins of FlashInfer 0.6's API
(``tests/probing/_standins.py``); no test runs the real library (it needs CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashprobe.kernels import AttentionCall, CallOutput
from flashprobe.probing import patching
from flashprobe.probing.direct import (
    DirectFunctions,
    LibraryCall,
    Reader,
    bind_arguments,
    function_wrapper,
    mark_original,
    signature_of,
    unexpressed,
)

__all__ = ["CLASSES", "FUNCTIONS", "SOURCE", "forget_plans", "patch_class"]

#: FlashInfer's arguments (of its functions, ``plan`` and ``run``) that change nothing compared
_HARMLESS = frozenset(
    {
        "backend", "use_tensor_cores", "use_fp16_qk_reduction", "enable_pdl", "non_blocking", "out",
        "lse", "rope_scale", "rope_theta", "q_data_type", "kv_data_type", "o_data_type", "o_dtype",
        "data_type", "fixed_split_size", "disable_split_kv", "num_qo_heads", "num_kv_heads", "head_dim",
        "head_dim_qk", "head_dim_vo", "page_size", "max_token_per_sequence", "max_sequence_kv",
    }
)  # fmt: skip
#: arguments read only at these values (a feature flashprobe does not compare, off)
_OFF = {
    "window_right": (None, 0, -1),  # one decode query is the last position: no right window
    "pos_encoding_mode": ("NONE",),
    "q_len_per_req": (None, 1),
    "token_pos_in_items_len": (0,),
    **{
        name: (None, 1)
        for name in ("q_scale", "k_scale", "v_scale", "o_scale", "scale_q", "scale_k", "scale_v")
    },
    "use_fp16_softmax": (None, False),
    "uses_spcompress": (None, False),
}
_LAYOUTS = ("NHD", "HND")


def _features(settings: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Pop FlashInfer's mask and score settings: the :class:`AttentionCall` fields they set, and a
    custom bool mask (which replaces ``causal``)."""
    custom = settings.pop("custom_mask", None)
    causal = bool(settings.pop("causal", False)) and custom is None
    left = settings.pop("window_left", None)
    left = -1 if left is None else int(left)
    cap = settings.pop("logits_soft_cap", None)
    fields = {
        "causal": causal, "align": "bottom_right", "window": (left, 0 if causal else -1),
        "softcap": float(cap or 0.0), "scale": settings.pop("sm_scale", None),
        "sinks": settings.pop("sinks", None),
    }  # fmt: skip
    if fields["window"] == (-1, 0):
        fields["window"] = (-1, -1)
    return fields, custom


def _outputs(call: AttentionCall) -> Callable[[Any], CallOutput]:
    """FlashInfer's return (``out``, or ``(out, lse)`` with ``lse`` ``(tokens, H)`` in base 2) in the
    logical form."""

    def outputs(returned: Any) -> CallOutput:
        out, lse = (returned[0], returned[1]) if isinstance(returned, tuple | list) else (returned, None)
        if call.q.dim() == 4:  # a single call: one sequence (or one query) without its batch dim
            out = out.reshape(*call.q.shape[:-1], out.shape[-1])
        found = call.lse_to_logical(lse.float(), "th") if call.return_lse and lse is not None else None
        return CallOutput(call.q_to_logical(out), found, 2)

    return outputs


def _forward_only(what: str, call: AttentionCall, own: Callable[[], Any], **extra: Any) -> LibraryCall:
    """A call FlashInfer runs with the caller's own arguments, compared forward."""
    return LibraryCall(what, call, lambda tensors, dropout: own(), _outputs(call), **extra)


def _single(decode: bool, named: dict[str, Any], library: Callable[..., Any], own: Callable[[], Any]) -> Any:
    """``single_prefill_with_kv_cache(q (N_q, H, D), k, v, ...)`` or, ``decode``,
    ``single_decode_with_kv_cache(q (H, D), k, v, ...)``; ``k``/``v`` NHD ``(N_k, H_kv, D)`` or HND."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (k, v)) or not (
        isinstance(q, torch.Tensor) and q.dim() == 3 - decode
    ):
        return None
    layout = named.pop("kv_layout", "NHD")
    if layout not in _LAYOUTS:
        return f"uses kv_layout={layout!r}"
    lse = bool(named.pop("return_lse", False))
    fields, custom = _features(named)
    reason = unexpressed(named, (), _HARMLESS, _OFF)
    if reason is not None:
        return reason
    q = q[None, None] if decode else q[None]  # (1, N_q, H, D)
    keys, values = (
        t[None] if layout == "NHD" else t.transpose(0, 1)[None] for t in (k, v)
    )  # (1, N_k, H_kv, D)
    mask = None if custom is None else custom.to(torch.bool).reshape(1, 1, q.shape[1], keys.shape[1])
    call = AttentionCall(
        q=q, k=keys, v=values, layout="bnhd", attn_mask=mask, return_lse=lse, lse_base=2, **fields
    )
    return _forward_only("single", call, own)


# --- The batch wrappers: plan, then run ---


@dataclasses.dataclass
class _Plan:
    """A wrapper's last ``plan()`` arguments, its deprecated ``forward()``'s settings, and what is read
    from them per device."""

    named: dict[str, Any]
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    cache: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        return {**self.named, **self.overrides}

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


#: Plans recorded while a probe is attached, per wrapper instance (forgotten when the last probe detaches).
_PLANS: weakref.WeakKeyDictionary[Any, _Plan] = weakref.WeakKeyDictionary()

_NO_PLAN = (
    "runs with a plan() made before the probe was attached, so its sequences are unknown; call plan() "
    "while the probe is attached (e.g. inside the `with probe(...)` block)"
)


def forget_plans() -> None:
    """Drop every recorded plan (called when the last handle detaches)."""
    _PLANS.clear()


def _offsets(indptr: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """FlashInfer's ``indptr`` as ``cu_seqlens`` on ``device`` and the longest sequence."""
    lengths = (indptr[1:] - indptr[:-1]).tolist()
    return indptr.to(device=device, dtype=torch.int32), max(lengths, default=0)


def _block_table(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    page_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """FlashInfer's page table as flash-attn's: ``(block_table (B, max_pages), cu_seqlens_k, longest)``."""
    ptr, pages, last = indptr.tolist(), indices.tolist(), last_page_len.tolist()
    rows = [pages[a:z] for a, z in itertools.pairwise(ptr)]
    lengths = [(len(r) - 1) * page_size + int(n) if r else 0 for r, n in zip(rows, last, strict=True)]
    width = max(1, *(len(r) for r in rows)) if rows else 1
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(
        len(rows), width
    )
    cu = F.pad(torch.tensor(lengths, dtype=torch.int64).cumsum(0), (1, 0)).to(torch.int32)
    return table.to(device), cu.to(device), max(lengths, default=0)


def _flat_mask(custom: torch.Tensor, logical: AttentionCall) -> torch.Tensor:
    """FlashInfer's flattened custom mask (each request's ``(len_q, len_k)`` block, row-major) as a
    ``(B, 1, n_q, n_k)`` bool mask of the logical call."""
    q_len, k_len = logical.q_lens.long(), logical.k_lens.long()  # (B,)
    offsets = F.pad(torch.cumsum(q_len * k_len, 0), (1, 0))[:-1]
    i = torch.arange(logical.n_q, device=q_len.device)[None, :, None]
    j = torch.arange(logical.n_k, device=q_len.device)[None, None, :]
    index = offsets[:, None, None] + i * k_len[:, None, None] + j
    inside = (i < q_len[:, None, None]) & (j < k_len[:, None, None])
    flat = custom.reshape(-1).to(device=q_len.device, dtype=torch.bool)
    return (flat[index.clamp(0, max(flat.numel() - 1, 0))] & inside)[:, None]


def _paged_cache(cache: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(k_cache, v_cache)`` of a paged KV cache (a pair of 4-D tensors or one 5-D tensor)."""
    if isinstance(cache, tuple | list) and len(cache) == 2:
        k, v = cache
    elif isinstance(cache, torch.Tensor) and cache.dim() == 5:
        k, v = cache[:, 0], cache[:, 1]
    else:
        return None
    ok = isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == v.dim() == 4
    return (k, v) if ok else None


def _batch(form: str, named: dict[str, Any], library: Callable[..., Any], own: Callable[[], Any]) -> Any:
    """A batch wrapper's ``run`` with its recorded plan's sequences, mask and scale; ``form`` is
    ``"ragged"`` (``run(q (total_q, H, D), k, v)``), ``"paged_prefill"`` or ``"paged_decode"``
    (``run(q, paged_kv_cache)``, decode with one query per request)."""
    wrapper = named.pop("self", None)
    try:
        plan = _PLANS.get(wrapper)
    except TypeError:  # not weak-referenceable
        plan = None
    if plan is None:
        return _NO_PLAN
    layout = getattr(wrapper, "_kv_layout", "NHD")
    if layout not in _LAYOUTS:
        return f"uses kv_layout={layout!r}"
    q = named.pop("q", None)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        return None
    device = q.device
    settings = plan.settings()
    if named.get("window_left") is not None:  # run()'s own window_left overrides the plan's
        settings["window_left"] = named["window_left"]
    named.pop("window_left", None)
    settings["sinks"] = named.pop("sinks", None)
    lse = bool(named.pop("return_lse", False))
    if settings.get("packed_custom_mask") is not None and settings.get("custom_mask") is not None:
        settings.pop("packed_custom_mask")  # (FlashInfer packs the bool mask itself)
    fields, custom = _features(settings)
    index_names = {
        "ragged": ("qo_indptr", "kv_indptr"),
        "paged_prefill": ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
        "paged_decode": ("indptr", "indices", "last_page_len"),
    }[form]
    index = [settings.pop(n, None) for n in index_names]
    if not all(isinstance(t, torch.Tensor) for t in index):
        return None
    reason = unexpressed(named, ("k", "v", "paged_kv_cache"), _HARMLESS, _OFF) or unexpressed(
        settings, (), _HARMLESS, _OFF
    )
    if reason is not None:
        return reason
    if form == "paged_decode":
        cu_q, most_q = plan.cached(("qo", device, q.shape[0]), lambda: (
            torch.arange(q.shape[0] + 1, dtype=torch.int32, device=device), 1))  # fmt: skip
    else:
        cu_q, most_q = plan.cached(("qo", device), lambda: _offsets(index[0], device))
    common = {
        "q": q,
        "cu_seqlens_q": cu_q,
        "max_seqlen_q": most_q,
        "return_lse": lse,
        "lse_base": 2,
        **fields,
    }
    if form == "ragged":
        k, v = named.pop("k", None), named.pop("v", None)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            return None
        keys, values = (t if layout == "NHD" else t.transpose(0, 1) for t in (k, v))  # (total_k, H_kv, D)
        cu_k, most_k = plan.cached(("kv", device), lambda: _offsets(index[1], device))
        call = AttentionCall(k=keys, v=values, cu_seqlens_k=cu_k, max_seqlen_k=most_k, **common)
    else:
        cache = _paged_cache(named.pop("paged_kv_cache", None))
        if cache is None:
            return None
        page = cache[0].shape[1 if layout == "NHD" else 2]
        pages = index[-3:]
        table, cu_k, most_k = plan.cached(("pages", device, page), lambda: _block_table(*pages, page, device))
        call = AttentionCall(k=cache[0], v=cache[1], block_table=table, kv_layout=layout, cu_seqlens_k=cu_k,
                             max_seqlen_k=most_k, **common)  # fmt: skip
    reference = None
    if custom is not None:
        logical = call.logical()
        mask = plan.cached(("mask", device, logical.n_q, logical.n_k), lambda: _flat_mask(custom, logical))
        reference = logical.replace(attn_mask=mask)
    return _forward_only(f"{form} run", call, own, reference=reference)


# --- Merges of attention states ---


def _merge_call(v: torch.Tensor, s: torch.Tensor) -> LibraryCall | None:
    """States ``v (T, S, H, D)`` with base-2 LSEs ``s (T, S, H)`` as one attention call: per token and
    head, one query over ``S`` keys with logits ``s · ln 2``; an empty state (``s = −inf``) is masked out."""
    if v.dim() != 4 or s.dim() != 3:
        return None
    wide = torch.promote_types(v.dtype, torch.float32)
    lse = s.detach().to(wide).permute(0, 2, 1)  # (T, H, S)
    empty = lse == float("-inf")
    call = AttentionCall(
        q=lse.new_ones(*lse.shape[:2], 1, 1), k=lse.masked_fill(empty, 0.0)[..., None],
        v=v.detach().to(wide).permute(0, 2, 1, 3), attn_mask=~empty[:, :, None, :], scale=math.log(2.0),
        return_lse=True, lse_base=2,
    )  # fmt: skip
    return LibraryCall("merge", call, lambda *_: None, _merged, dtype=v.dtype)


def _merged(returned: Any) -> CallOutput:
    """A merge's return ``(v (T, H, D), s (T, H))`` in the logical form of its call."""
    return CallOutput(returned[0][:, :, None, :], returned[1][:, :, None].float(), 2)


def _merge(form: str, named: dict[str, Any], library: Callable[..., Any], own: Callable[[], Any]) -> Any:
    """``merge_state(v_a, s_a, v_b, s_b)``, ``merge_states(v, s)`` or ``merge_state_in_place(v, s,
    v_other, s_other)`` (read before it runs, its result after)."""
    names = {
        "state": ("v_a", "s_a", "v_b", "s_b"),
        "states": ("v", "s"),
        "in_place": ("v", "s", "v_other", "s_other"),
    }
    parts = [named.pop(n, None) for n in names[form]]
    if not all(isinstance(t, torch.Tensor) for t in parts):
        return None
    reason = unexpressed(named, ())  # merge_state_in_place's mask, an unknown argument
    if reason is not None:
        return reason
    v, s = (
        (parts[0], parts[1])
        if form == "states"
        else (torch.stack(parts[0::2], 1), torch.stack(parts[1::2], 1))
    )
    found = _merge_call(v, s)
    if found is not None:
        found.run = lambda tensors, dropout: own()
        if form == "in_place":
            found.outputs = lambda returned: _merged((parts[0], parts[1]))
    return found


# --- Swapping the wrappers' methods ---


def _plan_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``plan`` recorded (its arguments by name, per wrapper instance), then run."""
    signature = signature_of(original)

    @functools.wraps(original)
    def plan(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        named = None if signature is None else bind_arguments(signature, args, kwargs)
        if named is not None:
            wrapper = named.pop("self", None)
            with contextlib.suppress(TypeError):  # not weak-referenceable: its runs are not compared
                _PLANS[wrapper] = _Plan(named)
        return result

    return mark_original(plan, original)


#: The settings the deprecated ``forward`` keeps on the wrapper for later runs.
_FORWARD_SETTINGS = frozenset(
    {"causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap", "sm_scale",
     "rope_scale", "rope_theta"}
)  # fmt: skip


def _forward_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """The deprecated ``forward``: its settings (defaults included) override the plan's, then ``run``."""
    signature = signature_of(original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if signature is not None:
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                plan = _PLANS.get(bound.arguments.get("self"))
            except TypeError:
                plan = None
            if plan is not None:
                plan.overrides = {k: v for k, v in bound.arguments.items() if k in _FORWARD_SETTINGS}
                plan.cache.clear()
        return original(*args, **kwargs)

    return mark_original(forward, original)


def patch_class(cls: type, read: Reader, what: str) -> dict[str, Any]:
    """``{attribute: replacement}`` for a FlashInfer wrapper class: ``plan`` recorded, ``run`` a site,
    ``forward`` setting ``run``'s settings, ``run_return_lse`` rebuilt on the new ``run``."""
    out: dict[str, Any] = {}
    run = getattr(cls, "run", None)
    if not callable(getattr(cls, "plan", None)) or not callable(run):
        return out
    out["plan"] = _plan_wrapper(cls.plan)
    out["run"] = function_wrapper(run, read, f"{what}.run")
    for name in ("forward", "forward_return_lse"):
        if callable(getattr(cls, name, None)):
            out[name] = _forward_wrapper(getattr(cls, name))
    partial = cls.__dict__.get("run_return_lse")
    if isinstance(partial, functools.partialmethod):
        out["run_return_lse"] = functools.partialmethod(out["run"], *partial.args, **partial.keywords)
    return out


_PREFILL, _DECODE = ("flashinfer", "flashinfer.prefill"), ("flashinfer", "flashinfer.decode")
_CASCADE = ("flashinfer", "flashinfer.cascade")

#: The functions, swapped where their modules are imported.
FUNCTIONS = DirectFunctions(
    (
        *((m, "single_prefill_with_kv_cache", functools.partial(_single, False)) for m in _PREFILL),
        *(
            (m, "single_prefill_with_kv_cache_return_lse", functools.partial(_single, False))
            for m in _PREFILL
        ),
        *((m, "single_decode_with_kv_cache", functools.partial(_single, True)) for m in _DECODE),
        *(
            (m, f"merge_{form}", functools.partial(_merge, form))
            for m in _CASCADE
            for form in ("state", "states")
        ),
        *((m, "merge_state_in_place", functools.partial(_merge, "in_place")) for m in _CASCADE),
    )
)

#: The batch wrappers ``(module, class, read)``.
CLASSES: tuple[tuple[str, str, Reader], ...] = tuple(
    (m, name, functools.partial(_batch, form))
    for name, form, modules in (
        ("BatchPrefillWithRaggedKVCacheWrapper", "ragged", _PREFILL),
        ("BatchPrefillWithPagedKVCacheWrapper", "paged_prefill", _PREFILL),
        ("BatchDecodeWithPagedKVCacheWrapper", "paged_decode", _DECODE),
    )
    for m in modules
)


def _install() -> None:
    FUNCTIONS.install()
    seen: set[int] = set()
    for module_name, class_name, read in CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if not isinstance(cls, type) or id(cls) in seen:
            continue
        seen.add(id(cls))
        for attribute, replacement in patch_class(cls, read, f"{cls.__module__}.{cls.__name__}").items():
            patching.patch_attribute(cls, attribute, replacement)


#: FlashInfer.
SOURCE = patching.Source("FlashInfer", _install, FUNCTIONS.stand_ins, forget_plans)
