"""The train order's small typed values: `GlobalBatch` (rows per optimizer step) and `TrainOrder` (seed, row shuffle).

Both are decided once on the driver (`ray/plan.RunPlan`) and travel with what they configure: the
`TrainDataConfig` (the feeder's global batch and its prestart's order) and each rank's
`GlobalOrderShard` (the loader asks the feeder for that order). No worker, loader or feeder works
them out from the run's options again. On the feeder (``feeder.py``), `EpochOrder` is one epoch's order
(`TrainOrder.of_epoch`: the block permutation's seed and the `RowShuffle`, if any), `StreamStart` where a
seekable source's stream entered the epoch, and `BatchCut` one global batch cut into the ranks' parts.
No Ray, no torch: the feeder imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Tuple

__all__ = ["BatchCut", "EpochOrder", "GlobalBatch", "RowShuffle", "StreamStart", "TrainOrder"]


@dataclass(frozen=True)
class GlobalBatch:
    """Rows per optimizer step: ``fixed`` (``global_batch_size``) whatever the world size, else
    ``per_rank`` (``batch_size``) times the data-parallel ranks, ``world_size // group`` (``group``: the
    ranks that share rows, TP x CP)."""

    per_rank: int
    fixed: Optional[int] = None
    group: int = 1

    def readers(self, world_size: int) -> int:
        """The data-parallel ranks (parts of each global batch) of a group of ``world_size`` workers."""
        return world_size // max(1, self.group)

    def rows(self, world_size: int) -> int:
        """The global batch of a group of ``world_size`` workers."""
        return self.fixed or self.per_rank * self.readers(world_size)

    def at(self, world_size: int) -> GlobalBatch:
        """This batch fixed at its size for ``world_size`` workers, whatever the world that is served it later
        (replica groups: every quorum is served the run's whole global batch)."""
        return GlobalBatch(self.per_rank, self.rows(world_size), self.group)


@dataclass(frozen=True)
class RowShuffle:
    """Rows permuted within windows of at least ``window_rows`` rows (`shuffle.WindowIndex`), keyed by (seed, epoch)."""

    seed: int
    epoch: int
    window_rows: int


@dataclass(frozen=True)
class EpochOrder:
    """One epoch's order on the feeder: blocks permuted with ``block_seed + epoch`` (None: the dataset's own
    order), then rows within windows (``shuffle``; None: no row shuffle). ``mixture``: for a mixture's train set
    whose online policy switched the weights, the `Mixture` with its switch stages, which the stream follows
    instead of the set's own (None: the set's own order; `mixture_source.MixtureSource.stream`)."""

    block_seed: Optional[int] = None
    shuffle: Optional[RowShuffle] = None
    mixture: Any = field(default=None, hash=False)

    @property
    def window_rows(self) -> int:
        """Rows per shuffle window (0: no row shuffle)."""
        return 0 if self.shuffle is None else self.shuffle.window_rows


@dataclass(frozen=True)
class TrainOrder:
    """The run's train order: with a row shuffle asked for (``shuffle_buffer_size``) and a seed, each epoch
    permutes the dataset's blocks with seed + epoch, then its rows within windows of ``shuffle_rows`` rows
    (feeder.py, shuffle.py); else the dataset's own order."""

    seed: Optional[int] = None  #: the block order's seed (None: the dataset's own order)
    shuffle_rows: Optional[int] = None  #: ``shuffle_buffer_size``: rows per shuffle window

    @classmethod
    def of(cls, seed: Optional[int], shuffle_buffer_size: Optional[int]) -> TrainOrder:
        """The order a run's ``seed`` and ``shuffle_buffer_size`` ask for (no shuffle without both)."""
        return cls(seed if shuffle_buffer_size and seed is not None else None, shuffle_buffer_size)

    def of_epoch(self, epoch: int, mixture: Any = None) -> EpochOrder:
        """Epoch ``epoch``'s order on the feeder (``mixture``: a switched mixture's, see `EpochOrder`)."""
        if self.seed is None or not self.shuffle_rows:
            return EpochOrder(self.seed, mixture=mixture)
        return EpochOrder(self.seed, RowShuffle(self.seed, epoch, self.shuffle_rows), mixture)


class StreamStart(NamedTuple):
    """Where an epoch's stream starts: its first global ``row`` and shuffle ``window`` number (a seekable source
    enters the epoch there; a Ray Dataset starts at (0, 0))."""

    row: int = 0
    window: int = 0


class BatchCut(NamedTuple):
    """A global batch of rows ``[start, start + parts * size + extra)`` cut into ``parts`` contiguous parts of
    ``size`` rows, the first ``extra`` parts one row more (`feeder.rank_rows`' cut, computed once per batch)."""

    start: int
    size: int
    extra: int

    @classmethod
    def of(cls, start: int, end: int, parts: int) -> BatchCut:
        """The cut of rows ``[start, end)`` into ``parts`` parts."""
        return cls(start, *divmod(end - start, parts))

    def part(self, i: int) -> Tuple[int, int]:
        """Rows ``[a, b)`` of part ``i``."""
        a = self.start + i * self.size + min(i, self.extra)
        return a, a + self.size + (1 if i < self.extra else 0)
