"""Instantiating a case inside a kernel's limits: the nearest call the kernel accepts that still
tests the case's property.

A kernel that declares limits (:class:`~flashprobe.KernelCapabilities`: head dims, lengths that
are multiples of 128, ``N_q = N_k`` only, grouped heads refused) would refuse most of the
catalogue's odd-sized calls. :func:`fit_inputs` moves a call to the nearest one the kernel takes,
without changing the answer the original call asks for on its own rows:

* **head dim** — q and k (and v, when it has q's head dim) get zero channels up to the nearest
  head dim the kernel takes, and the scale is passed explicitly as the original ``1/sqrt(D)``:
  every logit is unchanged (exactly: a zero channel adds ``0`` to each dot product);
* **lengths** — queries are appended (copies of the case's rows, cyclically, with their mask
  rows), keys too; the appended keys are hidden from every original row: by the case's own mask
  (extended with masked columns), by a key-padding mask added for them, or, under ``is_causal``,
  by the causal mask itself (the original rows never reach them when ``N_q ≤ N_k``). A partial
  last tile thus becomes a fully masked tail block;
* **grouped heads** — k and v are repeated to every query head for a kernel that refuses GQA;
* **mask kind** — a bool mask becomes the additive 0/−inf mask it equals, for a kernel that takes
  only additive masks.

What the case must keep (:attr:`FuzzCase.fixed <flashprobe.fuzz.cases.FuzzCase>`: its head dim,
its lengths, its grouped heads, its partial tail) is never changed: such a case is **not
applicable** to the kernel, with the reason (:class:`NotApplicableError`), and so is a call that
still breaks a limit after fitting (a mask kind the kernel does not take, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashprobe.errors import FlashprobeError
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.kernels import KernelCapabilities, default_scale, mask_kind

__all__ = ["FIXED", "MAX_FITTED_SCORES", "FittedInputs", "NotApplicableError", "fit_inputs"]

#: what a case can require to stay as built: ``head_dim`` (q's and v's head dims), ``lengths``
#: (``N_q`` and ``N_k``), ``gqa`` (fewer k/v heads than query heads), ``tail`` (a partial last key
#: tile: kept by the original lengths, or by masked keys appended after them)
FIXED = ("head_dim", "lengths", "gqa", "tail")
#: the most scores ``B · H · N_q · N_k`` a fitted call may have (a same-length kernel would turn
#: 32 queries against 8192 keys into 8192 × 8192); beyond it the case is not applicable
MAX_FITTED_SCORES = 1 << 25


class NotApplicableError(ValueError, FlashprobeError):
    """The case cannot be posed to this kernel without losing what it tests; the message says why."""


@dataclass(frozen=True)
class FittedInputs:
    """A case's call as posed to one kernel.

    Attributes:
        inputs: the call the kernel gets (``inputs`` itself when nothing had to change).
        changes: what was changed, in words (``""``: nothing), e.g.
            ``"N_q 16→256, N_k 203→256 (keys 203… masked); D 59→64 (zero channels)"``.
    """

    inputs: CaseInputs
    changes: str = ""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _head_dim_for(d: int, caps: KernelCapabilities) -> int | None:
    """The smallest head dim ``≥ d`` the kernel takes, or None."""
    if caps.head_dims is not None:
        fits = [h for h in sorted(caps.head_dims) if h >= d and h % caps.head_dim_multiple == 0]
        fits = [h for h in fits if caps.max_head_dim is None or h <= caps.max_head_dim]
        return fits[0] if fits else None
    target = _round_up(d, caps.head_dim_multiple)
    return target if caps.max_head_dim is None or target <= caps.max_head_dim else None


def _pad_channels(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` ``(..., D)`` with zero channels up to ``d``."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], d - x.shape[-1])], dim=-1)


def _cyclic(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` extended to ``n`` entries along ``dim`` by repeating its entries cyclically."""
    if x.shape[dim] == n:
        return x
    index = torch.arange(n, device=x.device) % x.shape[dim]
    return x.index_select(dim, index)


