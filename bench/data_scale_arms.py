"""Two arms of ``bench/data_scale.py``: Ray Data's streaming split and MosaicML Streaming.

``torch_arm`` runs one `TorchTrainer.fit()` of 3 workers (one per non-head node, the ``slot`` resource) whose
loop trains an epoch with ``decode`` as the per-batch work, measures its own node's object-store
growth over the epoch (between barriers, so no worker's next phase is counted), then measures the
arm's resume at 50% (see ``data_scale.py``'s doc). Each worker writes its figures to a JSON file
in the scratch dir (all nodes share this machine's disk); the driver reads them back.
``streaming_arm`` runs Streaming in 3 rank actors (its own doc says why not in a `TorchTrainer`).

`import_streaming`: ``streaming`` imports ``streaming.vision`` at package import, which imports
torchvision; the registry's torchvision wheels for Linux are CUDA builds, whose ops do not load next
to the CPU-only torch this project pins (``RuntimeError: operator torchvision::nms does not
exist``). Streaming's datasets, writer and loader do not use torchvision, so when torchvision
cannot be imported an empty ``streaming.vision`` module is registered first (said in the output).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
import types
from typing import Any, Callable, Dict, List

ARMS = ("ours", "ours-seek", "ray-data", "streaming", "ours-mix", "ray-data-mix", "streaming-mix")


def import_streaming() -> Any:
    """``import streaming``, without its torchvision-based vision datasets when torchvision is broken here."""
    import importlib.util

    if importlib.util.find_spec("streaming") is None:
        raise ImportError(
            "MosaicML Streaming is not installed; install it with pip install -c constraints.txt -e '.[bench]' "
            "&& pip install -c constraints.txt --no-deps streaming-community"
        )
    note = None
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # the CUDA wheel next to a CPU torch: RuntimeError, ImportError or OSError
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
        note = f"torchvision does not import here ({type(exc).__name__}: {exc}); streaming.vision skipped"
    try:
        import streaming
    except Exception as exc:
        raise ImportError(
            f"MosaicML Streaming cannot be imported ({type(exc).__name__}: {exc}); install it with "
            "pip install -c constraints.txt -e '.[bench]' && pip install -c constraints.txt --no-deps streaming-community"
        ) from exc
    streaming.bench_note = note
    return streaming


def write_mds(parquet: str, out: str, rows_per_file: int) -> None:
    """The Parquet files' rows as MDS shards of about one Parquet file each (uncompressed)."""
    import pyarrow.parquet as pq

    streaming = import_streaming()
    limit = rows_per_file * (2048 + 64)
    with streaming.MDSWriter(out=out, columns={"id": "int64", "tokens": "bytes"}, size_limit=limit) as writer:
        for path in sorted(glob.glob(os.path.join(parquet, "*.parquet"))):
            table = pq.read_table(path).to_pydict()
            for row_id, tokens in zip(table["id"], table["tokens"], strict=True):
                writer.write({"id": row_id, "tokens": tokens})


def epoch_figures(start: float, first: float, last: float, rows: int) -> Dict[str, float]:
    """A worker's epoch: time to its first batch, rows/s from first to last batch and over the whole epoch."""
    return {
        "first_batch_s": first - start,
        "rows": rows,
        "rows_per_s": rows / max(last - first, 1e-9),
        "epoch_rows_per_s": rows / max(last - start, 1e-9),
    }


def _node_created_bytes() -> int:
    import ray

    from raytrain_events.ray import _compat

    node = ray.get_runtime_context().get_node_id()
    return _compat.object_store_created_bytes(next(n for n in ray.nodes() if n["NodeID"] == node))


def _fit(ray: Any, loop: Callable, scratch: str, name: str, world: int, datasets: Dict[str, Any]) -> List[Dict]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(scratch, name)
    os.makedirs(out)
    TorchTrainer(
        loop,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=world, resources_per_worker={"CPU": 1, "slot": 1}),
        datasets=datasets,
        run_config=RunConfig(storage_path=os.path.join(scratch, "runs"), name=name),
    ).fit()
    figures = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            figures.append(json.load(f))
    return figures


def _write(out: str, figures: Dict[str, Any]) -> None:
    import ray.train

    with open(os.path.join(out, f"rank{ray.train.get_context().get_world_rank()}.json"), "w") as f:
        json.dump(figures, f)


