"""flash-attn 2's ``flash_attn_with_kvcache`` (its inference entry point) called inside a model: the call
is a site, the model gets the library's own output and cache (the new keys appended once, in place),
and the shadow compares it forward with the references of the call read before the append (the cache
up to ``cache_seqlens``, then the new keys; bottom-right causal), its LSE too where it returns one. The
library is the CPU stand-in (``_standins``: ``lab.contracts``' correct one, or one with a planted bug)
with flash-attn 2.8's signature."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from flashprobe.probing import ProbeWarning, probe

from ._standins import Bugs, flash_attn_2, install

SEQLENS = torch.tensor([3, 5], dtype=torch.int32)  # keys already cached for the two sequences
TABLE = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)  # paged: (B, max_blocks) of 3-row pages


class Decode(nn.Module):
    """One decoding step of 2 sequences: 2 new tokens each, 4 query and 2 key/value heads of 8."""

    def __init__(self, causal: bool, paged: bool, **extra: object) -> None:
        super().__init__()
        self.causal, self.paged, self.extra = causal, paged, extra

    def forward(self, q, k_new, v_new, k_cache, v_cache):  # type: ignore[no-untyped-def]
        fa = sys.modules["flash_attn"]
        return fa.flash_attn_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=SEQLENS, softmax_scale=0.3,
            causal=self.causal, block_table=TABLE if self.paged else None, **self.extra,
        )  # fmt: skip


def _inputs(paged: bool) -> tuple[torch.Tensor, ...]:
    """``q (2, 2, 4, 8)``, new keys/values ``(2, 2, 2, 8)`` and a cache whose unused rows hold NaN:
    dense ``(3, 9, 2, 8)`` (a spare row), or paged ``(6, 3, 2, 8)``."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 4, 8, generator=gen)
    k_new, v_new = (torch.randn(2, 2, 2, 8, generator=gen) for _ in range(2))
    shape = (6, 3, 2, 8) if paged else (3, 9, 2, 8)
    caches = [torch.full(shape, float("nan")) for _ in range(2)]
    for cache in caches:
        for i, n in enumerate(SEQLENS.tolist()):
            for p in range(n):
                row = (int(TABLE[i, p // 3]), p % 3) if paged else (i, p)
                cache[row] = torch.randn(2, 8, generator=gen)
    return q, k_new, v_new, *caches


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "bottom_right_causal"])
def test_a_kvcache_call_is_a_site_compared_forward(monkeypatch, causal: bool, paged: bool) -> None:
    install(monkeypatch, {"flash_attn": flash_attn_2()})
    plain, probed = _inputs(paged), _inputs(paged)
    want = Decode(causal, paged)(*plain)
    assert torch.isfinite(want).all()  # the library reads only the rows in use
    with probe(Decode(causal, paged)) as p, torch.no_grad():
        got = p.model(*probed)
    assert torch.equal(got, want)
    for a, b in zip(plain[3:], probed[3:], strict=True):  # the new keys appended once, as without it
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    entry = p.stats()["<root>"]
    assert entry["shadow_errors"] == 0
    assert entry["forward"]["calls"] == 1 and entry["verdict"] == "pass", entry["verdict_reason"]
    assert entry["nonfinite_inputs"]["k"] == 0  # unused cache rows are not compared (zeroed)


@pytest.mark.parametrize(
    ("bug", "verdict"),
    [(Bugs(), "pass"), (Bugs(stale_cache=True), "fail"), (Bugs(ignore_scale=True), "fail")],
    ids=["correct", "stale", "scale"],
)
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_a_kvcache_library_with_a_bug_fails(monkeypatch, bug: Bugs, verdict: str, paged: bool) -> None:
    """Attending before the append (the new keys' rows read stale) or ignoring the scale fails; the
    correct library passes on the same inputs."""
    install(monkeypatch, {"flash_attn": flash_attn_2(bug)})
    q, k_new, v_new, k_cache, v_cache = _inputs(paged)
    k_cache, v_cache = k_cache.nan_to_num(0.5), v_cache.nan_to_num(0.5)  # stale rows: finite garbage
    with probe(Decode(True, paged), on_failure="ignore") as p, torch.no_grad():
        p.model(q, k_new, v_new, k_cache, v_cache)
    assert p.stats()["<root>"]["verdict"] == verdict


def test_kvcache_rows_cache_lse_and_unexpressible_arguments(monkeypatch) -> None:
    """``cache_batch_idx`` picks the cache rows; ``return_softmax_lse`` gives the model both outputs;
    rotary embedding inside the kernel is not expressible in SDPA: run unchanged, with one warning."""
    install(monkeypatch, {"flash_attn": flash_attn_2()})
    rows = torch.tensor([2, 0], dtype=torch.int32)
    q, k_new, v_new, k_cache, v_cache = _inputs(paged=False)
    k_cache, v_cache = k_cache[[1, 2, 0]].clone(), v_cache[[1, 2, 0]].clone()  # sequence i in row rows[i]
    model = Decode(False, False, cache_batch_idx=rows, return_softmax_lse=True)
    want = model(q, k_new, v_new, k_cache.clone(), v_cache.clone())
    with probe(model) as p, torch.no_grad():
        got = p.model(q, k_new, v_new, k_cache.clone(), v_cache.clone())
    assert isinstance(got, tuple) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    entry = p.stats()["<root>"]
    assert entry["forward"]["calls"] == 1 and entry["verdict"] == "pass", entry["verdict_reason"]
    rotary = Decode(False, False, rotary_cos=torch.ones(9, 4), rotary_sin=torch.zeros(9, 4))
    with (
        pytest.warns(ProbeWarning, match="rotary_cos, rotary_sin"),
        pytest.raises(
            RuntimeError, match="no rotary embedding"
        ),  # the stand-in's own refusal: it got the call
        probe(rotary) as p,
        torch.no_grad(),
    ):
        p.model(*_inputs(paged=False))
    assert p.stats() == {} or p.stats()["<root>"]["forward"]["calls"] == 0
