"""Planted kernels for the sequences and invariants of ``flashprobe fuzz`` (flashprobe.fuzz.sequences,
flashprobe.fuzz.invariants): bugs no single call shows, bugs a tolerance is blind to, and correct
controls written the same way.

**Stateful** (SDPA signature unless said; each correct on its first call):

* ``plan_*``: a "plan" (the scale, the strides q, k, v are read with, the mask, the dtype of the
  output's workspace) made on the first call of a key and reused, as a compiled graph is; a key
  without the scale (flashinfer 4014), without strides (an HND graph replayed on NHD tensors,
  flashinfer 5007), without the mask and causal flag, without the dtype. ``plan_full`` keys on all.
* ``memo_pointer``: the output memoised by the inputs' pointers and shapes (a CUDA graph replayed on
  stale contents, KernelBench-Hard PR 7); ``memo_versioned`` keys on the tensors' versions too.
* ``stale_dout``: the backward keeps the first dO it saw for a shape and computes dq, dk from it (dv
  from the fresh one; flash-attention PR 2481); ``fresh_dout`` uses the dO it is given.
* ``scratch_stale``: split-KV over 32-key splits into a workspace kept per (B, H, N_q, D), grown when a
  call needs more splits; the merge reads every split the workspace holds, so a short call after a
  long one merges the long call's stale splits (vllm PR 47188); ``scratch_exact`` merges its own.
* ``pages_gathered`` (``flash_attn_varlen_func``): the keys gathered from the pages are kept per shape
  and ``cu_seqlens_k``, not per block table; ``pages_keyed`` keys on the table and the pages' contents.

**Invariant classes**: ``tile_transposed`` stores each head's first 16 × 16 output tile transposed
(its norm unchanged; flash-attention PR 2553); ``fp8_in_bf16`` declares ``fp8="e4m3"`` and computes in
bf16 (KernelBench-Hard's audit); ``batch_variant`` declares ``batch_invariant=True`` and splits its keys
into 4 // B parts, partials stored in the inputs' dtype (the split count follows the batch size);
``nondeterministic`` declares ``deterministic=True`` and sums its keys in a random order;
``delta_stale`` has a backward that is not its forward's derivative (its ``rowsum(dO∘O)`` from an
output stored in E4M3, which the forward never returned). ``batch_loop`` and ``ordered`` are the
controls of the two declarations.

:func:`register` registers each as ``plant_<name>`` (importing this module does, so the commands take
``--import lab.sequence_mutants`` and its reproducers' scripts find the kernels).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from flashprobe.kernels import KernelCapabilities, default_scale, math_attention, register_kernel
from lab import contracts

__all__ = ["KERNELS", "register", "register_heldout", "reset"]

_STATE: dict[str, dict[Any, Any]] = {}


def reset() -> None:
    """Forget every plan, memo, dO and workspace (a fresh process)."""
    _STATE.clear()


def _state(name: str) -> dict[Any, Any]:
    return _STATE.setdefault(name, {})


def _attend(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """Correct attention (autograd), in fp32 for 16-bit inputs, output in q's dtype."""
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    return math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dtype=wide)


def _planned(missing: frozenset[str]) -> Callable[..., torch.Tensor]:
    """A kernel whose plan is keyed on everything but ``missing`` (of scale, strides, mask, dtype)."""

    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        now = {
            "scale": default_scale(q.shape[-1], scale),
            "strides": tuple(t.stride() for t in (q, k, v)),
            "mask": (is_causal, attn_mask),
            "dtype": q.dtype,
        }
        mask = None if attn_mask is None else (attn_mask.dtype, tuple(attn_mask.flatten().tolist()))
        seen = {**now, "mask": (is_causal, mask)}
        key = (tuple(t.shape for t in (q, k, v)), *(seen[n] for n in now if n not in missing))
        plan = _state(f"plan{sorted(missing)}").setdefault(key, now)
        q, k, v = (torch.as_strided(t, t.shape, s) for t, s in zip((q, k, v), plan["strides"], strict=True))
        causal, mask = plan["mask"]
        out = _attend(q, k, v, attn_mask=mask, is_causal=causal, scale=plan["scale"])
        return out.to(plan["dtype"]).to(q.dtype)  # the workspace's dtype

    return kernel


