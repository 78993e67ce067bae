"""``flashprobe.bench.inputs``: the documented recipe of the benchmark inputs."""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.bench.errors import BenchArgumentError
from flashprobe.bench.inputs import InputConfig, Shape, cast_inputs, make_inputs


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """The documented recipe of ``make_inputs`` for ``normal``: q, k, v from one generator."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))


def test_make_inputs_follows_its_documented_recipe() -> None:
    shape = Shape(batch=1, heads=2, seq_len=50, head_dim=8)
    q, k, v = make_inputs(shape, 7, InputConfig(scale=2.0))
    for got, want in zip((q, k, v), _inputs(shape.dims, 7), strict=True):
        assert got.dtype == torch.float64 and torch.equal(got, want * 2.0)
    u = torch.cat(make_inputs(shape, 7, InputConfig(distribution="uniform")))
    assert u.abs().max() <= math.sqrt(3) and u.min() < -1.5 and u.max() > 1.5
    big = Shape(batch=1, heads=1, seq_len=1000, head_dim=100)
    o = make_inputs(big, 0, InputConfig(distribution="outliers", outlier_frac=0.01, outlier_scale=1e3))[0]
    frac = (o.abs() > 10).double().mean().item()  # normal entries never exceed 10; outliers mostly do
    assert 0.007 < frac < 0.0115


def test_cast_inputs_keeps_values_and_shapes() -> None:
    shape = Shape(batch=1, heads=1, seq_len=4, head_dim=2)
    drawn = make_inputs(shape, 0)
    cast = cast_inputs(drawn, torch.bfloat16)
    for got, want in zip(cast, drawn, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == (1, 1, 4, 2)
        assert torch.equal(got, want.to(torch.bfloat16))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Shape(batch=1, heads=0, seq_len=4, head_dim=2),
            r"heads must be a positive integer \(--heads\)",
        ),
        (lambda: InputConfig(distribution="cauchy"), "unknown input distribution 'cauchy'"),
        (lambda: InputConfig(scale=0.0), "input scale must be a finite positive number"),
        (lambda: InputConfig(outlier_frac=2.0), r"outlier fraction must lie in \[0, 1\]"),
    ],
)
def test_bad_configs_name_the_problem(make, message: str) -> None:
    with pytest.raises(BenchArgumentError, match=message):
        make()
