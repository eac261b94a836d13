"""The row-level shuffle (`shuffle.py`): rows permuted within windows of blocks, by (seed, epoch).

In-process over fake blocks: every row once per epoch; the same global batches at any world size;
a resume at any position continues the same order; another epoch or seed is another order; rows
really move across block boundaries. On local Ray: `GlobalOrderLoader`s at 2 and 3 workers and a
resumed pass train the same shuffled rows in the same global batches.
"""

from __future__ import annotations

import os
import sys
from typing import List

import numpy as np
import pytest

from raytrain_events.data.order import TrainOrder
from raytrain_events.data.ray.feeder import EpochFeeder, batches_in_epoch
from raytrain_events.data.ray.shuffle import window_permutation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_feeder_index import FakeDataset, _rows  # noqa: E402

SIZES = [(i * 5) % 17 + 3 for i in range(120)]  # blocks of 3-19 rows
TOTAL = sum(SIZES)


def _order(world: int, epoch: int = 0, position: int = 0, seed: int = 7, window: int = 50, gb: int = 24):
    """Global batches (row ids, ranks' parts concatenated) of one shuffled epoch, served in-process."""
    feeder = EpochFeeder(FakeDataset(SIZES), world, gb)
    feeder.start_epoch(epoch, position, TrainOrder(seed, window), 0)
    batches: List[List[int]] = []
    k = 0
    while True:
        parts = [feeder.batches(epoch, position, r, k, 1)[0] for r in range(world)]
        if parts[0] is None:
            break
        batches.append([row for part in parts for row in _rows(part, SIZES)])
        k += 1
    feeder.epochs[(epoch, position)].stop()
    return batches


def test_shuffled_epoch_is_every_row_once_and_the_same_at_any_world_size() -> None:
    two, three, five = _order(2), _order(3), _order(5)
    flat = [row for batch in two for row in batch]
    assert sorted(flat) == list(range(TOTAL)) and flat != list(range(TOTAL))
    assert two == three == five  # the same global batches, rows in the same order
    assert len(two) == batches_in_epoch(TOTAL, 24, 2)


def test_a_resume_continues_the_same_shuffled_order() -> None:
    full = [row for batch in _order(2) for row in batch]
    for position in (24 * 7, 24 * 31):  # a batch boundary inside a window, and later
        rest = [row for batch in _order(3, position=position) for row in batch]
        assert rest == full[position:]


def test_epochs_and_seeds_give_other_orders_and_rows_leave_their_blocks() -> None:
    e0, e1, other = _order(2, epoch=0), _order(2, epoch=1), _order(2, seed=8)
    assert e0 != e1 and e0 != other
    flat = np.array([row for batch in e0 for row in batch])
    assert np.mean(np.abs(np.diff(flat))) > 10  # consecutive trained rows are far apart in the source
    assert np.array_equal(window_permutation(7, 0, 3, 40), window_permutation(7, 0, 3, 40))


@pytest.mark.ray
def test_loaders_train_the_same_shuffled_batches_on_2_and_3_workers_and_after_a_resume(ray_cluster) -> None:
    ray = ray_cluster
    from raytrain_events.data.order import TrainOrder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    rows, global_batch = 1_200, 24
    dataset = ray.data.range(rows, override_num_blocks=12)

    def epoch(world: int, position: int = 0) -> List[List[int]]:
        feeder = ray.remote(EpochFeeder).options(num_cpus=0).remote(dataset, world, global_batch)
        loaders = [
            GlobalOrderLoader(
                GlobalOrderShard(feeder, r, world, global_batch, rows, order=TrainOrder(3, 300)), device="cpu"
            )
            for r in range(world)
        ]
        for loader in loaders:
            loader.set_epoch(1)
            loader.set_position(position)
        return [[row for batch in per_rank for row in batch["id"].tolist()] for per_rank in zip(*loaders, strict=True)]

    two, three = epoch(2), epoch(3)
    assert two == three
    flat = [row for batch in two for row in batch]
    assert sorted(flat) == list(range(rows)) and flat != list(range(rows))
    resumed = [row for batch in epoch(3, position=480) for row in batch]
    assert resumed == flat[480:]