def _memoised(versioned: bool) -> Callable[..., torch.Tensor]:
    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        key = (
            *((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (q, k, v)),
            *((t._version for t in (q, k, v)) if versioned else ()),
            None if attn_mask is None else attn_mask.data_ptr(), is_causal, scale,
        )  # fmt: skip
        memo = _state(f"memo{versioned}")
        if key not in memo:
            memo[key] = _attend(q, k, v, attn_mask, is_causal, scale)
        return memo[key]

    return kernel


class _Dout(torch.autograd.Function):
    """Correct forward; a backward whose dq, dk come from ``stale`` dO (the first of its shape)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, stale):
        ctx.save_for_backward(q, k, v)
        ctx.args = (attn_mask, is_causal, scale, stale)
        with torch.no_grad():
            return _attend(q, k, v, attn_mask, is_causal, scale)

    @staticmethod
    def backward(ctx, d_out):
        attn_mask, is_causal, scale, stale = ctx.args
        used = _state("dout").setdefault(d_out.shape, d_out.clone()) if stale else d_out
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = _attend(*leaves, attn_mask, is_causal, scale)
            dq, dk, _ = torch.autograd.grad(out, leaves, used, retain_graph=True)
            dv = torch.autograd.grad(out, leaves[2], d_out)[0]
        return dq, dk, dv, None, None, None, None


def _dout(stale: bool) -> Callable[..., torch.Tensor]:
    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        return _Dout.apply(q, k, v, attn_mask, is_causal, scale, stale)

    return kernel


def _scratch(stale: bool) -> Callable[..., torch.Tensor]:
    """Split-KV over 32-key splits, each a partial (out, lse), merged through the LSEs."""

    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        s = (q.to(wide) @ k.to(wide).transpose(-2, -1)) * default_scale(q.shape[-1], scale)
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -torch.inf)
        elif attn_mask is not None:
            s = s.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool else s + attn_mask
        work = _state("scratch").setdefault((q.shape, v.shape[-1], q.dtype), [])
        needed = -(-k.shape[-2] // 32)
        for j in range(needed):
            part = s[..., 32 * j : 32 * (j + 1)]
            lse = torch.logsumexp(part, -1, keepdim=True)
            o = torch.exp(part - lse.clamp(min=-1e30)) @ v[..., 32 * j : 32 * (j + 1), :].to(wide)
            (work.__setitem__(j, (o, lse)) if j < len(work) else work.append((o, lse)))
        parts = work if stale else work[:needed]
        lse = torch.cat([p[1] for p in parts], -1)
        w = torch.exp(lse - lse.amax(-1, keepdim=True)).nan_to_num(0.0)
        out = sum(w[..., i : i + 1] * p[0] for i, p in enumerate(parts)) / w.sum(-1, keepdim=True).clamp(
            min=1e-30
        )
        return out.to(q.dtype)

    return kernel


def _pages(keyed: bool) -> Callable[..., Any]:
    """``flash_attn_varlen_func`` whose keys gathered from the pages are cached."""

    def kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               deterministic=False, return_attn_probs=False, block_table=None):  # fmt: skip
        common = {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "causal": causal,
                  "softmax_scale": softmax_scale, "window_size": window_size,
                  "return_attn_probs": return_attn_probs}  # fmt: skip
        if block_table is None:
            return contracts.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, **common)
        key = (k.shape, tuple(cu_seqlens_k.tolist()))
        if keyed:
            key += (tuple(block_table.flatten().tolist()), k.data_ptr(), k._version, v.data_ptr(), v._version)
        cache = _state(f"pages{keyed}")
        if key not in cache:
            lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
            rows = [block_table[b, j // k.shape[1]] * k.shape[1] + j % k.shape[1] for b, n in enumerate(lens)
                    for j in range(n)]  # fmt: skip
            index = torch.tensor(rows, dtype=torch.long, device=k.device)
            cache[key] = tuple(t.flatten(0, 1)[index] for t in (k, v))
        return contracts.flash_attn_varlen_func(q, *cache[key], cu_seqlens_q, cu_seqlens_k, **common)

    return kernel


def tile_transposed(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Correct but each head's first 16 × 16 output tile stored transposed (N_q, D_v ≥ 16)."""
    out = _attend(q, k, v, attn_mask, is_causal, scale)
    if out.shape[-2] < 16 or out.shape[-1] < 16:
        return out
    tile = out[..., :16, :16].transpose(-2, -1)
    return torch.cat([torch.cat([tile, out[..., :16, 16:]], -1), out[..., 16:, :]], -2)


def fp8_in_bf16(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Declares E4M3 and computes in bf16 (fp32 accumulation)."""
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dtype=torch.bfloat16)
    return out.to(q.dtype)


def _batch(variant: bool) -> Callable[..., torch.Tensor]:
    """Split-KV attention whose partial outputs are stored in the inputs' dtype; ``variant``: the number
    of splits chosen from the batch size (4 // B, as a kernel fills its SMs), so an entry's bits depend
    on how many others share the call; else 4 splits always."""

    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        splits = max(1, 4 // q.shape[0]) if variant else 4
        s = (q.float() @ k.float().transpose(-2, -1)) * default_scale(q.shape[-1], scale)
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), -torch.inf)
        elif attn_mask is not None:
            s = s.masked_fill(~attn_mask, -torch.inf) if attn_mask.dtype == torch.bool else s + attn_mask
        size = -(-k.shape[-2] // splits)
        parts = []
        for j in range(0, k.shape[-2], size):
            part = s[..., j : j + size]
            lse = torch.logsumexp(part, -1, keepdim=True)
            o = torch.exp(part - lse.clamp(min=-1e30)) @ v[..., j : j + size, :].float()
            parts.append((o.to(q.dtype).float(), lse))  # partials stored in the inputs' dtype
        lse = torch.cat([p[1] for p in parts], -1)
        w = torch.exp(lse - lse.amax(-1, keepdim=True)).nan_to_num(0.0)
        out = sum(w[..., i : i + 1] * p[0] for i, p in enumerate(parts)) / w.sum(-1, keepdim=True)
        return out.to(q.dtype)

    return kernel


def _ordered(random_order: bool) -> Callable[..., torch.Tensor]:
    def kernel(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
        if random_order and attn_mask is None and not is_causal:
            perm = torch.randperm(k.shape[-2], device=k.device)  # the global RNG: another order each call
            k, v = k[..., perm, :], v[..., perm, :]
        return _attend(q, k, v, attn_mask, is_causal, scale)

    return kernel


class _DeltaStale(torch.autograd.Function):
    """A correct forward whose backward takes ``rowsum(dO∘O)`` from O stored in E4M3 (not its output)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        ctx.save_for_backward(q, k, v)
        ctx.args = (is_causal, scale)
        with torch.no_grad():
            return _attend(q, k, v, None, is_causal, scale)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v = (t.double() for t in ctx.saved_tensors)
        is_causal, scale = ctx.args
        s = q @ k.transpose(-2, -1) * default_scale(q.shape[-1], scale)
        if is_causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -torch.inf)
        p = torch.softmax(s, -1)
        do = d_out.double()
        o = (p @ v).float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
        ds = p * (do @ v.transpose(-2, -1) - (do * o).sum(-1, keepdim=True))
        sc = default_scale(q.shape[-1], scale)
        grads = (ds @ k * sc, ds.transpose(-2, -1) @ q * sc, p.transpose(-2, -1) @ do)
        return *(g.to(t.dtype) for g, t in zip(grads, ctx.saved_tensors, strict=True)), None, None


def delta_stale(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    return _DeltaStale.apply(q, k, v, is_causal, scale)


_FULL = frozenset()
_NO_MASKS = KernelCapabilities(masks=frozenset({"causal"}))
_VARLEN = contracts.CONTROLS["control_flash_attn_varlen_func"][2]
#: every planted kernel: name → (function, api, capabilities or None)
KERNELS: dict[str, tuple[Callable[..., Any], str, KernelCapabilities | None]] = {
    "plan_no_scale": (_planned(frozenset({"scale"})), "sdpa", None),
    "plan_no_strides": (_planned(frozenset({"strides"})), "sdpa", None),
    "plan_no_mask": (_planned(frozenset({"mask"})), "sdpa", None),
    "plan_no_dtype": (_planned(frozenset({"dtype"})), "sdpa", None),
    "plan_full": (_planned(_FULL), "sdpa", None),
    "memo_pointer": (_memoised(False), "sdpa", None),
    "memo_versioned": (_memoised(True), "sdpa", None),
    "stale_dout": (_dout(True), "sdpa", None),
    "fresh_dout": (_dout(False), "sdpa", None),
    "scratch_stale": (_scratch(True), "sdpa", None),
    "scratch_exact": (_scratch(False), "sdpa", None),
    "pages_gathered": (_pages(False), "flash_attn_varlen_func", _VARLEN),
    "pages_keyed": (_pages(True), "flash_attn_varlen_func", _VARLEN),
    "tile_transposed": (tile_transposed, "sdpa", None),
    "fp8_in_bf16": (fp8_in_bf16, "sdpa", KernelCapabilities(fp8="e4m3", backward_devices=frozenset())),
    "batch_variant": (_batch(True), "sdpa", KernelCapabilities(batch_invariant=True)),
    "batch_loop": (_batch(False), "sdpa", KernelCapabilities(batch_invariant=True)),
    "nondeterministic": (_ordered(True), "sdpa", KernelCapabilities(deterministic=True)),
    "ordered": (_ordered(False), "sdpa", KernelCapabilities(deterministic=True)),
    "delta_stale": (delta_stale, "sdpa", _NO_MASKS),
}  # fmt: skip


def register() -> list[str]:
    """Register every kernel of :data:`KERNELS` as ``plant_<name>`` (replacing earlier ones), with no
    state kept from earlier calls; returns the names."""
    reset()
    for name, (fn, api, caps) in KERNELS.items():
        register_kernel(f"plant_{name}", fn, api=api, capabilities=caps, overwrite=True)
    return [f"plant_{n}" for n in KERNELS]


register()  # ``--import lab.sequence_mutants``: the kernels by name


def _heldout_capabilities(name: str) -> KernelCapabilities:
    """A held-out kernel's capabilities as its user would declare them from its contract
    (:func:`lab.heldout_eval.capabilities`), with every mask kind and, for FP8 inputs, the E4M3 P cast
    of FlashAttention-3's FP8 path as its declared precision."""
    from lab.heldout import CONTRACTS
    from lab.heldout_eval import capabilities

    c = CONTRACTS[name]
    return dataclasses.replace(
        capabilities(c), masks=KernelCapabilities().masks, fp8="e4m3" if "e4m3" in c.dtypes else None
    )


def _here(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a function of this module (its signature kept), so a reproducer's script imports the
    module that registers it."""

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    kernel.__module__ = __name__
    return kernel


def register_heldout() -> list[str]:
    """Register every held-out kernel of :data:`lab.heldout.HELDOUT` as ``heldout_<name>`` with the
    capabilities its contract gives (nothing of its implementation read), state forgotten; returns
    the names."""
    from lab.heldout import HELDOUT
    from lab.heldout.stateful import reset_state

    reset_state()
    for name, row in HELDOUT.items():
        register_kernel(
            f"heldout_{name}",
            _here(row.fn),
            api=row.api,
            capabilities=_heldout_capabilities(name),
            overwrite=True,
        )
    return [f"heldout_{n}" for n in HELDOUT]


register_heldout()  # ``--import lab.sequence_mutants``: the held-out kernels by name too
