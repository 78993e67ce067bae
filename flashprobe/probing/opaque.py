"""Attention calls inside compiled graphs: one opaque op per call instead of a graph break.

While Dynamo traces the SDPA stand-in, :func:`traced_call` runs:

1. **The site, at trace time.** :func:`_trace_site` finds the innermost attached module from the
   module variables of the frames Dynamo is tracing (its internals) and guards on that module's
   identity; where that fails, the call takes the graph break the caller passes.
2. **The call, as one op.** ``torch.ops.flashprobe.attention`` runs the attached handle on real
   tensors when the graph runs (exactly the eager code) and returns the primary's output; its fake
   implementation gives the output's shape and dtype.
3. **Autograd.** With inputs needing a gradient, the op keeps the handle's eager graph until
   ``torch.ops.flashprobe.attention_backward`` runs ``torch.autograd.grad`` through it, named by a
   one-byte CPU token tensor's address; a missing graph is recomputed from the saved inputs.
4. **Autocast.** The stand-in casts the inputs as autocast would; the op runs with autocast off.

Calls the op cannot express (unknown arguments, a mask that needs a gradient) take the graph break.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flashprobe.probing.call import SdpaCall, autocast_dtype
from flashprobe.probing.sites import Resolution, handle_sdpa, in_passthrough, passthrough, resolution_of

__all__ = ["traced_call"]

#: Modules named at trace time; the op's ``site`` argument indexes this list.
_sites: list[weakref.ref[torch.nn.Module]] = []
_site_keys: dict[int, int] = {}
_sites_lock = threading.Lock()

#: Eager graphs kept from a forward op until its backward op, by their token's address.
_kept: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

#: Dispatch key sets of the top level, restored inside the ops (a custom op's implementation runs
#: below autograd; the handle needs autograd for the primary's gradients and the references').
_TOP_INCLUDE = torch._C._dispatch_tls_local_include_set()
_TOP_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()

#: Names of the frames (Dynamo's translators) whose ``self`` can be the module making a call.
_MODULE_FRAMES = ("forward", "_call_impl", "_wrapped_call_impl")


def _translator_module(tx: Any) -> tuple[torch.nn.Module, Any] | None:
    """The attached module that is ``self`` in a frame Dynamo traces, and its variable's source."""
    if tx.f_code.co_name not in _MODULE_FRAMES:
        return None
    var = tx.symbolic_locals.get("self")
    if var is None:
        return None
    realize = getattr(var, "realize", None)
    if realize is not None:
        var = realize()
    module = getattr(var, "value", None)
    if module is None and hasattr(var, "module_key"):
        module = tx.output.get_submodule(var.module_key)
    if resolution_of(module) is None:
        return None
    return module, getattr(var, "source", None)


def _find_traced() -> tuple[torch.nn.Module, Any] | None:
    """The innermost attached module among the frames Dynamo is tracing, with its source."""
    frame = sys._getframe(2)
    while frame is not None:
        tx = frame.f_locals.get("self")
        if type(tx).__name__ in ("InstructionTranslator", "InliningInstructionTranslator"):
            found = _translator_module(tx)
            if found is not None:
                return found
        frame = frame.f_back
    return None


def _site_key(module: torch.nn.Module) -> int:
    with _sites_lock:
        key = _site_keys.get(id(module))
        if key is None or _sites[key]() is not module:
            key = _site_keys[id(module)] = len(_sites)
            _sites.append(weakref.ref(module))
        return key


@torch._dynamo.assume_constant_result
def _trace_site() -> int:
    """The key of the module the call being traced is made in (guarded on its identity), or -1
    when it cannot be found or guarded: the caller then takes the graph-break path."""
    try:
        from torch._dynamo.guards import GuardBuilder, install_guard

        found = _find_traced()
        if found is None or found[1] is None:
            return -1
        module, source = found
        install_guard(source.make_guard(GuardBuilder.ID_MATCH))
        return _site_key(module)
    except Exception:  # Dynamo internals not as expected: the graph break needs none
        return -1


