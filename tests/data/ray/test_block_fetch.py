"""`block_fetch`: a rank's rows of a chunk, blocks on another node cut there instead of pulled whole.

Pure: which rows of which blocks a chunk reads (slices and shuffle takes), and which blocks are
fetched whole (on the rank's node, on no node, a one-node cluster) or cut where they live. On
local Ray, with the rank's node id replaced by another node's (so every block counts as remote
and is cut by that node's `BlockCutter` actor): exactly the rows asked for come back, and `GlobalOrderLoader`s
train the same batches -- every row once, plain and shuffled (at another world size) -- as through
whole blocks. The multi-node bytes check is ``test_data_network.py``.
"""

from __future__ import annotations

from typing import List

import numpy as np
import pytest

from raytrain_events.data.order import TrainOrder
from raytrain_events.data.ray import block_fetch
from raytrain_events.data.ray.block_fetch import chunk_refs, needed_rows, split_by_node
from raytrain_events.data.ray.feeder import EpochFeeder
from raytrain_events.data.ray.slices import RowRange, Take

ELSEWHERE = "f" * 56  # a node id no block is on


def test_needed_rows_joins_a_chunks_slices_and_takes_per_block() -> None:
    served = [
        [RowRange("a", 0, 4), RowRange("b", 10, 12)],
        [RowRange("b", 12, 15)],
        [Take(["b", "c"], np.array([1, 0, 1]), np.array([7, 30, 2]))],
        None,
        [RowRange("d", 0, 1)],  # after the epoch's end: not read
    ]
    assert chunk_refs(served) == ["a", "b", "c"]
    needed = needed_rows(served)
    assert list(needed) == ["a", "b", "c"]
    assert needed["a"].tolist() == [0, 1, 2, 3]
    assert needed["b"].tolist() == [10, 11, 12, 13, 14, 30]
    assert needed["c"].tolist() == [2, 7]
    assert list(needed_rows(served, {"c"})) == ["c"]  # rows listed only for the blocks to be cut


def test_blocks_on_this_node_or_on_none_are_fetched_whole_the_rest_cut() -> None:
    locations = {"a": ("n1",), "b": ("n2", "n1"), "c": (), "d": ("n2",)}
    whole, cut = split_by_node(list("abcde"), "n1", locations)
    assert whole == ["a", "b", "c", "e"] and cut == {"d": "n2"}  # e: no location known
    whole, cut = split_by_node(list("abcd"), None, locations)  # one node: everything is local
    assert whole == list("abcd") and not cut


@pytest.mark.ray
def test_remote_blocks_come_back_as_exactly_the_rows_asked_for(ray_cluster) -> None:
    ray = ray_cluster
    import pyarrow as pa

    table = pa.table({"id": np.arange(200), "pad": [bytes(1024)] * 200})  # ~200 KiB: in the object store
    ref = ray.put(table)
    served = [[RowRange(ref, 10, 20)], [RowRange(ref, 50, 53)], [Take([ref], np.array([0, 0]), np.array([199, 5]))]]
    fetched = block_fetch.fetch_blocks(served, ELSEWHERE)
    part, rows = fetched[ref]
    assert rows is not None and rows.tolist() == [5, *range(10, 20), 50, 51, 52, 199]
    assert part.num_rows == len(rows) and part.column("id").to_pylist() == rows.tolist()
    whole, none = block_fetch.fetch_blocks(served, ray.get_runtime_context().get_node_id())[ref]
    assert none is None and whole.num_rows == 200  # on this node: the block itself


@pytest.mark.ray
def test_one_cutter_process_per_node_and_a_dead_cutter_costs_only_a_whole_block(ray_cluster) -> None:
    ray = ray_cluster
    import pyarrow as pa

    refs = [ray.put(pa.table({"id": np.arange(i * 100, i * 100 + 100), "pad": [bytes(2048)] * 100})) for i in range(6)]
    served = [[RowRange(ref, 10, 20), RowRange(ref, 40, 41)] for ref in refs]
    node = ray.get_runtime_context().get_node_id()  # where the blocks are, so where they are cut
    pids = set()
    for _ in range(3):  # many cuts, several chunks: one actor, one process, for that node
        started = block_fetch.start_fetch(served, ELSEWHERE)
        assert len(started[1]) == 1 and len(started[1][0][0]) == 6  # one call for the node's six blocks
        fetched = block_fetch.finish_fetch(started)
        assert all(fetched[ref][0].column("id").to_pylist()[-1] == i * 100 + 40 for i, ref in enumerate(refs))
        pids.add(ray.get(block_fetch._cutter(node).__ray_call__.remote(lambda self: __import__("os").getpid())))
    name = block_fetch.CUTTER_NAME.format(node=node)
    assert len(pids) == 1 and [a["name"] for a in ray.util.list_named_actors(True)].count(name) == 1
    ray.kill(ray.get_actor(name))  # what happens when the rank that made it ends
    fetched = block_fetch.fetch_blocks(served, ELSEWHERE)
    assert all(rows is None and part.num_rows == 100 for part, rows in fetched.values())  # whole blocks instead
    fetched = block_fetch.fetch_blocks(served, ELSEWHERE)  # the next chunk: a new cutter
    assert all(rows is not None and part.num_rows == 11 for part, rows in fetched.values())
    ray.kill(ray.get_actor(name))


@pytest.mark.ray
def test_loaders_train_the_same_rows_when_every_block_is_cut_remotely(ray_cluster, monkeypatch) -> None:
    ray = ray_cluster
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    rows, global_batch = 600, 24
    dataset = ray.data.range_tensor(rows, shape=(256,), override_num_blocks=6)  # 200 KiB blocks: in the store

    def epoch(world: int, position: int = 0, seed=None) -> List[List[int]]:
        feeder = ray.remote(EpochFeeder).options(num_cpus=0).remote(dataset, world, global_batch)
        loaders = [
            GlobalOrderLoader(
                GlobalOrderShard(
                    feeder, r, world, global_batch, rows, order=TrainOrder(seed, 150 if seed is not None else None)
                ),
                device="cpu",
            )
            for r in range(world)
        ]
        for loader in loaders:
            loader.set_epoch(1)
            loader.set_position(position)
        return [[int(x) for b in per_rank for x in b["data"][:, 0].tolist()] for per_rank in zip(*loaders, strict=True)]

    local_plain, local_shuffled = epoch(3), epoch(3, seed=3)
    monkeypatch.setattr(block_fetch, "cluster_node", lambda: ELSEWHERE)
    cut_plain = epoch(3)
    assert cut_plain == local_plain
    assert [row for batch in cut_plain for row in batch] == list(range(rows))
    cut_shuffled = epoch(2, seed=3)
    assert cut_shuffled == local_shuffled  # the same global batches, at another world size
    flat = [row for batch in cut_shuffled for row in batch]
    assert sorted(flat) == list(range(rows)) and flat != list(range(rows))
