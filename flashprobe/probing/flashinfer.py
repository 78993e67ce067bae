"""FlashInfer as a source: its single prefill/decode functions and its batch wrappers.

An optional, self-contained source (:mod:`flashprobe.probing.direct` has what it shares with
flash-attn's): while a probe is attached and ``flashinfer`` is imported (flashprobe never imports it),
``single_prefill_with_kv_cache`` (and ``..._return_lse``), ``single_decode_with_kv_cache`` and the
batch wrappers ``BatchPrefillWithRaggedKVCacheWrapper``, ``BatchPrefillWithPagedKVCacheWrapper`` and
``BatchDecodeWithPagedKVCacheWrapper`` are swapped. A wrapper's ``plan()`` is recorded (its sequences,
page table, mask and scale, per instance, forgotten when the last probe detaches); its ``run()`` (and
``run_return_lse``) is a site, read with the recorded plan; the deprecated ``forward()`` sets the
settings later runs use. FlashInfer has no backward: every call runs with the caller's own arguments
and is compared forward. A run whose ``plan()`` was made before the probe was attached runs unchanged,
with one warning naming why.

**What this was checked against.** The signatures and semantics are FlashInfer 0.6's as the team read
them, and the tests run them against the team's own CPU stand-ins of those functions and wrappers
(``tests/probing/_standins.py``: layouts, bottom-right causal, grouped heads, ragged and paged
sequences, custom masks, and planted bugs); no test runs the real library (it needs CUDA), so a
FlashInfer release that changes an argument's meaning would not be caught here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashprobe.probing import patching
from flashprobe.probing.direct import (
    Conversion,
    Convert,
    DirectFunctions,
    Expressible,
    Library,
    PagedSlots,
    bind_arguments,
    bottom_right,
    function_wrapper,
    gather_pages,
    is_fp8,
    mark_original,
    own_arguments,
    packed_views,
    segment_mask,
    segments,
    signature_of,
)

__all__ = ["CLASSES", "FUNCTIONS", "SOURCE", "flashinfer_slots", "forget_plans", "patch_class"]

#: FlashInfer's arguments (of its functions, ``plan`` and ``run``) that SDPA can express.
_ANY_VALUE = frozenset(
    {
        "backend", "use_tensor_cores", "use_fp16_qk_reduction", "enable_pdl", "non_blocking", "out",
        "lse", "rope_scale", "rope_theta", "return_lse", "q_data_type", "kv_data_type", "o_data_type",
        "data_type", "fixed_split_size", "disable_split_kv", "num_qo_heads", "num_kv_heads", "head_dim",
        "head_dim_qk", "head_dim_vo", "page_size", "max_token_per_sequence", "max_sequence_kv",
    }
)  # fmt: skip
_ARGUMENTS = Expressible(
    any_value=_ANY_VALUE,
    off_values={
        "window_left": (-1, None),
        "window_right": (None, 0, -1),  # one decode query is the last position: no right window
        "logits_soft_cap": (0, None),
        "pos_encoding_mode": ("NONE",),
        "q_len_per_req": (None, 1),
        "token_pos_in_items_len": (0,),
        "q_scale": (None, 1),
        "k_scale": (None, 1),
        "v_scale": (None, 1),
        "o_scale": (None, 1),
        "use_fp16_softmax": (None, False),
        "uses_spcompress": (None, False),
    },
)

_LAYOUTS = ("NHD", "HND")


def _kv_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A FlashInfer ``(N, H_kv, D)`` (NHD) or ``(H_kv, N, D)`` (HND) tensor as ``(1, H_kv, N, D)``,
    detached."""
    t = t.detach()
    return (t.transpose(0, 1) if layout == "NHD" else t).unsqueeze(0)


def _forward_only(q: torch.Tensor, *kv: torch.Tensor) -> str | None:
    if is_fp8(q, *kv):
        return "has fp8 inputs (the baseline runs in the inputs' dtype; compare 16-bit calls)"
    return None


