"""Global data order for training: every rank's batches are a function of one position in one order.

An epoch is one pass over the train dataset in a fixed order (the dataset's own order, Ray Data
``preserve_order``; optionally its blocks permuted with ``seed + epoch``). The order is cut into
global batches of ``global_batch`` rows starting at the epoch's position (the global samples
already trained, 0 at an epoch start), and each global batch is split into ``world_size``
contiguous, near-equal parts: rank ``r`` trains part ``r``. After ``k`` batches, whatever the
number of workers, exactly the rows ``[0, position + trained)`` of the order are done, so a
checkpoint's global ``sample_in_epoch`` is the whole data position, and a resumed group of any
size re-splits the rest.

`EpochFeeder` is a Ray actor (one per worker group, like Ray Data's split coordinator): it runs
the dataset's streaming execution once per epoch and hands each rank the block references and row
ranges of its next batch. Blocks wholly before the position are never fetched by a worker;
workers fetch only the blocks that hold their rows.

The last global batch of an epoch may be short; if it would have fewer rows than there are
workers (some rank would get none) its rows join the batch before it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.ray import _compat

__all__ = ["EpochFeeder", "rank_rows", "batches_in_epoch"]

Slice = Tuple[Any, int, int]  # (block ref, first row, end row) within that block


def rank_rows(start: int, end: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rank ``rank``'s contiguous part ``[a, b)`` of the global batch ``[start, end)``."""
    q, rem = divmod(end - start, world_size)
    a = start + rank * q + min(rank, rem)
    return a, a + q + (1 if rank < rem else 0)


def batches_in_epoch(rows: int, global_batch: int, world_size: int, position: int = 0) -> int:
    """Global batches from ``position`` to the end of an epoch of ``rows`` rows (see module doc)."""
    remaining = rows - position
    if remaining <= 0:
        return 0
    full, tail = divmod(remaining, global_batch)
    if tail == 0:
        return full
    if tail >= world_size or full == 0:
        return full + 1
    return full  # the short tail joins the last full batch


class _Epoch:
    """One epoch's stream of blocks, buffered from the oldest row any rank still needs."""

    def __init__(self, bundles: Any, position: int, global_batch: int, world_size: int) -> None:
        self.bundles = bundles
        self.position = position
        self.global_batch = global_batch
        self.world_size = world_size
        self.blocks: List[Tuple[Any, int, int, int]] = []  # (ref, offset in block, rows, global start)
        self.pulled = 0  # rows of the order seen so far
        self.done = False
        self.next_batch = [0] * world_size

    def _pull_until(self, rows: int) -> None:
        while not self.done and self.pulled < rows:
            try:
                bundle = next(self.bundles)
            except StopIteration:
                self.done = True
                break
            slices = getattr(bundle, "slices", None) or [None] * len(bundle.blocks)
            for entry, piece in zip(bundle.blocks, slices):
                ref, meta = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
                offset, count = (0, meta.num_rows) if piece is None else (piece.start_offset, piece.num_rows)
                if count:
                    self.blocks.append((ref, offset, count, self.pulled))
                    self.pulled += count

    def batch_range(self, k: int) -> Optional[Tuple[int, int]]:
        """Global rows ``[start, end)`` of batch ``k`` of this epoch, or None past its end."""
        g, w = self.global_batch, self.world_size
        start = self.position + k * g
        self._pull_until(start + g + w)  # enough to know whether a short tail follows this batch
        left = self.pulled - start
        if left <= 0 or (k > 0 and self.done and left < w):
            return None  # the epoch is over (a short tail went with the batch before)
        if left < w:
            raise ValueError(
                f"The train data has {left} rows left in this epoch (from row {start}), fewer than the {w} "
                "workers: every worker needs at least one row per batch. Use fewer workers or more data."
            )
        end = min(start + g, self.pulled)
        if self.done and 0 < self.pulled - end < w:
            end = self.pulled  # the short tail joins this batch
        return start, end

    def slices(self, a: int, b: int) -> List[Slice]:
        out: List[Slice] = []
        for ref, offset, count, first in self.blocks:
            lo, hi = max(a, first), min(b, first + count)
            if lo < hi:
                out.append((ref, offset + lo - first, offset + hi - first))
        return out

    def serve(self, rank: int, k: int) -> Optional[List[Slice]]:
        rows = self.batch_range(k)
        self.next_batch[rank] = max(self.next_batch[rank], k + 1)
        if rows is None:
            return None
        a, b = rank_rows(rows[0], rows[1], rank, self.world_size)
        out = self.slices(a, b)
        # Drop blocks every rank is past (their refs travel with the slices already served).
        oldest = self.position + min(self.next_batch) * self.global_batch
        self.blocks = [blk for blk in self.blocks if blk[3] + blk[2] > oldest]
        return out


class EpochFeeder:
    """Serves each rank's batches of the global order (run as a Ray actor; see module doc)."""

    def __init__(self, dataset: Any, world_size: int, global_batch: int, materialize: bool = False) -> None:
        dataset = dataset.copy(dataset) if hasattr(dataset, "copy") else dataset
        dataset.context.execution_options.preserve_order = True
        self.dataset = dataset.materialize() if materialize else dataset
        self.world_size = world_size
        self.global_batch = global_batch
        self.epochs: Dict[Tuple[int, int], _Epoch] = {}

    def start_epoch(self, epoch: int, position: int, order_seed: Optional[int], rank: int) -> bool:
        """Every rank calls this at its epoch start with the same arguments; the first one starts it.

        Each (epoch, position) is served once per worker group: the blocks a rank is past are
        dropped, so a rank starting a pass it has already taken batches from (a Trainer rebuilt or
        reset to time zero inside the same group) is refused here, not given empty batches later.
        """
        key = (epoch, position)
        started = self.epochs.get(key)
        if started is not None and started.next_batch[rank] > 0:
            raise RuntimeError(
                f"Rank {rank} started epoch {epoch} at sample {position} of the train set's global order a "
                "second time in this worker group; each epoch is served once per group. Train on with "
                "Trainer.fit(duration=...) (the next epoch), or start a new run (RayTrainer.fit) to begin again."
            )
        if key not in self.epochs:
            dataset = self.dataset
            if order_seed is not None:
                dataset = dataset.randomize_block_order(seed=order_seed + epoch)
            self.epochs = {k: v for k, v in self.epochs.items() if k[0] >= epoch - 1}
            self.epochs[key] = _Epoch(_compat.iter_block_refs(dataset), position, self.global_batch, self.world_size)
        return True

    def batches(self, epoch: int, position: int, rank: int, first: int, count: int) -> List[Optional[List[Slice]]]:
        """Rank ``rank``'s batches ``first .. first + count - 1`` (from the epoch's start position).

        Each is a list of block slices; a None ends the list at the epoch's end. Several batches per
        call because every call is an actor round trip: one per batch costs a worker more CPU than
        Ray Data's own iterator spends on the batch.
        """
        state = self.epochs.get((epoch, position))
        if state is None:
            return [None]
        served: List[Optional[List[Slice]]] = []
        for k in range(first, first + count):
            slices = state.serve(rank, k)
            served.append(slices)
            if slices is None:
                break
        return served
