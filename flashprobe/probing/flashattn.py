"""flash-attn 2's, FlashAttention-3's and flash-attention 4's entry points as a source
(:mod:`flashprobe.probing.direct`).

Each call is read by the argument names of the library's own signature into a call of the kernels
layer's contracts (:func:`~flashprobe.kernels.contract.call_from_arguments`): ``flash_attn_func`` and
its packed forms, ``flash_attn_varlen_func`` (with paged ``block_table``, ``seqused_k``) and
``flash_attn_with_kvcache`` (read before it appends). The LSE is compared in base e (flash-attn 2's
``+inf`` for an empty row read as ``−inf``); dense and packed calls also compare their backward. Tested
against CPU stand-ins of the libraries (``lab/contracts.py``, ``tests/probing/_standins.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from flashprobe.kernels import CallOutput, KernelCapabilities
from flashprobe.kernels.contract import API_PARAMETERS, FA3_PARAMETERS, call_from_arguments, logical_outputs
from flashprobe.probing import patching
from flashprobe.probing.direct import DirectFunctions, LibraryCall, Tensors, unexpressed

__all__ = ["FUNCTIONS", "SOURCE"]

#: arguments that change nothing compared (speed, determinism, sizes the tensors say)
_HARMLESS = frozenset(
    {"deterministic", "num_splits", "pack_gqa", "sm_margin", "rotary_interleaved", "num_heads_q"}
)
#: arguments read only at these values (a feature flashprobe does not compare, off)
_OFF = {"attention_chunk": (0, None)}
#: flash-attn 2 returns +inf for the LSE of a row that sees no key; FlashAttention-3 and 4 −inf
_FA2_CAPS, _FA3_CAPS = KernelCapabilities(empty_lse=math.inf), KernelCapabilities(empty_lse=-math.inf)

#: how a form's q, k, v come out of its tensors and go back: ``(its tensors' names, unpack, pack)``;
#: ``pack(given, q, k, v)`` builds the tensors from q, k, v (``given``: the call's arguments)
_Form = tuple[
    tuple[str, ...], Callable[..., tuple[torch.Tensor, ...]], Callable[..., dict[str, torch.Tensor]]
]


def _qkv(given: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"q": q, "k": k, "v": v}


def _split_qkv(qkv: torch.Tensor, heads_q: int | None = None, **_: Any) -> tuple[torch.Tensor, ...]:
    """``qkv`` ``(B, N, 3, H, D)``, or FlashAttention-3's ``(B, N, H + 2 H_kv, D)`` with
    ``num_heads_q=H``: q, k, v views."""
    if qkv.dim() == 5 or heads_q is None:
        return qkv.unbind(2)
    h_kv = (qkv.shape[2] - heads_q) // 2
    return qkv.split([heads_q, h_kv, h_kv], dim=2)


def _pack_qkv(
    given: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> dict[str, torch.Tensor]:
    stacked = given["qkv"].dim() == 5
    return {"qkv": torch.stack((q, k, v), 2) if stacked else torch.cat((q, k, v), 2)}


def _same(*names: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    return lambda **t: tuple(t[n] for n in names)


#: the forms by entry point: ``(api, form)``
_FORMS: dict[str, tuple[str, _Form]] = {
    "flash_attn_func": ("flash_attn_func", (("q", "k", "v"), _same("q", "k", "v"), _qkv)),
    "flash_attn_qkvpacked_func": ("flash_attn_func", (("qkv",), _split_qkv, _pack_qkv)),
    "flash_attn_kvpacked_func": ("flash_attn_func", (
        ("q", "kv"), lambda q, kv, **_: (q, *kv.unbind(2)),
        lambda given, q, k, v: {"q": q, "kv": torch.stack((k, v), 2)},
    )),
    "flash_attn_varlen_func": ("flash_attn_varlen_func", (("q", "k", "v"), _same("q", "k", "v"), _qkv)),
    "flash_attn_varlen_qkvpacked_func": ("flash_attn_varlen_func", (
        ("qkv",), lambda qkv, **_: qkv.unbind(1), lambda given, q, k, v: {"qkv": torch.stack((q, k, v), 1)},
    )),
    "flash_attn_varlen_kvpacked_func": ("flash_attn_varlen_func", (
        ("q", "kv"), lambda q, kv, **_: (q, *kv.unbind(1)),
        lambda given, q, k, v: {"q": q, "kv": torch.stack((k, v), 1)},
    )),
    "flash_attn_with_kvcache": ("flash_attn_with_kvcache", ((), lambda **_: (), _qkv)),
}  # fmt: skip


def _read(
    library_name: str,
    function: str,
    named: dict[str, Any],
    library: Callable[..., Any],
    own: Callable[[], Any],
) -> LibraryCall | str | None:
    """One flash-attn call (``function`` of the module ``library_name``) as a :class:`LibraryCall`."""
    api, (packed, unpack, pack) = _FORMS[function]
    given = dict(named)
    if not all(isinstance(named.get(n), torch.Tensor) for n in packed):
        return None
    tensors = unpack(**{n: named.pop(n) for n in packed}, heads_q=named.pop("num_heads_q", None))
    if function.startswith("flash_attn_varlen_qkvpacked"):
        cu, most = named.pop("cu_seqlens", None), named.pop("max_seqlen", None)
        named.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=most, max_seqlen_k=most)
    dropout_p = float(named.pop("dropout_p", 0.0) or 0.0)
    if named.get("window_size") is not None:  # flash-attention 4: None for unbounded
        named["window_size"] = tuple(-1 if x is None else int(x) for x in named["window_size"])
    if named.pop("return_lse", False):  # flash-attention 4's name for it
        named["return_attn_probs"] = True
    seqused_k = named.pop("seqused_k", None) if api == "flash_attn_varlen_func" else None
    readable = {*API_PARAMETERS[api], *FA3_PARAMETERS} - {
        "seqused_q",
        "seqused_k",
        "rotary_cos",
        "rotary_sin",
    }
    reason = unexpressed(named, readable | {"q", "k", "v"}, _HARMLESS, _OFF)
    if reason is not None:
        return reason
    kw = {n: x for n, x in named.items() if n in readable}
    if tensors:
        kw.update(q=tensors[0], k=tensors[1], v=tensors[2])
    call = call_from_arguments(api, **kw)
    reference = None
    if seqused_k is not None:  # each sequence uses its first seqused_k keys (FlashAttention-3)
        logical = call.logical()
        used = torch.minimum(logical.k_lens, seqused_k.to(logical.k_lens))
        reference = logical.replace(k_lens=used)
    caps = _FA2_CAPS if library_name in _FA2 else _FA3_CAPS

    def run(replaced: Tensors | None, dropout: float | None) -> Any:
        if replaced is None:
            return own()
        kwargs = {**given, **pack(given, replaced["q"], replaced["k"], replaced["v"])}
        if "dropout_p" in given or dropout:
            kwargs["dropout_p"] = dropout
        return library(**kwargs)

    def outputs(returned: Any) -> CallOutput:
        if not call.return_lse and isinstance(returned, tuple | list):
            returned = returned[0]  # FlashAttention-3's first releases returned (out, lse) always
        return logical_outputs(api, call, returned, caps)

    differentiable = call.storage in ("dense", "packed") and not call.fp8 and api != "flash_attn_with_kvcache"
    return LibraryCall(
        function, call, run, outputs, dropout_p=dropout_p, reference=reference, differentiable=differentiable
    )


_FA2 = ("flash_attn", "flash_attn.flash_attn_interface")
_FA3 = ("flash_attn_interface",)  # FlashAttention-3 (hopper/)
_FA4 = ("flash_attn.cute", "flash_attn.cute.interface")  # flash-attention 4 (flash_attn/cute/)
#: where each entry point lives
_MODULES = {
    "flash_attn_func": _FA2 + _FA3 + _FA4,
    "flash_attn_qkvpacked_func": _FA2 + _FA3,
    "flash_attn_kvpacked_func": _FA2,
    "flash_attn_varlen_func": _FA2 + _FA3 + _FA4,
    "flash_attn_varlen_qkvpacked_func": _FA2,
    "flash_attn_varlen_kvpacked_func": _FA2,
    "flash_attn_with_kvcache": _FA2,
}

#: The entry points, swapped where their modules are imported.
FUNCTIONS = DirectFunctions(
    tuple(
        (module, function, functools.partial(_read, module, function))
        for function, modules in _MODULES.items()
        for module in modules
    ),
    callers=("transformers.modeling_flash_attention_utils",),
)

#: flash-attn 2, FlashAttention-3 and flash-attention 4.
SOURCE = patching.Source("flash-attn", FUNCTIONS.install, FUNCTIONS.stand_ins)
