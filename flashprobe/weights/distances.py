"""Distances between weight tensors: the 1-D Wasserstein-1 distance and the maximum difference.

:func:`wasserstein_distance` is :func:`scipy.stats.wasserstein_distance` (every element of a tensor
one observation). For two unweighted samples of one size, the only case the tool compares, it is
``mean |sort(u) − sort(v)|``, computed here in float64 (:func:`sorted_values` and
:func:`wasserstein_sorted`, so a sample compared with several others is sorted once); every other
case is scipy's. Bad input (empty, non-finite, bad weights) raises :class:`ValueError` naming it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["max_abs_diff", "sorted_values", "wasserstein_distance", "wasserstein_sorted"]

ArrayLike = torch.Tensor | np.ndarray | list[float] | tuple[float, ...]


def _as_float64(name: str, x: ArrayLike, device: torch.device | None = None) -> torch.Tensor:
    """Flattened float64 copy-or-view of ``x`` (detached), on ``device`` if given."""
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x, dtype=np.float64))
    if t.is_complex():
        raise ValueError(f"{name} is complex ({t.dtype}); pass real values")
    return t.to(device=device, dtype=torch.float64).reshape(-1)


def _check_finite(name: str, t: torch.Tensor) -> None:
    # Fast path: the sum is finite only if every value is (NaN or ±inf anywhere makes it NaN/±inf).
    if bool(torch.isfinite(t.sum())):
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        nan = int(torch.isnan(t).sum())
        raise ValueError(
            f"{name} has {bad} non-finite value(s) out of {t.numel()} ({nan} NaN, {bad - nan} ±inf); "
            "distances are defined for finite values only: drop or replace them first "
            "(torch.nan_to_num, or t[torch.isfinite(t)])"
        )


def _validate_distribution(
    name: str, values: ArrayLike, weights: ArrayLike | None, device: torch.device | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validated 1-D float64 values and weights (scipy's ``_validate_distribution`` plus finiteness)."""
    v = _as_float64(f"{name}_values", values, device)
    if v.numel() == 0:
        raise ValueError(f"{name}_values is empty; a distribution needs at least one value")
    _check_finite(f"{name}_values", v)
    if weights is None:
        return v, None
    w = _as_float64(f"{name}_weights", weights, v.device)
    if w.numel() != v.numel():
        raise ValueError(
            f"{name}_weights has {w.numel()} elements but {name}_values has {v.numel()}; "
            "pass one weight per value"
        )
    _check_finite(f"{name}_weights", w)
    if bool((w < 0).any()):
        raise ValueError(f"{name}_weights has negative entries; weights must be non-negative")
    if not float(w.sum()) > 0:
        raise ValueError(f"{name}_weights sum to 0; the sum must be positive (pass None for equal weights)")
    if not np.isfinite(float(w.sum())):
        raise ValueError(f"{name}_weights sum overflows float64; rescale the weights")
    return v, w


def sorted_values(x: torch.Tensor) -> torch.Tensor:
    """Sorted copy of a 1-D float64 tensor (numpy's SIMD sort on CPU, ``torch.sort`` elsewhere).

    Sorting is the cost floor of an exact Wasserstein distance: callers comparing one sample with
    several others sort it once and pass the result to :func:`wasserstein_sorted`.
    """
    if x.device.type == "cpu":
        return torch.from_numpy(np.sort(x.numpy()))
    return torch.sort(x).values


def wasserstein_sorted(us: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """W1 of two samples of one size given in ascending order: ``mean |us − vs|``, a 0-d float64 tensor.

    Args:
        us: ``(n,)`` float64 values, ascending.
        vs: ``(n,)`` float64 values, ascending.

    Raises:
        ValueError: the samples differ in size (:func:`wasserstein_distance` takes any two samples).
    """
    n = us.numel()
    if vs.numel() != n:
        raise ValueError(
            f"wasserstein_sorted compares two samples of one size, got {n} and {vs.numel()}; "
            "use wasserstein_distance for samples of different sizes"
        )
    return torch.dist(us, vs, p=1) / n  # mean |sort(u) − sort(v)|, fused


def wasserstein_distance(
    u_values: ArrayLike,
    v_values: ArrayLike,
    u_weights: ArrayLike | None = None,
    v_weights: ArrayLike | None = None,
) -> float:
    """Wasserstein-1 distance of two 1-D empirical distributions: :func:`scipy.stats.wasserstein_distance`.

    Same definition, arguments and value as scipy's; two unweighted samples of one size are computed
    here, in float64 on the device of ``u_values`` (module docstring), every other case by scipy.

    Args:
        u_values: observations of the first distribution, any shape (flattened), ``(n,)`` after
            flattening. Any real dtype; computed in float64.
        v_values: observations of the second distribution, ``(m,)`` after flattening; ``m`` may
            differ from ``n``. Moved to ``u_values``' device if it is elsewhere.
        u_weights: optional non-negative weights, one per ``u`` value (``(n,)``), with a positive
            finite sum; ``None`` gives every value the same weight.
        v_weights: the same for ``v`` (``(m,)``).

    Returns:
        The distance as a Python float (``0.0`` for identical distributions; ``|x|`` when one
        sample is the other shifted by ``x``).

    Raises:
        ValueError: an input is empty or complex, contains NaN/±inf, or its weights are the wrong
            size, negative, or do not have a positive finite sum.
    """
    device = u_values.device if isinstance(u_values, torch.Tensor) else None
    u, uw = _validate_distribution("u", u_values, u_weights, device)
    v, vw = _validate_distribution("v", v_values, v_weights, u.device)
    if uw is None and vw is None and u.numel() == v.numel():
        return float(wasserstein_sorted(sorted_values(u), sorted_values(v)))
    import scipy.stats  # the general case, with weights or two sizes: scipy's own

    arrays = (None if t is None else t.cpu().numpy() for t in (u, v, uw, vw))
    return float(scipy.stats.wasserstein_distance(*arrays))


def max_abs_diff(a: ArrayLike, b: ArrayLike) -> float:
    """Largest elementwise absolute difference ``max |a − b|``, computed in float64.

    Unlike the Wasserstein distance this compares weights element by element, so it only makes sense
    between tensors that correspond position by position (same initialisation, same shape).

    Args:
        a: any shape.
        b: the same shape as ``a`` (on ``a``'s device, or moved there).

    Returns:
        The maximum as a Python float (``0.0`` for empty tensors).

    Raises:
        ValueError: the shapes differ, or either input contains NaN/±inf.
    """
    device = a.device if isinstance(a, torch.Tensor) else None
    shape_a = tuple(a.shape) if hasattr(a, "shape") else (len(a),)
    shape_b = tuple(b.shape) if hasattr(b, "shape") else (len(b),)
    if shape_a != shape_b:
        raise ValueError(f"max_abs_diff: shapes differ: {shape_a} vs {shape_b}; compare tensors of one shape")
    ta, tb = _as_float64("a", a, device), _as_float64("b", b, device)
    _check_finite("a", ta)
    _check_finite("b", tb)
    if ta.numel() == 0:
        return 0.0
    return float((ta - tb).abs().amax())
