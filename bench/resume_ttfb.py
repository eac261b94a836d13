"""Time to first batch of a resume at 50% of an epoch against a fresh start, per train source.

A resumed worker group waits for its first batch: the feeder starts the epoch at the checkpoint's
position and the rank's loader fetches that batch. How long that takes depends on the source:

- ``seek``: `ParquetRowGroups(paths)` (``raytrain_events/data/ray/parquet_seek.py``): the stream starts
  at the row group holding the position; nothing before it is read.
- ``ray.data``: ``ray.data.read_parquet(paths)``: the epoch's stream runs again from its start and
  the feeder passes over the blocks before the position (read, then dropped by reference).

This drives the real `EpochFeeder` actor and `GlobalOrderLoader` on a local Ray (``--ranks``
loaders in this process, one feeder actor per measurement, as one per worker group). Timed: from
the loaders' ``iter()`` (the epoch's start on the feeder) until every rank holds its first batch
as tensors. Excluded, as the same for every case: Ray Train's worker-group start-up and the
feeder's own (its actor and its read tasks' worker processes, started by one untimed batch of a
warm-up epoch on the same feeder; the measured epoch is the next one, at position 0 or half). Each case is measured
``--repeats`` times, the cases interleaved; the median is printed, with the ratio resume / fresh
(goal: <= 1.5 for the seekable source).

The data: ``--files`` Parquet files of ``--file-mib`` MiB each (rows of ``--row-kib`` KiB of random
bytes, incompressible, ``--group-rows`` rows per row group), written once to ``--folder``. Reading
the first half of it must cost visibly more than the start-up; the page cache holds the files
after the first pass, so this measures Ray's read, decode and object-store work, not the disk.

Usage::

    python bench/resume_ttfb.py                         # 48 files x 16 MiB, 2 ranks, 3 repeats
    python bench/resume_ttfb.py --files 96 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`: loopback only
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def write_files(folder: str, files: int, file_mib: float, row_kib: float, group_rows: int) -> List[str]:
    """``files`` Parquet files of rows ``id, payload`` (ids in file order); existing ones are reused."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    row_bytes = int(row_kib * 1024)
    rows = max(1, int(file_mib * 2**20 // row_bytes))
    os.makedirs(folder, exist_ok=True)
    paths = []
    rng = np.random.default_rng(0)
    for i in range(files):
        path = os.path.join(folder, f"part-{i:04d}-{rows}x{row_bytes}-g{group_rows}.parquet")
        if not os.path.exists(path):
            payload = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
            table = pa.table(
                {
                    "id": np.arange(i * rows, (i + 1) * rows),
                    "payload": pa.FixedSizeListArray.from_arrays(pa.array(payload.reshape(-1)), row_bytes),
                }
            )
            pq.write_table(table, path + ".tmp", row_group_size=group_rows, compression=None)
            os.replace(path + ".tmp", path)
        paths.append(path)
    return paths


def _quiesce(timeout_s: float = 120.0) -> None:
    """Wait until the previous measurement's tasks have left every CPU (a killed feeder's read tasks)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            print(f"warning: CPUs still busy after {timeout_s:.0f} s: {ray.available_resources()}", file=sys.stderr)
            return
        time.sleep(0.2)


def _first_batches(loaders: List[Any], epoch: int, position: int) -> float:
    """Seconds from the loaders' ``iter()`` of ``epoch`` at ``position`` until every rank holds its first batch."""
    for loader in loaders:
        loader.set_epoch(epoch)
        loader.set_position(position)
    start = time.perf_counter()
    iterators = [iter(loader) for loader in loaders]
    with ThreadPoolExecutor(len(loaders)) as pool:  # the ranks wait at once, as separate workers would
        first = list(pool.map(next, iterators))
    elapsed = time.perf_counter() - start
    assert int(first[0]["id"][0]) == position, (int(first[0]["id"][0]), position)  # the row at the position
    for it in iterators:
        getattr(it, "close", lambda: None)()
    return elapsed


def first_batch_s(source: Any, ranks: int, global_batch: int, position: int, rows: int) -> float:
    """Seconds until every rank holds its first batch of an epoch started at ``position`` on a new feeder.

    The feeder first serves one batch of a warm-up epoch (not timed): its actor and the worker
    processes of its read tasks are up, as the first epoch of any run needs them; Ray starts a
    process per task owner, which on a loaded machine costs seconds and is the same at any position.
    """
    import ray

    from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    _quiesce()
    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(source, ranks, global_batch)
    loaders = [
        GlobalOrderLoader(GlobalOrderShard(feeder, r, ranks, global_batch, rows), device="cpu") for r in range(ranks)
    ]
    _first_batches(loaders, 0, 0)  # warm-up
    _quiesce()  # the warm-up epoch's read-ahead has stopped
    elapsed = _first_batches(loaders, 1, position)
    ray.kill(feeder)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=48)
    parser.add_argument("--file-mib", type=float, default=16.0)
    parser.add_argument("--row-kib", type=float, default=8.0)
    parser.add_argument("--group-rows", type=int, default=256, help="rows per Parquet row group")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-cpus", type=int, default=4, help="CPUs of the local Ray instance")
    parser.add_argument("--sources", nargs="+", default=["seek", "ray.data"], choices=["seek", "ray.data"])
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "raytrain-resume-ttfb"))
    args = parser.parse_args()

    import ray
    import ray.data

    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    paths = write_files(args.folder, args.files, args.file_mib, args.row_kib, args.group_rows)
    from raytrain_events.ray.embedded import own_state_api

    kwargs = {"num_cpus": args.num_cpus, "include_dashboard": False, "logging_level": "ERROR", "log_to_driver": False}
    with own_state_api(kwargs):  # Train's cleaner asks this instance's state API, not another's
        ray.init(address="local", **kwargs)
    ray.data.DataContext.get_current().enable_progress_bars = False
    seek = ParquetRowGroups(paths)
    rows = seek.count()
    half = rows // 2 // args.global_batch * args.global_batch
    data_mib = sum(os.path.getsize(p) for p in paths) / 2**20
    print(
        f"{args.files} files, {data_mib:.0f} MiB, {rows} rows of {args.row_kib:g} KiB, row groups of "
        f"{args.group_rows} rows; {args.ranks} ranks, global batch {args.global_batch}; resume at row {half} "
        f"({100 * half / rows:.0f}%); Ray with {args.num_cpus} CPUs; median of {args.repeats}"
    )
    makers = {"seek": lambda: seek, "ray.data": lambda: ray.data.read_parquet(paths)}
    sources = {name: makers[name] for name in args.sources}
    times: Dict[str, Dict[str, List[float]]] = {name: {"fresh": [], "resume": []} for name in sources}
    first_batch_s(seek, args.ranks, args.global_batch, 0, rows)  # warm-up: imports, page cache
    for _ in range(args.repeats):
        for name, make in sources.items():
            for case, position in (("fresh", 0), ("resume", half)):
                times[name][case].append(first_batch_s(make(), args.ranks, args.global_batch, position, rows))
                print(f"  {name} {case}: {times[name][case][-1]:.2f} s", flush=True)
    print(f"{'source':<10} {'fresh s':>9} {'resume@50% s':>13} {'resume/fresh':>13}")
    for name, cases in times.items():
        fresh, resume = statistics.median(cases["fresh"]), statistics.median(cases["resume"])
        print(f"{name:<10} {fresh:>9.2f} {resume:>13.2f} {resume / fresh:>12.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
