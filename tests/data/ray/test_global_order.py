"""The train set's global order: how batches are cut, and the loader that fetches them in chunks.

`rank_rows` / `batches_in_epoch` are pure arithmetic (property tests). The loader test runs a real
`EpochFeeder` actor on the shared local Ray instance, without Ray Train: every rank's
`GlobalOrderLoader` over one epoch, iterated side by side as the ranks of a group would.
"""

from __future__ import annotations

from typing import List

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raytrain_events.data.order import TrainOrder
from raytrain_events.data.ray.feeder import EpochFeeder, batches_in_epoch, rank_rows


@given(start=st.integers(0, 10_000), size=st.integers(1, 5_000), world=st.integers(1, 64))
def test_rank_parts_tile_the_global_batch(start: int, size: int, world: int) -> None:
    parts = [rank_rows(start, start + size, r, world) for r in range(world)]
    assert parts[0][0] == start and parts[-1][1] == start + size
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, in rank order
    lengths = [b - a for a, b in parts]
    assert max(lengths) - min(lengths) <= 1


@given(rows=st.integers(1, 5_000), batch=st.integers(1, 512), world=st.integers(1, 16), position=st.integers(0, 5_000))
def test_batches_in_epoch_counts_the_cut(rows: int, batch: int, world: int, position: int) -> None:
    batch = max(batch, world)  # a global batch holds at least one row per rank
    # The cut as `_Epoch.batch_range` makes it: batch k starts at position + k * batch; a tail shorter
    # than the world (after a first batch) is no batch of its own (it joined the batch before).
    expected = 0
    while True:
        left = rows - (position + expected * batch)
        if left <= 0 or (expected > 0 and left < world):
            break
        expected += 1
    assert batches_in_epoch(rows, batch, world, position) == expected


def _counting_feeder():
    """The real feeder, counting its `batches` calls (each one an actor round trip for a worker).

    Defined in a function so that Ray pickles the class by value (workers cannot import this test module).
    """

    class CountingFeeder(EpochFeeder):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.calls = 0

        def batches(self, *args, **kwargs):
            self.calls += 1
            return super().batches(*args, **kwargs)

        def call_count(self) -> int:
            return self.calls

    return CountingFeeder


def _epoch_rows(loaders, epoch: int, position: int = 0) -> List[List[List[int]]]:
    """Each global batch of the epoch as the ranks' row ids, iterating the ranks side by side."""
    for loader in loaders:
        loader.set_epoch(epoch)
        if position:
            loader.set_position(position)
    batches = []
    for per_rank in zip(*loaders, strict=True):  # every rank gets the same number of batches
        batches.append([batch["id"].tolist() for batch in per_rank])
    return batches


@pytest.mark.ray
@pytest.mark.parametrize("prefetch", [1, 5])
def test_loaders_cover_every_row_once_in_order_across_chunks(ray_cluster, prefetch: int) -> None:
    ray = ray_cluster
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    rows, world, global_batch = 1_003, 3, 30  # 33 full batches + a 13-row tail: several chunks per rank
    dataset = ray.data.range(rows, override_num_blocks=7)
    feeder = ray.remote(_counting_feeder()).options(num_cpus=0).remote(dataset, world, global_batch)
    loaders = [
        GlobalOrderLoader(
            GlobalOrderShard(feeder, r, world, global_batch, rows), device="cpu", prefetch_batches=prefetch
        )
        for r in range(world)
    ]
    assert len(loaders[0]) == batches_in_epoch(rows, global_batch, world) == 34

    batches = _epoch_rows(loaders, epoch=0)
    assert len(batches) == 34
    flat = [row for batch in batches for part in batch for row in part]
    assert flat == list(range(rows))  # every row once, in the dataset's order
    for k, parts in enumerate(batches):
        start, end = k * global_batch, min((k + 1) * global_batch, rows)
        assert [(p[0], p[-1] + 1) for p in parts] == [rank_rows(start, end, r, world) for r in range(world)]
    # Chunks of 1, 2, 4, 8, 16... (at least `prefetch`): a handful of feeder calls per rank, not one per batch.
    calls = ray.get(feeder.call_count.remote())
    assert calls <= world * (6 if prefetch == 1 else 4), calls

    # A resume mid-epoch: the rest of the epoch, every remaining row once, re-split from the position.
    batches = _epoch_rows(loaders, epoch=1, position=450)
    flat = [row for batch in batches for part in batch for row in part]
    assert flat == list(range(450, rows))
    assert len(batches) == batches_in_epoch(rows, global_batch, world, 450)

    # A pass a rank has taken batches from cannot start again in this group (its blocks are
    # dropped): refused at the epoch start with the way out, not as empty batches mid-epoch.
    loaders[0].set_epoch(0)
    with pytest.raises(RuntimeError, match="Rank 0 started epoch 0 at sample 0 .* a second time.*fit\\(duration"):
        iter(loaders[0])


