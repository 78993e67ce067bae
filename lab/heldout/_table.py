"""The row types of the held-out table: what a kernel is, and the contract it follows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

FLOAT_DTYPES = ("bf16", "fp16", "fp32")


class HeldOut(NamedTuple):
    """One held-out kernel.

    Attributes:
        fn: the kernel, a plain function with the real library's signature.
        api: the contract it follows: ``"flash_attn_func"``, ``"flash_attn_varlen_func"``,
            ``"flash_attn_with_kvcache"`` or ``"merge_state"``.
        kind: ``"control"`` (correct, computed differently from a golden) or ``"bug"``.
        trigger: the calls on which a bug is wrong (for a control, how it computes).
    """

    fn: Callable[..., Any]
    api: str
    kind: Literal["bug", "control"]
    trigger: str


@dataclass(frozen=True)
class Contract:
    """The conventions a held-out kernel follows, as a user would declare them when registering it.

    Attributes:
        signature: whose signature it copies: ``"flash-attn 2.8"``, ``"FlashAttention-3"`` or
            ``"FlashInfer"``.
        lse_base: base of the LSE it returns (``math.e`` or 2).
        empty_row_lse: LSE it returns for a query row that sees no key (flash-attn 2 returns +inf,
            FlashAttention-3 and FlashInfer -inf); its output row is 0 either way.
        dtypes: input dtypes it accepts (``"e4m3"`` is float8_e4m3fn with descales).
        backward: ``"autograd"`` (differentiable torch ops), ``"hand-written"`` (an autograd.Function)
            or None (forward only).
        out_kwarg: it takes a keyword-only preallocated ``out=`` (as vLLM's flash-attn fork does).
        calls: how many calls its bug needs to show (2 for state kept across calls).
    """

    signature: str
    lse_base: float = math.e
    empty_row_lse: float = math.inf
    dtypes: tuple[str, ...] = FLOAT_DTYPES
    backward: str | None = "autograd"
    out_kwarg: bool = False
    calls: int = 1
