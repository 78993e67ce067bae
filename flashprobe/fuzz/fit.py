"""Instantiating a case inside a kernel's limits: the nearest call the kernel accepts that still
tests the case's property.

:func:`fit_inputs` moves a call to one the kernel's :class:`~flashprobe.KernelCapabilities` accept:
k/v heads repeated where GQA is refused; zero channels up to a head dim it takes (scale kept, logits
unchanged); a mask shared, made additive or dropped where no property needs it; lengths grown to its
multiple (rows repeated, added keys hidden by a mask or the causal mask) or cut; a partial last tile
kept by a padding mask; contiguous inputs. The fitted call must still **exhibit** the case's
property (:data:`EXHIBITS`); otherwise, or when a :attr:`FuzzCase.fixed
<flashprobe.fuzz.cases.FuzzCase>` axis would change, the case is not applicable
(:class:`NotApplicableError`, saying why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from flashprobe.errors import FlashprobeError
from flashprobe.fuzz.inputs import CaseInputs
from flashprobe.kernels import KernelCapabilities, default_scale, mask_kind

__all__ = [
    "EXHIBITS",
    "FIXED",
    "MASK_PROPERTIES",
    "MAX_FITTED_SCORES",
    "FittedInputs",
    "NotApplicableError",
    "fit_inputs",
    "missing_property",
]

#: what a case can require to stay as built: ``head_dim`` (q's and v's), ``lengths`` (``N_q``,
#: ``N_k``), ``gqa`` (fewer k/v heads than query heads), ``tail`` (a partial last key tile)
FIXED = ("head_dim", "lengths", "gqa", "tail")
#: the most scores ``B · H · N_q · N_k`` a fitted call may have; beyond it the call shrinks, or is
#: not applicable
MAX_FITTED_SCORES = 1 << 25
#: the properties that need a mask; any other case's mask may be dropped for a kernel without one
MASK_PROPERTIES = frozenset(
    {"fully masked row", "one valid key", "key padding", "left padding", "additive mask"}
)
#: the key tiles a call is judged partial against when the kernel declares no multiple
_TILES = (64, 128)


class NotApplicableError(ValueError, FlashprobeError):
    """The case cannot be posed to this kernel without losing what it tests; the message says why."""


@dataclass(frozen=True)
class FittedInputs:
    """A case's call as posed to one kernel.

    Attributes:
        inputs: the call the kernel gets (``inputs`` itself when nothing had to change).
        changes: what was changed, in words (``""``: nothing), e.g.
            ``"N_q 16→256, N_k 203→256 (keys 203… masked); D 59→64 (zero channels)"``.
        lost: the case's other properties (``FuzzCase.also``) the fitted call no longer exhibits,
            each with why.
    """

    inputs: CaseInputs
    changes: str = ""
    lost: dict[str, str] = field(default_factory=dict)


# --- what a call exhibits: one inspection per property that fitting can lose ---


def _tiles(x: CaseInputs, caps: KernelCapabilities) -> tuple[int, ...]:
    m = caps.seq_multiple_for(x.is_causal)
    return (m,) if m > 1 else _TILES


def _mask_keep(x: CaseInputs) -> torch.Tensor | None:
    """The call's mask as bool ``True`` = may attend (causality left out), or None."""
    m = x.attn_mask
    return None if m is None else m if m.dtype == torch.bool else m > float("-inf")


def _cuts_last_tile(x: CaseInputs, tile: int) -> bool:
    """A row sees a key of the last key tile of ``tile`` keys, but not the tile's last key."""
    keep = _mask_keep(x)
    if keep is None:
        return False
    n_k = x.k.shape[2]
    start = (n_k - 1) // tile * tile
    last = keep.expand(*keep.shape[:-1], n_k)[..., start:]
    return bool((last.any(-1) & ~last[..., -1]).any())


def _partial_tile(x: CaseInputs, caps: KernelCapabilities) -> str | None:
    n_q, n_k, d = x.q.shape[2], x.k.shape[2], x.q.shape[3]
    tiles = _tiles(x, caps)
    if any(n % t for t in tiles for n in (n_q, n_k)) or d & (d - 1):
        return None
    if any(_cuts_last_tile(x, t) for t in tiles):
        return None
    return (
        f"N_q={n_q}, N_k={n_k} fill their tiles of {'/'.join(map(str, tiles))}, D={d} is a power of two, "
        "and no padding mask cuts the last key tile"
    )


def _rows_seeing(x: CaseInputs) -> torch.Tensor:
    """``(B, H, N_q)``: how many keys each row may attend to."""
    return x.valid_keys().sum(-1)


