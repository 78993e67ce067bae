"""FlexAttention calls under the probe: ``flex_attention(q, k, v, score_mod, block_mask, ...)``.

While a probe is attached, ``flex_attention`` is swapped for a stand-in (:data:`SOURCE`); calls while
Dynamo traces run unchanged and are not seen. The model gets the call's own output; the probe compares
it forward with references that apply the call's ``score_mod`` and ``block_mask`` on materialised
scores, element by element as FlexAttention's eager implementation does::

    s = scale · q kᵀ;  s = score_mod(s, b, h, q_idx, kv_idx);  s[~mask] = −inf;  out = softmax(s) v

(a row with no key left gives 0), in blocks of query rows within the memory budget. No reproducer is
saved for a FlexAttention call (its ``score_mod`` is code, not data).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flashprobe.kernels import default_scale
from flashprobe.kernels.flex import FLEX_ORIGINAL
from flashprobe.kernels.reference import expand_kv
from flashprobe.probing import patching
from flashprobe.probing.sites import passthrough, probing_caller

__all__ = ["FLEX_ORIGINAL", "SOURCE", "FlexCall", "flex_reference", "probed_call"]

try:
    from torch.nn.attention import flex_attention as _flex_module
except ImportError:  # torch < 2.5
    _flex_module = None  # type: ignore[assignment]
_SIGNATURE = None if FLEX_ORIGINAL is None else inspect.signature(FLEX_ORIGINAL)


@dataclass(frozen=True)
class FlexCall:
    """One ``flex_attention`` call's arguments, bound by name.

    Attributes:
        arguments: ``flex_attention``'s parameters by name.
        runner: what produces the model's output (default: the original ``flex_attention`` with
            ``arguments``), e.g. transformers' compiled wrapper with its own extra arguments.
    """

    arguments: dict[str, Any]
    runner: Callable[[], Any] | None = None

    @classmethod
    def bind(cls, *args: Any, **kwargs: Any) -> FlexCall:
        assert _SIGNATURE is not None
        bound = _SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        return cls(dict(bound.arguments))

    def __getattr__(self, name: str) -> Any:
        try:
            return self.arguments[name]
        except KeyError:
            raise AttributeError(name) from None

    def original(self) -> Any:
        """The call itself: what the model receives."""
        if self.runner is not None:
            return self.runner()
        assert FLEX_ORIGINAL is not None
        return FLEX_ORIGINAL(**self.arguments)


def _elementwise(fn: Callable[..., torch.Tensor], score: bool) -> Callable[..., torch.Tensor]:
    """``fn`` applied to every (b, h, q, kv) as FlexAttention applies it: vmapped over 1-D index
    ranges (with the ``(B, H, rows, N_k)`` scores first for a score_mod)."""
    vmap = getattr(_flex_module, "_vmap_for_bhqkv", None)
    if vmap is not None:
        return vmap(fn, prefix=(0,) if score else ())

    def broadcast(*args: torch.Tensor) -> torch.Tensor:  # a torch without the helper: broadcasting
        *head, b, h, q, kv = args
        return fn(*head, b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q.view(1, 1, -1, 1), kv.view(1, 1, 1, -1))

    return broadcast


def _element_mask(
    block_mask: Any, shape: tuple[int, int, int, int], rows: slice, device: torch.device
) -> torch.Tensor:
    """``(B|1, H|1, rows, N_k)`` bool: the mask_mod inside the block mask's non-empty blocks."""
    b, h, _, n_k = shape
    keep = _elementwise(block_mask.mask_mod, score=False)(
        torch.arange(b, device=device),
        torch.arange(h, device=device),
        torch.arange(rows.start, rows.stop, device=device),
        torch.arange(n_k, device=device),
    )
    blocks = block_mask.to_dense().to(device).bool()  # (B|1, H|1, Q blocks, KV blocks)
    q_block, kv_block = block_mask.BLOCK_SIZE
    dense = blocks.repeat_interleave(q_block, dim=2).repeat_interleave(kv_block, dim=3)
    dense = dense[:, :, rows.start : rows.stop, :n_k]
    return keep & dense


def flex_reference(call: FlexCall, dtype: torch.dtype, *, budget: int) -> torch.Tensor:
    """The call's ``(B, H, N_q, D_v)`` attention on materialised scores in ``dtype`` (module
    docstring), in blocks of query rows of ``budget`` bytes of scores; ``query (B, H, N_q, D)``,
    ``key (B, H_kv, N_k, D)``, ``value (B, H_kv, N_k, D_v)``."""
    q, k, v = (t.detach().to(dtype) for t in (call.query, call.key, call.value))
    b, h, n_q, d = q.shape
    k, v = expand_kv(k, v, h // k.shape[1])  # grouped-query attention
    n_k = k.shape[2]
    scale = default_scale(d, call.scale)
    per_row = max(1, b * h * n_k * torch.finfo(dtype).bits // 8 * 3)
    step = max(1, min(n_q, budget // per_row))
    out = q.new_empty(b, h, n_q, v.shape[3])
    device = q.device
    idx_b, idx_h, idx_k = (torch.arange(n, device=device) for n in (b, h, n_k))
    score_mod = None if call.score_mod is None else _elementwise(call.score_mod, score=True)
    for start in range(0, n_q, step):
        rows = slice(start, min(n_q, start + step))
        s = torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * scale
        if score_mod is not None:
            idx_q = torch.arange(rows.start, rows.stop, device=device)
            s = score_mod(s, idx_b, idx_h, idx_q, idx_k).to(dtype).expand_as(s)
        if call.block_mask is not None:
            keep = _element_mask(call.block_mask, (b, h, n_q, n_k), rows, device)
            s = s.masked_fill(~keep, float("-inf"))
        top = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isfinite(top), top, 0.0))
        denom = p.sum(dim=-1, keepdim=True)
        out[:, :, rows] = torch.matmul(p, v) / torch.where(denom > 0, denom, 1.0)
    return out


# --- The source: flex_attention swapped while a handle is attached ---


def probed_call(frame: Any, call: Callable[[], FlexCall], run: Callable[[], Any]) -> Any:
    """One FlexAttention call made from ``frame``: handed to the probe of the attached module that
    made it (``call()`` binds its arguments), else ``run()`` unchanged."""
    res = probing_caller(frame)
    if res is None:
        return run()
    try:
        bound = call()
    except TypeError:  # arguments from a newer torch: leave the call alone
        return run()
    with passthrough():
        return res.probe.handle_flex(res.site, bound)


def _stand_in(*args: Any, **kwargs: Any) -> Any:
    """``flex_attention`` while a handle is attached: a call made inside a probed model goes to its
    probe (:meth:`Probe.handle_flex <flashprobe.probing.Probe.handle_flex>`)."""
    assert FLEX_ORIGINAL is not None
    return probed_call(
        sys._getframe(1), lambda: FlexCall.bind(*args, **kwargs), lambda: FLEX_ORIGINAL(*args, **kwargs)
    )


_stand_in.__name__ = _stand_in.__qualname__ = "flex_attention"


def _install() -> None:
    if FLEX_ORIGINAL is not None and _flex_module is not None:
        patching.patch(vars(_flex_module), "flex_attention", _stand_in)


def _stand_ins() -> Mapping[int, tuple[Any, Any]]:
    return {} if FLEX_ORIGINAL is None else {id(FLEX_ORIGINAL): (FLEX_ORIGINAL, _stand_in)}


#: ``torch.nn.attention.flex_attention.flex_attention``, and the names model code imported it under.
SOURCE = patching.Source("flex_attention", _install, _stand_ins)
