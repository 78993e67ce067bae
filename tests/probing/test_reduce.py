"""reduce_across_ranks on a real 2-process gloo group: two ranks, each probing its own calls (and
sites the other rank never saw), reduce to what one probe over every call holds — including the
verdict's first failure (the earliest step, with its kind and value, from the rank that saw it) and
the worst call's step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashprobe.kernels import math_attention, register_kernel
from flashprobe.probing import ShadowAttention, reduce_across_ranks

#: (site, seed, ranks that make the call): "shared" is called on both ranks, the others on one. A
#: call's step is ``seed + 3 * rank``; calls of 7 tokens (seeds 1, 2, 5) fail the verdict.
CALLS = (
    ("shared", 0, (0, 1)),
    ("shared", 1, (1,)),  # fails at step 4 on rank 1: the earliest failure of "shared"
    ("shared", 5, (0,)),  # fails at step 5 on rank 0
    ("only0", 2, (0,)),  # fails at step 2
    ("only1", 3, (1,)),
)


def _off_at_seven(q, k, v, *, attn_mask=None, is_causal=False, scale=None):
    """Plain attention, 10 % too large on calls of 7 queries (a length-dependent bug)."""
    out = math_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return out * 1.1 if q.shape[-2] == 7 else out


def _call(shadow: ShadowAttention, site: str, seed: int, step: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 7 if seed % 10 in (1, 2, 5) else 9
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3))
    shadow.name, shadow.step = site, step
    out = shadow(q, k, v, is_causal=seed % 2 == 1)
    out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))


def _probe_calls(rank: int | None) -> ShadowAttention:
    register_kernel("off_at_seven", _off_at_seven, overwrite=True)
    shadow = ShadowAttention(primary="off_at_seven", backward=True, on_failure="ignore")
    for site, seed, ranks in CALLS:
        for r in ranks:
            if rank is None or r == rank:
                _call(shadow, site, seed + 10 * r, step=seed + 3 * r)
    return shadow


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        shadow = _probe_calls(rank)
        reduced = reduce_across_ranks(shadow.stat_tensors(), "cpu")
        if rank == 0:
            Path(out).write_text(json.dumps(shadow.stats(reduced, flat=True)))
    finally:
        dist.destroy_process_group()


def _close(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


@pytest.mark.timeout(300)
def test_two_gloo_ranks_reduce_to_one_probe_over_every_call(tmp_path: Path) -> None:
    out = tmp_path / "reduced.json"
    mp.spawn(_worker, args=(f"file://{tmp_path / 'rendezvous'}", str(out)), nprocs=2, join=True)
    reduced = json.loads(out.read_text())
    single = json.loads(json.dumps(_probe_calls(None).stats(flat=True)))  # every call in one process
    assert sorted(reduced) == ["only0", "only1", "shared"]  # the union of the ranks' sites
    for site, fields in single.items():
        assert reduced[site].keys() == fields.keys()
        differ = {k: (reduced[site][k], v) for k, v in fields.items() if not _close(reduced[site][k], v)}
        assert not differ, (site, differ)
    assert reduced["shared"]["forward.calls"] == 4 and reduced["only1"]["forward.calls"] == 1
    assert reduced["shared"]["forward.out.first_failure.step"] == 4  # rank 1's, earlier than rank 0's 5
    assert reduced["only0"]["forward.out.first_failure.step"] == 2 and reduced["only1"]["verdict"] == "pass"
    assert reduced["shared"]["forward.out.failed_calls"] == 2


def test_without_a_process_group_it_is_the_identity() -> None:
    tensors = _probe_calls(0).stat_tensors()
    assert reduce_across_ranks(tensors, "cpu") == tensors
