"""Train data path: `GlobalOrderLoader` (exact, resumable global order) vs Ray Data's own iterator.

`RayTrainer` feeds the train set through `GlobalOrderLoader`: an `EpochFeeder` actor cuts one
global order into batches and each rank fetches its rows (see ``raytrain_events/data/ray/feeder.py``).
The raw thing is ``DataIterator.iter_torch_batches``, what a hand-written Ray Train loop uses.
Both read the same materialized dataset (16384 rows of 64 float32 + a label, 8 blocks) in
batches of 64 rows, as rank 0 of a 2-worker group would (the feeder cuts global batches of 128),
with no training in between, so the numbers are the data path alone: wall and process CPU time
per batch (this process; the feeder actor's own CPU is not in it), one epoch per repeat,
arms interleaved, medians with [min-max].

Usage::

    python bench/data_loader.py                 # 5 repeats
    python bench/data_loader.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only; read when ray is imported
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import ray  # noqa: E402

from raytrain_events.data.ray.feeder import EpochFeeder  # noqa: E402
from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard  # noqa: E402

ROWS, D, BATCH, WORLD = 16384, 64, 64, 2


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(batches) -> tuple:
    """(wall ms, CPU ms) per batch over one pass of ``batches``."""
    wall, cpu, count = time.perf_counter(), _cpu(), 0
    for _ in batches:
        count += 1
    return (time.perf_counter() - wall) / count * 1e3, (_cpu() - cpu) / count * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from raytrain_events.ray.embedded import own_state_api

    kwargs = {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False}
    with own_state_api(kwargs):  # Train's cleaner asks this instance's state API, not another's
        ray.init(**kwargs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, D), dtype=np.float32)
    dataset = ray.data.from_items([{"x": x[i], "y": i % 10} for i in range(ROWS)], override_num_blocks=8).materialize()
    feeder = ray.remote(EpochFeeder).options(num_cpus=0).remote(dataset, WORLD, BATCH * WORLD)
    per_rank = ROWS // (BATCH * WORLD)

    def ours(epoch: int) -> tuple:
        loader = GlobalOrderLoader(GlobalOrderShard(feeder, 0, WORLD, BATCH * WORLD, ROWS), device="cpu")
        loader.set_epoch(epoch)
        return _timed(loader)

    def raw(_epoch: int) -> tuple:
        def first_rank_share():
            for k, batch in enumerate(dataset.iterator().iter_torch_batches(batch_size=BATCH)):
                if k == per_rank:
                    return
                yield batch

        return _timed(first_rank_share())

    arms = {"ours": ours, "raw": raw}
    for arm in arms.values():  # warm-up: starts the feeder's epoch machinery and Ray Data's executor
        arm(0)
    runs: dict = {name: [] for name in arms}
    for i in range(args.repeats):
        for name in list(arms)[i % 2 :] + list(arms)[: i % 2]:
            runs[name].append(arms[name](i + 1))
    print(f"data_loader: {ROWS} rows, {per_rank} batches of {BATCH} per rank, {args.repeats} repeats")
    for name, values in runs.items():
        walls, cpus = [v[0] for v in values], [v[1] for v in values]
        print(
            f"  {name:5s} wall {statistics.median(walls):6.3f} ms/batch [{min(walls):.3f}-{max(walls):.3f}]"
            f"   CPU {statistics.median(cpus):6.3f} ms/batch [{min(cpus):.3f}-{max(cpus):.3f}]"
        )
    ratio = statistics.median(v[1] for v in runs["ours"]) / statistics.median(v[1] for v in runs["raw"])
    print(f"  CPU per batch ours/raw = {ratio:.2f}x (lower is better)")
    ray.shutdown()


if __name__ == "__main__":
    main()
