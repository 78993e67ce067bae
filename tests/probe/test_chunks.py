"""Chunk planning: every score covered once, within the budget, with the right mask per block."""

from __future__ import annotations

import pytest
import torch

from flashprobe.kernels import causal_mask
from flashprobe.probe.call import SdpaCall, prepare
from flashprobe.probe.chunks import chunk_mask, plan_chunks


def _prepared(b=3, h=4, h_kv=2, n_q=13, n_k=11, causal=False, mask=None):
    q = torch.zeros(b, h, n_q, 8)
    k, v = torch.zeros(b, h_kv, n_k, 8), torch.zeros(b, h_kv, n_k, 8)
    return prepare(SdpaCall(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=h_kv != h))


@pytest.mark.parametrize("budget", [10**9, 2 * 2 * 13 * 11 + 5, 2 * 13 * 11, 2 * 11 * 3, 1])
def test_plan_covers_every_score_once_within_budget(budget) -> None:
    p = _prepared()
    covered = torch.zeros(3, 4, 13, dtype=torch.int64)  # (B, H, N_q): one count per score row
    for c in plan_chunks(p, budget):
        for rs in c.rows:
            rows = c.take(covered, p.rep, rs)
            rows += 1  # a view: counts land in `covered`
            assert rows.numel() * 11 <= max(budget, p.rep * 11)  # a single row may exceed it
    assert torch.equal(covered, torch.ones_like(covered))


def test_chunk_mask_slices_masks_and_makes_causal_explicit_per_row_block() -> None:
    mask = torch.rand(3, 4, 13, 11) > 0.5
    p = _prepared(mask=mask)
    c = plan_chunks(p, 2 * 11 * 3)[1]  # batch 0, key/value head 1, rows in blocks of 3
    rs = c.rows[2]
    got, causal = chunk_mask(p, c, rs)
    assert not causal and torch.equal(got, mask[0:1, 2:4, rs])
    assert chunk_mask(p, c._replace(rows=[None]), None)[0].shape == (1, 2, 13, 11)

    p = _prepared(causal=True)
    assert chunk_mask(p, c, None) == (None, True)
    got, causal = chunk_mask(p, c, rs)
    assert not causal and torch.equal(got, causal_mask(13, 11, "cpu")[rs])
