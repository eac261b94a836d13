"""Side by side on a 4-node Ray: this library's data path, Ray Data's streaming split, MosaicML Streaming.

Issue 27 item 5. One ``ray.cluster_utils.Cluster`` on this machine: a head with 1 CPU (Ray Data's
read tasks, the feeder, the split coordinator; no train worker) and 3 nodes of 1 CPU, one train
worker each. Each node has its own raylet and object store, so a block read on the head and used
by a worker crosses a real (loopback) connection. The data: ``--files`` Parquet files of
``--rows-per-file`` rows, each row an ``id`` and 2 KiB of random int32 tokens (incompressible),
written uncompressed to a temp dir (and, for Streaming, the same rows as MDS shards of about the
same size). Every arm trains one epoch with the same per-batch work (the tokens decoded to an int32
tensor and summed: the "model" costs nothing, so the data path is what is measured), 32 rows per
worker per step, then resumes at 50% of the epoch.

Arms:

- ``ours``: `GlobalOrderLoader` on each worker against one `EpochFeeder` actor over
  ``ray.data.read_parquet`` -- the feeder and rank-side code (``data/ray/feeder.py``, ``data/ray/loader.py``,
  ``data/ray/block_fetch.py``) exactly as `RayTrainer` builds them (`TrainDataConfig`), run in plain
  actors (one per node, pinned like a train worker, started after the feeder as Ray Train starts a worker
  group after the driver made the feeder and started its stream) instead of a `RayTrainer`: the trainer adds only
  the loop's start-up and per-step events, which are measured elsewhere (``bench/ray_overhead.py``)
  and would be the same for every arm. Its resume is a new feeder and loaders at ``set_position(50%)``,
  what a restarted worker group does: the epoch's stream runs again from its start, the part before
  the position read by Ray Data and passed over.
- ``ours-seek``: the same with `ParquetRowGroups` (``data/ray/parquet_seek.py``) over the folder as the
  source, whose resume starts at the row group holding the position (nothing before it is read):
  what ``RayTrainer`` runs for ``ParquetRowGroups(folder)`` and for a bare
  ``ray.data.read_parquet(folder)`` (detected, `as_seekable`), driven like ``ours``. Reads are
  byte-sized (16 MiB of row groups per task), handed on once read, 64 MiB ahead.
  Both ``ours`` arms get the token column as a (rows x 2048) uint8 tensor (``batch_tensors.py``)
  and view it as int32 (`tensor_decode`): no per-row objects; the other arms decode per row.
- ``ray-data``: a plain `TorchTrainer` loop over ``ray.train.get_dataset_shard("train").iter_batches``
  (Ray Train's default `DataConfig`: ``streaming_split(equal=True)``). Ray Data has no mid-epoch
  resume; its "resume" is a second pass that iterates past the first half of the worker's rows, so
  the time to first batch is the cost of skipping to the position.
- ``streaming``: MosaicML Streaming (``streaming-community``, the bench extra) in plain actors
  like ``ours``: `StreamingDataset` over the MDS shards (the "remote" is the temp dir; each worker
  its own local cache, as on separate machines) and `StreamingDataLoader`; its resume is a new
  dataset with an empty cache and ``load_state_dict`` of the loader's ``state_dict()`` taken at 50%
  (``data_scale_arms.streaming_arm`` says why its datasets are built one node at a time here).

- ``ours-mix``, ``ray-data-mix``, ``streaming-mix``: the mixing arms (``data_scale_mix.py``): the same
  files split into three sources (weights about 0.5/0.3/0.2, each source's share of the rows, so
  an epoch is the same rows interleaved), mixed by ``RayTrainer(mixture=...)``'s feeder path, by Ray
  Data's ``Dataset.mix(weights=)`` (no mid-epoch resume) and by Streaming's ``Stream(proportion=)``.
  A second table gives each mixing arm over its single-source arm (ours-seek, ray-data, streaming),
  repeat by repeat: the cost of mixing.

Repeats and network: every arm runs ``--repeats`` times (3) in turn on one cluster, and the table
gives each measure's median with its spread ``[min-max]``. Network bytes are counted in a separate
pass (one run of each Ray arm) on a second cluster started with ``max_direct_call_object_size=0``
(every object through the object store, so small ones are counted too), a setting that slows small
calls and so is kept out of the throughput runs; ``--no-network`` skips that pass.

Measured per arm: rows per second per worker (first to last batch of the epoch, mean over workers);
network bytes per epoch / dataset bytes (bytes that arrived at the 3 train nodes: for the Ray arms
the growth of each train node's object store ``cumulative_created_bytes``, Ray's own count of what
was created or pulled there, the cluster running with ``max_direct_call_object_size=0`` so small
objects are counted too; for Streaming the bytes of the shard files each worker's cache downloaded);
time to first batch of a fresh epoch and of the resume at 50%; peak object-store bytes (the largest
sum over the 4 nodes of bytes held, sampled every 0.2 s). Ratios are against ``ours``.

Usage::

    python bench/data_scale.py                         # 48 files x 500 rows of 2 KiB (47 MiB), all arms, 3 repeats
    python bench/data_scale.py --files 400 --rows-per-file 2000 --arms ours ray-data
    python bench/data_scale.py --files 4 --rows-per-file 200 --repeats 1 --no-network --arms ours-seek  # smoke
    python bench/data_scale.py --arms ours-seek ours-mix ray-data ray-data-mix streaming streaming-mix  # mixing
    python bench/data_scale.py --json                  # also one JSON line at the end

Streaming needs ``pip install -c constraints.txt -e '.[bench]'`` then ``pip install -c constraints.txt
--no-deps streaming-community`` (its torchvision requirement is left out: see pyproject.toml); when it cannot be imported its
row says why and the other arms still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data_scale_arms import ARMS, epoch_figures, streaming_arm, torch_arm  # noqa: E402

ROW_BYTES, WORLD, RANK_BATCH = 2048, 3, 32
STORE = 400 * 1024 * 1024


def write_parquet(folder: str, files: int, rows_per_file: int) -> int:
    """``files`` Parquet files of ``id`` and 2 KiB of random int32 tokens per row; returns the data bytes."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    total = 0
    for f in range(files):
        ids = np.arange(f * rows_per_file, (f + 1) * rows_per_file, dtype=np.int64)
        tokens = rng.integers(0, 2**31 - 1, size=(rows_per_file, ROW_BYTES // 4), dtype=np.int32)
        table = pa.table({"id": ids, "tokens": pa.array([row.tobytes() for row in tokens], type=pa.binary())})
        total += table.nbytes
        pq.write_table(table, os.path.join(folder, f"part-{f:05d}.parquet"), compression=None)
    return total


class StoreSampler:
    """Samples the sum over nodes of object-store bytes held, every 0.2 s, in a thread; ``peak()``."""

    def __init__(self, nodes: List[Dict[str, Any]]) -> None:
        from raytrain_events.ray import _compat

        self.used = _compat.object_store_used_bytes
        self.nodes = nodes
        deadline = time.monotonic() + 60  # the arm before's objects, freed lazily: not this arm's peak
        while self._total() > 2**20 and time.monotonic() < deadline:
            time.sleep(1)
        self.base = self._total()
        self.top = self.base
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _total(self) -> int:
        return sum(self.used(n) for n in self.nodes)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.top = max(self.top, self._total())
            except Exception:  # a node answering late under load: skip this sample
                pass
            self.stop.wait(0.2)

    def peak(self) -> int:
        """The most held at once since the start, less what was held at the start."""
        self.stop.set()
        self.thread.join()
        return self.top - self.base


def created(nodes: List[Dict[str, Any]]) -> int:
    from raytrain_events.ray import _compat

    return sum(_compat.object_store_created_bytes(n) for n in nodes)


def ours_arm(
    ray: Any,
    data: str,
    rows: int,
    arm: str,
    head: str,
    rank_nodes: List[Dict[str, Any]],
    mix: Any = None,
    prestart: bool = True,
) -> Dict:
    """One epoch of this library's data path on 3 rank actors, then a resume at 50% (see module doc).

    ``arm``: ``ours`` (a Ray Dataset), ``ours-seek`` (`ParquetRowGroups`) or ``ours-mix`` (a
    `MixtureSource` over ``mix``'s three sources, `data_scale_mix.ours_mix_source`). ``prestart``:
    the feeder's stream starts when it is created, before the rank actors (`EpochFeeder.prestart`,
    as ``RayTrainer`` starts it before the worker group); False: at the first rank's request."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard
    from raytrain_events.data.ray.mixture_loader import MixtureOrderLoader
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups

    mixture_run = mixed = None
    if arm == "ours-mix":
        from data_scale_mix import ours_mix_source

        mixed = ours_mix_source(mix, WORLD * RANK_BATCH)
        mixture_run, rows = mixed.run, mixed.count()

    @ray.remote(num_cpus=1, resources={"slot": 1})  # its node's CPU, as a train worker takes it
    class Rank:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def epoch(self, shard: Any, position: int, stop_after: Optional[int] = None) -> Dict:
            import torch

            # Token bytes as a uint8 tensor, no per-row objects; a mixture's loader also counts rows per source.
            kind = GlobalOrderLoader if shard.mixture is None else MixtureOrderLoader
            loader = kind(shard, device="cpu")
            loader.set_epoch(0)
            loader.set_position(position)
            start = time.monotonic()
            first = last = None
            seen = total = 0
            for batch in map(tensor_decode, loader):
                last = time.monotonic()
                if first is None:
                    first = last
                seen += int(batch["ids"].shape[0])
                total += int(torch.sum(batch["tokens"]).item()) & 1
                if stop_after is not None:
                    break
            return epoch_figures(start, first, last, seen)

    def feeder(position: int) -> Any:
        # ours-seek: the folder, as RayTrainer turns a bare ray.data.read_parquet(data) into (`as_seekable`).
        if arm == "ours-mix":
            source = mixed  # a new feeder loads it again (as a restarted group's feeder does)
        else:
            source = ParquetRowGroups(data) if arm == "ours-seek" else ray.data.read_parquet(data)
        actor = (
            ray.remote(EpochFeeder)
            .options(**FEEDER_OPTIONS, scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False))
            .remote(source, WORLD, WORLD * RANK_BATCH)
        )
        if prestart:  # as RayTrainer's driver does before the worker group starts (feeder.py, Started early)
            actor.prestart.remote(0, position, None, None)
        ray.get(actor.held_blocks.remote())  # up: the timings below start at the epoch's start
        return actor

    fresh = feeder(0)
    ranks = [Rank.remote() for _ in range(WORLD)]  # the worker group's start, after the feeder's (as in a run)
    ray.get([r.node.remote() for r in ranks])
    sampler = StoreSampler(ray_nodes(ray))
    before = created(rank_nodes)
    shards = [GlobalOrderShard(fresh, k, WORLD, WORLD * RANK_BATCH, rows, mixture=mixture_run) for k in range(WORLD)]
    epoch = ray.get([r.epoch.remote(shard, 0) for r, shard in zip(ranks, shards, strict=True)])
    moved = created(rank_nodes) - before
    resumed = feeder(rows // 2)  # the same ranks ask at once: no head start for the resume
    shards = [GlobalOrderShard(resumed, k, WORLD, WORLD * RANK_BATCH, rows, mixture=mixture_run) for k in range(WORLD)]
    resume = ray.get([r.epoch.remote(shard, rows // 2, 1) for r, shard in zip(ranks, shards, strict=True)])
    peak = sampler.peak()
    for actor in [*ranks, fresh, resumed]:  # ranks first: their prefetch threads still call the feeder
        ray.kill(actor)
    return summary(epoch, resume, moved, peak)


def tensor_decode(batch: Dict[str, Any]) -> Dict[str, Any]:
    """``decode`` for our loader's batches: the token column is already a (rows x 2048) uint8 tensor."""
    import torch

    return {"ids": batch["id"], "tokens": batch["tokens"].view(torch.int32)}


def decode(batch: Dict[str, Any]) -> Dict[str, Any]:
    """The per-batch work of every arm: the tokens' bytes as an int32 tensor (rows x 512)."""
    import numpy as np
    import torch

    tokens = np.frombuffer(b"".join(batch["tokens"]), dtype=np.int32).reshape(len(batch["tokens"]), -1)
    return {"ids": torch.as_tensor(np.array(batch["id"])), "tokens": torch.from_numpy(tokens.copy())}


def summary(epoch: List[Dict], resume: List[Dict], moved: int, peak: int, **extra: Any) -> Dict:
    """One arm's row: means over the workers (rows/s), the slowest worker (first-batch times)."""
    return {
        "rows": sum(e["rows"] for e in epoch),
        "rows_per_s_per_worker": sum(e["rows_per_s"] for e in epoch) / len(epoch),
        "epoch_rows_per_s_per_worker": sum(e["epoch_rows_per_s"] for e in epoch) / len(epoch),
        "moved_bytes": moved,
        "first_batch_s": max(e["first_batch_s"] for e in epoch),
        "resume_first_batch_s": max(r["first_batch_s"] for r in resume),
        "peak_store_bytes": peak,
        **extra,
    }


def ray_nodes(ray: Any) -> List[Dict[str, Any]]:
    return [n for n in ray.nodes() if n["Alive"]]


def table(results: Dict[str, Dict], data_bytes: int) -> str:
    """The side-by-side table: each measure and its ratio to ``ours``."""
    base = results.get("ours", {})

    def cell(arm: str, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
        value = results[arm].get(key)
        if value is None:
            return "-"
        text = fmt.format(value / scale)
        low, high = results[arm].get("spread", {}).get(key, (value, value))
        if low != high:  # the spread over the repeats (the cell is their median)
            text += f" [{fmt.format(low / scale)}-{fmt.format(high / scale)}]"
        ref = base.get(key)
        if arm != "ours" and ref:
            text += f" ({value / ref:.2f}x)"
        return text

    lines = [
        "| arm | rows/s per worker, first to last batch | rows/s per worker, whole epoch | network bytes / dataset "
        "| first batch (s) | resume at 50%: first batch (s) | peak object store (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    skips = False
    for arm, result in results.items():
        if "error" in result:
            lines.append(f"| {arm} | not run: {result['error']} | | | | | |")
            continue
        if result.get("moved_bytes") is not None:
            result["network_ratio"] = result["moved_bytes"] / data_bytes
        if "network_ratio" not in base and base.get("moved_bytes") is not None:
            base["network_ratio"] = base["moved_bytes"] / data_bytes
        resume = cell(arm, "resume_first_batch_s", fmt="{:.2f}")
        if result.get("resume_kind"):  # no mid-epoch resume: the cell is a pass skipping to 50%
            resume, skips = f"no resume; a skip: {resume}", True
        lines.append(
            f"| {arm} | {cell(arm, 'rows_per_s_per_worker')} | {cell(arm, 'epoch_rows_per_s_per_worker')} "
            f"| {cell(arm, 'network_ratio', fmt='{:.3f}')} "
            f"| {cell(arm, 'first_batch_s', fmt='{:.2f}')} | {resume} "
            f"| {cell(arm, 'peak_store_bytes', 2**20, '{:.1f}')} |"
        )
    if skips:
        lines.append(
            "\n'no resume; a skip': the arm has no mid-epoch resume; the time is a second pass's, iterating "
            "past the first half of each worker's rows."
        )
    return "\n".join(lines)


def aggregate(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The repeats of one arm: each number's median, its ``(min, max)`` under ``spread``; an error if any."""
    import statistics

    errors = [run for run in runs if "error" in run]
    if errors:
        return errors[0]
    out: Dict[str, Any] = dict(runs[-1])
    spread: Dict[str, Any] = {}
    for key, value in runs[-1].items():
        values = [run.get(key) for run in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and None not in values:
            out[key] = statistics.median(values)
            spread[key] = (min(values), max(values))
    out["spread"], out["repeats"] = spread, len(runs)
    return out


def start_cluster(cluster_class: Any, count_network: bool = False, tries: int = 3) -> Any:
    """The head (1 CPU) and ``WORLD`` nodes of 1 CPU and one ``slot``; a start that times out (Ray waits
    30 s for a raylet to register, which a loaded machine can miss) is retried. ``count_network``:
    every object through the object store (``max_direct_call_object_size=0``), so the per-node
    created bytes count small objects too -- a setting that slows small calls, so throughput is
    measured on a cluster without it."""
    system = {"_system_config": {"max_direct_call_object_size": 0}} if count_network else {}
    for attempt in range(tries):
        cluster = None
        try:
            cluster = cluster_class(
                initialize_head=True,
                head_node_args={"num_cpus": 1, "object_store_memory": STORE, **system},
            )
            for _ in range(WORLD):
                cluster.add_node(num_cpus=1, resources={"slot": 1}, object_store_memory=STORE)
            return cluster
        except Exception as exc:
            if cluster is not None:
                cluster.shutdown()
            if attempt == tries - 1:
                raise
            print(f"cluster start failed ({exc}); trying again", flush=True)
    raise AssertionError("unreachable")


def run_arms(
    arms: List[str],
    data: str,
    scratch: str,
    rows: int,
    repeats: int,
    count_network: bool,
    mix: Any = None,
    prestart: str = "on",
) -> Dict[str, List[Dict]]:
    """Each arm ``repeats`` times (arms in turn) on one fresh cluster (`start_cluster`); ``mix``: the
    mixing arms' three sources (`data_scale_mix.split_sources`)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = start_cluster(Cluster, count_network)
    # (label, arm, stream started when the feeder is made); prestart "both": each ours arm also at the request.
    runs = []
    for arm in arms:
        if arm.startswith("ours") and prestart == "both":
            runs += [(arm, arm, True), (f"{arm}@request", arm, False)]
        else:
            runs.append((arm, arm, prestart != "off"))
    results: Dict[str, List[Dict]] = {label: [] for label, _, _ in runs}
    try:
        os.environ["RAY_ADDRESS"] = cluster.address  # Ray Train's helper processes: this cluster, not another
        ray.init(address=cluster.address)
        ray.data.DataContext.get_current().enable_progress_bars = False
        cluster.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()
        rank_nodes = [n for n in ray_nodes(ray) if n["NodeID"] != head]
        # Warm-up: the first Ray Data execution in a cluster starts worker processes and imports
        # (a minute at load 50 here); without this, whichever arm runs first pays it in its first batch.
        ray.data.read_parquet(data).limit(1).take_all()
        for repeat in range(repeats):
            tag = f"{'net' if count_network else 'run'}{repeat}"
            folder = os.path.join(scratch, tag)  # this pass's MDS shards, caches and run dirs
            os.makedirs(folder)
            for label, arm, early in runs:
                started = time.monotonic()
                try:
                    if arm.startswith("ours"):
                        result = ours_arm(ray, data, rows, arm, head, rank_nodes, mix, early)
                    else:
                        run = torch_arm if arm.startswith("ray-data") else streaming_arm
                        sampler = StoreSampler(ray_nodes(ray))
                        sources = mix if arm.endswith("-mix") else None
                        result = run(ray, data, folder, rows, WORLD, RANK_BATCH, decode, summary, sampler, sources)
                except Exception as exc:  # e.g. Streaming not installed or not importable here: say so, go on
                    result = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                results[label].append(result)
                print(f"{tag} {label}: {time.monotonic() - started:.0f} s {json.dumps(result)}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return results


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=48, help="Parquet files (and about as many MDS shards)")
    parser.add_argument("--rows-per-file", type=int, default=500, help="2 KiB rows per file")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--repeats", type=int, default=3, help="runs of every arm (the table: medians [min-max])")
    parser.add_argument(
        "--no-network", action="store_true", help="skip the separate network-counting pass (its cluster)"
    )
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    parser.add_argument(
        "--prestart",
        choices=("on", "off", "both"),
        default="on",
        help="ours arms: the epoch's stream starts when the feeder is made (on, as RayTrainer), at the first "
        "rank's request (off, as before), or both in turn, the second labelled ARM@request",
    )
    args = parser.parse_args(argv)

    import data_scale_arms
    import data_scale_mix
    import ray

    for module in (data_scale_arms, data_scale_mix):  # the train loops' helpers, to the workers
        ray.cloudpickle.register_pickle_by_value(module)

    scratch = tempfile.mkdtemp(prefix="data_scale-")
    data = os.path.join(scratch, "parquet")
    os.makedirs(data)
    data_bytes = write_parquet(data, args.files, args.rows_per_file)
    rows = args.files * args.rows_per_file
    print(f"dataset: {args.files} files x {args.rows_per_file} rows x 2 KiB = {data_bytes / 2**20:.1f} MiB", flush=True)
    mix = None
    if any(arm.endswith("-mix") for arm in args.arms):
        mix = data_scale_mix.split_sources(data, os.path.join(scratch, "mix"))
        print("mixing arms' sources: " + ", ".join(f"{n} {s['rows']} rows ({s['weight']:.3f})" for n, s in mix.items()))
    network: Dict[str, Optional[int]] = {}
    try:
        # Throughput: every arm, --repeats times, on one cluster; then the network count on another.
        runs = run_arms(args.arms, data, scratch, rows, args.repeats, False, mix, args.prestart)
        if not args.no_network:
            counted = [arm for arm in args.arms if not arm.startswith("streaming")]  # Streaming: its caches' files
            for arm, results_of in run_arms(counted, data, scratch, rows, 1, True, mix, args.prestart).items():
                network[arm] = results_of[0].get("moved_bytes")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the Parquet files, MDS shards and caches
    results: Dict[str, Dict] = {}
    for arm, arm_runs in runs.items():
        results[arm] = aggregate(arm_runs)
        if not arm.startswith("streaming") and "error" not in results[arm]:
            results[arm]["moved_bytes"] = network.get(arm)  # None: not counted (--no-network)
            results[arm].get("spread", {}).pop("moved_bytes", None)
    print(table(results, data_bytes))
    costs = data_scale_mix.mixing_costs(runs)
    if costs:
        print("\nmixing cost (each mixing arm / its single-source arm, repeat by repeat: median [min-max]):")
        print(data_scale_mix.costs_table(costs))
    out = {"data_bytes": data_bytes, "rows": rows, "results": results, "mixing_costs": costs}
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
