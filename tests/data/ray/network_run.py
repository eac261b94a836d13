"""Network bytes of one global-order epoch on a Ray cluster of 4 raylets (``ray.cluster_utils.Cluster``),
run by ``test_data_network.py`` in its own process (the test session already holds a ``ray.init``).

Each Cluster node has its own raylet and object store, so a block read on one node and needed on
another crosses a real (loopback) connection. The head has 1 CPU, for Ray Data's read tasks, and
holds the feeder; 3 nodes of 1 CPU each carry one rank (a ``slot`` resource), so every row a rank
trains was read on another node. The ranks run the real `GlobalOrderLoader` against the real
`EpochFeeder` over Parquet files of 2 KiB rows, all three at once, for one epoch.

Bytes are Ray's own figure: the growth of each rank node's object store ``cumulative_created_bytes``
over the epoch (every object pulled to the node is created there; the rank creates nothing else of
size). Ray returns a task result under 100 KiB inline, past the object store, so the cluster runs
with ``max_direct_call_object_size=0``: every result goes through the store and is counted.

    python tests/data/ray/network_run.py <scratch dir>   # prints one NETWORK_RESULT {json} line
    python tests/data/ray/network_run.py <scratch dir> --whole-blocks   # the path before: ray.get whole blocks
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

FILES, ROWS_PER_FILE, ROW_BYTES = 16, 500, 2048
WORLD, GLOBAL_BATCH = 3, 96  # 32 rows per rank per step: each rank has rows in every block


def write_data(folder: str) -> int:
    """``FILES`` Parquet files of ``id`` and 2 KiB of ``tokens`` per row; returns the data's bytes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    total = 0
    for f in range(FILES):
        ids = np.arange(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE, dtype=np.int64)
        tokens = [rng.bytes(ROW_BYTES) for _ in ids]  # random: no compression anywhere shrinks it
        table = pa.table({"id": ids, "tokens": pa.array(tokens, type=pa.binary())})
        total += table.nbytes
        pq.write_table(table, os.path.join(folder, f"part-{f:03d}.parquet"), compression=None)
    return total


def main(scratch: str, whole_blocks: bool = False) -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard
    from raytrain_events.ray import _compat

    data = os.path.join(scratch, "data")
    os.makedirs(data)  # a new folder: the dataset is exactly the files written here
    data_bytes = write_data(data)
    store = 300 * 1024 * 1024
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": store,
            "_system_config": {"max_direct_call_object_size": 0},
        },
    )
    for _ in range(WORLD):
        cluster.add_node(num_cpus=1, resources={"slot": 1}, object_store_memory=store)
    try:
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()

        @ray.remote(num_cpus=1, resources={"slot": 1})  # its node's CPU, as a train worker takes it
        class Rank:
            def node(self) -> str:
                return ray.get_runtime_context().get_node_id()

            def epoch(self, shard) -> list:
                if whole_blocks:  # what a one-node cluster does: every block by ray.get, whole
                    from raytrain_events.data.ray import block_fetch

                    block_fetch.cluster_node = lambda: None
                loader = GlobalOrderLoader(shard, device="cpu", collate_fn=lambda batch: batch["id"].tolist())
                loader.set_epoch(0)
                return [list(batch) for batch in loader]

        dataset = ray.data.read_parquet(data)
        feeder = (
            ray.remote(EpochFeeder)
            .options(**FEEDER_OPTIONS, scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))
            .remote(dataset, WORLD, GLOBAL_BATCH)
        )
        ranks = [Rank.remote() for _ in range(WORLD)]
        rank_nodes = ray.get([r.node.remote() for r in ranks])
        # The stream started before any rank asks (RayTrainer starts it before the worker group; here after
        # the ranks hold their nodes' CPUs, so the reads stay on the head, where this test counts from): the
        # node of its first blocks gets its BlockCutter from the feeder, so no rank's first batch waits for it.
        feeder.prestart.remote(0, 0, None, None)
        deadline = time.monotonic() + 60
        cutters: list = []
        while not cutters and time.monotonic() < deadline:
            cutters = [a for a in ray.util.list_named_actors(True) if a["name"].startswith("raytrain-block-cutter-")]
            time.sleep(0.2)
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        before = {node: _compat.object_store_created_bytes(nodes[node]) for node in rank_nodes}
        start = time.monotonic()
        rows = FILES * ROWS_PER_FILE
        per_rank = ray.get(
            [r.epoch.remote(GlobalOrderShard(feeder, k, WORLD, GLOBAL_BATCH, rows)) for k, r in enumerate(ranks)]
        )
        seconds = time.monotonic() - start
        after = {node: _compat.object_store_created_bytes(nodes[node]) for node in rank_nodes}
        moved = sum(after[node] - before[node] for node in rank_nodes)
        trained = sorted(row for batches in per_rank for batch in batches for row in batch)
        result = {
            "data_bytes": data_bytes,
            "moved_bytes": moved,
            "ratio": moved / data_bytes,
            "per_node": {node[:8]: after[node] - before[node] for node in rank_nodes},
            "rank_nodes": len(set(rank_nodes)),
            "head_has_ranks": head in rank_nodes,
            "rows_once": trained == list(range(rows)),
            "batches": [len(b) for b in per_rank],
            "epoch_s": round(seconds, 2),
            "cutters_before_ranks": len(cutters),
        }
        print("NETWORK_RESULT " + json.dumps(result), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], "--whole-blocks" in sys.argv[2:])
