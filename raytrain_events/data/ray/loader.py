"""Worker-side data: the train set in one global order, eval sets as Ray shards.

Train data: `TrainDataConfig` (``data_config.py``) gives every worker a `GlobalOrderShard` served by one `EpochFeeder`
per worker group (see ``feeder.py``): rank ``r``'s batches are a function of the epoch's global
position, the global batch size and the world size, so a checkpoint's global ``sample_in_epoch``
says exactly which rows are done and a group of any size resumes with the rest
(`GlobalOrderLoader.set_position`, called by the loop instead of skipping batches). The default
streams the dataset each epoch; ``deterministic_split=True`` materializes it once per group.

Eval data: `ShardLoader` iterates the worker's Ray shard (``iter_torch_batches``) once per
epoch; `TrainDataConfig` splits eval sets with Ray's streaming split, or contiguously by rank
(``Dataset.split``) with ``deterministic_split=True``.

Tensor parallelism (``tensor_parallel=t``): the ``t`` consecutive ranks of a tensor group compute
one replica, so they must see the same rows. Every split is then by the data-parallel
coordinates ``(rank // t, world_size // t)``: the feeder cuts each global batch into
``world_size // t`` parts and serves part ``rank // t`` to each rank of the group (one cursor per
rank, `feeder.py`), and eval sets are split contiguously into ``world_size // t`` parts (a
streaming split cannot hand one part to several workers), each group's ranks sharing one.
``batch_size`` stays rows per worker per batch, so the default global batch is
``batch_size * world_size // t`` (`GlobalBatch`, decided once on the driver: ``ray/plan.py``).
Ranks that share rows but are not consecutive (``FSDPConfig(pipeline_outermost=True)``: a
pipeline's stages ``world_size / p`` apart) are served as the ranks ``serving_rank`` maps them to
(`ParallelismSpec.serving_rank`, a permutation that makes each such group consecutive): the shard's
``rank`` and its eval part are the mapped rank's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from raytrain_events.core.mixture_plan import MixtureRun
from raytrain_events.core.segments import is_segmented
from raytrain_events.data.order import TrainOrder
from raytrain_events.data.ray import block_fetch  # cluster_node read through it: tests stand in another node
from raytrain_events.data.ray.batch_tensors import table_to_torch
from raytrain_events.data.ray.block_fetch import finish_fetch, local_rows, start_fetch
from raytrain_events.data.ray.feeder import batches_in_epoch
from raytrain_events.data.ray.packed_batch import expand_batch, expand_packed, packed_tensors
from raytrain_events.data.ray.prefetch import prefetched
from raytrain_events.data.ray.slices import RowRange, Slice
from raytrain_events.ray._compat import ndarray_batch_to_torch

__all__ = ["ShardLoader", "GlobalOrderLoader", "GlobalOrderShard", "pick_columns"]


class ShardLoader:
    """An iterable over a Ray ``DataIterator`` shard: one full pass per ``iter()``."""

    def __init__(
        self,
        shard: Any,
        *,
        batch_size: int,
        device: Any = "auto",
        collate_fn: Optional[Callable] = None,
        prefetch_batches: int = 1,
        drop_last: bool = False,
        shuffle_buffer_size: Optional[int] = None,
        seed: Optional[int] = None,
        columns: Optional[List[str]] = None,
        length: Optional[int] = None,
    ) -> None:
        self.shard = shard
        self.length = length
        self.batch_size = batch_size
        self.device = device
        self.collate_fn = collate_fn
        self.prefetch_batches = prefetch_batches
        self.drop_last = drop_last
        self.shuffle_buffer_size = shuffle_buffer_size
        self.seed = seed
        self.columns = columns
        self.epoch = 0

    def __len__(self) -> int:
        """Batches per epoch, when the driver could tell (the loop uses it for epoch-based time)."""
        if self.length is None:
            raise TypeError("This shard's length is unknown; pass steps_per_epoch to RayTrainer.")
        return self.length

    def set_epoch(self, epoch: int) -> None:
        """Called by the loop at each epoch start: reseeds the local shuffle."""
        self.epoch = epoch

    def __iter__(self):
        kwargs: Dict[str, Any] = dict(
            batch_size=self.batch_size,
            prefetch_batches=self.prefetch_batches,
            drop_last=self.drop_last,
            device=self.device,
        )
        if self.collate_fn is not None:
            collate, columns = self.collate_fn, self.columns
            # `columns`: only those reach collate_fn (the numpy batch's other columns are dropped first)
            kwargs["collate_fn"] = collate if columns is None else (lambda batch: collate(pick_columns(batch, columns)))
        if self.shuffle_buffer_size:
            kwargs["local_shuffle_buffer_size"] = self.shuffle_buffer_size
            kwargs["local_shuffle_seed"] = None if self.seed is None else self.seed + self.epoch
        batches = self.shard.iter_torch_batches(**kwargs)
        if self.columns is None or self.collate_fn is not None:
            return iter(batches)
        return (pick_columns(batch, self.columns) for batch in batches)


def pick_columns(batch: Any, columns: List[str]) -> Any:
    """Only ``columns`` of a dict batch (or a pyarrow table); a missing one fails naming the columns there."""
    names = list(batch.column_names) if hasattr(batch, "column_names") else list(batch)
    missing = [c for c in columns if c not in names]
    if missing:
        raise KeyError(
            f"The dataset has no column(s) {missing}; its batches have columns {sorted(names)}. "
            "Rename the columns (Dataset.rename_columns) or change columns= (or the model's input/target keys)."
        )
    if hasattr(batch, "select"):
        return batch.select(columns)
    return {c: batch[c] for c in columns}


@dataclass
class GlobalOrderShard:
    """What a worker gets for the train set: the group's feeder and how batches are cut."""

    feeder: Any
    rank: int
    world_size: int
    global_batch: int
    num_rows: Optional[int]
    tensor_parallel: int = 1  # ranks per tensor group, which share one part of each global batch
    source: Any = None  # [ObjectRef of the train set]: the feeder loads it from here (feeder.py, Restarts)
    mixture: Optional[MixtureRun] = None  # a MixtureSource's run (mixture_loader.py), else None
    order: TrainOrder = TrainOrder()  # the run's train order (the driver's `RunPlan.order`)

    @property
    def data_world_size(self) -> int:
        """The parts each global batch is split into: ``world_size // tensor_parallel``."""
        return self.world_size // self.tensor_parallel