def _fit_head_dim(
    inputs: CaseInputs, caps: KernelCapabilities, fixed: frozenset[str]
) -> tuple[CaseInputs, str]:
    d, d_v = inputs.q.shape[-1], inputs.v.shape[-1]
    accepted = _head_dim_for(d, caps) == d
    v_ok = d_v == d or caps.value_head_dim
    if accepted and v_ok:
        return inputs, ""
    if not v_ok:
        raise NotApplicableError(f"the case needs v's head dim {d_v} ≠ q's {d}; the kernel needs D_v = D")
    if "head_dim" in fixed:
        raise NotApplicableError(f"the case tests head dim {d}; the kernel takes {caps.describe_head_dims()}")
    target = _head_dim_for(d, caps)
    if target is None:
        raise NotApplicableError(f"no head dim ≥ {d} is among the kernel's {caps.describe_head_dims()}")
    v = _pad_channels(inputs.v, target) if d_v == d else inputs.v
    scale = default_scale(d, inputs.scale)
    fitted = replace(
        inputs, q=_pad_channels(inputs.q, target), k=_pad_channels(inputs.k, target), v=v, scale=scale
    )
    return fitted, f"D {d}→{target} (zero channels, scale {scale:.4g} kept)"


def _fit_gqa(inputs: CaseInputs, caps: KernelCapabilities, fixed: frozenset[str]) -> tuple[CaseInputs, str]:
    h, h_kv = inputs.q.shape[1], inputs.k.shape[1]
    if h_kv == h or caps.gqa != "none":
        return inputs, ""
    if "gqa" in fixed:
        raise NotApplicableError(
            f"the case tests {h_kv} k/v heads for {h} query heads; the kernel has no GQA"
        )
    k, v = inputs.reference_kv()
    return replace(inputs, k=k, v=v), f"k, v heads {h_kv}→{h} (repeated)"


def _key_mask(inputs: CaseInputs, caps: KernelCapabilities, n_k: int) -> torch.Tensor:
    """The case's mask with masked key columns up to ``n_k`` (or a new key-padding mask)."""
    mask, old = inputs.attn_mask, inputs.k.shape[2]
    if mask is None:
        b = inputs.q.shape[0]
        keep = (torch.arange(n_k, device=inputs.q.device) < old).expand(b, 1, 1, n_k)
        if caps.masks & {"key_padding", "bool"}:
            return keep.clone()
        if "float" in caps.masks:
            return torch.where(keep, 0.0, float("-inf")).to(inputs.dtype)
        raise NotApplicableError(
            f"N_k={old} must grow to {n_k} ({caps.describe_lengths()}), and the kernel takes no mask "
            "to hide the added keys"
        )
    if mask.shape[-1] == 1:
        mask = mask.expand(*mask.shape[:-1], old)
    fill = False if mask.dtype == torch.bool else float("-inf")
    pad = mask.new_full((*mask.shape[:-1], n_k - old), fill)
    return torch.cat([mask, pad], dim=-1)


