"""``torch.nn.functional.scaled_dot_product_attention`` as a source: the dispatcher that hands each SDPA
call made inside an attached model to its probe or route.

While at least one handle is attached, ``F.scaled_dot_product_attention`` is the stand-in
:func:`stand_in` (:data:`SOURCE`). ``nn.MultiheadAttention`` (through ``F.multi_head_attention_forward``)
and libraries calling ``F.scaled_dot_product_attention`` look the name up at call time, so they reach it;
modules of the attached models' classes that did ``from torch.nn.functional import
scaled_dot_product_attention`` have that global swapped too (:mod:`flashprobe.probing.patching`).
Calls made outside attached models, and calls made by the probe's own kernels, pass straight to torch.

**Compiled models.** While Dynamo traces the stand-in, each call becomes one opaque op
(:mod:`flashprobe.probing.opaque`: the site found at trace time and guarded on, the handle run on real
tensors when the graph runs); a call the op cannot express runs the dispatcher wrapped in
``torch.compiler.disable`` (:data:`COMPILED_DISPATCH`), one graph break, eagerly, with the modules'
``__call__`` frames on the Python stack (Dynamo runs ``nn.Module._call_impl`` itself, or a copy of its
code when the module was compiled with ``module.compile()``; both are recognised). Swapping the global
names changes what Dynamo's guards check, so a model compiled before attaching recompiles once and
returns to its first graph after detaching. ``fullgraph=True`` forbids the fallback's graph breaks:
:mod:`flashprobe.probing.compiled` refuses it at attach time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from flashprobe.probing import opaque, patching
from flashprobe.probing.call import ORIGINAL_SDPA, SdpaCall
from flashprobe.probing.sites import GRAPH_BREAK_REASON, find_caller, handle_sdpa

__all__ = ["COMPILED_DISPATCH", "SOURCE", "dispatch", "stand_in"]


def dispatch(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The eager stand-in for ``F.scaled_dot_product_attention``: the call goes to the handle of the
    attached module that made it, or to torch. Also the graph break of a compiled call
    (:data:`COMPILED_DISPATCH`)."""
    res = find_caller(sys._getframe(1))
    if res is None:
        return ORIGINAL_SDPA(*args, **kwargs)
    try:
        call = SdpaCall(*args, **kwargs)
    except TypeError:  # arguments from a newer torch: leave the call alone
        return ORIGINAL_SDPA(*args, **kwargs)
    return handle_sdpa(res, call)


dispatch.__name__ = dispatch.__qualname__ = "scaled_dot_product_attention"

#: The dispatcher, opaque to ``torch.compile``: a graph break, run eagerly on real tensors.
COMPILED_DISPATCH: Callable[..., torch.Tensor] = torch.compiler.disable(dispatch, reason=GRAPH_BREAK_REASON)
COMPILED_DISPATCH.__doc__ = ORIGINAL_SDPA.__doc__


def stand_in(*args: Any, **kwargs: Any) -> torch.Tensor:
    """What replaces ``F.scaled_dot_product_attention`` while a handle is attached: the eager
    dispatcher, or, while Dynamo traces it, one opaque op per call (the graph break where that
    cannot be)."""
    if torch.compiler.is_compiling():
        return opaque.traced_call(COMPILED_DISPATCH, *args, **kwargs)
    return dispatch(*args, **kwargs)


stand_in.__name__ = stand_in.__qualname__ = "scaled_dot_product_attention"


def _install() -> None:
    patching.patch(vars(F), "scaled_dot_product_attention", stand_in)


def _stand_ins() -> Mapping[int, tuple[Any, Any]]:
    return {id(ORIGINAL_SDPA): (ORIGINAL_SDPA, stand_in)}


#: ``F.scaled_dot_product_attention``, and the names model code imported it under.
SOURCE = patching.Source("scaled_dot_product_attention", _install, _stand_ins)
