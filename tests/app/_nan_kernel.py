"""A user's kernel module for ``flashprobe train --import tests.app._nan_kernel``: ``nan_at_step``, the
baseline except one NaN element of its output from optimizer step ``$NAN_AT_STEP`` (default 3) of this
process on, through an addition so the NaN reaches the gradients and the weights.

The kernel counts the backward passes it has seen (a hook on its output): at the forward of step ``s``
of a process it has seen ``s`` of them. A resumed process counts again from its first step.
"""

from __future__ import annotations

import os

import torch

from flashprobe.kernels import math_attention, register_kernel

NAN_AT_STEP = int(os.environ.get("NAN_AT_STEP", "3"))
_seen = {"backwards": 0, "in_backward": False}


def _backward_reached(grad: torch.Tensor) -> None:
    _seen["in_backward"] = True


def nan_at_step(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    if _seen["in_backward"]:  # the first call after a backward pass: the next step (or its validation)
        _seen["backwards"], _seen["in_backward"] = _seen["backwards"] + 1, False
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    if torch.is_grad_enabled() and out.requires_grad:
        if _seen["backwards"] >= NAN_AT_STEP:
            poison = torch.zeros_like(out)
            poison[0, 0, 0, 0] = float("nan")
            out = out + poison
        out.register_hook(_backward_reached)
    return out


register_kernel("nan_at_step", nan_at_step, overwrite=True)