def _fit_lengths(
    inputs: CaseInputs, caps: KernelCapabilities, fixed: frozenset[str]
) -> tuple[CaseInputs, str]:
    b, h, n_q, _ = inputs.q.shape
    n_k = inputs.k.shape[2]
    new_q, new_k = _round_up(n_q, caps.seq_multiple), _round_up(n_k, caps.seq_multiple)
    if caps.same_length:
        new_q = new_k = max(new_q, new_k)
    if (new_q, new_k) == (n_q, n_k):
        return inputs, ""
    limits = caps.describe_lengths()
    if "lengths" in fixed:
        raise NotApplicableError(f"the case tests N_q={n_q}, N_k={n_k}; the kernel takes {limits}")
    if b * h * new_q * new_k > MAX_FITTED_SCORES:
        raise NotApplicableError(
            f"at the nearest lengths the kernel takes ({limits}: N_q={new_q}, N_k={new_k}) the case has "
            f"{b * h * new_q * new_k:.3g} scores, past the fuzzer's limit of {MAX_FITTED_SCORES:.3g}"
        )
    if inputs.is_causal and new_k > n_k and n_q > n_k:
        raise NotApplicableError(
            f"causal with N_q={n_q} > N_k={n_k}: keys added past {n_k} would be seen by the case's rows"
        )
    if "tail" in fixed and inputs.is_causal and new_k != n_k:
        raise NotApplicableError(
            f"the case tests a partial last key tile (N_k={n_k}) under is_causal; at the lengths the "
            f"kernel takes ({limits}) only a masked tail could stand for it, and causal calls take no mask"
        )
    q = _cyclic(inputs.q, new_q, 2)
    mask = inputs.attn_mask
    if mask is not None and mask.dim() >= 2 and mask.shape[-2] == n_q > 1:  # not a broadcast row
        mask = _cyclic(mask, new_q, mask.dim() - 2)
    k, v = _cyclic(inputs.k, new_k, 2), _cyclic(inputs.v, new_k, 2)
    fitted = replace(inputs, q=q, k=k, v=v, attn_mask=mask)
    text = f"N_q {n_q}→{new_q}" if new_q != n_q else ""
    if new_k != n_k:
        hidden = "by the causal mask" if inputs.is_causal else "masked"
        if not inputs.is_causal:
            fitted = replace(fitted, attn_mask=_key_mask(replace(inputs, attn_mask=mask), caps, new_k))
            if mask is None:
                kind = "bool" if fitted.attn_mask.dtype == torch.bool else "additive"
                hidden += f" by an added {kind} key-padding mask"
        text += f"{', ' if text else ''}N_k {n_k}→{new_k} (keys {n_k}… {hidden})"
    return fitted, text + " (rows repeated)"


def _fit_mask(inputs: CaseInputs, caps: KernelCapabilities, fixed: frozenset[str]) -> tuple[CaseInputs, str]:
    """A bool mask as the additive 0/−inf mask it equals, for a kernel that takes only those."""
    mask = inputs.attn_mask
    if mask is None or mask.dtype != torch.bool or "float" not in caps.masks or "bool" in caps.masks:
        return inputs, ""
    if mask_kind(mask) == "key_padding" and "key_padding" in caps.masks:
        return inputs, ""
    additive = torch.where(mask, 0.0, float("-inf")).to(inputs.dtype)
    return replace(inputs, attn_mask=additive), "bool mask as an additive 0/−inf mask"


def fit_inputs(
    inputs: CaseInputs, caps: KernelCapabilities, *, fixed: frozenset[str] | tuple[str, ...] = ()
) -> FittedInputs:
    """The nearest call to ``inputs`` that ``caps`` accepts and that keeps ``fixed``.

    Args:
        inputs: the case's call: q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_k, ·)``, in any layout
            (the fitted call is laid out the same way).
        caps: the kernel's declared limits.
        fixed: what must not change (of :data:`FIXED`).

    Returns:
        The fitted call and what changed; ``inputs`` itself when the kernel takes it as it is.

    Raises:
        NotApplicableError: the kernel cannot take any call that still tests the case; the
            message says why (a fixed axis, or the limit the fitted call still breaks).
    """
    unknown = set(fixed) - set(FIXED)
    if unknown:
        raise ValueError(f"fixed: unknown {sorted(unknown)}; allowed: {', '.join(FIXED)}")
    fixed = frozenset(fixed)
    changes = []
    fitted = inputs
    for step in (_fit_gqa, _fit_head_dim, _fit_lengths, _fit_mask):
        fitted, text = step(fitted, caps, fixed)
        changes += [text] if text else []
    if changes:  # the added rows and channels made the tensors contiguous: lay them out as the case's
        fitted = fitted.with_layout(inputs.layout)
    problem = caps.call_problem(fitted.q, fitted.k, fitted.v, fitted.attn_mask, fitted.is_causal)
    if problem is not None:
        raise NotApplicableError(f"the kernel {problem}")
    return FittedInputs(fitted, "; ".join(changes))