def traced_call(
    graph_break: Callable[..., torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **unknown: Any,
) -> torch.Tensor:
    """The stand-in's body while Dynamo traces it: one ``flashprobe::attention`` op (see the module
    docstring), or ``graph_break(*sdpa_arguments)`` when the call cannot be one."""
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if unknown or (attn_mask is not None and attn_mask.requires_grad):
        return graph_break(*args, **unknown)
    site = _trace_site()
    if site < 0:
        return graph_break(*args)
    # cast as autocast casts SDPA's inputs
    q, k, v, mask = (None if t is None else t.to(autocast_dtype(t)) for t in (query, key, value, attn_mask))
    grads = 0
    if torch.is_grad_enabled():
        grads = sum(1 << i for i, t in enumerate((q, k, v)) if t.requires_grad)
    out, _ = torch.ops.flashprobe.attention(
        q, k, v, mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa), site, grads
    )
    return out


@contextlib.contextmanager
def _eager_below_op(device_type: str) -> Iterator[None]:
    """Inside an op's implementation: the top level's dispatch keys (autograd back on), autocast
    off (the inputs are cast already)."""
    keys = torch._C._ForceDispatchKeyGuard(_TOP_INCLUDE, _TOP_EXCLUDE)
    with keys, torch.autocast(device_type, enabled=False):
        yield


def _run_handle(site: int, call: SdpaCall) -> torch.Tensor:
    module = _sites[site]() if 0 <= site < len(_sites) else None
    res: Resolution | None = resolution_of(module) if module is not None else None
    if res is None or in_passthrough():
        return call.original()
    return handle_sdpa(res, call)


@torch.library.custom_op("flashprobe::attention", mutates_args=())
def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    site: int,
    grads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention call handled by the attached handle of module ``site``; returns the primary's
    output and a token (one byte on the CPU, whose address names the kept graph)."""
    token = torch.empty(1, dtype=torch.uint8)
    with _eager_below_op(query.device.type):
        if not grads:
            with torch.no_grad():
                call = SdpaCall(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
                return _run_handle(site, call).contiguous(), token
        leaves = _leaves(grads, query, key, value)
        with torch.enable_grad():
            call = SdpaCall(*leaves, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            out = _run_handle(site, call)
        address = token.data_ptr()
        _kept[address] = (out, leaves)
        weakref.finalize(token, _kept.pop, address, None)  # no backward: the graph goes with the token
        return out.detach().contiguous(), token


@_attention.register_fake
def _attention_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, site, grads):
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, torch.empty(1, dtype=torch.uint8, device="cpu")


@torch.library.custom_op("flashprobe::attention_backward", mutates_args=())
def _attention_backward(
    token: torch.Tensor,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    grads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The primary's gradients of the call kept under ``token``, through its eager graph (or
    recomputed with torch's SDPA from the saved inputs when that graph is gone)."""
    kept = _kept.pop(token.data_ptr(), None)
    with _eager_below_op(grad_out.device.type):
        if kept is None:
            leaves = _leaves(grads, query, key, value)
            with torch.enable_grad(), passthrough():
                out = SdpaCall(*leaves, attn_mask, 0.0, is_causal, scale, enable_gqa).original()
        else:
            out, leaves = kept
        wanted = [t for t in leaves if t.requires_grad]
        found = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        grads = [next(found) if t.requires_grad else None for t in leaves]
    return tuple(_like(g, t) for g, t in zip(grads, (query, key, value), strict=True))


def _leaves(grads: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors detached as autograd leaves; tensor ``i`` requires grad where bit ``i`` of ``grads`` is."""
    return tuple(t.detach().requires_grad_() if grads >> i & 1 else t.detach() for i, t in enumerate(tensors))


def _like(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``like``'s strides (what the fake implementation promised), zeros for None."""
    if grad is None:
        return torch.zeros_like(like)
    if grad.stride() == like.stride():
        return grad
    return torch.empty_like(like).copy_(grad)


@_attention_backward.register_fake
def _attention_backward_fake(token, grad_out, query, key, value, *args):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    query, key, value, attn_mask, _dropout_p, is_causal, scale, enable_gqa, _site, grads = inputs
    ctx.save_for_backward(output[1], query, key, value, attn_mask)
    ctx.call = (is_causal, scale, enable_gqa, grads)


def _backward(ctx: Any, grad_out: torch.Tensor, _grad_token: torch.Tensor | None) -> tuple[Any, ...]:
    token, query, key, value, attn_mask = ctx.saved_tensors
    backward = torch.ops.flashprobe.attention_backward
    dq, dk, dv = backward(token, grad_out, query, key, value, attn_mask, *ctx.call)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)
