"""The training order and noise as functions of (seed, batch index)."""

from __future__ import annotations

import pytest
import torch

from flashprobe.t2i.steps import StepLoader, StepSampler, batch_generator, derived_seed


def _batches(sampler: StepSampler) -> list[list[int]]:
    flat = list(sampler)
    return [flat[i : i + sampler.batch_size] for i in range(0, len(flat), sampler.batch_size)]


def test_an_epoch_is_a_permutation_cut_into_full_batches():
    sampler = StepSampler(23, 4, seed=7)
    batches = _batches(sampler)
    assert len(sampler) == 20 and len(batches) == 5
    seen = [i for b in batches for i in b]
    assert len(set(seen)) == 20 and set(seen) <= set(range(23))
    assert seen == sampler.permutation(0)[:20].tolist()


def test_iteration_starts_at_the_batch_the_run_is_at():
    position = {"next": 0}
    sampler = StepSampler(40, 4, seed=1, next_batch=lambda: position["next"])
    (epoch0,) = (_batches(sampler),)
    position["next"] = 7  # resumed at batch 7 of epoch 0: the remaining 3 batches
    assert _batches(sampler) == epoch0[7:]
    position["next"] = 10  # the start of epoch 1: a new permutation
    epoch1 = _batches(sampler)
    assert epoch1 != epoch0 and sorted(i for b in epoch1 for i in b) == sorted(i for b in epoch0 for i in b)
    position["next"] = 13
    assert _batches(sampler) == epoch1[3:]


def test_ranks_split_each_global_batch():
    ranks = [_batches(StepSampler(32, 2, seed=3, rank=r, world_size=2)) for r in (0, 1)]
    single = _batches(StepSampler(32, 4, seed=3))  # one rank with the global batch size
    assert [a + b for a, b in zip(*ranks, strict=True)] == single


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="do not fill one batch"):
        StepSampler(3, 4, seed=0)
    with pytest.raises(ValueError, match="rank=2 must lie in"):
        StepSampler(8, 2, seed=0, rank=2, world_size=2)


def test_batch_generators_differ_by_seed_batch_and_rank_and_repeat():
    draw = [batch_generator(*args).initial_seed() for args in [(0, 5), (0, 5), (1, 5), (0, 6), (0, 5, 1)]]
    assert draw[0] == draw[1] and len(set(draw)) == 4
    assert derived_seed(1, 2) != derived_seed(2, 1) and 0 <= derived_seed(9) < 2**63


def test_the_loader_refuses_a_resume_with_another_order():
    loader = StepLoader(torch.arange(32), batch_size=4, sampler=StepSampler(32, 4, seed=0), drop_last=True)
    state = loader.state_dict()
    loader.load_state_dict(state)  # the same order: accepted
    with pytest.raises(ValueError, match=r"another data order \(batch_size 8 → 4\)"):
        loader.load_state_dict({**state, "batch_size": 8})
