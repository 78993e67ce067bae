"""One pass for a call's statistics (:func:`flashprobe.judge.call_statistics`, over
:func:`flashprobe.deviation.pair_and_row_sums`): the pair sums, the row statistics and a second
baseline form's noise against an independent numpy float64 computation, with non-finite values, at
every slice size, strided or not, with host reads free (the CPU: finite slices skip masking) or not
(as on a device); both ways give the same bits on finite data; and the signed bias told that every
value is finite (what the pass read) gives the same bits as the bias that looks for itself.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from flashprobe.bias import BIAS_SAMPLE, BiasStats
from flashprobe.deviation import StatsWorkspace, pair_and_row_sums, pair_sums
from flashprobe.judge import call_statistics, noise_statistics, row_statistics

deviation_module = sys.modules["flashprobe.deviation"]  # (the package's `deviation` is the function)


def _tensors(shape, dtype, seed, nonfinite=False):
    gen = torch.Generator().manual_seed(seed)
    g = 3.0 * torch.randn(shape, generator=gen, dtype=torch.float64)
    g[..., 1, :] *= 1e-3  # a row the golden makes small: scaled by the rows' RMS, not its own norm
    p, b, f = (
        (g + 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype) for _ in range(3)
    )
    if nonfinite:
        p.view(-1)[[0, 17]] = float("nan")
        b.view(-1)[[5, 40]] = float("inf")
        g.view(-1)[[70]] = float("-inf")
        f.view(-1)[[3]] = float("nan")
    return p, b, g, f


def _rows_oracle(x: np.ndarray, g: np.ndarray) -> tuple[float, np.ndarray]:
    """Worst row error and each row's error of ``x`` against ``g``, both ``(rows, D)`` float64."""
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.sqrt(((x - g) ** 2).sum(axis=1))
        ref = np.sqrt((g**2).sum(axis=1))
    err = np.where(np.isfinite(err), err, 0.0)
    scale = np.maximum(ref, np.sqrt((ref**2).mean()))
    with np.errstate(invalid="ignore", divide="ignore"):
        row = np.where(scale > 0, err / scale, 0.0)
    return float(row.max()), err


