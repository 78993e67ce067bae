"""Interception: every ``scaled_dot_product_attention`` call made inside an attached model.

A handle (:class:`~flashprobe.probe.KernelRoute` from :func:`~flashprobe.probe.use_kernel`, or a
:class:`~flashprobe.probe.Probe`) derives from :class:`AttentionRoute`; attaching registers its
model, and every SDPA call made inside a registered model reaches the handle as a
:class:`~flashprobe.probe.call.SdpaCall` together with its site.

**How calls are caught.** While at least one handle is attached,
``torch.nn.functional.scaled_dot_product_attention`` is replaced by a dispatcher.
``nn.MultiheadAttention`` (through ``F.multi_head_attention_forward``) and libraries calling
``F.scaled_dot_product_attention`` look the name up at call time, so they reach it; modules of the
attached model's classes that did ``from torch.nn.functional import scaled_dot_product_attention``
have that global swapped too. When the last handle detaches every swapped name is restored. (A
``TorchFunctionMode`` would also catch names bound elsewhere, but it puts Python on the path of
*every* tensor op of the model.)

**Which module made a call.** The dispatcher walks up the Python stack to the innermost
``nn.Module.__call__`` frame whose module belongs to an attached model: that module's path in
the model (``blocks.3.attn``) is the **site**. Nothing is stored on the modules (no hooks, no
attributes), so ``state_dict``, ``deepcopy``, pickling and torch's fused fast paths are untouched;
calls made outside attached models, and calls made by the probe's own kernels, pass straight to
torch. Nested models: the innermost attached model that has a probe (or a route) wins.

**Compiled models.** While Dynamo traces the stand-in, each intercepted call becomes one opaque op
(:mod:`flashprobe.probe.opaque`: the site found at trace time and guarded on, the handle run on
real tensors when the graph runs); a call the op cannot express runs the dispatcher wrapped in
``torch.compiler.disable`` (:data:`_COMPILED_DISPATCH`), one graph break, eagerly, with the
modules' ``__call__`` frames on the Python stack (Dynamo runs ``nn.Module._call_impl`` itself, or a
copy of its code when the module was compiled with ``module.compile()``; both are recognised).
Swapping the global names changes what Dynamo's guards check, so a model compiled before attaching
recompiles once and returns to its first graph after detaching. Two Dynamo details are handled:
``F.multi_head_attention_forward`` is one opaque op to Dynamo (its SDPA call would run with
FakeTensors at trace time and without module frames at run time), so while compiling the stand-in
calls a plain copy of it that Dynamo traces down to the SDPA call; and Dynamo's table of torch
functions is built before the first swap, so it never lists a stand-in. ``fullgraph=True`` forbids
the fallback's graph breaks: :mod:`flashprobe.probe.compiled` refuses it at attach time.

**FlexAttention.** ``torch.nn.attention.flex_attention.flex_attention`` (and the names model code
imported it under) is swapped the same way: a call made inside a probed model is a site, compared
forward with references that apply its own ``score_mod`` and ``block_mask``
(:mod:`flashprobe.probe.flex`); calls while Dynamo traces (e.g. a compiled ``flex_attention``) run
unchanged and are not seen.

**Direct calls of attention libraries.** flash-attn's and FlashAttention-3's entry points and
FlashInfer's prefill/decode functions and batch wrappers are swapped the same way where those
libraries are imported (:mod:`flashprobe.probe.direct`: arguments bound by the library's own
signature, layouts converted for the baseline and golden, the model gets the library's output).

**Fused fast paths.** In eval mode without autograd, ``nn.TransformerEncoderLayer`` and
``nn.MultiheadAttention`` call fused C++ ops (``torch._transformer_encoder_layer_fwd``,
``torch._native_multi_head_attention``) that never reach SDPA; ``nn.MultiheadAttention`` called with
``need_weights=True`` (its default) computes attention with explicit matmuls. Both are detected at
call time and reported once per site with a :class:`ProbeWarning` naming the module.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.probe import flex as _flex
from flashprobe.probe.call import ORIGINAL_SDPA, SdpaCall
from flashprobe.probe.compiled import check_compiled

if TYPE_CHECKING:
    from flashprobe.probe.routing import KernelRoute

__all__ = [
    "ROOT_SITE",
    "AttentionRoute",
    "ProbeWarning",
    "active_handles",
    "passthrough",
]

#: Site name of an attention call made by the attached model's root module itself.
ROOT_SITE = "<root>"

# Prefixes that wrappers (FSDP1, activation checkpointing, torch.compile) insert into module paths.
_WRAPPER_PREFIX = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.?")


class ProbeWarning(UserWarning):
    """An attention call inside an attached model that flashprobe cannot route or compare."""


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
    """Base of the handles that attach to a model (:class:`~flashprobe.probe.KernelRoute`,
    :class:`~flashprobe.probe.Probe`).

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
        """(Re-)attach to the model; a no-op when attached. Returns ``self``.

        Raises:
            ProbeCompileError: a module of the model is compiled with ``fullgraph=True``.
        """
        with _lock:
            if not self.attached:
                check_compiled(self.model, "probe" if self.kind == "probe" else "use_kernel")
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
# (class, attribute, the class's own original or _UNSET when inherited, replacement)
_attr_patches: list[tuple[type, str, Any, Any]] = []
_UNSET = object()


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


