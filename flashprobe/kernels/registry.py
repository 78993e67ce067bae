"""Kernel registry and spec strings.

A **spec** names a kernel and its options: ``name[:key=value,...]``, for example ``math``,
``sdpa_flash``, ``tiled:block_q=32,block_k=128,dtype=bfloat16`` or ``tiled:mask_value=-5e4``.
Values are parsed as int, float (``inf``/``-inf``/``1e-3``), bool (``true``/``false``) or string;
each kernel converts them further (dtype names, ...). The same strings work from Python, the CLI
and Hydra configs.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from flashprobe.errors import FlashprobeError
from flashprobe.kernels._inputs import check_inputs, dtype_name
from flashprobe.kernels.call import ALIGNS, LSE_BASES, AttentionCall, CallOutput
from flashprobe.kernels.contract import (
    API_PARAMETERS,
    APIS,
    FA3_PARAMETERS,
    contract_problem,
    run_contract,
    sdpa_arguments,
)
from flashprobe.kernels.fp8 import FP8_FORMATS

__all__ = [
    "ANY_CAPABILITIES",
    "BACKWARD_MASK_KINDS",
    "GQA_MODES",
    "MASK_KINDS",
    "AttentionFn",
    "Kernel",
    "KernelAvailability",
    "KernelCapabilities",
    "KernelInfo",
    "KernelSpecError",
    "KernelUnavailableError",
    "KernelUnsupportedError",
    "available_kernels",
    "get_kernel",
    "import_kernel_modules",
    "kernel_availability",
    "list_kernels",
    "mask_kind",
    "parse_spec",
    "register_kernel",
    "unregister_kernel",
]


class AttentionFn(Protocol):
    """The SDPA signature every kernel implements; tensors are ``(B, H, N, D)``."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor: ...


class KernelSpecError(ValueError, FlashprobeError):
    """A kernel spec string is malformed, names an unknown kernel or an unknown option."""


class KernelUnavailableError(RuntimeError, FlashprobeError):
    """A kernel cannot run here (missing package, wrong device, unsupported dtype)."""


#: the mask kinds a kernel can declare; a call without a mask is always supported
MASK_KINDS = ("causal", "bool", "float", "key_padding", "head_shared")
#: the kinds of call a kernel can declare a backward for (``backward_masks``): no mask, or a mask kind
BACKWARD_MASK_KINDS = ("none", *MASK_KINDS)
#: how a kernel handles grouped key/value heads (``H_kv < H``)
GQA_MODES = ("native", "expanded", "none")

#: kernels that support what another kernel refuses, named in the fixes of refusals
_FALLBACK = "math, tiled or sdpa_math"
#: each kind of call of :data:`BACKWARD_MASK_KINDS`, in words
_CALL_TEXT = {
    "none": "calls without a mask",
    "causal": "causal calls",
    "bool": "bool masks",
    "float": "additive masks",
    "key_padding": "key-padding masks",
    "head_shared": "bool masks shared by every head",
}


class KernelUnsupportedError(KernelUnavailableError):
    """A kernel does not support a setting or a call (per its :class:`KernelCapabilities`), raised
    before any kernel work; the message names the feature and the fix."""


def _device_label(kind: str) -> str:
    return {"cuda": "CUDA", "cpu": "CPU", "mps": "MPS", "xpu": "XPU"}.get(kind, kind)


def _device_labels(kinds: frozenset[str]) -> str:
    return ", ".join(_device_label(k) for k in sorted(kinds))


