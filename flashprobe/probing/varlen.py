"""PyTorch's own variable-length attention as a source (:mod:`flashprobe.probing.direct`).

``torch.nn.attention.varlen.varlen_attn`` (and ``varlen_attn_out``) runs packed ``(total, H, D)``
sequences: causal as ``window_size=(-1, 0)``, bottom-right windows, grouped heads, a paged cache and
the LSE on request (base e). Swapped where the module is imported; the backward is compared too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashprobe.kernels import AttentionCall, KernelCapabilities
from flashprobe.kernels.contract import logical_outputs
from flashprobe.probing import patching
from flashprobe.probing.direct import DirectFunctions, LibraryCall, Tensors, unexpressed

__all__ = ["FUNCTIONS", "SOURCE"]

#: torch's flash kernel follows flash-attn 2: ``+inf`` for the LSE of a row that sees no key
_CAPS = KernelCapabilities(empty_lse=math.inf)


def _read(into: bool, named: dict[str, Any], library: Callable[..., Any], own: Callable[[], Any]) -> Any:
    """One ``varlen_attn`` (``into``: ``varlen_attn_out``) call as a :class:`LibraryCall`."""
    given = dict(named)
    q, k, v = (named.pop(n, None) for n in ("query", "key", "value"))
    cu_q, cu_k = named.pop("cu_seq_q", None), named.pop("cu_seq_k", None)
    table, used = named.pop("block_table", None), named.pop("seqused_k", None)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, cu_q)) or q.dim() != 3:
        return None
    if (cu_k is None and table is None) or (table is not None and used is None):
        return None  # torch refuses these: let it say so
    aux = named.pop("return_aux", None)
    left, right = (int(x) for x in (named.pop("window_size", None) or (-1, -1)))
    causal = right == 0
    fields: dict[str, Any] = {
        "q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "max_seqlen_q": named.pop("max_q", None),
        "max_seqlen_k": named.pop("max_k", None), "scale": named.pop("scale", None), "causal": causal,
        "align": "bottom_right", "window": (-1, -1) if (left, right) == (-1, 0) else (left, right),
        "return_lse": bool(getattr(aux, "lse", False)), "out": named.pop("out", None) if into else None,
    }  # fmt: skip
    named.pop("enable_gqa", None)
    reason = unexpressed(named, (), ("num_splits",))
    if reason is not None:
        return reason
    if table is not None:  # paged: the sequences' lengths are seqused_k
        fields.update(block_table=table, cu_seqlens_k=F.pad(used.cumsum(0), (1, 0)).to(torch.int32))
    else:
        fields["cu_seqlens_k"] = cu_k
    call = AttentionCall(**fields)
    reference = None
    if used is not None and table is None:  # each sequence uses its first seqused_k keys
        logical = call.logical()
        reference = logical.replace(k_lens=torch.minimum(logical.k_lens, used.to(logical.k_lens)))

    def run(replaced: Tensors | None, dropout: float | None) -> Any:
        if replaced is None:
            return own()
        return library(**{**given, "query": replaced["q"], "key": replaced["k"], "value": replaced["v"]})

    def outputs(returned: Any) -> Any:
        if call.return_lse:
            out, lse = returned[0], returned[1]
            if lse.shape[0] != call.heads:  # (total_q, H) as its docstring says; the op's is (H, total_q)
                lse = lse.transpose(0, 1)
            returned = (out, lse)
        return logical_outputs("flash_attn_varlen_func", call, returned, _CAPS)

    differentiable = call.storage == "packed" and used is None and not into
    return LibraryCall("varlen_attn", call, run, outputs, reference=reference, differentiable=differentiable)


_MODULE = "torch.nn.attention.varlen"

#: ``varlen_attn`` and ``varlen_attn_out``, swapped where ``torch.nn.attention.varlen`` is imported.
FUNCTIONS = DirectFunctions(
    (
        (_MODULE, "varlen_attn", lambda *a: _read(False, *a)),
        (_MODULE, "varlen_attn_out", lambda *a: _read(True, *a)),
    )
)

#: PyTorch's varlen attention.
SOURCE = patching.Source("torch varlen_attn", FUNCTIONS.install, FUNCTIONS.stand_ins)
