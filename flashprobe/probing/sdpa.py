"""``torch.nn.functional.scaled_dot_product_attention`` as a source: the dispatcher that hands each SDPA
call made inside an attached model to its probe or route.

While a handle is attached, ``F.scaled_dot_product_attention`` is :func:`stand_in` (:data:`SOURCE`);
calls made outside attached models, or by the probe's own kernels, pass straight to torch. While Dynamo
traces it, each call becomes one opaque op (:mod:`flashprobe.probing.opaque`), or else runs the
dispatcher under ``torch.compiler.disable`` (:data:`COMPILED_DISPATCH`, one graph break). A model
compiled before attaching recompiles once; ``fullgraph=True`` is refused (:mod:`flashprobe.probing.compiled`).
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
    dispatcher, or one opaque op per call while Dynamo traces it."""
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