def _logits(x: CaseInputs, *, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``(B, H, N_q, N_k)`` logits (``q·kᵀ·scale``; ``raw``: ``q·kᵀ``) and where they are valid."""
    k, _ = x.reference_kv()
    s = x.q.double() @ k.double().transpose(-2, -1)
    return (s if raw else s * default_scale(x.q.shape[-1], x.scale)), x.valid_keys()


def _rows_below(x: CaseInputs, level: float, *, raw: bool = False) -> bool:
    """Some row with a valid key has every valid logit below ``level``."""
    s, valid = _logits(x, raw=raw)
    top = s.masked_fill(~valid, float("-inf")).amax(-1)
    return bool(((top < level) & valid.any(-1)).any())


def _rises(x: CaseInputs) -> bool:
    """Some row's maximum over its valid logits rises by more than 1 after its first 64-key tile."""
    s, valid = _logits(x)
    s = s.masked_fill(~valid, float("-inf"))
    if s.shape[-1] <= 64:
        return False
    return bool((s[..., 64:].amax(-1) > s[..., :64].amax(-1) + 1).any())


def _check(
    ok: Callable[[CaseInputs], bool], why: str
) -> Callable[[CaseInputs, KernelCapabilities], str | None]:
    return lambda x, caps: None if ok(x) else why


def _strided(x: CaseInputs) -> bool:
    return any(not t.is_contiguous() or t.storage_offset() for t in (x.q, x.k, x.v))


def _key_padding(x: CaseInputs) -> bool:
    keep = _mask_keep(x)
    return keep is not None and keep.dim() >= 3 and all(s == 1 for s in keep.shape[1:-1]) and not keep.all()


def _left_padding(x: CaseInputs) -> bool:
    keep = _mask_keep(x)
    return keep is not None and bool((~keep[..., 0] & keep.any(-1)).any())


#: property → ``check(call, caps)``: ``None`` when the call exhibits the property, else why not;
#: properties not listed are kept by construction (fitting keeps the case's own rows, keys, values).
EXHIBITS: dict[str, Callable[[CaseInputs, KernelCapabilities], str | None]] = {
    "partial tile": _partial_tile,
    "sentinel": _check(lambda x: _rows_below(x, -1e4), "no row has every valid logit below −1e4"),
    "raw sentinel": _check(lambda x: _rows_below(x, -5e4, raw=True), "no row has every score below −5e4"),
    "large logits": _check(lambda x: bool(_logits(x)[0].abs().max() >= 1e4), "no logit reaches 1e4"),
    "qk overflow": _check(lambda x: bool(_logits(x, raw=True)[0].abs().max() > 65504), "q·kᵀ fits fp16"),
    "rescaling": _check(_rises, "no row's maximum rises after its first key tile"),
    "extreme scale": _check(
        lambda x: x.scale is not None and (0 < x.scale <= 2**-14 or x.scale >= 2**12), "the scale is moderate"
    ),
    "scale zero": _check(lambda x: x.scale == 0.0, "the scale is not 0"),
    "fully masked row": _check(lambda x: bool((_rows_seeing(x) == 0).any()), "every row sees a key"),
    "one valid key": _check(lambda x: bool((_rows_seeing(x) == 1).any()), "no row sees exactly one key"),
    "single key": _check(
        lambda x: bool((_rows_seeing(x) <= 1).all() and (_rows_seeing(x) == 1).any()), "rows see several keys"
    ),
    "key padding": _check(_key_padding, "no key-padding mask"),
    "left padding": _check(_left_padding, "no sequence has its first key masked"),
    "additive mask": _check(
        lambda x: x.attn_mask is not None and x.attn_mask.is_floating_point(), "no additive mask"
    ),
    "causal": _check(lambda x: x.is_causal, "not causal"),
    "causal N_q ≠ N_k": _check(
        lambda x: x.is_causal and x.q.shape[2] != x.k.shape[2], "not causal with N_q ≠ N_k"
    ),
    "decode": _check(lambda x: x.q.shape[2] == 1, "more than one query"),
    "GQA": _check(lambda x: x.k.shape[1] < x.q.shape[1], "as many k/v heads as query heads"),
    "strided inputs": _check(_strided, "q, k, v are contiguous"),
    "head dim > 128": _check(lambda x: x.q.shape[-1] > 128, "head dim ≤ 128"),
    "D_v ≠ D": _check(lambda x: x.v.shape[-1] != x.q.shape[-1], "D_v = D"),
    "long context": _check(lambda x: bool(_rows_seeing(x).max() > 4096), "no row sees more than 4096 keys"),
    "large grid": _check(lambda x: x.q.shape[0] * x.q.shape[1] > 1024, "B·H ≤ 1024"),
    "poisoned memory": _check(lambda x: bool(x.poison), "no poisoned memory"),
    "NaN inputs": _check(lambda x: x.nan_rows() is not None, "no NaN input"),
    "large offsets": _check(lambda x: max(t.numel() for t in (x.q, x.k, x.v)) > 2**24, "no tensor past 2^24"),
    "signed bias": _check(
        lambda x: x.q.shape[0] * x.q.shape[1] >= 256, "fewer than 256 (batch, head) replicates"
    ),
}


def missing_property(prop: str, inputs: CaseInputs, caps: KernelCapabilities) -> str | None:
    """Why ``inputs`` (a call posed to a kernel of ``caps``) does not exhibit ``prop``; None when it
    does (or when ``prop`` is one fitting keeps by construction)."""
    check = EXHIBITS.get(prop)
    return None if check is None else check(inputs, caps)


# --- the fitting steps ---


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
    """``x`` extended (or cut) to ``n`` entries along ``dim``, its entries repeated cyclically."""
    if x.shape[dim] == n:
        return x
    index = torch.arange(n, device=x.device) % x.shape[dim]
    return x.index_select(dim, index)


class _Fit:
    """One fitting: the kernel's limits, what must not change, the properties the case tests."""

    def __init__(self, caps: KernelCapabilities, fixed: frozenset[str], properties: tuple[str, ...]) -> None:
        self.caps, self.fixed, self.properties = caps, fixed, properties
        self.needs_mask = not properties or bool(MASK_PROPERTIES & set(properties))

    def gqa(self, x: CaseInputs) -> tuple[CaseInputs, str]:
        h, h_kv = x.q.shape[1], x.k.shape[1]
        if h_kv == h or self.caps.gqa != "none":
            return x, ""
        if "gqa" in self.fixed:
            raise NotApplicableError(
                f"the case tests {h_kv} k/v heads for {h} query heads; the kernel has no GQA"
            )
        k, v = x.reference_kv()
        return replace(x, k=k, v=v), f"k, v heads {h_kv}→{h} (repeated)"

    def head_dim(self, x: CaseInputs) -> tuple[CaseInputs, str]:
        caps, d, d_v = self.caps, x.q.shape[-1], x.v.shape[-1]
        target = _head_dim_for(d, caps)
        v_ok = d_v == d or caps.value_head_dim
        if target == d and v_ok:
            return x, ""
        if not v_ok:
            raise NotApplicableError(f"the case needs v's head dim {d_v} ≠ q's {d}; the kernel needs D_v = D")
        if "head_dim" in self.fixed:
            raise NotApplicableError(
                f"the case tests head dim {d}; the kernel takes {caps.describe_head_dims()}"
            )
        if target is None:
            raise NotApplicableError(f"no head dim ≥ {d} is among the kernel's {caps.describe_head_dims()}")
        v = _pad_channels(x.v, target) if d_v == d else x.v
        scale = default_scale(d, x.scale)
        fitted = replace(x, q=_pad_channels(x.q, target), k=_pad_channels(x.k, target), v=v, scale=scale)
        return fitted, f"D {d}→{target} (zero channels, scale {scale:.4g} kept)"

    def mask(self, x: CaseInputs) -> tuple[CaseInputs, str]:
        """Drop a mask no property needs where the kernel takes none of its kind; share a per-head
        bool mask; turn a bool mask additive for a kernel that takes only those."""
        mask = x.attn_mask
        if mask is None or self._mask_problem(x, mask) is None:
            return x, ""
        per_head = mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] > 1
        if per_head and "head_shared" in self.caps.masks and self._mask_problem(x, mask[:, :1]) is None:
            shared = mask[:, :1]
            return replace(x, attn_mask=shared), "per-head bool mask as head 0's, shared by every head"
        if mask.dtype == torch.bool and "float" in self.caps.masks:
            additive = torch.where(mask, 0.0, float("-inf")).to(x.dtype)
            return replace(x, attn_mask=additive), "bool mask as an additive 0/−inf mask"
        if not self.needs_mask:
            kind = {"key_padding": "key-padding", "float": "additive"}.get(mask_kind(mask), "bool")
            what = self.properties[0] if self.properties else "the call"
            return replace(
                x, attn_mask=None
            ), f"{kind} mask dropped (the kernel takes none, {what} needs none)"
        return x, ""  # refused with the kernel's reason at the end

    def _mask_problem(self, x: CaseInputs, mask: torch.Tensor) -> str | None:
        """The kernel's refusal of ``mask`` alone (every other limit lifted)."""
        masks_only = replace(
            self.caps, seq_multiple=1, causal_seq_multiple=None, same_length=False, head_dims=None,
            max_head_dim=None, head_dim_multiple=1, gqa="native", value_head_dim=True, contiguous=False,
            dtypes=None, devices=None, backward_masks=None, backward_devices=None, min_cuda_capability=None,
        )  # fmt: skip
        return masks_only.call_problem(x.q, x.k, x.v, mask, x.is_causal)

    def _hider(self, x: CaseInputs, n_k: int) -> torch.Tensor | None:
        """The call's mask with masked key columns up to ``n_k`` (or a new key-padding mask), or None
        when the kernel takes no mask that can hide them."""
        mask, old, masks = x.attn_mask, x.k.shape[2], self.caps.masks
        if mask is None:
            keep = (torch.arange(n_k, device=x.q.device) < old).expand(x.q.shape[0], 1, 1, n_k)
            if masks & {"key_padding", "bool", "head_shared"}:
                return keep.clone()
            return torch.where(keep, 0.0, float("-inf")).to(x.dtype) if "float" in masks else None
        if mask.shape[-1] == 1:
            mask = mask.expand(*mask.shape[:-1], old)
        fill = False if mask.dtype == torch.bool else float("-inf")
        return torch.cat([mask, mask.new_full((*mask.shape[:-1], n_k - old), fill)], dim=-1)

    def lengths(self, x: CaseInputs) -> tuple[CaseInputs, str]:
        caps, n_q = self.caps, x.q.shape[2]
        n_k, m = x.k.shape[2], caps.seq_multiple_for(x.is_causal)
        new_q, new_k = _round_up(n_q, m), _round_up(n_k, m)
        if caps.same_length:
            new_q = new_k = max(new_q, new_k)
        if (new_q, new_k) == (n_q, n_k):
            return x, ""
        limits = caps.describe_lengths()
        if "lengths" in self.fixed:
            raise NotApplicableError(f"the case tests N_q={n_q}, N_k={n_k}; the kernel takes {limits}")
        try:
            return self._grow(x, new_q, new_k)
        except NotApplicableError as err:
            why = str(err)
        cut_k = n_k // m * m  # keys cut to the multiple below; queries grown (rows repeated) or cut
        cut_q = cut_k if caps.same_length else new_q
        if not cut_k or x.q.shape[0] * x.q.shape[1] * cut_q * cut_k > MAX_FITTED_SCORES:
            raise NotApplicableError(f"{why}; nor can N_k={n_k} be cut to {limits}")
        k, v = x.k[:, :, :cut_k], x.v[:, :, :cut_k]
        mask = x.attn_mask
        if mask is not None:
            mask = mask[..., : min(cut_k, mask.shape[-1])]
            if mask.dim() >= 2 and mask.shape[-2] == n_q > 1:
                mask = _cyclic(mask, cut_q, mask.dim() - 2)
        fitted = replace(x, q=_cyclic(x.q, cut_q, 2), k=k, v=v, attn_mask=mask)
        return fitted, f"N_q {n_q}→{cut_q}, N_k {n_k}→{cut_k} (keys cut: {why})"

    def _grow(self, x: CaseInputs, new_q: int, new_k: int) -> tuple[CaseInputs, str]:
        b, h, n_q, _ = x.q.shape
        n_k, limits = x.k.shape[2], self.caps.describe_lengths()
        if b * h * new_q * new_k > MAX_FITTED_SCORES:
            raise NotApplicableError(
                f"at the nearest lengths the kernel takes ({limits}: N_q={new_q}, N_k={new_k}) the case has "
                f"{b * h * new_q * new_k:.3g} scores, past the fuzzer's limit of {MAX_FITTED_SCORES:.3g}"
            )
        if x.is_causal and new_k > n_k and n_q > n_k:
            raise NotApplicableError(
                f"causal with N_q={n_q} > N_k={n_k}: keys added past {n_k} would be seen by the case's rows"
            )
        if "tail" in self.fixed and x.is_causal and new_k != n_k:
            raise NotApplicableError(
                f"the case tests a partial last key tile (N_k={n_k}) under is_causal; at the lengths the "
                f"kernel takes ({limits}) only a masked tail could stand for it; causal calls take no mask"
            )
        mask = x.attn_mask
        if mask is not None and mask.dim() >= 2 and mask.shape[-2] == n_q > 1:  # not a broadcast row
            mask = _cyclic(mask, new_q, mask.dim() - 2)
        grown = replace(x, attn_mask=mask)
        hidden = ""
        if new_k != n_k and not x.is_causal:
            mask = self._hider(grown, new_k)
            if mask is None:
                raise NotApplicableError(
                    f"N_k={n_k} must grow to {new_k} ({limits}); the kernel takes no mask to hide added keys"
                )
            kind = "bool" if mask.dtype == torch.bool else "additive"
            hidden = "masked" if x.attn_mask is not None else f"masked by an added {kind} key-padding mask"
        q, k, v = _cyclic(x.q, new_q, 2), _cyclic(x.k, new_k, 2), _cyclic(x.v, new_k, 2)
        text = f"N_q {n_q}→{new_q}" if new_q != n_q else ""
        if new_k != n_k:
            hidden = hidden or "hidden by the causal mask"
            text += f"{', ' if text else ''}N_k {n_k}→{new_k} (keys {n_k}… {hidden})"
        return replace(x, q=q, k=k, v=v, attn_mask=mask), text + " (rows repeated)"

    def tail(self, x: CaseInputs) -> tuple[CaseInputs, str]:
        """Cut the last key tile with the padding mask where a partial-tile case lost its partial tile."""
        if "partial tile" not in self.properties or _partial_tile(x, self.caps) is None or x.is_causal:
            return x, ""
        n_k, m = x.k.shape[2], self.caps.seq_multiple_for(False)
        cut = n_k - max(m, 2) // 2
        if cut < 1:
            return x, ""
        keep = torch.arange(n_k, device=x.q.device) < cut  # (N_k,)
        mask = x.attn_mask
        if mask is None:
            mask = self._hider(replace(x, k=x.k[:, :, :cut]), n_k)
            if mask is None:
                return x, ""
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
        return replace(x, attn_mask=mask), f"keys {cut}… masked (a padding mask cuts the last tile of {m})"

    def contiguous(self, x: CaseInputs) -> tuple[CaseInputs, str]:
        if not self.caps.contiguous or not _strided(x):
            return x, ""
        if "strided inputs" in self.properties[:1]:
            raise NotApplicableError("the case tests strided inputs; the kernel takes contiguous inputs only")
        poison = x.poison if not x.poison or x.poison.endswith("_after") else f"{x.poison}_after"
        fitted = replace(x, poison=poison).with_layout("contiguous")
        return fitted, "contiguous" + (" (poisoned memory after each tensor)" if poison else "")


