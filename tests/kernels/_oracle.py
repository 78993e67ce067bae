"""An independent FP64 oracle of attention calls: one query row at a time, from the libraries' words.

Every rule is written again from flash-attn's docstrings (``flash_attn_interface.py``) and
FlashInfer's, not from :mod:`flashprobe.kernels.call`: a row ``i`` of a sequence with ``n_q`` queries
and ``n_k`` keys sees key ``j`` unless causal and ``j > i + off``, or the window ``(left, right)``
excludes it (``j < i + off − left``, ``j > i + off + right``), ``off = n_k − n_q`` bottom-right and
0 top-left; its logit is ``scale · q·k``, softcapped ``c · tanh(s / c)``, minus ``slope · |i + off −
j|``; a sink adds ``e^{sink}`` to the denominator; its LSE is ``log`` of the denominator (``−inf``
when it is empty).
"""

from __future__ import annotations

import math

import torch

__all__ = ["oracle", "random_sequences"]


def random_sequences(q_lens, k_lens, h, h_kv, d, d_v, *, seed, dtype=torch.float32, scale=1.0):
    """Per-sequence ``(q (n_q, H, D), k (n_k, H_kv, D), v (n_k, H_kv, D_v))`` in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            (scale * torch.randn(nq, h, d, generator=gen)).to(dtype),
            (scale * torch.randn(nk, h_kv, d, generator=gen)).to(dtype),
            torch.randn(nk, h_kv, d_v, generator=gen).to(dtype),
        )
        for nq, nk in zip(q_lens, k_lens, strict=True)
    ]


def oracle(seqs, *, scale=None, causal=False, align="bottom_right", window=(-1, -1), softcap=0.0,
           slopes=None, sinks=None, descales=None):  # fmt: skip
    """Per sequence ``(out (n_q, H, D_v), lse (H, n_q))`` in float64, natural LSE.

    Args:
        seqs: :func:`random_sequences`' tensors (any dtype; FP8 with ``descales``).
        slopes: ``(H,)`` or ``(B, H)`` ALiBi slopes, or None.
        sinks: ``(H,)`` sink logits, or None.
        descales: ``(q, k, v)`` descales ``(B, H_kv)`` each, or None.
    """
    found = []
    for b, (q, k, v) in enumerate(seqs):
        q, k, v = q.double(), k.double(), v.double()
        n_q, h, d = q.shape
        n_k, h_kv, d_v = v.shape
        group = h // h_kv
        if descales is not None:
            dq, dk, dv = (t[b].double() for t in descales)
            q = q * dq[[x // group for x in range(h)]][None, :, None]
            k, v = k * dk[None, :, None], v * dv[None, :, None]
        s_scale = 1.0 / math.sqrt(d) if scale is None else scale
        off = n_k - n_q if align == "bottom_right" else 0
        out = torch.zeros(n_q, h, d_v, dtype=torch.float64)
        lse = torch.full((h, n_q), float("-inf"), dtype=torch.float64)
        for head in range(h):
            g = head // group
            slope = None if slopes is None else float(slopes[head] if slopes.dim() == 1 else slopes[b, head])
            for i in range(n_q):
                logits, values = [], []
                for j in range(n_k):
                    if causal and j > i + off:
                        continue
                    if window[0] >= 0 and j < i + off - window[0]:
                        continue
                    if window[1] >= 0 and j > i + off + window[1]:
                        continue
                    s = s_scale * float(q[i, head] @ k[j, g])
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    if slope is not None:
                        s -= slope * abs(i + off - j)
                    logits.append(s)
                    values.append(v[j, g])
                extra = [] if sinks is None else [float(sinks[head])]
                if not logits and not extra:
                    continue
                top = max(logits + extra)
                weights = [math.exp(s - top) for s in logits]
                total = sum(weights) + sum(math.exp(s - top) for s in extra)
                if values:
                    out[i, head] = sum(w * x for w, x in zip(weights, values, strict=True)) / total
                lse[head, i] = top + math.log(total)
        found.append((out, lse))
    return found
