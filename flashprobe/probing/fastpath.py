"""torch's attention paths that never reach SDPA, reported: fused fast paths and ``need_weights=True``.

``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` in eval mode without autograd call fused
C++ ops, and ``nn.MultiheadAttention`` with ``need_weights=True`` uses explicit matmuls. While a handle
is attached these are swapped (:data:`SOURCE`) for stand-ins that report such a call once per site
with a :class:`~flashprobe.probing.ProbeWarning`; the call runs unchanged. While compiling,
``F.multi_head_attention_forward``'s stand-in calls a plain copy that Dynamo traces down to SDPA.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.probing import patching
from flashprobe.probing.sites import ROOT_SITE, Resolution, find_caller

__all__ = ["SOURCE"]

_FUSED = ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")

_FASTPATH_HELP = (
    "which computes attention in C++ without calling scaled_dot_product_attention, so this call "
    "is neither routed nor probed. torch takes it in eval mode when autograd is off "
    "(torch.no_grad / inference_mode); call model.train(), run with gradients enabled, or "
    "disable it with torch.backends.mha.set_fastpath_enabled(False)"
)


def _attention_child(module: nn.Module) -> str:
    """Path of the first ``nn.MultiheadAttention`` inside ``module`` (``"self_attn"`` for a
    ``TransformerEncoderLayer``): the site its attention call has when it reaches SDPA."""
    for name, sub in module.named_modules():
        if name and isinstance(sub, nn.MultiheadAttention):
            return name
    return ""


def _unprobed(res: Resolution, reason: str, child: str = "") -> None:
    """Warn once per site that a call there is not probed; ``child`` is the path, below the module
    that made the call, of the module whose calls the probe names (the site a user would look for)."""
    module = f"{type(res.module).__module__}.{type(res.module).__qualname__}"
    for handle, site in ((res.probe, res.site), (res.route, res.route_site)):
        if handle is not None:
            where = module
            if child:
                where, site = f"{module} at {site!r}", child if site == ROOT_SITE else f"{site}.{child}"
            handle.warn_once(("unprobed", site, reason), f"flashprobe: site {site!r} ({where}) {reason}")


def _fused_stand_in(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            res = find_caller(sys._getframe(1))
            if res is not None:
                child = _attention_child(res.module) if name == "_transformer_encoder_layer_fwd" else ""
                _unprobed(res, f"ran torch's fused fast path torch.{name}, {_FASTPATH_HELP}", child)
        return original(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = original.__doc__
    return wrapper


def _mha_stand_in(original: Callable[..., Any]) -> Callable[..., Any]:
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
        res = find_caller(sys._getframe(1)) if need_weights else None
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


def _install() -> None:
    functional, torch_ns = vars(F), vars(torch)
    mha = F.multi_head_attention_forward
    patching.patch(
        functional, "multi_head_attention_forward", patching.stand_in_of(mha, lambda: _mha_stand_in(mha))
    )
    for name in _FUSED:
        if name in torch_ns:
            fused = torch_ns[name]
            stand_in = patching.stand_in_of(fused, lambda n=name, f=fused: _fused_stand_in(n, f))
            patching.patch(torch_ns, name, stand_in)


#: ``F.multi_head_attention_forward`` and torch's fused fast paths, reported.
SOURCE = patching.Source("torch fast paths", _install)