@pytest.mark.parametrize("free", [True, False])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("chunk", [16, 40, 1 << 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_against_numpy(dtype, chunk, strided, free, monkeypatch) -> None:
    monkeypatch.setitem(deviation_module.SLICE_ELEMENTS, "cpu", chunk)
    monkeypatch.setattr(deviation_module, "FREE_READS", frozenset({"cpu"} if free else ()))
    p, b, g, f = _tensors((2, 3, 9, 8), dtype, seed=1)
    if strided:  # rows of 9 along the last dimension, from transposed views
        p, b, g, f = (t.transpose(-1, -2) for t in (p, b, g, f))
    got = call_statistics(p, b, g, form=f)
    x64 = {
        name: t.double().contiguous().numpy().reshape(-1, g.shape[-1])
        for name, t in zip("pbgf", (p, b, g, f), strict=True)
    }
    worst_p, _ = _rows_oracle(x64["p"], x64["g"])
    worst_b, _ = _rows_oracle(x64["b"], x64["g"])
    worst_f, err_f = _rows_oracle(x64["f"], x64["g"])
    want_rows = [worst_p, worst_b, np.abs(x64["g"]).max()]
    for i, value in enumerate(want_rows):
        assert float(got.rows[i]) == pytest.approx(value, rel=1e-12, abs=1e-300), i
    assert got.noise is not None
    assert float(got.noise[0]) == pytest.approx((err_f**2).sum(), rel=1e-12)
    assert float(got.noise[1]) == pytest.approx(worst_f, rel=1e-12)
    assert torch.allclose(got.sums, pair_sums(p, b, g), rtol=1e-12, atol=0)  # the same sums as alone
    assert got.finite is free  # read where reads are free; never claimed where they are not
    assert torch.equal(got.rows, row_statistics(p, b, g))
    assert torch.equal(got.noise, noise_statistics(f, g))


@pytest.mark.parametrize("free", [True, False])
def test_non_finite_values_are_counted_and_rows_read_zero(free, monkeypatch) -> None:
    monkeypatch.setitem(deviation_module.SLICE_ELEMENTS, "cpu", 40)
    monkeypatch.setattr(deviation_module, "FREE_READS", frozenset({"cpu"} if free else ()))
    p, b, g, f = _tensors((2, 3, 9, 8), torch.float32, seed=2, nonfinite=True)
    got = call_statistics(p, b, g, form=f)
    assert got.finite is False
    assert torch.isfinite(got.sums).all()
    assert got.sums[4].tolist() == [4.0, 3.0, 3.0]  # non-finite positions: p–b, p–g, b–g
    x64 = {name: t.double().numpy().reshape(-1, 8) for name, t in zip("pbgf", (p, b, g, f), strict=True)}
    assert float(got.rows[0]) == pytest.approx(_rows_oracle(x64["p"], x64["g"])[0], rel=1e-12)
    assert float(got.rows[1]) == pytest.approx(_rows_oracle(x64["b"], x64["g"])[0], rel=1e-12)
    assert float(got.rows[2]) == float("inf")  # max|golden| over every position, the -inf included
    assert torch.equal(got.rows, row_statistics(p, b, g))
    assert got.noise is not None and torch.equal(got.noise, noise_statistics(f, g))


@pytest.mark.parametrize("chunk", [16, 1 << 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_skipping_the_mask_changes_no_bit(dtype, chunk, monkeypatch) -> None:
    """On finite data the CPU's unmasked pass equals the always-masked device path bit for bit, and
    the bias told that every value is finite equals the bias that looks for itself."""
    monkeypatch.setitem(deviation_module.SLICE_ELEMENTS, "cpu", chunk)
    for shape in [(2, 1), (2, 3, 13, 8), (2, 2, 130, 64)]:
        p, b, g, f = _tensors(shape, dtype, seed=3)
        monkeypatch.setattr(deviation_module, "FREE_READS", frozenset({"cpu"}))
        read = call_statistics(p, b, g, form=f)
        monkeypatch.setattr(deviation_module, "FREE_READS", frozenset())
        masked = call_statistics(p, b, g, form=f)
        assert read.finite and not masked.finite
        for a, z in zip(read[:3], masked[:3], strict=True):
            assert torch.equal(a, z), shape
        told, looked = BiasStats(sample=BIAS_SAMPLE), BiasStats(sample=BIAS_SAMPLE)
        told.add("out", p, g, b, finite=True)
        looked.add("out", p, g, b)
        assert torch.equal(told.state, looked.state), shape


def test_empty_tensors() -> None:
    empty = torch.empty(0, 4)
    got = call_statistics(empty, empty, empty.double(), form=empty)
    assert got.sums.shape == (7, 3) and (got.sums == 0).all()
    assert got.rows.tolist() == [0.0, 0.0, 0.0]
    assert got.noise is not None and got.noise.tolist() == [0.0, 0.0]


def test_a_workspace_keeps_call_shapes_within_its_bytes_and_results_apart(monkeypatch) -> None:
    """A workspace reused over many call shapes (as a run with varying sequence lengths) keeps the
    tables of the latest within :attr:`StatsWorkspace.KEPT_BYTES` and gives the same statistics as a
    fresh one; a result's row norms are its own (the next call of the same shape does not change
    them)."""
    monkeypatch.setattr(StatsWorkspace, "KEPT_BYTES", 40 << 10)  # the shapes of n = 64 and up evict
    workspace = StatsWorkspace()
    first = None
    for n in [5, 17, 64, 300, 1000, 17, 5]:
        p, b, g, f = _tensors((2, 3, n, 8), torch.float32, seed=n)
        kept = call_statistics(p, b, g, workspace, form=f)
        fresh = call_statistics(p, b, g, StatsWorkspace(), form=f)
        for a, z in zip(kept[:3], fresh[:3], strict=True):
            assert torch.equal(a, z), n
        assert sum(x.nbytes for x in workspace._layouts.values()) <= StatsWorkspace.KEPT_BYTES
        if n == 64:  # the oldest shapes made room
            assert all(key[1] != 2 * 3 * 5 * 8 for key in workspace._layouts)
        if first is None:
            first = (p, b, g, pair_and_row_sums(p, b, g, workspace)[1].clone())
    p, b, g, norms = first
    again = pair_and_row_sums(p, b, g, workspace)[1]
    assert torch.equal(again, norms)
    pair_and_row_sums(p + 1, b, g, workspace)  # same shape, other values
    assert torch.equal(again, norms)