@pytest.mark.ray
def test_a_rank_that_stops_early_leaves_the_next_epoch_intact(ray_cluster) -> None:
    ray = ray_cluster
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    rows, world, global_batch = 640, 2, 16
    dataset = ray.data.range(rows, override_num_blocks=4)
    feeder = ray.remote(EpochFeeder).options(num_cpus=0).remote(dataset, world, global_batch)
    loaders = [
        GlobalOrderLoader(GlobalOrderShard(feeder, r, world, global_batch, rows), device="cpu") for r in range(2)
    ]
    for loader in loaders:
        loader.set_epoch(0)
    iterators = [iter(loader) for loader in loaders]
    for _ in range(3):  # a stop after 3 batches: chunks fetched ahead are simply dropped
        for it in iterators:
            next(it)
    batches = _epoch_rows(loaders, epoch=1)
    assert [row for batch in batches for part in batch for row in part] == list(range(rows))


def _wait_for_blocks(ray, feeder, key: str) -> None:
    """Until the prestarted epoch ``key`` holds blocks (its stream started before any rank asked)."""
    import time

    deadline = time.monotonic() + 120
    while not ray.get(feeder.held_blocks.remote()).get(key) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(feeder.held_blocks.remote()).get(key), ray.get(feeder.held_blocks.remote())


@pytest.mark.ray
def test_a_prestarted_stream_serves_the_ranks_only_when_it_is_what_they_ask_for(ray_cluster) -> None:
    """`EpochFeeder.prestart` (the driver's guess, made while the workers start): the ranks' first request
    takes it when it names their (epoch, position) and order, and otherwise starts where they ask --
    a newer checkpoint than the driver read, or another order -- with the guess's rows never served."""
    ray = ray_cluster
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    rows, world, global_batch = 640, 2, 16
    dataset = ray.data.range(rows, override_num_blocks=8)

    def run(prestart, position: int, order_seed=None):
        feeder = ray.remote(EpochFeeder).options(num_cpus=0).remote(dataset, world, global_batch)
        feeder.prestart.remote(*prestart, None)
        _wait_for_blocks(ray, feeder, f"{prestart[0]}@{prestart[1]}")
        loaders = [
            GlobalOrderLoader(
                GlobalOrderShard(feeder, r, world, global_batch, rows, order=TrainOrder(order_seed)), device="cpu"
            )
            for r in range(world)
        ]
        batches = _epoch_rows(loaders, epoch=0, position=position)
        report, held = ray.get(feeder.start_report.remote()), ray.get(feeder.held_blocks.remote())
        ray.kill(feeder)
        return [row for batch in batches for part in batch for row in part], report, held

    # The right guess: the first request finds the stream started and rows already read.
    flat, report, _ = run((0, 0, TrainOrder()), 0)
    assert flat == list(range(rows))
    assert report["used"] and report["rows_ready"] > 0 and report["lead_s"] > 0 and report["asked"][:2] == [0, 0]
    # A newer checkpoint than the guess: the ranks ask from sample 320 and get exactly the rest of the epoch.
    flat, report, held = run((0, 0, TrainOrder()), 320)
    assert flat == list(range(320, rows)) and not report["used"] and report["asked"][:2] == [0, 320]
    assert "0@0" not in held  # the wrong guess was stopped and dropped
    # The right position in another order (blocks permuted with seed 5): the ranks' own order is served.
    flat, report, _ = run((0, 0, TrainOrder(5)), 0)
    assert flat == list(range(rows)) and not report["used"]