_MAX_CHUNK = 16  # batches per feeder call once an epoch is under way
_RECONNECTS = 3  # times a rank asks a restarted feeder again before the error ends the worker
_RESTART_WAIT_S = 60.0  # how long a rank waits for a dead feeder to come back before it fails


def _call_feeder(submit: Callable[[], Any]) -> Any:
    """``ray.get`` of a feeder call, submitted again while the feeder is down and restarting (Ray
    refuses calls to a restarting actor with ``ActorUnavailableError``) for up to `_RESTART_WAIT_S`."""
    import ray

    deadline = time.monotonic() + _RESTART_WAIT_S
    ref = submit()
    while True:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            ref = submit()


class GlobalOrderLoader:
    """This rank's batches of the global order (the shard's `TrainOrder`): one epoch per ``iter()`` from the set
    position."""

    def __init__(
        self,
        shard: GlobalOrderShard,
        *,
        device: Any = "auto",
        collate_fn: Optional[Callable] = None,
        prefetch_batches: int = 1,
        columns: Optional[List[str]] = None,
        length: Optional[int] = None,
    ) -> None:
        self.shard = shard
        self.collate_fn = collate_fn
        self.prefetch_batches = max(1, prefetch_batches)
        self.columns = columns
        self.length = length
        self.device = device
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches in a whole epoch (from the row count in the dataset's metadata, or steps_per_epoch)."""
        if self.length is not None:
            return self.length
        if self.shard.num_rows is None:
            raise TypeError("The train set's row count is unknown; pass steps_per_epoch to RayTrainer.")

        return batches_in_epoch(self.shard.num_rows, self.shard.global_batch, self.shard.data_world_size)

    def set_epoch(self, epoch: int) -> None:
        """Called by the loop at each epoch start: selects the epoch's order."""
        self.epoch = epoch
        self.position = 0

    def set_position(self, samples_in_epoch: int) -> None:
        """Start the next ``iter()`` after the first ``samples_in_epoch`` rows of the epoch (a resume)."""
        self.position = samples_in_epoch

    def __iter__(self):
        """The epoch's batches, made one to ``prefetch_batches`` ahead in a thread (`prefetched`): the
        train thread only takes finished batches, as from Ray Data's ``iter_torch_batches``."""

        epoch, position = self.epoch, self.position
        self._start(epoch, position, 0)
        return prefetched(self._batches(epoch, position), self.prefetch_batches, "raytrain-train-batches")

    def device_transforms(self, batch: Any) -> Any:
        """Finish a batch on the device the loop moved it to (`DataSpec` runs this before the user's own
        ``device_transforms``): a packed ``document_ids`` batch, made as segments (`packed_batch.packed_tensors`,
        O(runs + sequences) numbers on the host), gets its per-token ``document_ids``/``position_ids`` there
        (`packed_batch.expand_batch`: a few kernels) and then ``columns`` picked; any other batch as it is.
        Iterating the loader outside the `Trainer`, call it on each batch for the batch the model sees."""
        if is_segmented(batch):
            batch = expand_batch(batch)
            return batch if self.columns is None else pick_columns(batch, self.columns)
        return batch

    def _batches(self, epoch: int, position: int):
        import ray

        shard = self.shard
        here = block_fetch.cluster_node()  # None on a one-node cluster: blocks are fetched whole, as they are local
        # Batches are asked for in chunks (1, 2, 4... up to `_MAX_CHUNK`, at least `prefetch_batches`),
        # one chunk always in flight: an early first batch, then one feeder call per many batches.
        # A chunk's blocks are fetched together (consecutive batches mostly share a block); a block on
        # another node is cut there to this rank's rows (`block_fetch`), never pulled whole, and those
        # cut tasks start as soon as the chunk's answer is in, while the chunk before it trains.
        first, count = 0, self.prefetch_batches
        pending = shard.feeder.batches.remote(epoch, position, shard.rank, first, count)
        ahead = None  # the next chunk (its answer, its fetch started) when it came in early
        while pending is not None or ahead is not None:
            if ahead is None:
                served = self._served(pending, epoch, position, first, count)
                started = start_fetch(served, here)
            else:
                (served, started), ahead = ahead, None
            first, count = first + count, max(self.prefetch_batches, min(2 * count, _MAX_CHUNK))
            ended = not served or served[-1] is None
            pending = None if ended else shard.feeder.batches.remote(epoch, position, shard.rank, first, count)
            blocks = finish_fetch(started)
            for slices in served:
                if slices is None:
                    return
                if here is not None and pending is not None and ray.wait([pending], timeout=0)[0]:
                    answer = self._served(pending, epoch, position, first, count)
                    ahead, pending = (answer, start_fetch(answer, here)), None
                yield self._to_batch(slices, blocks)

    def _served(self, pending: Any, epoch: int, position: int, first: int, count: int) -> List[Any]:
        """The feeder's answer to ``pending``. If the feeder died (it restarts, ``max_restarts``) or
        restarted since the last call (it answers None: no such epoch), the same batches are asked
        again after starting the epoch there from batch ``first`` (the feeder rebuilds it)."""
        import ray

        shard = self.shard
        try:
            served = ray.get(pending)
        except ray.exceptions.RayActorError:
            served = None  # the feeder died during the call
        for _ in range(_RECONNECTS):
            if served is not None:
                return served
            self._start(epoch, position, first)
            served = _call_feeder(lambda: shard.feeder.batches.remote(epoch, position, shard.rank, first, count))
        if served is not None:
            return served
        raise RuntimeError(
            f"The train feeder lost epoch {epoch} (from sample {position}) {_RECONNECTS} times in a row while "
            f"rank {shard.rank} needed its batch {first}; the worker group restarts from its last checkpoint."
        )

    def _start(self, epoch: int, position: int, resume_batch: int) -> None:
        """Start (or, after a feeder restart, rebuild from ``resume_batch``) the epoch on the feeder."""
        shard = self.shard
        _call_feeder(
            lambda: shard.feeder.start_epoch.remote(
                epoch, position, shard.order, shard.rank, resume_batch, source=shard.source
            )
        )

    def _to_batch(self, slices, blocks: Dict[Any, Any]) -> Any:
        """The batch of ``slices``: a dict of tensors straight from the Arrow columns (`batch_tensors`:
        token lists and binaries without per-row objects), or ``collate_fn`` of Ray's NumPy batch."""
        import pyarrow as pa
        from ray.data.block import BlockAccessor

        parts = [_part(piece, blocks) for piece in _merged(slices)]
        # Packed runs: the public columns, a document_ids batch as segments (finished on the device, `device_transforms`)
        packed = packed_tensors(parts, expand=False) if self.collate_fn is None else None
        if packed is not None:
            return packed if self.columns is None or is_segmented(packed) else pick_columns(packed, self.columns)
        parts = expand_packed(parts)
        if self.columns is not None:  # only these columns reach the batch (and collate_fn)
            parts = [pick_columns(part, self.columns) if isinstance(part, pa.Table) else part for part in parts]
        if self.collate_fn is None and all(isinstance(part, pa.Table) for part in parts):
            return table_to_torch(parts[0] if len(parts) == 1 else pa.concat_tables(parts))
        if len(parts) == 1:
            table = parts[0]
        else:
            builder = BlockAccessor.for_block(parts[0]).builder()
            for part in parts:
                builder.add_block(part)
            table = builder.build()
        batch = BlockAccessor.for_block(table).to_batch_format("numpy")
        if self.columns is not None:
            batch = pick_columns(batch, self.columns)
        if self.collate_fn is not None:
            return self.collate_fn(batch)

        return ndarray_batch_to_torch(batch)


def _merged(slices: List[Slice]) -> List[Slice]:
    """``slices`` with consecutive row ranges of one block joined (row groups of one read)."""
    out: List[Slice] = []
    for piece in slices:
        joined = out[-1].then(piece) if out else None
        if joined is not None:
            out[-1] = joined
        else:
            out.append(piece)
    return out


def _part(piece: Slice, blocks: Dict[Any, Any]) -> Any:
    """One slice of a batch as a block: rows ``lo:hi`` of a block, or a take across a window's blocks.

    ``blocks``: ref -> (the block, or the rows of it this rank fetched; which rows: None = all).
    """
    from ray.data.block import BlockAccessor

    if isinstance(piece, RowRange):
        ref, lo, hi = piece
        block, rows = blocks[ref]
        at = int(local_rows(rows, lo))
        return BlockAccessor.for_block(block).slice(at, at + hi - lo, copy=False)
    refs, which, wanted = piece
    import numpy as np

    fetched = [blocks[ref] for ref in refs]
    local = np.asarray(wanted, dtype=np.int64).copy()
    for j, (_, rows) in enumerate(fetched):
        if rows is not None:
            mask = which == j
            local[mask] = local_rows(rows, local[mask])
    tables = [block for block, _ in fetched]
    if len(tables) == 1:
        return BlockAccessor.for_block(tables[0]).take(local)
    builder = BlockAccessor.for_block(tables[0]).builder()
    for table in tables:
        builder.add_block(table)
    sizes = np.array([BlockAccessor.for_block(t).num_rows() for t in tables], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return BlockAccessor.for_block(builder.build()).take(starts[which] + local)