# --------------------------------------------------------------------------------------------
# The dispatcher: which attached module made a call
# --------------------------------------------------------------------------------------------


_CALL_IMPL_CODE = nn.Module._call_impl.__code__


def _is_call_impl(code: types.CodeType) -> bool:
    """``nn.Module._call_impl``'s code, or the copy Dynamo runs when it compiled that frame
    (``model.compile()``): same name and file, new bytecode."""
    return code is _CALL_IMPL_CODE or (
        code.co_name == _CALL_IMPL_CODE.co_name and code.co_filename == _CALL_IMPL_CODE.co_filename
    )


def _find(frame: FrameType | None) -> _Resolution | None:
    """The innermost attached module whose ``__call__`` is on the stack above ``frame``."""
    index = _index
    while frame is not None:
        if _is_call_impl(frame.f_code):
            module = frame.f_locals.get("self")
            res = index.get(id(module))
            if res is not None and res.module is module:
                return res
        frame = frame.f_back
    return None


def _dispatch(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Stand-in for ``F.scaled_dot_product_attention`` while any handle is attached.

    Called by :func:`_stand_in` in eager mode, and, wrapped in ``torch.compiler.disable``
    (:data:`_COMPILED_DISPATCH`), for the calls a compiled graph cannot hold as an op: a graph break,
    run here eagerly, on real tensors, with the modules' ``__call__`` frames on the Python stack
    (see "Compiled models" in the module docstring).
    """
    if _state.busy:
        return ORIGINAL_SDPA(*args, **kwargs)
    res = _find(sys._getframe(1))
    if res is None:
        return ORIGINAL_SDPA(*args, **kwargs)
    try:
        call = SdpaCall.bind(*args, **kwargs)
    except TypeError:  # arguments from a newer torch: leave the call alone
        return ORIGINAL_SDPA(*args, **kwargs)
    _state.busy = True
    try:
        if res.probe is not None:
            return res.probe.handle(res.site, call, res.route)
        assert res.route is not None
        return res.route.run(call)
    finally:
        _state.busy = False


#: Why the dispatcher is a graph break: Dynamo prints this when it skips the call (and in the
#: error that ``torch.compile(..., fullgraph=True)`` raises).
GRAPH_BREAK_REASON = (
    "flashprobe: an attached probe or use_kernel route runs each attention call eagerly at a graph "
    "break (the shadow computation needs real tensors and the module stack); compile without "
    "fullgraph=True while it is attached, or detach it"
)

_dispatch.__name__ = "scaled_dot_product_attention"
_dispatch.__qualname__ = "scaled_dot_product_attention"
#: What replaces ``F.scaled_dot_product_attention``: the dispatcher, opaque to ``torch.compile``.
_COMPILED_DISPATCH: Callable[..., torch.Tensor] = torch.compiler.disable(_dispatch, reason=GRAPH_BREAK_REASON)
_COMPILED_DISPATCH.__doc__ = ORIGINAL_SDPA.__doc__


def _flex_dispatch(*args: Any, **kwargs: Any) -> Any:
    """Stand-in for ``flex_attention`` while a handle is attached: a call made inside a probed
    model goes to its probe (:meth:`Probe.handle_flex <flashprobe.probe.Probe.handle_flex>`);
    anything else, and any call while Dynamo traces, runs the original unchanged."""
    original = _flex.FLEX_ORIGINAL
    assert original is not None
    if _state.busy or torch.compiler.is_compiling():
        return original(*args, **kwargs)
    res = _find(sys._getframe(1))
    if res is None or res.probe is None:
        return original(*args, **kwargs)
    try:
        call = _flex.FlexCall.bind(*args, **kwargs)
    except TypeError:  # arguments from a newer torch: leave the call alone
        return original(*args, **kwargs)
    _state.busy = True
    try:
        return res.probe.handle_flex(res.site, call)
    finally:
        _state.busy = False


_flex_dispatch.__name__ = _flex_dispatch.__qualname__ = "flex_attention"

#: transformers' FlexAttention entry point (``attn_implementation="flex_attention"``): it calls a
#: compiled ``flex_attention``, which no name swap reaches, so its wrapper is swapped instead.
_HF_FLEX = ("transformers.integrations.flex_attention", "compile_friendly_flex_attention")


def _hf_flex_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``compile_friendly_flex_attention``, probed: the model gets its output (the
    compiled FlexAttention, unchanged); the probe compares it like a direct call."""

    def compile_friendly_flex_attention(
        query: Any, key: Any, value: Any, training: bool = False, **kwargs: Any
    ):  # type: ignore[no-untyped-def]
        def run() -> Any:
            return original(query, key, value, training=training, **kwargs)

        if _state.busy or torch.compiler.is_compiling():
            return run()
        res = _find(sys._getframe(1))
        if res is None or res.probe is None:
            return run()
        try:
            call = _flex.FlexCall.bind(query, key, value, **kwargs)
        except TypeError:
            return run()
        _state.busy = True
        try:
            return res.probe.handle_flex(res.site, _flex.FlexCall(call.arguments, runner=run))
        finally:
            _state.busy = False

    return compile_friendly_flex_attention


def _stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
    """What replaces ``F.scaled_dot_product_attention`` while a handle is attached: the eager
    dispatcher, or, while Dynamo traces it, one opaque op per call
    (:func:`flashprobe.probe.opaque.traced_call`; the graph break where that cannot be)."""
    if torch.compiler.is_compiling():
        return opaque.traced_call(*args, **kwargs)
    return _dispatch(*args, **kwargs)


_stand_in.__name__ = _stand_in.__qualname__ = "scaled_dot_product_attention"


# --------------------------------------------------------------------------------------------
# Fused fast paths, reported
# --------------------------------------------------------------------------------------------


def _attention_child(module: nn.Module) -> str:
    """Path of the first ``nn.MultiheadAttention`` inside ``module`` (``"self_attn"`` for a
    ``TransformerEncoderLayer``): the site its attention call has when it reaches SDPA."""
    for name, sub in module.named_modules():
        if name and isinstance(sub, nn.MultiheadAttention):
            return name
    return ""


def _unprobed(res: _Resolution, reason: str, child: str = "") -> None:
    """Warn once per site that a call there is not probed; ``child`` is the path, below the module
    that made the call, of the module whose calls the probe names (the site a user would look for)."""
    module = f"{type(res.module).__module__}.{type(res.module).__qualname__}"
    for handle, site in ((res.probe, res.site), (res.route, res.route_site)):
        if handle is not None:
            where = module
            if child:
                where, site = f"{module} at {site!r}", child if site == ROOT_SITE else f"{site}.{child}"
            handle.warn_once(("unprobed", site, reason), f"flashprobe: site {site!r} ({where}) {reason}")


_FASTPATH_HELP = (
    "which computes attention in C++ without calling scaled_dot_product_attention, so this call "
    "is neither routed nor probed. torch takes it in eval mode when autograd is off "
    "(torch.no_grad / inference_mode); call model.train(), run with gradients enabled, or "
    "disable it with torch.backends.mha.set_fastpath_enabled(False)"
)


def _fused_wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and not _state.busy:
            res = _find(sys._getframe(1))
            if res is not None:
                child = _attention_child(res.module) if name == "_transformer_encoder_layer_fwd" else ""
                _unprobed(res, f"ran torch's fused fast path torch.{name}, {_FASTPATH_HELP}", child)
        return original(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = original.__doc__
    return wrapper


def _mha_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    position = list(inspect.signature(original).parameters).index("need_weights")
    # Dynamo records torch's own function as one opaque graph op, run later (with FakeTensors while
    # compiling, then from the compiled graph): its SDPA call would reach the dispatcher with no
    # module frames on the stack. A copy of the function is plain Python to Dynamo, which traces it
    # down to the SDPA call, where the dispatcher makes its graph break.
    fn = original
    traceable = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    traceable.__kwdefaults__ = original.__kwdefaults__

    def multi_head_attention_forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by Dynamo: no frames to walk, nothing to warn
            return traceable(*args, **kwargs)
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


# --------------------------------------------------------------------------------------------
# Swapping the global names
# --------------------------------------------------------------------------------------------


def _patch(namespace: dict[str, Any], name: str, replacement: Any) -> None:
    if any(ns is namespace and n == name for ns, n, _, _ in _patches):
        return
    original = namespace.get(name)
    if original is None:
        return
    _patches.append((namespace, name, original, replacement))
    namespace[name] = replacement


def _freeze_dynamo_rules() -> None:
    """Build Dynamo's table of torch functions (cached on first use, keyed by the objects found
    under their torch names) before any name is swapped, so it never lists our stand-ins as torch
    functions to put in a graph. Best effort: the table is a Dynamo internal."""
    try:
        from torch._dynamo.trace_rules import get_torch_obj_rule_map

        get_torch_obj_rule_map()
    except Exception:  # a torch without this internal: nothing to freeze
        return


_WRAPPERS: dict[Any, Callable[..., Any]] = {}  # original -> its stand-in, built once (attach is per step)


def _wrapped(original: Callable[..., Any], build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """The stand-in of ``original``, built by ``build`` the first time it is asked for."""
    wrapper = _WRAPPERS.get(original)
    if wrapper is None:
        wrapper = _WRAPPERS[original] = build()
    return wrapper


def _install(roots: list[nn.Module]) -> None:
    if not _patches:
        _freeze_dynamo_rules()
        functional, torch_ns = vars(F), vars(torch)
        _patch(functional, "scaled_dot_product_attention", _stand_in)
        mha = F.multi_head_attention_forward
        _patch(functional, "multi_head_attention_forward", _wrapped(mha, lambda: _mha_wrapper(mha)))
        for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention"):
            if name in torch_ns:
                fused = torch_ns[name]
                _patch(torch_ns, name, _wrapped(fused, lambda n=name, f=fused: _fused_wrapper(n, f)))
        if _flex.FLEX_ORIGINAL is not None:
            _patch(vars(_flex._flex_module), "flex_attention", _flex_dispatch)
            hf = sys.modules.get(_HF_FLEX[0])
            if hf is not None and callable(getattr(hf, _HF_FLEX[1], None)):
                _patch(vars(hf), _HF_FLEX[1], _hf_flex_wrapper(getattr(hf, _HF_FLEX[1])))
        _install_direct()
    # Model code that imported a function by name: swap that module global as well (each of its
    # names looked up once in a table of the functions to swap, keyed by identity).
    stand_ins: dict[int, Callable[[Any], Any]] = {id(ORIGINAL_SDPA): lambda _: _stand_in}
    if _flex.FLEX_ORIGINAL is not None:
        stand_ins[id(_flex.FLEX_ORIGINAL)] = lambda _: _flex_dispatch
    for key in _direct_forms:
        stand_ins[key] = _direct_replacement
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
                    stand_in = stand_ins.get(id(value))
                    if stand_in is not None:
                        _patch(namespace, name, stand_in(value))


#: ``id(library function) -> (function, form, what)`` of the direct entry points found at install.
_direct_forms: dict[int, tuple[Any, str, str]] = {}


def _is_direct_original(value: Any) -> bool:
    entry = _direct_forms.get(id(value))
    return entry is not None and entry[0] is value


def _direct_replacement(fn: Any) -> Any:
    original, form, what = _direct_forms[id(fn)]
    return direct.function_wrapper(original, form, what)


def _install_direct() -> None:
    """Swap the attention libraries' direct entry points (:mod:`flashprobe.probe.direct`) where their
    modules are imported: the functions in their modules and in modules that keep them in globals of
    their own (transformers' flash-attention helper), FlashInfer's batch wrappers' methods."""
    _direct_forms.clear()
    for module_name, function, form in direct.DIRECT_FUNCTIONS:
        library = sys.modules.get(module_name)
        fn = direct.original_of(getattr(library, function, None)) if library is not None else None
        if callable(fn):
            if not _is_direct_original(fn):  # named where first found: flash_attn.flash_attn_func
                _direct_forms[id(fn)] = (fn, form, f"{module_name}.{function}")
            _patch(vars(library), function, _direct_replacement(fn))
    for module_name in direct.CALLER_MODULES:
        caller = sys.modules.get(module_name)
        for name, value in list(vars(caller).items()) if caller is not None else ():
            if _is_direct_original(value):
                _patch(vars(caller), name, _direct_replacement(value))
    seen: set[int] = set()
    for module_name, class_name, form in direct.DIRECT_CLASSES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if not isinstance(cls, type) or id(cls) in seen:
            continue
        seen.add(id(cls))
        what = f"{cls.__module__}.{cls.__name__}"
        for attribute, replacement in direct.patch_class(cls, form, what).items():
            if not any(c is cls and a == attribute for c, a, _, _ in _attr_patches):
                _attr_patches.append((cls, attribute, cls.__dict__.get(attribute, _UNSET), replacement))
                setattr(cls, attribute, replacement)


def _uninstall() -> None:
    while _attr_patches:
        cls, attribute, original, replacement = _attr_patches.pop()
        if cls.__dict__.get(attribute) is not replacement:
            continue  # replaced by someone else meanwhile: theirs stays
        if original is _UNSET:
            delattr(cls, attribute)
        else:
            setattr(cls, attribute, original)
    direct.forget_plans()
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


from flashprobe.probe import direct, opaque  # noqa: E402  (they use this module's names at run time)
