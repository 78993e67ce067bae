"""Routing every ``scaled_dot_product_attention`` call made inside a model, and ``use_kernel``.

**How calls are caught.** While at least one handle (:class:`KernelRoute` from :func:`use_kernel`,
or a :class:`~flashprobe.probe.Probe`) is attached, ``torch.nn.functional.scaled_dot_product_attention``
is replaced by a dispatcher. ``nn.MultiheadAttention`` (through ``F.multi_head_attention_forward``)
and libraries calling ``F.scaled_dot_product_attention`` look the name up at call time, so they
reach it; modules of the attached model's classes that did ``from torch.nn.functional import
scaled_dot_product_attention`` have that global swapped too. When the last handle detaches every
swapped name is restored. (A ``TorchFunctionMode`` would also catch names bound elsewhere, but it
puts Python on the path of *every* tensor op of the model.)

**Which module made a call.** The dispatcher walks up the Python stack to the innermost
``nn.Module.__call__`` frame whose module belongs to an attached model: that module's path in
the model (``blocks.3.attn``) is the **site**. Nothing is stored on the modules (no hooks, no
attributes), so ``state_dict``, ``deepcopy``, pickling and torch's fused fast paths are untouched;
calls made outside attached models, and calls made by the probe's own kernels, pass straight to
torch. Nested models: the innermost attached model that has a probe (or a route) wins.

**Fused fast paths.** In eval mode without autograd, ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention`` call fused C++ ops (``torch._transformer_encoder_layer_fwd``,
``torch._native_multi_head_attention``) that never reach SDPA; ``nn.MultiheadAttention`` called with
``need_weights=True`` (its default) computes attention with explicit matmuls. Both are detected at
call time and reported once per site with a :class:`ProbeWarning` naming the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import FrameType, ModuleType
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.kernels import Kernel, get_kernel

__all__ = [
    "ROOT_SITE",
    "AttentionRoute",
    "KernelRoute",
    "Prepared",
    "ProbeWarning",
    "SdpaCall",
    "active_handles",
    "autocast_dtype",
    "autocast_off",
    "check_kernel_here",
    "expand_kv",
    "model_device_dtype",
    "passthrough",
    "prepare",
    "run_kernel",
    "use_kernel",
]

#: Site name of an attention call made by the attached model's root module itself.
ROOT_SITE = "<root>"

# Prefixes that wrappers (FSDP1, activation checkpointing, torch.compile) insert into module paths.
_WRAPPER_PREFIX = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.?")

#: torch's SDPA as it was when flashprobe was imported (restored after every detach).
_ORIGINAL_SDPA: Callable[..., torch.Tensor] = F.scaled_dot_product_attention


class ProbeWarning(UserWarning):
    """An attention call inside an attached model that flashprobe cannot route or compare."""


# --------------------------------------------------------------------------------------------
# One SDPA call, normalised
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """The arguments of one ``scaled_dot_product_attention`` call, bound to their names.

    Tensors are SDPA's: ``query (..., N_q, D)``, ``key (..., N_k, D)``, ``value (..., N_k, D_v)``
    (usually ``(B, H, N, D)``; with ``enable_gqa`` key/value may have fewer heads).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @staticmethod
    def bind(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> SdpaCall:
        """Bind SDPA's positional/keyword arguments (raises ``TypeError`` for unknown ones)."""
        return SdpaCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def replace(self, **changes: Any) -> SdpaCall:
        return dataclasses.replace(self, **changes)

    def original(self) -> torch.Tensor:
        """Run torch's own SDPA with exactly these arguments (what the model would have got)."""
        return _ORIGINAL_SDPA(
            self.query,
            self.key,
            self.value,
            attn_mask=self.attn_mask,
            dropout_p=self.dropout_p,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
        )


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes in for input ``t``: the autocast dtype if autocast is on for its
    device and ``t`` is a floating tensor other than float64 (torch's autocast rule), else ``t.dtype``."""
    device_type = t.device.type
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast support
        return t.dtype
    if enabled and t.is_floating_point() and t.dtype != torch.float64:
        return torch.get_autocast_dtype(device_type)
    return t.dtype


@contextlib.contextmanager
def autocast_off(device_type: str) -> Iterator[None]:
    """Disable autocast for ``device_type`` inside the block (no-op when it is off)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:
        enabled = False
    if not enabled:
        yield
        return
    with torch.autocast(device_type, enabled=False):
        yield


def _to_4d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        return x
    if x.dim() < 4:
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    return x.reshape(-1, *x.shape[-3:])


class Prepared(NamedTuple):
    """An SDPA call brought to the kernels' convention.

    Attributes:
        q: ``(B, H, N_q, D)`` in the compute dtype (the autocast dtype under autocast).
        k: ``(B, H_kv, N_k, D)``; ``H_kv = H / rep`` under grouped-query attention.
        v: ``(B, H_kv, N_k, D_v)``.
        attn_mask: bool or additive mask broadcastable to ``(B, H, N_q, N_k)``, 4-D, or None.
        is_causal: top-left causal mask.
        scale: softmax scale or None.
        rep: query heads per key/value head (1 without GQA); expand with :func:`expand_kv`.
        dtype: the compute dtype.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    rep: int
    dtype: torch.dtype

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """Shape of the 4-D output, ``(B, H, N_q, D_v)``."""
        return (self.q.shape[0], self.q.shape[1], self.q.shape[2], self.v.shape[3])


def prepare(call: SdpaCall, dtype: torch.dtype | None = None) -> Prepared:
    """Cast to the compute dtype (``dtype``, default :func:`autocast_dtype`), reshape to 4-D.

    Differentiable: gradients flow back to the call's tensors.
    """
    q, k, v, mask = call.query, call.key, call.value, call.attn_mask
    dtype = dtype or autocast_dtype(q)
    if q.dim() > 4 and mask is not None:
        mask = mask.expand(*q.shape[:-2], q.shape[-2], k.shape[-2])
        mask = mask.reshape(-1, q.shape[-3], q.shape[-2], k.shape[-2])
    q4, k4, v4 = (_to_4d(t).to(dtype) for t in (q, k, v))
    if mask is not None:
        mask = _to_4d(mask)
        if mask.is_floating_point():
            mask = mask.to(dtype)
    rep = 1
    if call.enable_gqa and k4.shape[1] != q4.shape[1]:
        rep = q4.shape[1] // max(k4.shape[1], 1)
    return Prepared(q4, k4, v4, mask, bool(call.is_causal), call.scale, rep, dtype)


def expand_kv(k: torch.Tensor, v: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat each key/value head ``rep`` times along dim 1, as SDPA's ``enable_gqa`` does."""
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def run_kernel(kernel: Kernel, call: SdpaCall) -> torch.Tensor:
    """Run ``kernel`` with SDPA's semantics: autocast casting, any leading dims, GQA, mask, scale.

    Dropout is not handled here (kernels have none); callers fall back to torch's SDPA.

    Returns:
        The output in SDPA's layout: ``query.shape[:-1] + (D_v,)``.
    """
    p = prepare(call)
    k, v = expand_kv(p.k, p.v, p.rep)
    with autocast_off(p.q.device.type):
        out = kernel(p.q, k, v, attn_mask=p.attn_mask, is_causal=p.is_causal, scale=p.scale)
    return out.reshape(*call.query.shape[:-1], call.value.shape[-1])


# --------------------------------------------------------------------------------------------
# Handles and the registry of attached models
# --------------------------------------------------------------------------------------------


class _State(threading.local):
    busy = False  # inside a probe/route: nested SDPA calls go straight to torch


_state = _State()


@contextlib.contextmanager
def passthrough() -> Iterator[None]:
    """Inside the block, SDPA calls on this thread bypass every probe and route."""
    previous = _state.busy
    _state.busy = True
    try:
        yield
    finally:
        _state.busy = previous


_H = TypeVar("_H", bound="AttentionRoute")


class AttentionRoute:
    """Base of the handles that attach to a model (:class:`KernelRoute`, ``Probe``).

    Attaching never touches the model's modules; it registers the model so that SDPA calls made
    inside it reach this handle. Use as a context manager or call :meth:`detach`.
    """

    kind = "route"

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected an nn.Module to attach to, got {type(model).__name__}")
        self.model = model
        self._warned: set[Any] = set()

    @property
    def attached(self) -> bool:
        """Whether SDPA calls inside the model currently reach this handle."""
        return any(b is self for b in _bindings)

    def attach(self: _H) -> _H:
        """(Re-)attach to the model; a no-op when attached. Returns ``self``."""
        with _lock:
            if not self.attached:
                _bindings.append(self)
                _rebuild()
        return self

    def detach(self) -> None:
        """Stop routing this model's calls here; the previous routing (if any) applies again."""
        with _lock:
            if self.attached:
                _bindings[:] = [b for b in _bindings if b is not self]
                _rebuild()

    def __enter__(self: _H) -> _H:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def warn_once(self, key: Any, message: str) -> None:
        """Emit ``message`` as a :class:`ProbeWarning` the first time ``key`` is seen."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, ProbeWarning, stacklevel=3)


class KernelRoute(AttentionRoute):
    """Handle returned by :func:`use_kernel`: SDPA calls inside ``model`` run ``kernel``.

    Attributes:
        model: the routed model.
        kernel: the kernel every call is routed to.
    """

    kind = "route"

    def __init__(self, model: nn.Module, kernel: Kernel) -> None:
        super().__init__(model)
        self.kernel = kernel

    def run(self, call: SdpaCall) -> torch.Tensor:
        """Run one call: the kernel, or torch's SDPA for calls with attention dropout."""
        if call.dropout_p > 0:
            self.warn_once(
                "dropout",
                f"use_kernel({self.kernel.spec!r}): attention calls with dropout_p="
                f"{call.dropout_p} run torch's scaled_dot_product_attention (kernels implement "
                "no attention dropout); set the attention dropout to 0 to route them",
            )
            return call.original()
        return run_kernel(self.kernel, call)

    def __repr__(self) -> str:
        return f"KernelRoute({type(self.model).__name__}, {self.kernel.spec!r}, attached={self.attached})"


class _Resolution(NamedTuple):
    module: nn.Module
    probe: Any  # the Probe handling calls of this module, or None
    site: str  # the module's path in the probe's model
    route: KernelRoute | None
    route_site: str


_lock = threading.RLock()
_bindings: list[AttentionRoute] = []
_index: dict[int, _Resolution] = {}
_patches: list[tuple[dict[str, Any], str, Any, Any]] = []  # (namespace, name, original, replacement)


def active_handles(model: nn.Module | None = None) -> list[AttentionRoute]:
    """Attached handles (of ``model`` only, if given), oldest first."""
    return [b for b in _bindings if model is None or b.model is model]


def _site_name(path: str) -> str:
    return _WRAPPER_PREFIX.sub("", path) or ROOT_SITE


def _rebuild() -> None:
    """Recompute the module → handle index after an attach/detach (under ``_lock``)."""
    global _index
    roots: list[nn.Module] = []
    for b in _bindings:
        if all(r is not b.model for r in roots):
            roots.append(b.model)
    members = {id(r): {id(m): (m, name) for name, m in r.named_modules()} for r in roots}
    # Innermost first: a root contained in more of the other roots is deeper.
    depth = {id(r): sum(id(r) in members[id(o)] for o in roots if o is not r) for r in roots}
    ordered = sorted(roots, key=lambda r: -depth[id(r)])
    top: dict[tuple[int, str], AttentionRoute] = {}
    for b in _bindings:
        top[(id(b.model), b.kind)] = b  # the most recently attached of each kind wins
    index: dict[int, _Resolution] = {}
    for module_id in {mid for r in roots for mid in members[id(r)]}:
        module, probe, site, route, route_site = None, None, "", None, ""
        for r in ordered:
            entry = members[id(r)].get(module_id)
            if entry is None:
                continue
            module = entry[0]
            if probe is None and (id(r), "probe") in top:
                probe, site = top[(id(r), "probe")], _site_name(entry[1])
            if route is None and (id(r), "route") in top:
                route, route_site = top[(id(r), "route")], _site_name(entry[1])
        assert module is not None
        index[module_id] = _Resolution(module, probe, site, route, route_site)  # type: ignore[arg-type]
    _index = index
    if _bindings:
        _install(roots)
    else:
        _uninstall()


_CALL_IMPL_CODE = nn.Module._call_impl.__code__


def _find(frame: FrameType | None) -> _Resolution | None:
    """The innermost attached module whose ``__call__`` is on the stack above ``frame``."""
    index = _index
    while frame is not None:
        if frame.f_code is _CALL_IMPL_CODE:
            module = frame.f_locals.get("self")
            res = index.get(id(module))
            if res is not None and res.module is module:
                return res
        frame = frame.f_back
    return None


def _dispatch(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Stand-in for ``F.scaled_dot_product_attention`` while any handle is attached."""
    if _state.busy:
        return _ORIGINAL_SDPA(*args, **kwargs)
    res = _find(sys._getframe(1))
    if res is None:
        return _ORIGINAL_SDPA(*args, **kwargs)
    try:
        call = SdpaCall.bind(*args, **kwargs)
    except TypeError:  # arguments from a newer torch: leave the call alone
        return _ORIGINAL_SDPA(*args, **kwargs)
    _state.busy = True
    try:
        if res.probe is not None:
            return res.probe.handle(res.site, call, res.route)
        assert res.route is not None
        return res.route.run(call)
    finally:
        _state.busy = False


_dispatch.__doc__ = _ORIGINAL_SDPA.__doc__
_dispatch.__name__ = "scaled_dot_product_attention"
_dispatch.__qualname__ = "scaled_dot_product_attention"


def _unprobed(res: _Resolution, reason: str) -> None:
    module = f"{type(res.module).__module__}.{type(res.module).__qualname__}"
    for handle, site in ((res.probe, res.site), (res.route, res.route_site)):
        if handle is not None:
            handle.warn_once(("unprobed", site, reason), f"flashprobe: site {site!r} ({module}) {reason}")


_FASTPATH_HELP = (
    "which computes attention in C++ without calling scaled_dot_product_attention, so this call "
    "is neither routed nor probed. torch takes it in eval mode when autograd is off "
    "(torch.no_grad / inference_mode); call model.train(), run with gradients enabled, or "
    "disable it with torch.backends.mha.set_fastpath_enabled(False)"
)


def _fused_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _state.busy:
            res = _find(sys._getframe(1))
            if res is not None:
                _unprobed(res, f"ran torch's fused fast path torch.{name}, {_FASTPATH_HELP}")
        return original(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = original.__doc__
    return wrapper


def _mha_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    position = list(inspect.signature(original).parameters).index("need_weights")

    def multi_head_attention_forward(*args: Any, **kwargs: Any) -> Any:
        need_weights = kwargs.get("need_weights", args[position] if len(args) > position else True)
        if need_weights and not _state.busy:
            res = _find(sys._getframe(1))
            if res is not None:
                _unprobed(
                    res,
                    "called nn.MultiheadAttention with need_weights=True (its default), which "
                    "computes attention with explicit matmuls instead of scaled_dot_product_attention, "
                    "so this call is neither routed nor probed; pass need_weights=False",
                )
        return original(*args, **kwargs)

    multi_head_attention_forward.__doc__ = original.__doc__
    return multi_head_attention_forward


def _patch(namespace: dict[str, Any], name: str, replacement: Any) -> None:
    if any(ns is namespace and n == name for ns, n, _, _ in _patches):
        return
    original = namespace.get(name)
    if original is None:
        return
    _patches.append((namespace, name, original, replacement))
    namespace[name] = replacement


def _install(roots: list[nn.Module]) -> None:
    if not _patches:
        functional, torch_ns = vars(F), vars(torch)
        _patch(functional, "scaled_dot_product_attention", _dispatch)
        _patch(functional, "multi_head_attention_forward", _mha_wrapper(F.multi_head_attention_forward))
        for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention"):
            if name in torch_ns:
                _patch(torch_ns, name, _fused_wrapper(name, torch_ns[name]))
    # Model code that imported the function by name: swap that module global as well.
    seen: set[str] = set()
    for root in roots:
        for module in root.modules():
            for cls in type(module).__mro__:
                if cls.__module__ in seen or cls is object:
                    continue
                seen.add(cls.__module__)
                py_module: ModuleType | None = sys.modules.get(cls.__module__)
                if py_module is None or py_module is F:
                    continue
                namespace = vars(py_module)
                for name, value in list(namespace.items()):
                    if value is _ORIGINAL_SDPA:
                        _patch(namespace, name, _dispatch)


def _uninstall() -> None:
    while _patches:
        namespace, name, original, replacement = _patches.pop()
        if namespace.get(name) is replacement:
            namespace[name] = original
        else:
            warnings.warn(
                f"flashprobe: {name} was replaced by someone else while a probe was attached; "
                "leaving their version in place",
                ProbeWarning,
                stacklevel=3,
            )


# --------------------------------------------------------------------------------------------
# use_kernel
# --------------------------------------------------------------------------------------------


def model_device_dtype(
    model: nn.Module, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """The device and floating dtype a model computes in: given values, else its first floating
    parameter or buffer, else CPU and the default dtype.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"expected an nn.Module, got {type(model).__name__}; to shadow a bare attention "
            "function use flashprobe.probe.ShadowAttention"
        )
    if device is None or dtype is None:
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                device = t.device if device is None else device
                dtype = t.dtype if dtype is None else dtype
                break
    return torch.device(device if device is not None else "cpu"), dtype or torch.get_default_dtype()


def check_kernel_here(kernel: Kernel, device: torch.device, dtype: torch.dtype, role: str) -> None:
    """Run ``kernel.check`` with a hint on how to tell flashprobe the dtype under autocast."""
    from flashprobe.kernels import KernelUnavailableError

    try:
        kernel.check(device, dtype)
    except KernelUnavailableError as err:
        raise KernelUnavailableError(
            f"{role} kernel {kernel.spec!r} cannot run on {device} with {dtype}: {err} "
            "(if the model runs under autocast, pass dtype=<the autocast dtype>)"
        ) from None


def use_kernel(
    model: nn.Module,
    spec: str | Kernel,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> KernelRoute:
    """Route every ``scaled_dot_product_attention`` call made inside ``model`` to ``spec``.

    No statistics, no host synchronisation: each call runs the kernel with SDPA's semantics
    (mask, ``is_causal``, ``scale``, ``enable_gqa``, autocast, any leading dims). Calls with
    attention dropout run torch's SDPA (kernels have no dropout; warned once). Re-routing the same
    model stacks: the newest route applies, and detaching it restores the previous one.

    Args:
        model: any ``nn.Module``; it is not modified.
        spec: a kernel spec (``"tiled:mask_value=-5e4"``) or :class:`~flashprobe.kernels.Kernel`.
        device: device to check the kernel against (default: the model's).
        dtype: compute dtype to check against (default: the model's; pass the autocast dtype
            when the model runs under autocast).

    Returns:
        The attached :class:`KernelRoute`; ``.detach()`` it or use it as a context manager.

    Raises:
        KernelSpecError: unknown kernel or option.
        KernelUnavailableError: the kernel cannot run on the model's device/dtype.
    """
    kernel = get_kernel(spec)
    dev, dt = model_device_dtype(model, device, dtype)
    check_kernel_here(kernel, dev, dt, "routed")
    route = KernelRoute(model, kernel)
    route.attach()
    return route
