"""The verdict in 16-bit training: every planted bug of the mutation suite that the loop's shapes
exercise fails at the site, direction and step it first fires, with the criterion named, and its
reproducer replays to a failure; correct kernels pass. fp16 and bf16, three sites:

* ``self``: causal self-attention, 2 heads of 32;
* ``cross``: cross-attention to 77 context keys, key-padded (a partial last key tile of 16 and 32);
* ``wide``: non-causal self-attention, one head of dim 256.

Shapes change at known steps (:data:`SCHEDULE`) so each bug first fires at a known step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flashprobe.judge import FAILURES
from flashprobe.probing import probe
from flashprobe.probing.repro import load_reproducer, replay
from lab.mutants import register_mutants

#: ``(batch, query tokens)`` per step.
SCHEDULE: tuple[tuple[int, int], ...] = (
    (1, 32),  # 0: one entry, rows a multiple of 16, at most 32 keys in the self sites
    (2, 32),  # 1: a second batch entry
    (2, 40),  # 2: a partial last row tile (40 % 16 = 8); 40 > 32 keys in the self sites
)
CONTEXT, WIDTH = 77, 64
SITES = ("self", "cross", "wide")
#: bug -> {site: (direction, step)} of its first failures (no other site fails).
EXPECTED: dict[str, dict[str, tuple[str, int]]] = {
    "delta_dropped": {s: ("dq", 0) for s in SITES},
    "kv_tile_zeroed": {"cross": ("dk", 0), "self": ("dk", 2), "wide": ("dk", 2)},
    "tail_rows_stale": {s: ("out", 2) for s in SITES},
    "one_head_wrong": {"self": ("out", 0), "cross": ("out", 0)},  # wide has one head
    "one_batch_wrong": {s: ("out", 1) for s in SITES},
}
DTYPES = (torch.float16, torch.bfloat16)


class ThreeSites(nn.Module):
    """Causal self-attention, key-padded cross-attention and a head-dim-256 self-attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.cross_q = nn.Linear(WIDTH, WIDTH)
        self.cross_kv = nn.Linear(WIDTH, 2 * WIDTH)
        self.wide = nn.Linear(WIDTH, 3 * 256)
        self.out = nn.Linear(WIDTH + 256, WIDTH)
        self.self_attn, self.cross_attn, self.wide_attn = _Site(), _Site(), _Site()

    def forward(self, x: torch.Tensor, context: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 2, 32).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        h = self.self_attn(q, k, v, is_causal=True)
        q = self.cross_q(h.transpose(1, 2).reshape(b, n, WIDTH) + x).view(b, n, 2, 32).transpose(1, 2)
        k, v = (t.view(b, CONTEXT, 2, 32).transpose(1, 2) for t in self.cross_kv(context).chunk(2, dim=-1))
        h = self.cross_attn(q, k, v, attn_mask=keep)  # (B, 2, N, 32)
        h = h.transpose(1, 2).reshape(b, n, WIDTH)
        q, k, v = (
            t.view(b, n, 1, 256).transpose(1, 2) for t in self.wide(h + x).chunk(3, dim=-1)
        )  # tokens differ
        w = self.wide_attn(q, k, v)
        w = w.transpose(1, 2).reshape(b, n, 256)
        return self.out(torch.cat((h, w), dim=-1))


class _Site(nn.Module):
    def forward(self, q, k, v, **kwargs):  # type: ignore[no-untyped-def]
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def train(primary: str | None, dtype: torch.dtype, **probe_args):
    """The scheduled loop in ``dtype`` under ``probe(model, primary, backward=True)``."""
    torch.manual_seed(0)
    model = ThreeSites().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(1)
    p = probe(model, primary=primary, backward=True, **probe_args)
    try:
        for step, (b, n) in enumerate(SCHEDULE):
            p.set_step(step)
            x = torch.randn(b, n, WIDTH, generator=gen).to(dtype)
            context = torch.randn(b, CONTEXT, WIDTH, generator=gen).to(dtype)
            valid = torch.arange(CONTEXT) < CONTEXT - 9 * torch.arange(b).unsqueeze(-1)  # (B, N_k)
            opt.zero_grad()
            out = model(x, context, valid[:, None, None, :])
            (out.float().square().sum() * 64).backward()  # scaled as fp16 training scales its loss
            opt.step()
    finally:
        p.detach()
    return p


def _site(name: str) -> str:
    return f"{name}_attn"


@pytest.fixture
def bugs() -> None:
    register_mutants()  # unregistered after the test by the autouse fixture of tests/conftest.py


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_a_planted_bug_fails_where_and_when_it_fires(
    bug: str, dtype: torch.dtype, bugs, tmp_path: Path
) -> None:
    p = train(f"bug_{bug}", dtype, repro_dir=tmp_path, on_failure="ignore")
    assert p.summary().verdict == "fail"
    expected = {_site(s): v for s, v in EXPECTED[bug].items()}
    first: dict[str, int] = {}
    for f in p.failures:
        first[f.site] = min(first.get(f.site, f.step), f.step)
        assert f.kind in FAILURES, f
    assert first == {site: step for site, (_, step) in expected.items()}, p.failures
    for site, (direction, step) in expected.items():
        failure = next(f for f in p.failures if (f.site, f.direction) == (site, direction))
        assert failure.step == step and failure.reason, failure
    site, (direction, _) = next(iter(expected.items()))
    failure = next(f for f in p.failures if (f.site, f.direction) == (site, direction))
    call = load_reproducer(failure.repro)
    results = replay(call, [f"bug_{bug}", "sdpa_math", "ok_flash_backward"])
    assert results[f"bug_{bug}"]["verdict"] == "fail", results
    assert results["sdpa_math"]["verdict"] == "pass", results
    assert results["ok_flash_backward"]["verdict"] == "pass", results


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("primary", [None, "tiled", "ok_flash_backward", "ok_exp2_folded", "ok_split_k_lse"])
def test_correct_kernels_pass_the_16_bit_loop(primary: str | None, dtype: torch.dtype, bugs) -> None:
    p = train(primary, dtype, on_failure="raise")
    summary = p.summary()
    assert summary.verdict == "pass", summary.verdict_reason
    assert 0 < summary.limit_ratio <= 1