def fit_inputs(
    inputs: CaseInputs,
    caps: KernelCapabilities,
    *,
    fixed: frozenset[str] | tuple[str, ...] = (),
    properties: tuple[str, ...] = (),
) -> FittedInputs:
    """The nearest call to ``inputs`` that ``caps`` accepts, that keeps ``fixed`` and exhibits the
    first of ``properties``.

    Args:
        inputs: the case's call: q ``(B, H, N_q, D)``, k, v ``(B, H_kv, N_k, ·)``, in any layout
            (kept, unless the kernel takes contiguous inputs only).
        fixed: what must not change (of :data:`FIXED`).
        properties: what the case tests, its own first: the fitted call is inspected for them, and
            a mask none of them needs may be dropped (none given: every mask is kept).

    Returns:
        The fitted call (``inputs`` itself when the kernel takes it), what changed, and which of
        the other properties it lost.

    Raises:
        NotApplicableError: the kernel cannot take any call that still tests the case; the
            message says why.
    """
    unknown = set(fixed) - set(FIXED)
    if unknown:
        raise ValueError(f"fixed: unknown {sorted(unknown)}; allowed: {', '.join(FIXED)}")
    fit = _Fit(caps, frozenset(fixed), tuple(properties))
    changes = []
    fitted = inputs
    for step in (fit.gqa, fit.head_dim, fit.mask, fit.lengths, fit.tail, fit.contiguous):
        fitted, text = step(fitted)
        changes += [text] if text else []
    if changes and not caps.contiguous:  # added rows and channels made the tensors contiguous
        fitted = fitted.with_layout(inputs.layout)
    problem = caps.call_problem(fitted.q, fitted.k, fitted.v, fitted.attn_mask, fitted.is_causal)
    if problem is not None:
        raise NotApplicableError(f"the kernel {problem}")
    if properties and (why := missing_property(properties[0], fitted, caps)):
        posed = f" ({'; '.join(changes)})" if changes else ""
        raise NotApplicableError(f"the call it takes{posed} has no {properties[0]}: {why}")
    lost = {p: why for p in properties[1:] if (why := missing_property(p, fitted, caps))}
    return FittedInputs(fitted, "; ".join(changes), lost)
