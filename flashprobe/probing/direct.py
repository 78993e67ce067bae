"""Attention libraries called directly inside an attached model: what their sources share.

Models and libraries that call a fused kernel themselves never reach SDPA: transformers'
``flash_attention_2`` calls ``flash_attn_func`` / ``flash_attn_varlen_func``, inference engines call
FlashInfer's prefill and decode wrappers. While a probe is attached, each library's source
(:mod:`flashprobe.probing.flashattn`, :mod:`flashprobe.probing.flashinfer`) swaps its entry points
(:class:`DirectFunctions`: in the libraries' modules, where they are already imported — flashprobe
never imports them — in transformers' flash-attention helper, and in model modules that imported them
by name), and each call made inside the probed model becomes a site, like an SDPA call:

* the arguments are bound to the **library's own signature** (:func:`inspect.signature` of the
  function found at attach time), so flash-attn 2's and FlashAttention-3's different positional
  orders, and FlashInfer's changes between versions, are read by name;
* the call's tensors are converted to SDPA's ``(B, H, N, D)`` layout for the baseline and the golden
  (:class:`Conversion`, one function per form of call in the library's source), with the library's
  scale, its grouped key/value heads, and its masks made explicit: flash-attn's and FlashInfer's causal
  mask is aligned bottom-right when ``N_q != N_k``; a packed/ragged call (``cu_seqlens``,
  ``qo_indptr``/``kv_indptr``) is one ``(1, H, total, D)`` call whose bool mask keeps each query to its
  own sequence (:func:`segment_mask`, built on the device, no host sync); a **paged KV cache**
  (FlashInfer's page table, flash-attn's ``block_table``) is gathered into one contiguous key/value row
  per page slot (:func:`gather_pages`), the slots past a sequence's length masked out and zeroed;
* the model gets the library's own output (and gradients): flash-attn is called on the shadow's
  (tapped) tensors in its own layout, so its backward is compared too; FlashInfer (no backward) and
  paged or KV-cache calls run with the caller's own arguments and are compared forward;
* arguments SDPA cannot express (sliding windows, ALiBi, soft-capping, RoPE inside the kernel, fp8
  scales, attention sinks, ``seqused_*``, bit-packed masks, a FlashInfer wrapper planned before the
  probe was attached) make the call run unchanged, not compared, with one warning per site naming
  them. Unknown arguments count as expressible only when they are None.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from flashprobe.probing import patching
from flashprobe.probing.call import SdpaCall
from flashprobe.probing.sites import Resolution, passthrough, probing_caller

__all__ = [
    "Conversion",
    "Convert",
    "DirectFunctions",
    "DirectPrimary",
    "Expressible",
    "Library",
    "PagedSlots",
    "bind_arguments",
    "bottom_right",
    "function_wrapper",
    "gather_pages",
    "is_fp8",
    "mark_original",
    "original_of",
    "own_arguments",
    "packed_views",
    "segment_mask",
    "segments",
    "signature_of",
    "swap_heads",
    "unpacked",
    "varlen_mask",
    "with_arguments",
]

# --- Which arguments SDPA can express ---


@dataclasses.dataclass(frozen=True)
class Expressible:
    """Which of a library's arguments leave a call expressible in SDPA's terms; any argument not named
    here only when it is None (an unknown argument with a value makes the call run uncompared).

    Attributes:
        any_value: arguments that change nothing the comparison depends on (speed, determinism,
            output buffers, the extra outputs, sizes the tensors already say).
        off_values: arguments expressible only at these values (the feature off).
    """

    any_value: frozenset[str]
    off_values: Mapping[str, tuple[Any, ...]]

    def accepts(self, name: str, value: Any) -> bool:
        """Whether the argument ``name=value`` leaves the call expressible."""
        if name in self.any_value:
            return True
        if isinstance(value, torch.Tensor):
            return False
        if name in self.off_values:
            try:
                return (tuple(value) if isinstance(value, list | tuple) else value) in self.off_values[name]
            except TypeError:
                return False
        return value is None

    def reason(self, named: Mapping[str, Any]) -> str | None:
        """Why a call is not compared, from the arguments left after its conversion took its own; None
        when it can be."""
        bad = [name for name, value in named.items() if not self.accepts(name, value)]
        if bad:
            return f"uses arguments SDPA cannot express ({', '.join(bad)})"
        return None


# --- Layout conversions ---


def segments(indptr: torch.Tensor, total: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Rows ``0..total-1`` of a packed tensor: each row's sequence (``B`` for rows past
    ``indptr[-1]``), its position in it, and the ``(B + 1,)`` sequence lengths (0 at ``B``)."""
    indptr = indptr.to(device=device, dtype=torch.int64)
    rows = torch.arange(total, device=device)
    seq = torch.searchsorted(indptr[1:].contiguous(), rows, right=True)  # (total,)
    pos = rows - indptr[seq]  # indptr has B + 1 entries: seq == B is in range
    lengths = F.pad(indptr[1:] - indptr[:-1], (0, 1))
    return seq, pos, lengths


