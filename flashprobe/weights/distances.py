"""Distances between weight tensors: the 1-D Wasserstein-1 distance and the maximum difference.

:func:`wasserstein_distance` is exactly :func:`scipy.stats.wasserstein_distance` (``scipy/stats/
_stats_py.py``, ``_cdf_distance`` with ``p = 1``), computed with torch on the inputs' device. Both
distributions are empirical: every element of a tensor is one observation (tensors are flattened),
optionally weighted. With CDFs ``U`` and ``V`` over the merged sorted values ``x₀ ≤ … ≤ x_{n+m−1}``::

    W1(u, v) = Σ_k |U(x_k) − V(x_k)| · (x_{k+1} − x_k)

For two unweighted samples of the same size this reduces to ``mean(|sort(u) − sort(v)|)``, which
is what we compute in that case (one sort per input, no merge).

Speed: torch's CPU sort is several times slower than numpy's vectorised sort on the machines we
measured (``flashprobe bench wasserstein`` shows both), so on CPU the sorting is delegated to numpy
(zero-copy views of the same float64 memory), the two samples on two threads when torch may use
more than one (``torch.get_num_threads()``); on CUDA ``torch.sort`` is used. Sorting is exact, so
these choices change speed only, never the value.

Validation is split from computation as in scipy (``_validate_distribution``): empty inputs,
non-finite values (NaN/±inf), mismatched weight sizes, negative weights or a weight sum that is not
positive and finite raise :class:`ValueError` naming the argument and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["max_abs_diff", "sorted_values", "wasserstein_distance", "wasserstein_sorted"]

ArrayLike = torch.Tensor | np.ndarray | list[float] | tuple[float, ...]
T = TypeVar("T")


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


def _argsort(x: torch.Tensor, *, stable: bool = False) -> torch.Tensor:
    """Indices that sort a 1-D float64 tensor (int64, same device)."""
    if x.device.type == "cpu":
        order = np.argsort(x.numpy(), kind="stable" if stable else None)
        return torch.from_numpy(order.astype(np.int64, copy=False))
    return torch.sort(x, stable=stable).indices


def wasserstein_sorted(
    us: torch.Tensor,
    vs: torch.Tensor,
    u_steps: torch.Tensor | None = None,
    v_steps: torch.Tensor | None = None,
) -> torch.Tensor:
    """W1 of two samples given in ascending order; returns a 0-d float64 tensor.

    Args:
        us: ``(n,)`` float64 values, ascending.
        vs: ``(m,)`` float64 values, ascending.
        u_steps: ``(n,)`` the CDF step of each value of ``us`` (its weight over the total weight),
            in the same order; ``None``: ``1/n`` each.
        v_steps: the same for ``vs``.

    For two unweighted samples of one size this is ``mean |us − vs|``. Otherwise the CDFs are
    integrated over the merged values: merging the two ascending runs gives the order, and the
    running sum of the signed steps in that order is ``U(x_k) − V(x_k)``, exact wherever
    ``x_{k+1} > x_k`` (scipy's ``searchsorted`` counts); where ``x_{k+1} = x_k`` the term has zero
    width in both formulations.
    """
    n, m = us.numel(), vs.numel()
    if u_steps is None and v_steps is None and n == m:
        return torch.dist(us, vs, p=1) / n  # mean |sort(u) − sort(v)|, fused
    if us.device.type == "cpu":
        u = us.numpy() if u_steps is None else _keyed(us.numpy(), u_steps.numpy())
        v = vs.numpy() if v_steps is None else _keyed(vs.numpy(), v_steps.numpy())
        totals = (n if u_steps is None else 1.0, m if v_steps is None else 1.0)  # steps: 1/n, or given
        return torch.tensor(_merged_w1_numpy(u, v, *totals), dtype=torch.float64)
    both = torch.cat((us, vs))  # (n + m,)
    order = _argsort(both, stable=True)
    steps = torch.cat(
        (
            us.new_full((n,), 1.0 / n) if u_steps is None else u_steps,
            vs.new_full((m,), -1.0 / m) if v_steps is None else v_steps.neg(),
        )
    )[order]  # (n + m,) signed CDF steps in merged order
    cdf_gap = steps[:-1].cumsum_(0).abs_()  # (n + m − 1,) |U(x_k) − V(x_k)|
    return torch.dot(cdf_gap, torch.diff(both[order]))


# On the CPU a weighted sample is sorted as complex128 ``value + i·weight``: numpy sorts complex
# numbers by real part (ties by imaginary part, which W1 ignores: equal values have zero width), a
# key-value sort faster than an argsort and two gathers. The merge of two samples sorts such keyed
# values too, with the signed CDF steps as imaginary parts, so no index array is ever gathered.


def _keyed(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``(n,)`` complex128 ``values + i·weights``."""
    keyed = np.empty(values.size, dtype=np.complex128)
    keyed.real, keyed.imag = values, weights
    return keyed


def _sorted_numpy(values: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
    """``values`` sorted (float64), or with weights: ``values + i·weights`` sorted by value (complex128)."""
    if weights is None:
        return np.sort(values)
    keyed = _keyed(values, weights)
    keyed.sort()
    return keyed


def _real(sample: np.ndarray) -> np.ndarray:
    return sample.real if np.iscomplexobj(sample) else sample


def _merge_part(
    a: np.ndarray, b: np.ndarray, a_total: float, b_total: float, offset: float
) -> tuple[float, float, float]:
    """One stretch of the merged CDF integral.

    Args:
        a: ascending values of ``u`` (float64, each step ``1/a_total``) or keyed by weight (complex128,
            each step ``weight/a_total``).
        b: the same for ``v``, whose steps count negatively.
        a_total, b_total: the divisors of the steps.
        offset: ``U − V`` just below this stretch.

    Returns:
        ``(Σ_k |U(x_k) − V(x_k)|·(x_{k+1} − x_k) within the stretch, its first value, its last value)``.
    """
    both = np.empty(a.size + b.size, dtype=np.complex128)  # (n_a + n_b,) value + i·signed step
    for part, sample, total in ((both[: a.size], a, a_total), (both[a.size :], b, -b_total)):
        if np.iscomplexobj(sample):
            part[...] = sample
            np.divide(part.imag, total, out=part.imag)
        else:
            part.real, part.imag = sample, 1.0 / total
    both.sort(kind="stable")  # two ascending runs: a linear merge
    gap = np.cumsum(both.imag[:-1])  # (n_a + n_b − 1,) U − V, less the offset
    if offset:
        gap += offset
    np.abs(gap, out=gap)
    return float(np.dot(gap, np.diff(both.real))), float(both.real[0]), float(both.real[-1])


def _merged_w1_numpy(u: np.ndarray, v: np.ndarray, u_total: float, v_total: float) -> float:
    """W1 of two ascending samples (as :func:`_sorted_numpy` returns them) over their merged values.

    The merge is split at the median of ``u``: values below it form one stretch, the rest another,
    and ``U − V`` at the split is the steps' sum below it. The two stretches are merged concurrently
    when torch may use more than one thread; the split is the same either way, so is the value.
    """
    i = u.size // 2
    pivot = _real(u)[i] if i else 0.0
    j = int(np.searchsorted(_real(v), pivot, side="left"))
    if i == 0 or j == v.size:  # nothing to split off: one stretch
        return _merge_part(u, v, u_total, v_total, 0.0)[0]
    below = (np.sum(u.imag[:i]) if np.iscomplexobj(u) else i) / u_total
    below -= (np.sum(v.imag[:j]) if np.iscomplexobj(v) else j) / v_total
    (low, _, low_last), (high, high_first, _) = _on_two_threads(
        _merge_part, (u[:i], v[:j], u_total, v_total, 0.0), (u[i:], v[j:], u_total, v_total, below)
    )
    return low + high + abs(below) * (high_first - low_last)


def _cdf_distance_w1(
    u: torch.Tensor, v: torch.Tensor, u_weights: torch.Tensor | None, v_weights: torch.Tensor | None
) -> torch.Tensor:
    """scipy's ``_cdf_distance(1, ...)`` on validated 1-D float64 tensors; returns a 0-d tensor."""
    if u.device.type != "cpu":
        (us, u_steps), (vs, v_steps) = (_ordered(u, u_weights), _ordered(v, v_weights))
        return wasserstein_sorted(us, vs, u_steps, v_steps)
    uw = None if u_weights is None else u_weights.numpy()
    vw = None if v_weights is None else v_weights.numpy()
    us, vs = _on_two_threads(_sorted_numpy, (u.numpy(), uw), (v.numpy(), vw))
    if uw is None and vw is None and us.size == vs.size:
        return wasserstein_sorted(torch.from_numpy(us), torch.from_numpy(vs))
    # numpy's sums: the same whatever torch's thread count
    u_total = us.size if uw is None else float(np.sum(uw))
    v_total = vs.size if vw is None else float(np.sum(vw))
    return torch.tensor(_merged_w1_numpy(us, vs, u_total, v_total), dtype=torch.float64)


def _ordered(x: torch.Tensor, w: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` sorted (on a GPU), and each sorted value's CDF step ``w / Σw`` (``None``: equal)."""
    if w is None:
        return sorted_values(x), None
    order = _argsort(x)
    return x[order], w[order] / w.sum()


#: Samples at least this large are sorted (and merged) on two threads at once (numpy releases the GIL).
_TWO_THREADS_MIN = 1 << 16


def _on_two_threads(fn: Callable[..., T], a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[T, T]:
    """``(fn(*a), fn(*b))``, the two calls concurrent on a CPU with more than one torch thread.

    numpy's sorts release the GIL, so the two samples of a distance sort in parallel; the result is
    the same as sorting them one after the other. With ``torch.set_num_threads(1)`` (or small
    samples) the calls run in turn.
    """
    x, y = a[0], b[0]
    if torch.get_num_threads() > 1 and min(len(x), len(y)) >= _TWO_THREADS_MIN:
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(fn, *a)
            second = fn(*b)
            return first.result(), second
    return fn(*a), fn(*b)


def wasserstein_distance(
    u_values: ArrayLike,
    v_values: ArrayLike,
    u_weights: ArrayLike | None = None,
    v_weights: ArrayLike | None = None,
) -> float:
    """Wasserstein-1 distance between two 1-D empirical distributions, as scipy computes it.

    Same definition, arguments and value as :func:`scipy.stats.wasserstein_distance` (to float64
    rounding of the final sum), computed in float64 with torch on the device of ``u_values``.

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
    return float(_cdf_distance_w1(u, v, uw, vw))


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
