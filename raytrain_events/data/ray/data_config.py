"""How Ray Train hands the run's datasets to a worker group: the `DataConfig` it runs at each group's start.

`TrainDataConfig` gives every worker the train set as a `GlobalOrderShard` (``loader.py`` reads it) served by one
`EpochFeeder` per worker group (``feeder.py``): made on the driver for the first group (`start_feeder`, so the
stream starts while Ray Train starts the workers) and anew for a restarted one. Eval sets are split by Ray: a
streaming split, or contiguously by rank with ``deterministic_split=True`` (`DeterministicSplitDataConfig`), or one
contiguous part per tensor group under tensor parallelism (see ``loader.py``'s module doc); the sets split by rank
are read once per fit, on the driver (`TrainDataConfig.read_once`). `cheap_row_count`: a
train set's rows from metadata, never by running its pipeline.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ray.train import DataConfig

from raytrain_events.data.order import GlobalBatch, TrainOrder
from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
from raytrain_events.data.ray.loader import GlobalOrderShard
from raytrain_events.data.ray.parquet_seek import is_seekable
from raytrain_events.parallel.world import check_tensor_parallel_world
from raytrain_events.ray import _compat

__all__ = ["DeterministicSplitDataConfig", "TrainDataConfig", "cheap_row_count"]


class DeterministicSplitDataConfig(DataConfig):
    """Split each dataset into equal contiguous parts by rank, the same on every run."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        output: List[Dict[str, Any]] = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            parts = dataset.split(world_size, equal=True)
            for rank, part in enumerate(parts):
                output[rank][name] = part.iterator()
        return output


class TrainDataConfig(DeterministicSplitDataConfig):
    """Train set in one global order (an `EpochFeeder` per worker group); eval sets split by Ray.

    ``batch``: the run's `GlobalBatch` (rows per optimizer step for a world size); ``order``: its
    `TrainOrder`, which every rank's shard carries (both the driver's `RunPlan`'s). ``deterministic``:
    materialize the train set once per group (else stream it every epoch) and split eval sets
    contiguously by rank. ``tensor_parallel``: the ranks per tensor group, which get the same rows
    (see the module doc); 1: none. ``serving_rank``: ``(rank, world_size) -> the rank served as``
    (`ParallelismSpec.serving_rank`, the driver's; None: each rank as itself).
    """

    def __init__(  # noqa: PLR0913 (keyword-only: the run plan's decisions and the world's split)
        self,
        *,
        batch: GlobalBatch,
        order: TrainOrder = TrainOrder(),
        deterministic: bool = False,
        train_rows: Optional[int] = None,
        tensor_parallel: int = 1,
        serving_rank: Optional[Callable[[int, int], int]] = None,
    ):
        super().__init__()
        self.train_rows = train_rows
        self.tensor_parallel = tensor_parallel
        self.serving_rank = serving_rank
        self.batch = batch
        self.order = order
        self.deterministic = deterministic
        self.feeder: Any = None  # the first group's feeder when the driver made it (`start_feeder`)
        self.source: Any = None
        self.feeder_world = 0

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        tp = self.tensor_parallel
        check_tensor_parallel_world(world_size, tp)
        output: List[Dict[str, Any]] = [{} for _ in range(world_size)]
        serving = self.serving_rank
        served = [rank if serving is None else serving(rank, world_size) for rank in range(world_size)]
        others = {name: ds for name, ds in datasets.items() if name != "train"}
        if others and tp > 1:  # one contiguous part per tensor group, shared by its ranks
            for name, dataset in others.items():
                parts = dataset.split(world_size // tp, equal=True)
                for rank in range(world_size):
                    output[rank][name] = parts[served[rank] // tp].iterator()
        elif others:
            configure = super().configure if self.deterministic else DataConfig().configure
            for rank, shards in enumerate(configure(others, world_size, worker_handles, worker_node_ids, **kwargs)):
                output[rank].update(shards)
        if "train" in datasets:
            import ray

            dataset = datasets["train"]
            global_batch = self.batch.rows(world_size)
            ready = self.feeder is not None and world_size == self.feeder_world  # made on the driver (`start_feeder`)
            if ready and ray.get(self.feeder.claim.remote()):  # the first group's; a restarted group makes its own
                feeder, source = self.feeder, self.source
            else:
                feeder, source = self._new_feeder(dataset, world_size)
            rows = self.train_rows if self.train_rows is not None else _compat.dataset_meta_count(dataset)
            for rank in range(world_size):
                output[rank]["train"] = GlobalOrderShard(
                    feeder,
                    served[rank],
                    world_size,
                    global_batch,
                    rows,
                    tp,
                    source,
                    getattr(dataset, "run", None),
                    self.order,
                )
        return output

    def read_once(self, datasets: Dict[str, Any]) -> Dict[str, Any]:
        """``datasets`` as Ray Train is to get them: each eval set that `configure` splits by rank (with
        ``deterministic`` or tensor parallelism: `Dataset.split`, which reads the whole set) read into the object
        store here, on the driver, once per fit. Ray Train runs `configure` in an actor of each worker group's own,
        so a split set was read again at every group's start (its read tasks in new worker processes: seconds
        before a restarted group trained); now every group splits the blocks read here. They live while the
        driver holds them (the fit): the first group's split held the whole set too, so the most held is the same,
        only also between groups. A streamed set (Ray's streaming split, the default) is read at each pass
        anyway: left as it is."""
        if not (self.deterministic or self.tensor_parallel > 1):
            return datasets
        return {
            name: dataset if name == "train" or not hasattr(dataset, "materialize") else dataset.materialize()
            for name, dataset in datasets.items()
        }

    def _new_feeder(self, dataset: Any, world_size: int) -> Any:
        """A group's `EpochFeeder` actor (pinned to this node: the driver's or Ray Train's controller's,
        which outlive the workers) and ``[ObjectRef of the train set]`` it loads from."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        tp = self.tensor_parallel
        here = ray.get_runtime_context().get_node_id()
        options = {"consumers": tp} if tp > 1 else {}
        # The dataset goes by reference in each start_epoch call, not as a constructor argument
        # (a restartable actor's constructor arguments in the object store: ray issue 53727).
        source = [ray.put(dataset)]
        feeder = (
            ray.remote(EpochFeeder)
            .options(**FEEDER_OPTIONS, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False))
            .remote(None, world_size // tp, self.batch.rows(world_size), self.deterministic, **options)
        )
        return feeder, source

    def start_feeder(self, dataset: Any, world_size: int, start: Tuple[int, int]) -> Any:
        """On the driver, before Ray Train starts the worker group: the first group's feeder, its stream
        of epoch ``start[0]`` from global sample ``start[1]`` in the run's order started now
        (`EpochFeeder.prestart`, a guess the first rank's request confirms or replaces). Returns the feeder."""
        self.feeder, self.source = self._new_feeder(dataset, world_size)
        self.feeder_world = world_size
        self.feeder.prestart.remote(start[0], start[1], self.order, self.source)
        return self.feeder


def cheap_row_count(dataset: Any) -> Optional[int]:
    """Rows of ``dataset`` from metadata, or from a bare read (files' row counts, no data columns).

    None when counting would run a preprocessing pipeline (``map_batches``, ``filter``...). A
    seekable source (`parquet_seek.ParquetRowGroups`) counts from the footers it read when built.
    """

    if is_seekable(dataset):
        return dataset.count()
    rows = _compat.dataset_meta_count(dataset)
    if rows is not None:
        return rows
    if _compat.is_bare_read(dataset):
        return dataset.count()  # Ray counts a bare read from the files' metadata (no data columns read)
    return None