@dataclass(frozen=True, kw_only=True)
class KernelCapabilities:
    """What a kernel supports, checked when it is chosen and at each call before it runs; the
    default supports everything (a kernel that declares nothing is never refused).

    Attributes:
        masks: the mask kinds it accepts, of :data:`MASK_KINDS`: ``causal`` (``is_causal``),
            ``bool``, ``float`` (additive), ``key_padding`` (a bool mask masking the same keys for
            every head and query: ``(B, 1, 1, N_k)``, or ``(B, 1, N_q, N_k)`` whose rows the kernel
            checks itself), ``head_shared`` (one bool mask for every head, ``(B, 1, N_q, N_k)``).
        causal_cross: causal with ``N_q != N_k`` (SDPA's top-left alignment).
        seq_multiple: ``N_q`` and ``N_k`` must be multiples of this.
        same_length: ``N_q = N_k`` only.
        causal_seq_multiple: that multiple for causal calls where it differs (None: ``seq_multiple``).
        contiguous: contiguous q, k, v only.
        backward_masks: the kinds of call that have a backward, of :data:`BACKWARD_MASK_KINDS`;
            None: every call it takes.
        gqa: ``native`` (``H_kv < H`` passed as is), ``expanded`` (k, v repeated to ``H`` heads) or
            ``none`` (refused).
        head_dims: the exact head dims supported (None: any within ``max_head_dim`` and
            ``head_dim_multiple``).
        value_head_dim: ``D_v != D`` supported.
        dtypes: the input dtypes (None: any floating dtype); ``torch.float8_e4m3fn`` among them
            for FlashAttention-3's FP8 inputs with descales.
        devices: the device types it runs on (None: any).
        backward_devices: those it has a backward on (None: every device it runs on; empty: none).
        min_cuda_capability: the oldest CUDA architecture, e.g. ``(8, 0)``.
        install: how to install what it needs, named in device refusals.
        fp8: the coarsest FP8 format (``"e4m3"``, ``"e5m2"``) the kernel rounds its operands to;
            ``flashprobe fuzz`` judges it against ``math:fp8=<format>``. None: no FP8 rounding.
        window, softcap, alibi, sinks, lse: it has that feature (the flash apis).
        lse_base: the base of the LSE it returns or takes: ``"e"`` or 2.
        empty_lse: its LSE for a row that sees no key: ``-inf`` or ``inf`` (flash-attn 2).
        causal_align: where it anchors causal masks, windows and ALiBi when N_q != N_k; None: as
            its api (SDPA top-left, flash-attn bottom-right).
        page_sizes: the page sizes of a paged KV cache it takes (None: any multiple of
            ``page_multiple``).
        preallocated_out: it writes into a preallocated ``out=``.
        cache_leftpad: it takes ``flash_attn_with_kvcache``'s ``cache_leftpad``.
        batch_invariant: a row's output is bit-identical whatever else is in the batch.
        deterministic: the same call gives the same bits every time, its backward included.
    """

    masks: frozenset[str] = frozenset(MASK_KINDS)
    causal_cross: bool = True
    seq_multiple: int = 1
    same_length: bool = False
    causal_seq_multiple: int | None = None
    contiguous: bool = False
    backward_masks: frozenset[str] | None = None
    gqa: str = "native"
    head_dims: frozenset[int] | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    value_head_dim: bool = True
    dtypes: frozenset[torch.dtype] | None = None
    devices: frozenset[str] | None = None
    backward_devices: frozenset[str] | None = None
    min_cuda_capability: tuple[int, int] | None = None
    install: str = ""
    fp8: str | None = None
    window: bool = True
    softcap: bool = True
    alibi: bool = True
    sinks: bool = True
    lse: bool = True
    lse_base: str | int = "e"
    empty_lse: float = float("-inf")
    causal_align: str | None = None
    page_sizes: frozenset[int] | None = None
    page_multiple: int = 1
    preallocated_out: bool = False
    cache_leftpad: bool = True
    batch_invariant: bool = False
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.lse_base not in LSE_BASES:
            allowed = ", ".join(repr(b) for b in LSE_BASES)
            raise ValueError(f"lse_base={self.lse_base!r} must be one of {allowed}")
        if self.empty_lse not in (float("-inf"), float("inf")):
            raise ValueError(f"empty_lse={self.empty_lse!r} must be -inf or inf")
        if self.causal_align not in (None, *ALIGNS):
            raise ValueError(f"causal_align={self.causal_align!r} must be None or one of {', '.join(ALIGNS)}")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8={self.fp8!r} must be one of {', '.join(FP8_FORMATS)} or None")
        if self.gqa not in GQA_MODES:
            raise ValueError(f"gqa={self.gqa!r} must be one of {', '.join(GQA_MODES)}")
        for name in ("page_multiple", "head_dim_multiple", "seq_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.causal_seq_multiple is not None and self.causal_seq_multiple < 1:
            raise ValueError(f"causal_seq_multiple={self.causal_seq_multiple} must be >= 1 or None")
        for name, allowed in (("masks", MASK_KINDS), ("backward_masks", BACKWARD_MASK_KINDS)):
            unknown = set(getattr(self, name) or ()) - set(allowed)
            if unknown:
                raise ValueError(f"{name}: unknown kinds {sorted(unknown)}; allowed: {', '.join(allowed)}")

    def has_backward_for(self, kind: str) -> bool:
        """Whether a call of ``kind`` (of :data:`BACKWARD_MASK_KINDS`) has a backward; a
        ``key_padding`` call has one where ``bool`` masks do."""
        if self.backward_masks is None:
            return True
        return kind in self.backward_masks or (kind == "key_padding" and "bool" in self.backward_masks)

    def seq_multiple_for(self, is_causal: bool) -> int:
        """The multiple ``N_q`` and ``N_k`` must be for a causal (or a non-causal) call."""
        if is_causal and self.causal_seq_multiple is not None:
            return self.causal_seq_multiple
        return self.seq_multiple

    def length_problem(self, n_q: int, n_k: int, is_causal: bool = False) -> str | None:
        """Why the kernel cannot take ``N_q`` queries and ``N_k`` keys (``seq_multiple``,
        ``causal_seq_multiple``, ``same_length``), feature and fix; None when it can."""
        if self.same_length and n_q != n_k:
            return (
                f"takes N_q = N_k only, not N_q={n_q}, N_k={n_k}; compare cross-attention shapes with "
                f"a kernel that takes them ({_FALLBACK})"
            )
        m = self.seq_multiple_for(is_causal)
        if n_q % m or n_k % m:
            calls = ""
            if self.causal_seq_multiple is not None:
                calls = " in causal calls" if is_causal else " without causal"
            return (
                f"needs sequence lengths that are multiples of {m}{calls}, not N_q={n_q}, N_k={n_k}; pad the "
                f"sequences to a multiple of {m} and mask the padded keys, or choose {_FALLBACK}"
            )
        return None

    def has_backward(self, device: torch.device | str) -> bool:
        """Whether the kernel has a backward on ``device`` (a device or device type)."""
        kind = torch.device(device).type
        if self.devices is not None and kind not in self.devices:
            return False
        return self.backward_devices is None or kind in self.backward_devices

    def setting_problem(
        self, device: torch.device | str, dtype: torch.dtype, *, backward: bool = False
    ) -> str | None:
        """Why the kernel cannot run on ``device`` at ``dtype`` (with a backward when ``backward``),
        feature and fix; None when it can."""
        device = torch.device(device)
        if self.devices is not None and device.type not in self.devices:
            return (
                f"runs on {_device_labels(self.devices)} devices only, not {_device_label(device.type)}; "
                f"move the model there or choose a kernel that runs on {_device_label(device.type)} "
                f"({_FALLBACK})"
                + (f"; on a {_device_labels(self.devices)} machine: {self.install}" if self.install else "")
            )
        if self.dtypes is not None and dtype not in self.dtypes:
            allowed = ", ".join(sorted(dtype_name(d) for d in self.dtypes))
            return (
                f"supports {allowed} only, not {dtype_name(dtype)}; run the model in (or under "
                f"autocast to) {allowed}, or choose a kernel that takes {dtype_name(dtype)} ({_FALLBACK})"
            )
        if backward and not self.has_backward(device):
            where = (
                ""
                if not self.backward_devices
                else f" on {_device_label(device.type)} (only on {_device_labels(self.backward_devices)})"
            )
            return (
                f"has no backward{where}; compare forward only (backward=False, or the fuzzer's "
                f"--no-backward), or choose a kernel with a backward ({_FALLBACK})"
            )
        if self.min_cuda_capability is not None and device.type == "cuda" and torch.cuda.is_available():
            have = torch.cuda.get_device_capability(device)
            if tuple(have) < self.min_cuda_capability:
                need = "sm{}{}".format(*self.min_cuda_capability)
                return (
                    f"needs a CUDA architecture {need} or newer, this GPU is sm{have[0]}{have[1]}; "
                    "choose sdpa_efficient, sdpa_math or tiled"
                )
        return None

    def call_problem(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
    ) -> str | None:
        """Why the kernel cannot take this SDPA call (feature and fix), or None; from shapes, dtypes
        and devices only. q ``(B, H, N_q, D)``, k ``(B, H_kv, N_k, D)``, v ``(B, H_kv, N_k, D_v)``."""
        problem = self.setting_problem(q.device, q.dtype)
        if problem is not None:
            return problem
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            problem = self.setting_problem(q.device, q.dtype, backward=True)
            if problem is not None:
                return f"inputs require grad, but it {problem}"
            kind = "causal" if is_causal else "none" if attn_mask is None else mask_kind(attn_mask)
            if not self.has_backward_for(kind):
                return (
                    f"inputs require grad, but it has a backward only for {self.describe_backward_masks()}, "
                    f"not for {_CALL_TEXT[kind]}; compare forward only (the fuzzer's --no-backward) or "
                    f"choose a kernel with that backward ({_FALLBACK})"
                )
        problem = self.length_problem(q.shape[-2], k.shape[-2], is_causal)
        if problem is not None:
            return problem
        if self.contiguous and not all(t.is_contiguous() for t in (q, k, v)):
            return f"takes contiguous q, k, v only; call .contiguous() on them first, or choose {_FALLBACK}"
        problem = self.head_problem(q.shape[-1], v.shape[-1], q.shape[-3], k.shape[-3])
        if problem is not None:
            return problem
        if is_causal:
            if "causal" not in self.masks:
                return f"does not support causal masks (is_causal=True); choose {_FALLBACK}"
            if q.shape[-2] != k.shape[-2] and not self.causal_cross:
                return (
                    f"does not support is_causal with N_q != N_k (N_q={q.shape[-2]}, N_k={k.shape[-2]}: "
                    "SDPA aligns that mask top-left); compare such shapes with sdpa kernels, math or tiled"
                )
        if attn_mask is not None:
            kind = mask_kind(attn_mask)
            if kind == "float" and "float" not in self.masks:
                return f"does not support additive float masks; pass a bool mask or choose {_FALLBACK}"
            shared = attn_mask.dim() < 3 or attn_mask.shape[-3] == 1
            if kind != "float" and "bool" not in self.masks and not ("head_shared" in self.masks and shared):
                if "key_padding" not in self.masks:
                    only = " per head" if "head_shared" in self.masks else ""
                    return f"does not support attn_mask (bool masks{only}); choose {_FALLBACK}"
                if attn_mask.dim() == 4 and attn_mask.shape[1] != 1:
                    return (
                        "supports bool masks only as key padding (the same keys masked for every head "
                        f"and query), not a mask of shape {tuple(attn_mask.shape)}; choose {_FALLBACK}"
                    )
        return None

    def head_problem(self, d: int, d_v: int, h: int, h_kv: int) -> str | None:
        """Why the kernel cannot take head dims ``d``/``d_v`` with ``h`` query and ``h_kv`` key/value
        heads (feature and fix), or None."""
        if (
            (self.head_dims is not None and d not in self.head_dims)
            or (self.max_head_dim is not None and d > self.max_head_dim)
            or d % self.head_dim_multiple
        ):
            return (
                f"does not support head dim {d} ({self.describe_head_dims()}); "
                f"choose a kernel without that limit ({_FALLBACK})"
            )
        if d_v != d and not self.value_head_dim:
            return f"needs v's head dim ({d_v}) to equal q's ({d}); choose {_FALLBACK} for D_v != D"
        if h_kv != h and self.gqa == "none":
            return (
                f"does not support grouped key/value heads ({h_kv} for {h} query heads); "
                "repeat k and v to every query head, or choose a kernel with GQA"
            )
        return None

    def page_problem(self, page_size: int) -> str | None:
        """Why the kernel cannot take pages of ``page_size`` keys (feature and fix), or None."""
        if self.page_sizes is not None and not self.page_sizes:
            return "does not take a paged KV cache (page_sizes is empty); pass k and v unpaged"
        listed = self.page_sizes is None or page_size in self.page_sizes
        if not listed or page_size % self.page_multiple:
            return f"does not take pages of {page_size} keys ({self.describe_pages()}); page the cache so"
        return None

    def describe_pages(self) -> str:
        """The page sizes supported, in words."""
        if self.page_sizes is not None and not self.page_sizes:
            return "no paged KV cache"
        parts = [] if self.page_sizes is None else [", ".join(str(p) for p in sorted(self.page_sizes))]
        if self.page_multiple > 1:
            parts.append(f"multiples of {self.page_multiple}")
        return "page sizes " + (" that are ".join(parts) or "any")

    def describe_head_dims(self) -> str:
        """The head dims supported, in words."""
        if self.head_dims is not None:
            return "head dims " + ", ".join(str(d) for d in sorted(self.head_dims))
        parts = []
        if self.max_head_dim is not None:
            parts.append(f"up to {self.max_head_dim}")
        if self.head_dim_multiple > 1:
            parts.append(f"multiples of {self.head_dim_multiple}")
        return "head dims " + " that are ".join(parts) if parts else "any head dim"

    def describe_lengths(self) -> str:
        """The sequence lengths supported, in words (``""`` for any)."""
        parts = []
        if self.same_length:
            parts.append("N_q = N_k only")
        if self.seq_multiple > 1:
            without = " without causal" if self.causal_seq_multiple not in (None, self.seq_multiple) else ""
            parts.append(f"lengths multiples of {self.seq_multiple}{without}")
        if self.causal_seq_multiple not in (None, 1, self.seq_multiple):
            parts.append(f"causal lengths multiples of {self.causal_seq_multiple}")
        if self.contiguous:
            parts.append("contiguous inputs only")
        return ", ".join(parts)

    def describe_backward_masks(self) -> str:
        """The calls with a backward, in words: ``causal calls``, ``calls without a mask, causal``."""
        kinds = [k for k in BACKWARD_MASK_KINDS if k in (self.backward_masks or BACKWARD_MASK_KINDS)]
        return ", ".join(_CALL_TEXT[k] for k in kinds) or "no call"

    def describe(self) -> str:
        """One line: masks, lengths, GQA, head dims, dtypes, devices, backward."""
        masks = ", ".join(m for m in MASK_KINDS if m in self.masks) or "none"
        dtypes = (
            "any dtype" if self.dtypes is None else "/".join(sorted(dtype_name(d) for d in self.dtypes))
        )
        devices = "any device" if self.devices is None else _device_labels(self.devices).replace(", ", "/")
        if self.backward_devices is None:
            backward = "backward"
        elif self.backward_devices:
            backward = "backward on " + _device_labels(self.backward_devices).replace(", ", "/")
        else:
            backward = "no backward"
        if self.backward_masks is not None and backward != "no backward":
            backward += f" for {self.describe_backward_masks()} only"
        arch = "" if self.min_cuda_capability is None else ", sm{}{}+".format(*self.min_cuda_capability)
        lengths = f"; {text}" if (text := self.describe_lengths()) else ""
        return (
            f"masks: {masks}{lengths}; GQA {self.gqa}; {self.describe_head_dims()}; {dtypes}; "
            f"{devices}{arch}; {backward}{self.describe_features()}"
        )

    def describe_features(self) -> str:
        """The features beyond SDPA's it lacks and its conventions, in words (``""`` for the defaults)."""
        features = ("window", "softcap", "alibi", "sinks", "lse", "cache_leftpad")
        lacks = [n for n in features if not getattr(self, n)]
        parts = [f"no {', '.join(lacks)}"] if lacks else []
        if self.lse_base != "e" or self.empty_lse != float("-inf"):
            parts.append(f"LSE base {self.lse_base}, {self.empty_lse} for a row without keys")
        if self.causal_align is not None:
            parts.append(f"causal {self.causal_align.replace('_', '-')}")
        if self.page_sizes is not None or self.page_multiple > 1:
            parts.append(self.describe_pages())
        if self.preallocated_out:
            parts.append("out=")
        return "".join(f"; {p}" for p in parts)


def mask_kind(attn_mask: torch.Tensor) -> str:
    """``"float"``, ``"key_padding"`` (bool, at least 3 dims, every dim but the first and last of
    size 1) or ``"bool"``, by shape and dtype only."""
    if attn_mask.dtype != torch.bool:
        return "float"
    if attn_mask.dim() >= 3 and all(s == 1 for s in attn_mask.shape[1:-1]):
        return "key_padding"
    return "bool"


#: everything supported: the capabilities of a kernel that declares none
ANY_CAPABILITIES = KernelCapabilities()


@dataclass(frozen=True)
class _Entry:
    fn: Callable[..., torch.Tensor]
    description: str
    check: Callable[..., None] | None
    options: tuple[str, ...]
    validate: Callable[..., None] | None = None
    capabilities: KernelCapabilities | Callable[[Mapping[str, Any]], KernelCapabilities] = ANY_CAPABILITIES
    api: str = "sdpa"

    def capabilities_for(self, options: Mapping[str, Any]) -> KernelCapabilities:
        """The capabilities of the kernel with these spec options."""
        caps = self.capabilities
        return caps if isinstance(caps, KernelCapabilities) else caps(options)


_REGISTRY: dict[str, _Entry] = {}


def register_kernel(
    name: str,
    fn: Callable[..., torch.Tensor] | None = None,
    *,
    description: str = "",
    check: Callable[..., None] | None = None,
    validate: Callable[..., None] | None = None,
    capabilities: KernelCapabilities | Callable[[Mapping[str, Any]], KernelCapabilities] | None = None,
    overwrite: bool = False,
    api: str = "sdpa",
) -> Any:
    """Register an attention kernel under ``name`` so specs can select it; usable as a decorator::

        @register_kernel("mine")
        def my_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, block=64): ...

    ``fn`` has the signature of its ``api`` (:mod:`flashprobe.kernels.contract`): SDPA's by default,
    else flash-attn's or FlashInfer's ``merge_state``; its keyword-only parameters that are not the
    api's become the spec's options. Every kernel runs a call of any form with :meth:`Kernel.run`.

    Args:
        name: the spec name, letters, digits and ``_`` only.
        fn: the kernel function (omit to use as a decorator).
        description: one line shown by ``flashprobe`` listings (default: the docstring's first line).
        check: optional ``check(device, dtype, /, **options)`` raising :class:`KernelUnavailableError`
            where the kernel cannot run.
        validate: optional ``validate(**options)`` raising ``ValueError`` for bad option values, so a
            bad spec fails when it is parsed.
        capabilities: what the kernel supports (default: everything), or
            ``capabilities(options) -> KernelCapabilities`` per spec.
        overwrite: replace an existing kernel of that name.
        api: the contract ``fn`` has, of :data:`~flashprobe.kernels.contract.APIS`.

    Returns:
        ``fn`` (or the decorator).

    Raises:
        KernelSpecError: the name is invalid or already taken, or the api unknown.
    """
    if api not in APIS:
        raise KernelSpecError(f"api={api!r} must be one of {', '.join(APIS)}")

    def decorate(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if not name or not name.replace("_", "").isalnum():
            raise KernelSpecError(f"kernel name {name!r} must be letters, digits and '_'")
        if name in _REGISTRY and not overwrite:
            raise KernelSpecError(f"kernel {name!r} is already registered; pass overwrite=True")
        params = inspect.signature(f).parameters
        base = {*API_PARAMETERS[api], *(FA3_PARAMETERS if api.startswith("flash_attn") else ())}
        options = tuple(p for p, prm in params.items() if p not in base and prm.kind == prm.KEYWORD_ONLY)
        doc = description or (inspect.getdoc(f) or "").split("\n")[0]
        caps = ANY_CAPABILITIES if capabilities is None else capabilities
        _REGISTRY[name] = _Entry(f, doc, check, options, validate, caps, api)
        return f

    return decorate(fn) if fn is not None else decorate


@dataclass(frozen=True)
class KernelInfo:
    """What the registry knows of one kernel: its spec name, one-line description, spec options (in
    signature order), whether it ships with flashprobe, its capabilities and its api."""

    name: str
    description: str
    options: tuple[str, ...]
    builtin: bool
    capabilities: KernelCapabilities = ANY_CAPABILITIES
    api: str = "sdpa"


def list_kernels() -> list[KernelInfo]:
    """Every registered kernel, sorted by name."""
    _ensure_builtin()
    return [
        KernelInfo(n, e.description, e.options, _is_builtin(e), e.capabilities_for({}), e.api)
        for n, e in sorted(_REGISTRY.items())
    ]


def _is_builtin(entry: _Entry) -> bool:
    return entry.fn.__module__.startswith("flashprobe.kernels.")


def available_kernels() -> dict[str, str]:
    """Registered kernel names mapped to their one-line descriptions."""
    return {info.name: info.description for info in list_kernels()}


#: the dtypes :func:`kernel_availability` tries, in this order
_AVAILABILITY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KernelAvailability:
    """Whether a kernel runs on one device, and why not.

    Attributes:
        dtypes: the dtypes it ran at (``"bf16"``, ...); empty when it cannot run there at all.
        reasons: dtype name → why it cannot run at that dtype (the kernel's own message).
        called: whether a tiny call ran (False: only the kernel's declared check was asked).
    """

    spec: str
    device: str
    dtypes: tuple[str, ...]
    reasons: Mapping[str, str]
    called: bool = True

    @property
    def available(self) -> bool:
        """True when it runs at one dtype or more."""
        return bool(self.dtypes)

    @property
    def reason(self) -> str:
        """Why it cannot run (at some dtypes); ``""`` when it runs at every dtype tried."""
        distinct = list(dict.fromkeys(self.reasons.values()))
        if len(distinct) == 1 and not self.dtypes:
            return distinct[0]
        return "; ".join(f"{dtype}: {why}" for dtype, why in self.reasons.items())


def kernel_availability(
    spec: str | Kernel,
    device: torch.device | str = "cpu",
    dtypes: tuple[torch.dtype, ...] = _AVAILABILITY_DTYPES,
    *,
    call: bool = True,
) -> KernelAvailability:
    """Try a kernel on ``device`` at each dtype: its ``check``, then (with ``call``) one tiny call
    ``(1, 1, 8, 16)``, which catches what a ``check`` does not know (a package imported when called).

    Raises:
        KernelSpecError: the spec is not valid.
    """
    kernel = get_kernel(spec)
    device = torch.device(device)
    ran: list[str] = []
    reasons: dict[str, str] = {}
    for dtype in dtypes:
        name = dtype_name(dtype)
        try:
            kernel.check(device, dtype)
            if call:
                x = torch.zeros(1, 1, 8, 16, device=device, dtype=dtype)
                kernel(x, x, x)
        except Exception as err:  # any failure means "not here"; its message says why
            unavailable = isinstance(err, KernelUnavailableError)
            reasons[name] = str(err) if unavailable else f"{type(err).__name__}: {err}"
        else:
            ran.append(name)
    return KernelAvailability(kernel.spec, str(device), tuple(ran), reasons, called=call)


def add_import_option(parser: argparse.ArgumentParser) -> None:
    """Add the CLIs' repeatable ``--import MODULE`` option (into ``args.imports``); the command passes
    ``args.imports or []`` to :func:`import_kernel_modules` before it reads a kernel spec."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE first (it registers your kernels with flashprobe.register_kernel); repeatable",
    )


def import_kernel_modules(modules: Iterable[str]) -> None:
    """Import the modules that register a user's kernels (``--import MODULE``), finding them in the
    working directory as ``python -m`` does, without writing bytecode beside them.

    Raises:
        KernelSpecError: a name that is not a dotted module name (a path, ``""``), a module that
            cannot be imported, or one that raises as it is imported, naming it and the fix.
    """
    modules = list(modules)
    if modules and "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    for module in modules:
        if not all(part.isidentifier() for part in module.split(".")):
            raise KernelSpecError(
                f"--import {module!r} is not a module name: give a dotted Python name (e.g. mypkg.kernels), "
                "not a path, and run from the directory that holds it"
            )
        written, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ beside it
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise KernelSpecError(
                f"--import {module}: {err}; run from the directory that holds it or add that to PYTHONPATH"
            ) from None
        except Exception as err:  # the module itself fails as it is imported: its error, in one line
            first = (str(err).strip().splitlines() or [""])[0]
            raise KernelSpecError(
                f"--import {module}: importing it raised {type(err).__name__}: {first}; fix the module"
            ) from None
        finally:
            sys.dont_write_bytecode = written


def unregister_kernel(name: str) -> None:
    """Remove a kernel registered with :func:`register_kernel`.

    Raises:
        KernelSpecError: no kernel of that name, or a built-in kernel (they cannot be removed).
    """
    _ensure_builtin()
    if name not in _REGISTRY:
        raise KernelSpecError(f"no kernel {name!r} is registered; registered: {', '.join(sorted(_REGISTRY))}")
    if _is_builtin(_REGISTRY[name]):
        raise KernelSpecError(f"kernel {name!r} is built into flashprobe and cannot be unregistered")
    del _REGISTRY[name]


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(low)
    except ValueError:
        pass
    try:
        return float(low)
    except ValueError:
        return text.strip()


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"name:key=value,..."`` into ``(name, options)``.

    Raises:
        KernelSpecError: the spec is malformed.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise KernelSpecError(f"kernel spec must be a non-empty string like 'tiled:block_k=64', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    options: dict[str, Any] = {}
    if rest.strip():
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise KernelSpecError(
                    f"kernel spec {spec!r}: option {item!r} must look like key=value "
                    "(e.g. 'tiled:block_k=64,dtype=bf16')"
                )
            if key.strip() in options:
                raise KernelSpecError(f"kernel spec {spec!r}: option {key.strip()!r} is given twice")
            options[key.strip()] = _parse_value(value)
    return name.strip(), options


@dataclass(frozen=True)
class Kernel:
    """A registered kernel (``name``) bound to its spec ``options``; call it like SDPA."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> str:
        """The canonical spec string, e.g. ``"tiled:block_k=64"``."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.options.items())

    @property
    def fn(self) -> Callable[..., torch.Tensor]:
        return _REGISTRY[self.name].fn

    @property
    def capabilities(self) -> KernelCapabilities:
        """What the kernel declares it supports (with its options)."""
        return _REGISTRY[self.name].capabilities_for(self.options)

    @property
    def api(self) -> str:
        """The contract it is called with (:data:`~flashprobe.kernels.contract.APIS`)."""
        return _REGISTRY[self.name].api

    def run(self, call: AttentionCall) -> CallOutput:
        """Run the kernel on a call of any form through its contract's adapter; its output (and LSE)
        in the logical form.

        Raises:
            KernelUnsupportedError: before any kernel work, a call its api or capabilities exclude
                (the feature and the fix).
        """
        entry = _REGISTRY[self.name]
        caps = entry.capabilities_for(self.options)
        problem = contract_problem(entry.api, call, caps)
        if problem is not None:
            raise KernelUnsupportedError(f"{self.spec}: {problem}")
        if entry.api == "sdpa":
            args = sdpa_arguments(call, caps)
            return CallOutput(self(args.pop("q"), args.pop("k"), args.pop("v"), **args), None, call.lse_base)
        return run_contract(entry.api, entry.fn, call, caps, self.options)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Run the kernel: q, k, v ``(B, H, N_q|N_k, D|D_v)`` → ``(B, H, N_q, D_v)``.

        Raises:
            KernelUnsupportedError: before any kernel work, a call its capabilities exclude.
        """
        entry = _REGISTRY[self.name]
        if entry.api != "sdpa":  # another contract: the same call through its adapter
            check_inputs(q, k, v, attn_mask, is_causal, kernel=self.spec, gqa=True)
            call = AttentionCall(q=q, k=k, v=v, attn_mask=attn_mask, causal=is_causal, scale=scale)
            return self.run(call).out.to(q.dtype)
        caps = entry.capabilities_for(self.options)
        if caps is not ANY_CAPABILITIES:
            check_inputs(q, k, v, attn_mask, is_causal, kernel=self.spec, gqa=True)  # shapes first
            problem = caps.call_problem(q, k, v, attn_mask, is_causal)
            if problem is not None:
                raise KernelUnsupportedError(f"{self.spec}: {problem}")
        return entry.fn(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **self.options)

    def check(self, device: torch.device | str, dtype: torch.dtype, *, backward: bool = False) -> None:
        """Raise if this kernel cannot run on ``device``/``dtype`` (with gradients when ``backward``).

        Raises:
            KernelUnsupportedError: its capabilities exclude the setting (the feature and the fix).
            KernelUnavailableError: its own check refuses (e.g. a missing package).
        """
        problem = self.capabilities.setting_problem(device, dtype, backward=backward)
        if problem is not None:
            raise KernelUnsupportedError(f"{self.spec}: {problem}")
        entry = _REGISTRY[self.name]
        if entry.check is not None:
            entry.check(torch.device(device), dtype, **self.options)

    def __str__(self) -> str:
        return self.spec


def get_kernel(spec: str | Kernel) -> Kernel:
    """Resolve a spec string (or pass through a :class:`Kernel`).

    Raises:
        KernelSpecError: unknown kernel name or option (naming the allowed ones), or an option
            value the kernel rejects.
    """
    if isinstance(spec, Kernel):
        return spec
    _ensure_builtin()
    name, options = parse_spec(spec)
    if name not in _REGISTRY:
        allowed = ", ".join(sorted(_REGISTRY))
        raise KernelSpecError(
            f"unknown kernel {name!r} in spec {spec!r}; available: {allowed} "
            "(register your own with flashprobe.register_kernel)"
        )
    entry = _REGISTRY[name]
    unknown = [k for k in options if k not in entry.options]
    if unknown:
        allowed = ", ".join(entry.options) or "(none)"
        raise KernelSpecError(
            f"kernel {name!r} has no option {unknown[0]!r} (spec {spec!r}); its options: {allowed}"
        )
    if entry.validate is not None:
        try:
            entry.validate(**options)
        except ValueError as err:
            raise KernelSpecError(f"kernel spec {spec!r}: {err}") from None
    return Kernel(name, options)


_BUILTIN_LOADED = False


def _ensure_builtin() -> None:
    global _BUILTIN_LOADED
    if not _BUILTIN_LOADED:
        _BUILTIN_LOADED = True
        from flashprobe.kernels import flash_attn, math, sdpa, tiled  # noqa: F401  (registers)