def segment_mask(
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    q_len: torch.Tensor,
    k_seq: torch.Tensor,
    k_pos: torch.Tensor,
    k_len: torch.Tensor,
    causal: bool,
    custom: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``(N_q, N_k)`` bool mask of packed sequences: a query sees the keys of its own sequence
    within that sequence's length (and, ``causal``, those up to its position aligned bottom-right, as
    flash-attn and FlashInfer do; or, ``custom``, where FlashInfer's flattened per-sequence mask —
    each sequence's ``(len_q, len_k)`` block row-major, one after the other — says so).

    Args:
        q_seq: ``(N_q,)`` sequence of each query row, ``B`` for none.
        q_pos: ``(N_q,)`` its position within the sequence.
        q_len: ``(B + 1,)`` query lengths (0 at ``B``).
        k_seq, k_pos, k_len: the same for the key rows (slots of a paged cache included).
        causal: bottom-right causal within each sequence (ignored with ``custom``, as FlashInfer does).
        custom: FlashInfer's flattened bool mask, or None.
    """
    mask = (
        (q_seq[:, None] == k_seq[None, :]) & (k_pos < k_len[k_seq])[None, :] & (q_pos < q_len[q_seq])[:, None]
    )
    if custom is not None:
        offsets = F.pad(torch.cumsum(q_len[:-1] * k_len[:-1], 0), (1, 0))  # (B + 1,)
        index = (offsets[q_seq] + q_pos * k_len[q_seq])[:, None] + k_pos[None, :]
        flat = custom.reshape(-1).to(device=mask.device, dtype=torch.bool)
        mask &= flat[index.clamp(0, max(flat.numel() - 1, 0))]
    elif causal:
        mask &= k_pos[None, :] <= (q_pos + k_len[q_seq] - q_len[q_seq])[:, None]
    return mask


def varlen_mask(
    cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, causal: bool
) -> torch.Tensor:
    """The ``(total_q, total_k)`` bool mask of a varlen call (``cu_seqlens``): each query sees its own
    sequence's keys (and, causal, those up to its position aligned bottom-right, as flash-attn does),
    computed on the device (no host sync)."""
    q_seq, q_pos, q_len = segments(cu_q, total_q, cu_q.device)
    k_seq, k_pos, k_len = segments(cu_k, total_k, cu_q.device)
    return segment_mask(q_seq, q_pos, q_len, k_seq, k_pos, k_len, causal)


@dataclasses.dataclass(frozen=True)
class PagedSlots:
    """Where each key slot of a gathered paged cache comes from: ``page`` (a page id of the cache, for
    every ``page_size`` slots), its sequence, position and validity, and the sequences' lengths."""

    page: torch.Tensor  # (S / page_size,) long
    seq: torch.Tensor  # (S,)
    pos: torch.Tensor  # (S,)
    lengths: torch.Tensor  # (B + 1,)

    @property
    def valid(self) -> torch.Tensor:
        return self.pos < self.lengths[self.seq]


def gather_pages(cache: torch.Tensor, slots: PagedSlots, layout: str) -> torch.Tensor:
    """The keys (or values) of a paged cache as one ``(1, H_kv, S, D)`` tensor, one row per slot of
    ``slots`` (a copy, detached; slots past their sequence's length are zero, whatever the cache held
    there).

    Args:
        cache: ``(num_pages, page_size, H_kv, D)`` (``"NHD"``) or ``(num_pages, H_kv, page_size, D)``
            (``"HND"``).
        slots: where each slot comes from.
        layout: ``"NHD"`` or ``"HND"``.
    """
    cache = cache.detach()
    if layout == "HND":
        cache = cache.transpose(1, 2)  # (num_pages, page_size, H_kv, D)
    page = slots.page.clamp(0, cache.shape[0] - 1)  # unused table entries may hold anything
    rows = cache[page].reshape(-1, cache.shape[2], cache.shape[3])  # (S, H_kv, D)
    rows = rows.masked_fill(~slots.valid[:, None, None], 0)
    return rows.transpose(0, 1).unsqueeze(0)  # (1, H_kv, S, D)


def bottom_right(n_q: int, n_k: int, causal: bool, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """SDPA's mask and causal flag for a library's causal flag (aligned bottom-right when N_q != N_k)."""
    if causal and n_q != n_k:
        return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril(diagonal=n_k - n_q), False
    return None, bool(causal)


# --- One call, converted ---

#: The library called with arguments by name.
Library = Callable[[dict[str, Any]], Any]


@dataclasses.dataclass
class Conversion:
    """One library call in SDPA's terms.

    Attributes:
        q: ``(B, H, N_q, D)`` for the shadow; k, v: ``(B, H_kv, N_k, D)``.
        mask: bool mask broadcastable to ``(B, H, N_q, N_k)``, or None.
        causal: SDPA's top-left causal flag.
        scale: the softmax scale (None: ``1/sqrt(D)``).
        dropout_p: the call's attention dropout.
        call_library: runs the library on the shadow's ``(q, k, v, dropout_p)``; returns its raw result.
        to_shadow: the library's output → ``(B, H, N_q, D_v)``.
        to_library: ``(B, H, N_q, D_v)`` → the library's layout.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float | None
    dropout_p: float
    call_library: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Any]
    to_shadow: Callable[[torch.Tensor], torch.Tensor]
    to_library: Callable[[torch.Tensor], torch.Tensor]
    extras: tuple[Any, ...] | None = None

    def primary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """The library's output on these tensors, in the shadow's layout; extra outputs (``lse``, attention
        probabilities) of the first call — the one the model gets — are kept for :meth:`back`."""
        result = self.call_library(q, k, v, dropout_p)
        if isinstance(result, tuple | list):
            if self.extras is None:
                self.extras = tuple(result[1:])
            result = result[0]
        return self.to_shadow(result)

    @classmethod
    def packed(
        cls, views: Sequence[torch.Tensor], mask: torch.Tensor, scale: float | None, dropout: float, call: Any
    ) -> Conversion:
        """The conversion of a call on packed ``(total_q, H, D)`` queries, its sequences in ``mask`` (no
        causal flag): ``views`` are q's ``(1, H, total_q, D)`` view (:func:`packed_views`), k and v;
        the library's output is ``(total_q, H, D_v)``."""
        return cls(*views, mask, False, scale, dropout, call, lambda o: packed_views(o)[0], unpacked)

    def back(self, out: torch.Tensor) -> Any:
        """The shadow's returned ``(B, H, N_q, D_v)`` output as the library would have returned it."""
        out = self.to_library(out)
        return out if self.extras is None else (out, *self.extras)


#: A form's conversion: ``convert(library, named, parameters, run)`` → a :class:`Conversion`, a reason
#: not to compare the call (a string), or None when the call is not of this form (run unchanged).
Convert = Callable[
    [Library, dict[str, Any], dict[str, inspect.Parameter], Callable[[], Any]], "Conversion | str | None"
]


class DirectPrimary:
    """The library as the probe's primary (a route): ``run(call)`` calls it on the call's (possibly tapped)
    tensors with the call's dropout (0 for the dropout-free comparison of a dropout call)."""

    def __init__(self, conversion: Conversion) -> None:
        self._conversion = conversion

    def run(self, call: SdpaCall) -> torch.Tensor:
        return self._conversion.primary(call.query, call.key, call.value, call.dropout_p)


def own_arguments(
    run: Callable[[], Any],
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Any]:
    """A primary that calls the library with the caller's own arguments (forward-only comparisons)."""
    return lambda q, k, v, dropout_p: run()


def with_arguments(
    named: dict[str, Any], params: dict[str, inspect.Parameter], dropout_p: float, **tensors: Any
) -> dict:
    """The caller's arguments by name with ``tensors`` replaced and the dropout the shadow asks for."""
    kwargs = {**named, **tensors}
    if "dropout_p" in params:
        kwargs["dropout_p"] = dropout_p
    return kwargs


def is_fp8(*tensors: torch.Tensor) -> bool:
    return any(t.dtype.itemsize == 1 and t.is_floating_point() for t in tensors)


def swap_heads(t: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, D)`` ↔ ``(B, H, N, D)``, a view."""
    return t.transpose(1, 2)


def packed_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``(total, H, D)`` → ``(1, H, total, D)`` views."""
    return [t.unsqueeze(0).transpose(1, 2) for t in tensors]


def unpacked(o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2)[0]  # (1, H, total, D) → (total, H, D)


# --- The replacements ---

_EXTRA_OUTPUTS = ("return_lse", "return_attn_probs", "return_softmax_lse")


def signature_of(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def bind_arguments(
    signature: inspect.Signature, args: tuple, kwargs: dict
) -> tuple[dict[str, Any], bool] | None:
    """The caller's arguments by the library's parameter names (``**kwargs`` merged; extra positional
    arguments kept under ``*name``, which no conversion expresses), and whether the call returns extra
    outputs (``return_lse``, ... with their defaults applied); None when they do not bind."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    for param in signature.parameters.values():
        if param.kind is param.VAR_KEYWORD:
            named.update(named.pop(param.name, {}))
        elif param.kind is param.VAR_POSITIONAL and named.pop(param.name, ()):
            named[f"*{param.name}"] = bound.arguments[param.name]
    bound.apply_defaults()
    extras = any(bound.arguments.get(n) or named.get(n) for n in _EXTRA_OUTPUTS)
    return named, extras


def _probe_call(
    res: Resolution,
    what: str,
    original: Callable[..., Any],
    signature: inspect.Signature,
    convert: Convert,
    args: tuple,
    kwargs: dict,
) -> Any:
    """One direct call at ``res.site``: converted and handed to the probe, or run unchanged."""

    def run() -> Any:  # the caller's arguments, exactly
        return original(*args, **kwargs)

    if res.probe.shadow.primary is None and not res.probe.will_compare(res.site):
        res.probe.count_call(res.site)  # not sampled: no conversion, the library's own call
        return run()
    bound = bind_arguments(signature, args, kwargs)
    if bound is None:
        return run()
    named, extras = bound
    try:
        conversion = convert(lambda kw: original(**kw), named, dict(signature.parameters), run)
    except Exception as err:  # a layout this conversion does not know: never break the model's call
        conversion = f"could not be converted ({type(err).__name__}: {err})"
    if conversion is None:
        return run()
    if not isinstance(conversion, str):
        conversion = _shape_problem(conversion) or conversion
    if not isinstance(conversion, str) and extras and res.probe.shadow.primary is not None:
        conversion = "returns extra outputs (lse), which an explicit primary kernel cannot give"
    if isinstance(conversion, str):
        res.probe.warn_once(
            ("direct-unsupported", res.site, what),
            f"flashprobe: the {what} call at site {res.site!r} {conversion}; it runs unchanged and is not "
            "compared",
        )
        return run()
    c = conversion
    call = SdpaCall(c.q, c.k, c.v, c.mask, c.dropout_p, c.causal, c.scale, c.k.shape[1] != c.q.shape[1])
    with passthrough():
        out = res.probe.handle(res.site, call, DirectPrimary(c))
    return c.back(out)


def _shape_problem(c: Conversion) -> str | None:
    """Why the converted tensors are not one SDPA call (the references would not match the library's
    call: never compared), or None."""
    q, k, v = c.q, c.k, c.v
    ok = q.dim() == k.dim() == v.dim() == 4 and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
    ok = (
        ok
        and q.shape[0] == k.shape[0] == v.shape[0]
        and k.shape[:3] == v.shape[:3]
        and q.shape[3] == k.shape[3]
    )
    ok = ok and (c.mask is None or tuple(c.mask.shape[-2:]) == (q.shape[2], k.shape[2]))
    if ok:
        return None
    mask = "" if c.mask is None else f", mask {tuple(c.mask.shape)}"
    return (
        f"has shapes the conversion cannot compare (q {tuple(q.shape)}, k {tuple(k.shape)}, "
        f"v {tuple(v.shape)}{mask} as (B, H, N, D))"
    )


def mark_original(wrapper: Any, original: Any) -> Any:
    """``wrapper``, marked as the replacement of ``original`` (:func:`original_of`)."""
    wrapper.__flashprobe_original__ = original
    return wrapper


def original_of(fn: Any) -> Any:
    """The library's function behind a flashprobe replacement (``fn`` itself when it is none)."""
    return getattr(fn, "__flashprobe_original__", fn)


def function_wrapper(original: Callable[..., Any], convert: Convert, what: str) -> Callable[..., Any]:
    """The probed replacement of one library entry point (or method) whose calls ``convert`` reads:
    each call made inside a probed model is a site; any other call runs the original unchanged. It has
    the original's name, docstring and signature (``__wrapped__``), which callers such as transformers
    inspect."""
    signature = signature_of(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        res = probing_caller(sys._getframe(1))
        if res is None or signature is None:
            return original(*args, **kwargs)
        return _probe_call(res, what, original, signature, convert, args, kwargs)

    return mark_original(wrapper, original)


class DirectFunctions:
    """A library's direct entry points, swapped where their modules are imported.

    Args:
        entries: ``(module, function, convert)``: ``module.function`` is swapped when ``module`` is in
            ``sys.modules`` (flashprobe never imports the library); a function found under several names
            is named in messages where it is first found.
        callers: modules that keep the library's functions in globals of their own (swapped like model
            modules), e.g. transformers' flash-attention helper.
    """

    def __init__(self, entries: Sequence[tuple[str, str, Convert]], callers: Sequence[str] = ()) -> None:
        self.entries = tuple(entries)
        self.callers = tuple(callers)
        self._found: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, replacement)

    def install(self) -> None:
        """Swap the entry points of the imported modules (a :class:`~flashprobe.probing.patching.Source`'s
        ``install``)."""
        self._found.clear()
        for module_name, function, convert in self.entries:
            library = sys.modules.get(module_name)
            fn = original_of(getattr(library, function, None)) if library is not None else None
            if not callable(fn):
                continue
            found = self._found.get(id(fn))
            if found is None or found[0] is not fn:
                found = self._found[id(fn)] = (fn, function_wrapper(fn, convert, f"{module_name}.{function}"))
            patching.patch(vars(library), function, found[1])
        for module_name in self.callers:
            caller = sys.modules.get(module_name)
            for name, value in list(vars(caller).items()) if caller is not None else ():
                found = self._found.get(id(value))
                if found is not None and found[0] is value:
                    patching.patch(vars(caller), name, found[1])

    def stand_ins(self) -> Mapping[int, tuple[Any, Any]]:
        """``id(original) -> (original, replacement)`` of the functions found at install."""
        return self._found