def torch_arm(
    ray: Any, data: str, scratch: str, rows: int, world: int, rank_batch: int, decode, summary, sampler, mix=None
):
    """Ray Data's ``streaming_split`` (Ray Train's default `DataConfig`) in a plain `TorchTrainer` loop.

    ``mix``: the mixing arm's sources (`data_scale_mix.split_sources`): the train set is their
    ``Dataset.mix`` (`data_scale_mix.ray_data_mix`) instead of ``read_parquet(data)``."""

    def loop(config: Dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        shard = ray.train.get_dataset_shard("train")
        dist.barrier()
        before = _node_created_bytes()
        start = time.monotonic()
        first = last = None
        seen = 0
        for batch in shard.iter_batches(batch_size=rank_batch, batch_format="numpy"):
            last = time.monotonic()
            first = first or last
            seen += len(batch["id"])
            torch.sum(decode(batch)["tokens"])
        moved = _node_created_bytes() - before
        dist.barrier()
        # No mid-epoch resume: a second pass skips the first half of this worker's rows.
        skipped, resumed = 0, time.monotonic()
        for batch in shard.iter_batches(batch_size=rank_batch, batch_format="numpy"):
            if skipped >= seen // 2:
                torch.sum(decode(batch)["tokens"])
                resumed = time.monotonic() - resumed
                break
            skipped += len(batch["id"])
        epoch = epoch_figures(start, first, last, seen)
        _write(config["out"], {"epoch": epoch, "moved": moved, "resume": {"first_batch_s": resumed}})

    if mix is None:
        name, train = "ray-data", ray.data.read_parquet(data)
    else:
        from data_scale_mix import ray_data_mix

        name, train = "ray-data-mix", ray_data_mix(ray, mix)
    figures = _fit(ray, loop, scratch, name, world, {"train": train})
    return summary(
        [f["epoch"] for f in figures],
        [f["resume"] for f in figures],
        sum(f["moved"] for f in figures),
        sampler.peak(),
        resume_kind="no mid-epoch resume: a pass iterating past the first half",
    )


def streaming_arm(
    ray: Any, data: str, scratch: str, rows: int, world: int, rank_batch: int, decode, summary, sampler, mix=None
):
    """MosaicML Streaming on 3 rank actors, a local cache per node; resume by ``load_state_dict`` at 50%.

    ``mix``: the mixing arm's sources (`data_scale_mix.split_sources`): one ``Stream(proportion=)``
    per source over its own MDS shards, the epoch ``rows`` samples.

    Streaming names a node's shared memory by the first free prefix in ``/dev/shm``, found between two
    ``torch.distributed`` barriers; here every "node" shares one machine's ``/dev/shm``, so datasets
    built at once behind a global barrier all took the same name (``FileExistsError: '/000000_locals'``).
    So each rank runs Streaming with a process group of its own (its construction-time barriers are
    node-local) and the driver builds the 3 datasets one after another; the epochs then run at once.
    Streaming partitions samples by ``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` from the environment,
    so each node still reads only its part, as in a real multi-node run.
    """
    streaming = import_streaming()
    mds = _write_shards(data, scratch, rows, mix)
    note = streaming.bench_note

    def collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        import numpy as np

        return decode({"id": np.array([s["id"] for s in samples]), "tokens": [s["tokens"] for s in samples]})

    @ray.remote(num_cpus=1, resources={"slot": 1})
    class Rank:
        def __init__(self, rank: int, port: int) -> None:
            import torch.distributed as dist

            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            self.rank = rank
            self.sd = import_streaming()
            self.loader: Any = None

        def build(self, cache: str) -> None:
            self.loader = None  # the first pass's dataset, gone before the resumed one is made
            if mix is None:
                dataset = self.sd.StreamingDataset(remote=mds, local=cache, batch_size=rank_batch, shuffle=False)
            else:  # one Stream(proportion=) per source
                streams = [
                    self.sd.Stream(remote=mds[n], local=os.path.join(cache, n), proportion=s["weight"])
                    for n, s in mix.items()
                ]
                dataset = self.sd.StreamingDataset(
                    streams=streams, epoch_size=rows, batch_size=rank_batch, shuffle=False
                )
            self.loader = self.sd.StreamingDataLoader(dataset, batch_size=rank_batch, num_workers=0, collate_fn=collate)
            self.cache = cache

        def epoch(self) -> Dict[str, Any]:
            import torch

            start = time.monotonic()
            first = last = state = None
            seen = 0
            for batch in self.loader:
                last = time.monotonic()
                first = first or last
                seen += int(batch["ids"].shape[0])
                torch.sum(batch["tokens"])
                if state is None and seen >= rows // world // 2:
                    state = self.loader.state_dict()  # the global position: samples yielded x world size
            files = glob.glob(os.path.join(self.cache, "**", "*"), recursive=True)
            moved = sum(os.path.getsize(p) for p in files if os.path.isfile(p))
            epoch = epoch_figures(start, first, last, seen)
            return {"epoch": epoch, "moved": moved, "state": state}

        def resume(self, state: Dict[str, Any]) -> Dict[str, Any]:
            import torch

            self.loader.load_state_dict(state)
            begin = time.monotonic()
            torch.sum(next(iter(self.loader))["tokens"])
            return {"first_batch_s": time.monotonic() - begin}

    ranks = [Rank.remote(r, _free_port()) for r in range(world)]
    for r, rank in enumerate(ranks):
        ray.get(rank.build.remote(os.path.join(scratch, f"cache-{r}")))
    figures = ray.get([rank.epoch.remote() for rank in ranks])
    for r, rank in enumerate(ranks):  # a new machine's empty cache, as after a failure
        ray.get(rank.build.remote(os.path.join(scratch, f"cache-{r}-resume")))
    resume = ray.get([rank.resume.remote(f["state"]) for rank, f in zip(ranks, figures, strict=True)])
    for rank in ranks:
        ray.kill(rank)
    return summary(
        [f["epoch"] for f in figures],
        resume,
        sum(f["moved"] for f in figures),
        sampler.peak(),
        network="bytes of shard files in the 3 workers' caches",
        note=note,
        resume_state=figures[0]["state"],
    )


def _write_shards(data: str, scratch: str, rows: int, mix: Any) -> Any:
    """The MDS shards of the Parquet files: their folder, or with ``mix`` ``{source: folder}``."""
    files = len(glob.glob(os.path.join(data, "*.parquet")))
    if mix is None:
        write_mds(data, os.path.join(scratch, "mds"), rows // files)
        return os.path.join(scratch, "mds")
    out = {name: os.path.join(scratch, "mds-mix", name) for name in mix}
    for name, source in mix.items():
        write_mds(source["folder"], out[name], rows // files)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