def _single_prefill(
    lib: Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``single_prefill_with_kv_cache(q, k, v, ...)``: ``q (N_q, H, D)``, ``k``/``v`` NHD
    ``(N_k, H_kv, D)`` or HND ``(H_kv, N_k, D)``; a bool ``custom_mask (N_q, N_k)`` replaces ``causal``."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v)):
        return None
    layout, custom = named.pop("kv_layout", "NHD"), named.pop("custom_mask", None)
    causal, scale = bool(named.pop("causal", False)), named.pop("sm_scale", None)
    if layout not in _LAYOUTS:
        return f"uses kv_layout={layout!r}"
    reason = _ARGUMENTS.reason(named) or _forward_only(q, k, v)
    if reason:
        return reason
    keys, values = _kv_view(k, layout), _kv_view(v, layout)
    n_q, n_k = q.shape[0], keys.shape[2]
    if custom is not None:
        mask, sdpa_causal = custom.to(device=q.device, dtype=torch.bool).reshape(n_q, n_k), False
    else:
        mask, sdpa_causal = bottom_right(n_q, n_k, causal, q.device)
    return Conversion(
        q.detach().transpose(0, 1).unsqueeze(0), keys, values, mask, sdpa_causal, scale, 0.0,
        own_arguments(run), lambda o: o.transpose(0, 1).unsqueeze(0), lambda o: o[0].transpose(0, 1),
    )  # fmt: skip


def _single_decode(
    lib: Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """``single_decode_with_kv_cache(q, k, v, ...)``: one query ``q (H, D)`` against all of ``k``/``v``."""
    q, k, v = (named.pop(n, None) for n in "qkv")
    if not (
        isinstance(q, torch.Tensor) and q.dim() == 2 and all(isinstance(t, torch.Tensor) for t in (k, v))
    ):
        return None
    layout, scale = named.pop("kv_layout", "NHD"), named.pop("sm_scale", None)
    if layout not in _LAYOUTS:
        return f"uses kv_layout={layout!r}"
    reason = _ARGUMENTS.reason(named) or _forward_only(q, k, v)
    if reason:
        return reason
    return Conversion(
        q.detach()[None, :, None, :], _kv_view(k, layout), _kv_view(v, layout), None, False, scale, 0.0,
        own_arguments(run), lambda o: o[None, :, None, :], lambda o: o[0, :, 0, :],
    )  # fmt: skip


@dataclasses.dataclass
class _Plan:
    """A FlashInfer wrapper's last ``plan()`` (its arguments by name), the settings its deprecated
    ``forward()`` set since, and the page slots and masks computed from them (per device)."""

    named: dict[str, Any]
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    cache: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def settings(self) -> dict[str, Any]:
        return {**self.named, **self.overrides}

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


#: Plans recorded while a probe is attached, per wrapper instance (forgotten when the last probe detaches:
#: a plan made while none is attached is not seen, and a stale one must not be used).
_PLANS: weakref.WeakKeyDictionary[Any, _Plan] = weakref.WeakKeyDictionary()

_NO_PLAN = (
    "runs with a plan() made before the probe was attached, so its sequences are unknown; call plan() "
    "while the probe is attached (e.g. inside the `with probe(...)` block)"
)


def forget_plans() -> None:
    """Drop every recorded plan (called when the last handle detaches)."""
    _PLANS.clear()


def _paged_cache(cache: Any, layout: str) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(k_cache, v_cache, page_size)`` of a paged KV cache: a ``(k, v)`` pair of 4-D tensors or one
    5-D tensor with k and v at index 1."""
    if isinstance(cache, tuple | list) and len(cache) == 2:
        k, v = cache
    elif isinstance(cache, torch.Tensor) and cache.dim() == 5:
        k, v = cache[:, 0], cache[:, 1]
    else:
        return None
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4):
        return None
    return k, v, k.shape[1] if layout == "NHD" else k.shape[2]


def _batch(
    form: str, lib: Library, named: dict, params: dict, run: Callable[[], Any]
) -> Conversion | str | None:
    """A FlashInfer batch wrapper's ``run``, with the sequences, mask and scale of its recorded plan;
    ``form`` names the wrapper:

    * ``"ragged"``: ``BatchPrefillWithRaggedKVCacheWrapper.run(q, k, v, ...)``: ``q (total_q, H, D)``,
      ``k``/``v`` ``(total_k, H_kv, D)`` (NHD; HND ``(H_kv, total_k, D)``), sequences from
      ``plan(qo_indptr, kv_indptr)``;
    * ``"paged_prefill"``: ``BatchPrefillWithPagedKVCacheWrapper.run(q, paged_kv_cache, ...)``: pages
      from ``plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, ...)``;
    * ``"paged_decode"``: ``BatchDecodeWithPagedKVCacheWrapper.run(q, paged_kv_cache, ...)``:
      ``q (B, H, D)``, one query per request, pages from ``plan(indptr, indices, last_page_len, ...)``.
    """
    wrapper = named.pop("self", None)
    try:
        plan = _PLANS.get(wrapper)
    except TypeError:  # not weak-referenceable
        plan = None
    if plan is None:
        return _NO_PLAN
    layout = getattr(wrapper, "_kv_layout", "NHD")
    q = named.pop("q", None)
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or layout not in _LAYOUTS:
        return None if layout in _LAYOUTS else f"uses kv_layout={layout!r}"
    settings = plan.settings()
    custom = settings.pop("custom_mask", None)
    causal, scale = bool(settings.pop("causal", False)), settings.pop("sm_scale", None)
    device = q.device
    if form == "ragged":
        k, v = named.pop("k", None), named.pop("v", None)
        qo, kv = settings.pop("qo_indptr", None), settings.pop("kv_indptr", None)
        if not all(isinstance(t, torch.Tensor) for t in (k, v, qo, kv)):
            return None
        keys, values = _kv_view(k, layout), _kv_view(v, layout)
        total_k = keys.shape[2]

        def key_rows() -> tuple[torch.Tensor, ...]:
            return segments(kv, total_k, device)
    else:
        parts = _paged_cache(named.pop("paged_kv_cache", None), layout)
        prefix = "paged_kv_" if form == "paged_prefill" else ""
        indptr, indices = settings.pop(f"{prefix}indptr", None), settings.pop(f"{prefix}indices", None)
        last = settings.pop(f"{prefix}last_page_len", None)
        qo = settings.pop("qo_indptr", None)
        if parts is None or not all(isinstance(t, torch.Tensor) for t in (indptr, indices, last)):
            return None
        k_cache, v_cache, page_size = parts
        slots = plan.cached(
            ("slots", device), lambda: flashinfer_slots(indptr, indices, last, page_size, device)
        )

        def key_rows() -> tuple[torch.Tensor, ...]:
            return slots.seq, slots.pos, slots.lengths

    reason = _ARGUMENTS.reason(named) or _ARGUMENTS.reason(settings) or _forward_only(q)
    if reason:
        return reason
    if form == "paged_decode":  # one query per request
        qo = torch.arange(q.shape[0] + 1, device=device)
    elif not isinstance(qo, torch.Tensor):
        return None
    if form != "ragged":
        keys, values = gather_pages(k_cache, slots, layout), gather_pages(v_cache, slots, layout)

    def make_mask() -> torch.Tensor:
        q_seq, q_pos, q_len = segments(qo, q.shape[0], device)
        k_seq, k_pos, k_len = key_rows()
        return segment_mask(q_seq, q_pos, q_len, k_seq, k_pos, k_len, causal, custom)

    mask = plan.cached(("mask", device, q.shape[0], keys.shape[2], causal), make_mask)
    return Conversion.packed([*packed_views(q.detach()), keys, values], mask, scale, 0.0, own_arguments(run))


def flashinfer_slots(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    page_size: int,
    device: torch.device,
) -> PagedSlots:
    """FlashInfer's page table: request ``i`` holds pages ``indices[indptr[i]:indptr[i+1]]``, its last
    one filled to ``last_page_len[i]``."""
    seq_of_page, _, pages_per_seq = segments(indptr, indices.shape[0], device)
    last = F.pad(last_page_len.to(device=device, dtype=torch.int64), (0, 1))
    lengths = ((pages_per_seq - 1) * page_size + last).clamp(min=0)
    lengths[-1] = 0
    indptr64 = indptr.to(device=device, dtype=torch.int64)
    slot = torch.arange(indices.shape[0] * page_size, device=device)
    rank = slot // page_size  # which entry of indices
    seq = seq_of_page[rank]
    pos = (rank - indptr64[seq]) * page_size + slot % page_size
    return PagedSlots(indices.to(device=device, dtype=torch.int64), seq, pos, lengths)


def _plan_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``plan`` recorded (its arguments by name, per wrapper instance), then run."""
    signature = signature_of(original)

    @functools.wraps(original)
    def plan(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        bound = None if signature is None else bind_arguments(signature, args, kwargs)
        if bound is not None:
            named = bound[0]
            wrapper = named.pop("self", None)
            with contextlib.suppress(TypeError):  # not weak-referenceable: its runs are not compared
                _PLANS[wrapper] = _Plan(named)
        return result

    return mark_original(plan, original)


#: The settings the deprecated ``forward`` keeps on the wrapper for its and later runs (the rest of its
#: arguments it passes on to ``run``).
_FORWARD_SETTINGS = frozenset(
    {"causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap", "sm_scale",
     "rope_scale", "rope_theta"}
)  # fmt: skip


def _forward_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """The deprecated ``forward``: it sets the wrapper's mask and scale settings (kept for later runs),
    then calls ``run``; those settings (defaults included) override the recorded plan's."""
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


def patch_class(cls: type, convert: Convert, what: str) -> dict[str, Any]:
    """``{attribute: replacement}`` for a FlashInfer wrapper class: ``plan`` recorded, ``run`` a site,
    ``forward``/``forward_return_lse`` setting ``run``'s settings, ``run_return_lse`` (a
    ``partialmethod`` of the original ``run``) rebuilt on the replacement."""
    out: dict[str, Any] = {}
    run = getattr(cls, "run", None)
    if not callable(getattr(cls, "plan", None)) or not callable(run):
        return out
    out["plan"] = _plan_wrapper(cls.plan)
    out["run"] = function_wrapper(run, convert, f"{what}.run")
    for name in ("forward", "forward_return_lse"):
        if callable(getattr(cls, name, None)):
            out[name] = _forward_wrapper(getattr(cls, name))
    partial = cls.__dict__.get("run_return_lse")
    if isinstance(partial, functools.partialmethod):
        out["run_return_lse"] = functools.partialmethod(out["run"], *partial.args, **partial.keywords)
    return out


_PREFILL, _DECODE = ("flashinfer", "flashinfer.prefill"), ("flashinfer", "flashinfer.decode")

#: The single-call functions, swapped where their modules are imported.
FUNCTIONS = DirectFunctions(
    (
        *((m, "single_prefill_with_kv_cache", _single_prefill) for m in _PREFILL),
        *((m, "single_prefill_with_kv_cache_return_lse", _single_prefill) for m in _PREFILL),
        *((m, "single_decode_with_kv_cache", _single_decode) for m in _DECODE),
    )
)

#: The batch wrappers ``(module, class, convert)``: ``plan`` recorded, ``run`` (and the deprecated
#: ``forward``, which sets ``run``'s settings) a site.
CLASSES: tuple[tuple[str, str, Convert], ...] = tuple(
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
    for module_name, class_name, convert in CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if not isinstance(cls, type) or id(cls) in seen:
            continue
        seen.add(id(cls))
        for attribute, replacement in patch_class(cls, convert, f"{cls.__module__}.{cls.__name__}").items():
            patching.patch_attribute(cls, attribute, replacement)


#: FlashInfer.
SOURCE = patching.Source("FlashInfer", _install, FUNCTIONS.stand_ins, forget_plans)
