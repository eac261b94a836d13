"""Network bytes per epoch of the global-order data path, simulated at 8 x 8 and 64 x 8 ranks.

Drives the REAL code with fake blocks: `EpochFeeder` (``raytrain_events/data/ray/feeder.py``) serves
every rank its chunks of batches (1, 2, 4, 8, then 16 batches per call, as `GlobalOrderLoader`
asks), and `block_fetch.chunk_refs` / `split_by_node` / `needed_rows` decide, per rank and chunk, which
blocks the rank gets whole and which it has cut on the block's node. No Ray, no torch: block
references are ints, each block is placed on a random node (as Ray Data's read tasks land on the
nodes with free CPUs), ranks sit ``--per-node`` to a node.

Counted, per epoch, as a multiple of the dataset's bytes D:

- ``before`` (whole blocks, the path before `block_fetch`): each node pulls every block that one
  of its ranks needs and that lives elsewhere, once per node (Ray's pull manager shares a pull
  among a node's workers; the copy is assumed kept for the epoch, which favours ``before``);
- ``after`` (`block_fetch`): whole blocks only from the rank's own node (free), the rows of every
  other block cut where it lives, so only the rank's rows travel.

Also printed: ``cut tasks/step/rank``, the `cut_rows` tasks a rank submits per global batch (one per
remote block per chunk), the per-step cost of the change.

``--task-cost``: on a local one-node Ray, the time a rank spends per chunk fetching 16 blocks of
2 KiB rows (64 rows of each): whole (``ray.get``, local) against cut by `cut_rows` tasks (the
rank's node id replaced by another, so every block counts as remote and is cut on this node).
That is the latency of a cut task round trip, without the network it saves.

Usage::

    python bench/data_network.py                       # 8x8 and 64x8, 2 KiB and 8 KiB rows, 128 MiB blocks
    python bench/data_network.py --nodes 8 --row-kib 2 --block-mib 16 128 512
    python bench/data_network.py --task-cost        # starts a local Ray (2 CPUs)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from raytrain_events.data.ray.block_fetch import chunk_refs, needed_rows, split_by_node  # noqa: E402
from raytrain_events.data.ray.feeder import EpochFeeder  # noqa: E402

CHUNKS = [1, 2, 4, 8]  # then 16 per call: GlobalOrderLoader's chunk sizes with prefetch_batches=1
MAX_CHUNK = 16


class FakeDataset:
    """What `EpochFeeder` uses of a Ray Dataset: ``context`` and the stream of ref bundles."""

    def __init__(self, blocks: int, rows_per_block: int) -> None:
        self.blocks = blocks
        self.rows_per_block = rows_per_block
        self.context = SimpleNamespace(execution_options=SimpleNamespace(preserve_order=False))

    def iter_internal_ref_bundles(self) -> Iterator[Any]:
        meta = SimpleNamespace(num_rows=self.rows_per_block)
        for i in range(self.blocks):
            yield SimpleNamespace(blocks=[(i, meta)], slices=None)


def simulate(nodes: int, per_node: int, row_bytes: int, block_bytes: int, rows_per_rank: int, steps: int) -> Dict:
    """One epoch of ``steps`` global batches; bytes moved before and after, and cut tasks."""
    world = nodes * per_node
    rows_per_block = max(1, block_bytes // row_bytes)
    global_batch = rows_per_rank * world
    blocks = -(-steps * global_batch // rows_per_block)
    rng = random.Random(0)
    where = {b: rng.randrange(nodes) for b in range(blocks)}
    feeder = EpochFeeder(FakeDataset(blocks, rows_per_block), world, global_batch)
    feeder.start_epoch(0, 0, None, 0)
    pulled: List[Set[int]] = [set() for _ in range(nodes)]  # before: remote blocks each node pulled
    cut_rows = cut_tasks = 0
    first, count, done = 0, CHUNKS[0], False
    while not done:
        for rank in range(world):
            node = rank // per_node
            served = feeder.batches(0, 0, rank, first, count) or []
            done = done or not served or served[-1] is None
            refs = chunk_refs(served)
            pulled[node].update(ref for ref in refs if where[ref] != node)
            _, cut = split_by_node(refs, node, {ref: (where[ref],) for ref in refs})
            cut_tasks += len(cut)
            cut_rows += sum(len(rows) for rows in needed_rows(served, cut).values())
        first += count
        count = CHUNKS[CHUNKS.index(count) + 1] if count in CHUNKS[:-1] else MAX_CHUNK
    total = blocks * rows_per_block * row_bytes
    before = sum(len(p) for p in pulled) * rows_per_block * row_bytes
    return {
        "before": before / total,
        "after": cut_rows * row_bytes / total,
        "tasks_per_step_rank": cut_tasks / steps / world,
        "blocks": blocks,
        "blocks_per_step": global_batch / rows_per_block,
    }


def task_cost(chunks: int = 30, blocks: int = 16, rows: int = 4096, take: int = 64) -> None:
    """Milliseconds per chunk (``blocks`` blocks, ``take`` rows of each): whole gets against cut tasks."""
    import time

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import numpy as np
    import pyarrow as pa
    import ray

    from raytrain_events.data.ray.block_fetch import fetch_blocks
    from raytrain_events.data.ray.slices import RowRange
    from raytrain_events.ray.embedded import own_state_api

    kwargs = {"num_cpus": 2, "include_dashboard": False}
    with own_state_api(kwargs):  # Train's cleaner asks this instance's state API, not another's
        ray.init(**kwargs)
    try:
        table = pa.table({"id": np.arange(rows), "tokens": [bytes(2048)] * rows})  # 8 MiB
        refs = [ray.put(table) for _ in range(blocks)]
        elsewhere = "f" * 56
        results = {}
        for mode, here in (("whole", None), ("cut", elsewhere), ("whole", None), ("cut", elsewhere)):
            times = []
            for c in range(chunks):
                lo = (c * take) % (rows - take)
                served = [[RowRange(ref, lo, lo + take)] for ref in refs]
                start = time.perf_counter()
                fetch_blocks(served, here)
                times.append(time.perf_counter() - start)
            results[mode] = sorted(times)[len(times) // 2] * 1000
        print(f"per chunk of {blocks} blocks, {take} rows of each (median of {chunks}):")
        print(f"  whole blocks (local ray.get): {results['whole']:.2f} ms")
        print(f"  cut tasks: {results['cut']:.2f} ms, {results['cut'] / blocks:.2f} ms per task")
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--row-kib", type=float, nargs="+", default=[2, 8])
    parser.add_argument("--block-mib", type=float, nargs="+", default=[128])
    parser.add_argument("--rows-per-rank", type=int, default=1024, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=47, help="global batches in the simulated epoch")
    parser.add_argument("--task-cost", action="store_true", help="time cut tasks on a local Ray instead")
    args = parser.parse_args()
    if args.task_cost:
        task_cost()
        return
    print(
        "| nodes x ranks | row | block | blocks/step | before (x D) | after (x D) | cut tasks/step/rank |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    for nodes in args.nodes:
        for row_kib in args.row_kib:
            for block_mib in args.block_mib:
                r = simulate(
                    nodes,
                    args.per_node,
                    int(row_kib * 1024),
                    int(block_mib * 1024 * 1024),
                    args.rows_per_rank,
                    args.steps,
                )
                print(
                    f"| {nodes} x {args.per_node} | {row_kib:g} KiB | {block_mib:g} MiB | {r['blocks_per_step']:.2f} "
                    f"| {r['before']:.2f} | {r['after']:.3f} | {r['tasks_per_step_rank']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
