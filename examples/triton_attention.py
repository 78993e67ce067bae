"""A Triton attention kernel, registered with flashprobe with the limits it really has.

The forward of FlashAttention in the form most hand-written Triton kernels take: one program per
(query block, batch × head), key blocks of ``BLOCK`` with an online softmax in fp32, ``N_q = N_k``
and lengths that are multiples of ``BLOCK`` (no boundary checks on loads), causal or key-padding
masks, head dims 32/64/128, no backward. Fuzz it on a CPU under Triton's interpreter::

    TRITON_INTERPRET=1 flashprobe fuzz --import examples.triton_attention --kernel triton_attention \\
        --dtype fp16,fp32 --out out/fuzz-triton

(docs/fuzz.md "Fuzz a Triton kernel on a CPU"). On a GPU the same module runs compiled. Needs
``pip install 'flashprobe[triton]'`` (``triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashprobe import register_kernel
from flashprobe.kernels import KernelCapabilities, KernelUnsupportedError

BLOCK = 64


@triton.jit
def _attention_forward(
    q_ptr, k_ptr, v_ptr, keep_ptr, out_ptr,
    scale,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    heads, n_ctx,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: N803 (Triton style)
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr,  # noqa: N803
):  # fmt: skip
    """One query block of one (batch, head): out = softmax(q kᵀ · scale, masked) v."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + dims[None, :] * stride_qd)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = (start_m + 1) * BLOCK_M if CAUSAL else n_ctx
    for start_n in range(0, end, BLOCK_N):
        keys = start_n + cols
        k = tl.load(
            k_ptr + b * stride_kb + h * stride_kh + keys[None, :] * stride_kn + dims[:, None] * stride_kd
        )
        s = tl.dot(q, k) * scale  # (BLOCK_M, BLOCK_N), fp32
        valid = keys[None, :] < n_ctx
        if HAS_KEEP:
            valid = valid & (tl.load(keep_ptr + b * n_ctx + keys)[None, :] != 0)
        if CAUSAL:
            valid = valid & (rows[:, None] >= keys[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with every key masked so far
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + b * stride_vb + h * stride_vh + keys[:, None] * stride_vn + dims[None, :] * stride_vd
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees no key gives 0
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


#: what the kernel takes; flashprobe refuses anything else before it runs, and the fuzzer poses each
#: case at the nearest call within these limits (or reports it not applicable, with the reason)
CAPABILITIES = KernelCapabilities(
    masks=frozenset({"causal", "key_padding"}),
    seq_multiple=BLOCK,
    same_length=True,
    gqa="none",
    head_dims=frozenset({32, 64, 128}),
    value_head_dim=False,
    dtypes=frozenset({torch.float16, torch.float32}),  # the interpreter's bf16 tl.dot is wrong
    backward_devices=frozenset(),
)


@register_kernel("triton_attention", capabilities=CAPABILITIES)
def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of q ``(B, H, N, D)``, k, v ``(B, H, N, D)``; ``attn_mask`` a bool key-padding mask
    ``(B, 1, 1, N)`` (True = attend). Returns ``(B, H, N, D)``."""
    b, h, n, d = q.shape
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        raise KernelUnsupportedError("triton_attention: takes bool key-padding masks only")
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    keep = q if attn_mask is None else attn_mask.expand(b, 1, 1, n).reshape(b, n).to(torch.int8).contiguous()
    grid = (n // BLOCK, b * h)
    _attention_forward[grid](
        q, k, v, keep, out,
        scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        h, n,
        HEAD_DIM=d, BLOCK_M=BLOCK, BLOCK_N=BLOCK, CAUSAL=is_causal, HAS_KEEP=attn_mask is not None,
    )  # fmt: skip
    return out
