"""The feeder actor dies mid-epoch and comes back (``max_restarts``): rows stay exactly once.

* Loaders side by side (no Ray Train): `ray.kill(feeder, no_restart=False)` in the middle of a
  long epoch, while each rank has a chunk in flight; the ranks reconnect, the restarted feeder
  rebuilds the epoch from (epoch, position, seed) and the ranks' next batches, and the epoch
  is every row once, in order, with a bounded buffer after the rebuild.
* (A real `RayTrainer` run whose rank 0 kills the feeder mid-epoch, exact and every row once per
  epoch, with a clean console: folded into the hung-rank run of tests/ray/guards/test_watchdog.py.)
* A rank that needs rows from before what a rebuilt epoch holds gets the error that restarts
  the group from its checkpoint (no Ray needed).
"""

from __future__ import annotations

import os
import sys
from typing import List

import pytest
from ray import cloudpickle as ray_cloudpickle

from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_feeder_index import FakeDataset  # noqa: E402

from tests import resume_helpers as h  # noqa: E402

ray_cloudpickle.register_pickle_by_value(h)
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.mark.ray
@pytest.mark.parametrize("kill_at", [3, 400])
def test_loaders_survive_a_killed_feeder(ray_cluster, kill_at: int) -> None:
    ray = ray_cluster
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    rows, world, global_batch = 15_000, 3, 30  # 500 batches: a kill at 400 rebuilds from batch > 0
    dataset = ray.data.range(rows, override_num_blocks=60)
    # As `TrainDataConfig` makes it: no dataset in the constructor (ray issue 53727); the ranks' loaders
    # pass it by reference to start_epoch, from which the restarted feeder loads it again.
    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(None, world, global_batch)
    source = [ray.put(dataset)]
    loaders = [
        GlobalOrderLoader(
            GlobalOrderShard(feeder, r, world, global_batch, rows, source=source), device="cpu", prefetch_batches=2
        )
        for r in range(world)
    ]
    for loader in loaders:
        loader.set_epoch(0)
    trained: List[int] = []
    batches = 0
    for per_rank in zip(*loaders, strict=True):
        trained += [row for batch in per_rank for row in batch["id"].tolist()]
        batches += 1
        if batches == kill_at:
            ray.kill(feeder, no_restart=False)  # the process dies; Ray restarts the actor
    assert trained == list(range(rows))  # every row once, in order, through the restart
    held = ray.get(feeder.held_blocks.remote())
    assert sum(held.values()) <= 8, held  # the rebuilt epoch did not keep what it passed over


def test_a_rank_behind_a_rebuilt_epoch_is_refused() -> None:
    feeder = EpochFeeder(FakeDataset([10] * 200), 2, 10)
    feeder.start_epoch(0, 0, None, 1, resume_batch=100)  # rank 1 reconnects first, needing batch 100
    assert feeder.batches(0, 0, 1, 100, 1)[0] == [(100, 5, 10)]
    with pytest.raises(RuntimeError, match="restarted and rebuilt this epoch from batch 60.*needs batch 5"):
        feeder.batches(0, 0, 0, 5, 1)
    feeder.epochs[(0, 0)].stop()
