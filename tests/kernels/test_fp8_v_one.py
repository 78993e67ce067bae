"""The FP8 P-cast fixture on ``tiled:preset=fa3_fp8``: V = 1, so every correct kernel outputs 1.

A P cast to E4M3 without the 2^8 prescale loses the probabilities below E4M3's smallest value
from the numerator only (flashinfer PR 5020: the row sum keeps them); FlashAttention-4's lazy
rescale at threshold 4 with the 2^8 offset lets ``P·2^8`` reach ``2^12`` and saturate at 448
(flash-attention issue 2716). The rows (one query each, ``scale = 1``; logits given as offsets
from the smallest, which softmax cannot tell apart from the issue's ``0`` and ``−7``):

* ``peaked``: 1024 keys, the last one 7 above the others (one logit 0, the rest −7); the last key
  sits in the key tile FA3's reverse order visits first;
* ``sink``: 512 keys, key 0 7 above the others (an attention sink, visited last);
* ``diffuse``: 300 equal logits (every ``P = 1``: exact in any format);
* ``rising``: 256 keys, key 200 at 7 and key 0 at 9 above the others: the tile visited last raises
  the row max by 2 (2.885 bits, ≤ 4: the lazy kernel keeps the stale max).

Inputs are exact through the preset's Hadamard rotation and block quantization: ``q = e₀``,
``k_j = c_j·e₀``, so every rotated entry of a row is ``±c_j/8`` and each K block holds only 0 and
its amax, which quantize to 0 and ±448. Oracle: the output by hand, with ``E = e^-7``; the E4M3
roundings by hand (in ``[2^e, 2^(e+1))`` the step is ``2^(e-3)``, below ``2^-10`` a value rounds
to 0, above 448 it saturates): ``256·E = 0.2334 → 0.234375 = 15/64``; ``256·e^-9 = 0.0316 →
1/32``; ``256·e^2 = 1891.6 → 448``; ``e^2 = 7.389 → 7.5``; without the prescale ``E`` and
``e^-9`` round to 0. E5M2 (``[2^e, 2^(e+1))`` step ``2^(e-2)``): ``256·E → 7/32``, ``1891.6 → 1792``.

A row passes when ``|out − 1| ≤ u`` with u the format's unit roundoff (E4M3 ``2^-4``, E5M2
``2^-3``): with V = 1, ``out = Σ P̃ / Σ P`` and a P cast that only rounds keeps every ``P̃``
within ``(1 ± u)·P``; with the prescale every ``P·256`` here is in the normal range.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashprobe.kernels import get_kernel
from flashprobe.kernels.fp8 import Fp8Numerics, cast_p

E = math.exp(-7.0)
D = 64
ROWS = {  # name: (number of keys, {key: logit above the others})
    "peaked": (1024, {1023: 7.0}),
    "sink": (512, {0: 7.0}),
    "diffuse": (300, {}),
    "rising": (256, {200: 7.0, 0: 9.0}),
}

FA3 = "tiled:preset=fa3_fp8"
NO_PRESCALE = "tiled:preset=fa3_fp8,p_scale=1"
LAZY = "tiled:preset=fa3_fp8,rescale_threshold=4"
LAZY_BOUNDED = "tiled:preset=fa3_fp8,rescale_threshold=0.75"  # 2^(8+0.75) = 430 < 448
LAZY_E5M2 = "tiled:preset=fa3_fp8,qkv_fp8=e5m2,p_fp8=e5m2,rescale_threshold=4"

C7 = 15 / 64 / 256  # cast(256·E) / 256
EXPECTED = {  # spec: {row: out by hand}
    FA3: {
        "peaked": (1 + 1023 * C7) / (1 + 1023 * E),
        # tiles 3..1 (384 keys at 0) first: P = 1; then the sink's tile: α = E, its 127 others P = E
        "sink": (1 + 384 * E + 127 * C7) / (1 + 511 * E),
        "diffuse": 1.0,
        # tile 1: key 200 sets m, 127 keys at E; tile 0: m = 9, α = e^-2, 127 keys at e^-9 → 1/32
        "rising": (math.exp(-2) * (1 + 127 * C7) + 1 + 127 / 32 / 256)
        / (math.exp(-2) * (1 + 127 * E) + 1 + 127 * math.exp(-9)),
    },
    NO_PRESCALE: {
        "peaked": 1 / (1 + 1023 * E),  # every key at E is lost from the numerator
        "sink": (1 + 384 * E) / (1 + 511 * E),  # the sink tile's 127 keys are lost
        "diffuse": 1.0,
        "rising": (math.exp(-2) + 1) / (math.exp(-2) * (1 + 127 * E) + 1 + 127 * math.exp(-9)),
    },
    LAZY: {
        "peaked": (1 + 1023 * C7) / (1 + 1023 * E),  # the max is in the first tile: nothing lags
        "sink": (1 + 384 * E + 127 * C7) / (1 + 511 * E),  # a rise of 7 (10.1 bits) updates the max
        "diffuse": 1.0,
        # tile 0 keeps m = 7: key 0's P = e^2, ×256 = 1891.6 saturates at 448 (P̃ = 1.75)
        "rising": (1 + 254 * C7 + 448 / 256) / (1 + 254 * E + math.exp(2)),
    },
    LAZY_E5M2: {  # 57344 absorbs 2^(8+2.885): key 0's P̃ = 1792/256 = 7
        "rising": (1 + 254 * 7 / 32 / 256 + 7) / (1 + 254 * E + math.exp(2)),
    },
}
UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


def v_one_row(name: str, dtype: torch.dtype = torch.float32):
    """``q (1, 1, 1, D)``, ``k``, ``v = 1`` ``(1, 1, N, D)`` of one fixture row (``scale=1``)."""
    n, peaks = ROWS[name]
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, D)
    for key, logit in peaks.items():
        k[0, 0, key, 0] = logit
    return q.to(dtype), k.to(dtype), torch.ones(1, 1, n, D, dtype=dtype)


def run(spec: str, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return get_kernel(spec)(*v_one_row(name, dtype), scale=1.0)


def fails(spec: str, name: str) -> bool:
    """Whether the row's output is off 1 by more than the P format's unit roundoff."""
    fmt = "e5m2" if "p_fp8=e5m2" in spec else "e4m3"
    return bool(((run(spec, name).double() - 1).abs() > UNIT_ROUNDOFF[fmt]).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("spec", "name"), [(s, r) for s, rows in EXPECTED.items() for r in rows])
def test_fixture_rows_match_the_output_by_hand(spec, name, dtype):
    out = run(spec, name, dtype)
    assert out.dtype == dtype and torch.isfinite(out).all()
    rel = 1e-5 if dtype == torch.float32 else 2.0**-8  # bf16: the output's own rounding
    assert out.double().flatten().tolist() == pytest.approx([EXPECTED[spec][name]] * D, rel=rel)


def test_fa3_fp8_with_the_prescale_passes_every_row():
    assert not any(fails(FA3, name) for name in ROWS)


def test_fa3_fp8_without_the_prescale_fails_the_peaked_and_sink_rows():
    """S = 1: ``E = e^-7 = 9.1e-4`` is below half of E4M3's smallest value (``2^-9``), so it rounds
    to 0 in the numerator while the fp32 row sum keeps it: the peaked row loses the fraction
    ``1023·E / (1 + 1023·E)`` = 48 % of its mass."""
    assert [name for name in ROWS if fails(NO_PRESCALE, name)] == ["peaked", "sink"]
    lost = 1 - run(NO_PRESCALE, "peaked").double().mean().item()
    assert lost == pytest.approx(1023 * E / (1 + 1023 * E), rel=1e-5)
    assert 0.48 < lost < 0.49


def test_fa4_lazy_rescale_at_4_with_the_offset_fails_the_rising_row_by_saturation():
    """Threshold 4 with ``p_scale=256``: the stale max makes key 0's ``P·256 = 256·e^2 = 1891.6``,
    past E4M3's 448; the cast saturates and the dominant key keeps ``1.75 / e^2`` = 24 % of its
    weight in the numerator. The rows whose max is found in the first tile, or rises by more than
    4 bits, pass; the bounded threshold 0.75 (``2^8.75 = 430 < 448``) and E5M2 pass the rising row."""
    assert [name for name in ROWS if fails(LAZY, name)] == ["rising"]
    saturated = cast_p(torch.tensor([math.exp(2)]), Fp8Numerics(p="e4m3", p_scale=256.0))
    assert saturated.item() == 448 / 256
    assert run(LAZY, "rising").mean().item() < 0.35  # 0.346 by hand
    assert not fails(LAZY_BOUNDED, "rising") and not fails(LAZY_E5M2, "rising")
    assert not fails(FA3, "rising")
