"""The feeder under tensor parallelism, without Ray: the ``t`` ranks of a tensor group are consumers
of one part of each global batch (`EpochFeeder(consumers=t)`).

What is checked: each rank of a group gets exactly its group's part (the data-parallel split by
``rank // t`` of ``world_size / t``), so every row is trained once per group and both ranks see the
same rows whatever order and chunk sizes they call in; a block stays until every consumer is past
it (a group's slow rank still gets its rows after its partner ran ahead); a restarted feeder rebuilt
by one rank of a group serves the other the same rows; and world sizes that cannot form whole
tensor groups are refused with the fix (the worker-start check, RayTrainer's check).
"""

from __future__ import annotations

import os
import random
import sys
from typing import List

import pytest

from raytrain_events.data.ray.feeder import EpochFeeder, batches_in_epoch, rank_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_feeder_index import FakeDataset, _rows  # noqa: E402


def _serve(feeder: EpochFeeder, ranks: int, seed: int) -> List[List[List[int]]]:
    """Every rank's rows per batch, ranks calling in a random order with random chunk sizes."""
    rng = random.Random(seed)
    sizes = feeder.dataset.sizes
    for rank in rng.sample(range(ranks), ranks):
        feeder.start_epoch(0, 0, None, rank)
    rows: List[List[List[int]]] = [[] for _ in range(ranks)]
    nxt, finished = [0] * ranks, [False] * ranks
    while not all(finished):
        rank = rng.choice([r for r in range(ranks) if not finished[r]])
        chunk = rng.randint(1, 6)
        served = feeder.batches(0, 0, rank, nxt[rank], chunk)
        nxt[rank] += chunk
        for slices in served:
            if slices is None:
                finished[rank] = True
                break
            rows[rank].append(_rows(slices, sizes))
    feeder.epochs[(0, 0)].stop()
    return rows


@pytest.mark.parametrize("parts,t,seed", [(2, 2, 0), (3, 2, 1), (1, 4, 2), (2, 3, 3)])
def test_each_tensor_group_gets_its_part_and_every_row_once(parts: int, t: int, seed: int) -> None:
    sizes = [(i * 5) % 17 + 1 for i in range(120)]  # blocks of 1-17 rows
    total, global_batch = sum(sizes), 30
    feeder = EpochFeeder(FakeDataset(sizes), parts, global_batch, consumers=t)
    rows = _serve(feeder, parts * t, seed)
    batches = batches_in_epoch(total, global_batch, parts)
    for group in range(parts):
        ranks = range(group * t, group * t + t)
        assert all(rows[r] == rows[group * t] for r in ranks), f"group {group}'s ranks got different rows"
        assert len(rows[group * t]) == batches
    flat = [row for k in range(batches) for group in range(parts) for row in rows[group * t][k]]
    assert flat == list(range(total))  # counted once per group: every row once, in order
    for k in range(batches - 1):
        start = k * global_batch
        for rank in range(parts * t):
            a, b = rank_rows(start, start + global_batch, rank // t, parts)
            assert (rows[rank][k][0], rows[rank][k][-1] + 1) == (a, b)


def test_a_block_stays_until_every_rank_of_the_group_is_past_it() -> None:
    sizes = [10] * 100
    feeder = EpochFeeder(FakeDataset(sizes), 1, 10, consumers=2)
    feeder.start_epoch(0, 0, None, 0)
    ahead = feeder.batches(0, 0, 0, 0, 40)  # rank 0 runs 40 batches ahead of its partner
    assert len(feeder.epochs[(0, 0)].index) >= 40  # nothing its partner still needs was dropped
    behind = feeder.batches(0, 0, 1, 0, 40)  # one cursor per part would have trimmed these: LookupError
    assert behind == ahead
    assert feeder.held_blocks()["0@0"] <= 4  # now both are past them: trimmed
    feeder.epochs[(0, 0)].stop()


def test_both_ranks_restart_a_rebuilt_epoch_at_the_same_rows() -> None:
    feeder = EpochFeeder(FakeDataset([10] * 200), 2, 20, consumers=2)
    feeder.start_epoch(0, 0, None, 3, resume_batch=50)  # rank 3 (part 1) reconnects first
    assert feeder.batches(0, 0, 3, 50, 1)[0] == [(101, 0, 10)]  # rows 1010-1019: block 101
    feeder.start_epoch(0, 0, None, 2, resume_batch=50)  # its partner: the same epoch, the same rows
    assert feeder.batches(0, 0, 2, 50, 1)[0] == [(101, 0, 10)]
    assert feeder.batches(0, 0, 0, 50, 1)[0] == [(100, 0, 10)]  # part 0: rows 1000-1009
    with pytest.raises(
        RuntimeError, match="restarted and rebuilt this epoch from batch 10.*rank 1 still needs batch 2"
    ):
        feeder.batches(0, 0, 1, 2, 1)
    feeder.epochs[(0, 0)].stop()


def test_a_rank_starting_its_pass_again_is_refused_but_its_partner_is_not() -> None:
    feeder = EpochFeeder(FakeDataset([10] * 20), 1, 10, consumers=2)
    feeder.start_epoch(0, 0, None, 0)
    feeder.batches(0, 0, 0, 0, 3)
    feeder.start_epoch(0, 0, None, 1)  # the partner's first start: allowed, though rank 0 is past batch 0
    with pytest.raises(RuntimeError, match="Rank 0 started epoch 0 at sample 0 .* a second time"):
        feeder.start_epoch(0, 0, None, 0)
    feeder.epochs[(0, 0)].stop()


def test_bad_consumers_and_indivisible_groups_are_refused() -> None:
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard
    from raytrain_events.parallel.world import check_tensor_parallel_world

    with pytest.raises(ValueError, match="consumers=0 must be an integer >= 1"):
        EpochFeeder(FakeDataset([10]), 1, 10, consumers=0)
    check_tensor_parallel_world(4, 2)
    check_tensor_parallel_world(3, 1)
    with pytest.raises(
        ValueError, match=r"tensor_parallel=2\) needs a world size divisible by 2, got 3 ranks.*Fix: a fixed"
    ):
        check_tensor_parallel_world(3, 2)
    # The length the loop counts epochs by: the feeder's cut of the global batch into world_size // t parts.
    shard = GlobalOrderShard(None, 0, 4, global_batch=10, num_rows=23, tensor_parallel=2)
    assert shard.data_world_size == 2
    assert len(GlobalOrderLoader(shard)) == batches_in_epoch(23, 10, 2) == 3  # 4 parts: 2 (the tail of 3 joins)


def test_ray_trainer_refuses_workers_that_tensor_groups_cannot_divide() -> None:
    from raytrain_events import RayTrainer
    from raytrain_events.parallel import FSDPConfig

    options = dict(model=lambda: None, optimizers=lambda m: None, datasets={"train": object()}, max_duration="1ep")
    tp = FSDPConfig(tensor_parallel=2)
    assert RayTrainer(**options, num_workers=4, parallelism=tp).spec.tensor_parallel == 2
    assert RayTrainer(**options, num_workers=3).spec.tensor_parallel == 1
    for bad in (dict(num_workers=3), dict(scaling_config={"num_workers": 3}), {}):  # {}: one worker by default
        with pytest.raises(ValueError, match="tensor_parallel=2\\) needs a world size divisible by 2, got [13] ranks"):
            RayTrainer(**options, parallelism=tp, **bad)
    RayTrainer(**options, num_workers=(3, 4), parallelism=tp)  # elastic: checked at each worker start
