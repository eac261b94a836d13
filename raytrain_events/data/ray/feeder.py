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

Cost and memory at scale: the execution is pulled by a background thread (`_Epoch`), a bounded
distance ahead of the furthest batch asked for (``_AHEAD_BATCHES`` global batches), and the actor is
threaded (``max_concurrency``), so a rank's call never waits behind another rank's pull. Buffered
blocks are indexed by global row and trimmed from the front once every rank is past them
(`row_index.BlockIndex`): a call costs O(log blocks + its own slices), whatever the buffer, and
the buffer holds the blocks between the slowest rank and the pull front, at any position (blocks
before a resume's position are passed over, never held).

Restarts: the actor is created with ``max_restarts`` and without the dataset (its constructor
arguments are small plain values, so Ray's creation task holds them inline and a restart cannot
lose them; a constructor argument in the object store could be gone by then, ray issue 53727).
The train set travels as ``[ObjectRef]`` in every `start_epoch` call, which each rank's loader
holds for the whole run; the first call, and a restarted feeder's, loads it from there. A
restarted feeder holds no epochs; each
rank's loader, on its next call, starts the epoch again with the batch it needs next
(`EpochFeeder.start_epoch` with ``resume_batch``) and the feeder rebuilds the epoch from (epoch,
position, seed), keeping rows from a few chunks before that batch on. Rows stay exactly once;
a rank that needs rows the rebuilt epoch no longer holds gets an error, so the worker group
restarts from its last checkpoint (``max_failures``) instead of training a wrong row.
A rank that *starts* the epoch (`EpochFeeder.start_epoch`) at a batch before what the pass still holds
opens the pass again there, in the same way: replica groups keep the driver's feeder across a restart of
every group, which resumes from a storage checkpoint older than the pass. A call waiting on the stopped
pass answers None, so its rank starts the epoch again and asks the new pass.

Tensor parallelism (``consumers`` > 1): the ``t`` ranks of a tensor group compute one model replica
together, so they must train the same rows. The global batch is then split into ``world_size``
parts as above (``world_size`` is the data-parallel size, the number of groups) and part ``p`` is
served to each of the ranks ``p * t .. p * t + t - 1``: every rank keeps its own cursor (its
own position in the epoch, a restart's ``resume_batch``), so a block is dropped only once all
``world_size * t`` ranks are past it, and each of a group's ranks gets every row of its part.
``consumers=1`` is the plain data-parallel case (part ``r`` to rank ``r``).

Started early: the driver creates the group's feeder before Ray Train starts the worker group and
calls `EpochFeeder.prestart` with the epoch the run will begin with (0, or the position of the
run's newest checkpoint, read from its manifest on the driver), so the stream's first blocks are
read while the workers start, not when the first rank asks. A prestarted epoch is only a guess:
the first rank's `start_epoch` uses it if it names the same (epoch, position) and order (seed,
row shuffle); otherwise the guess is stopped and dropped, and the epoch starts where the rank
asks, as without it. `EpochFeeder.start_report` says whether the first rank found it started.

The last global batch of an epoch may be short; if it would have fewer rows than there are
workers (some rank would get none) its rows join the batch before it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from raytrain_events.data.order import BatchCut, EpochOrder, StreamStart, TrainOrder
from raytrain_events.data.ray.block_fetch import CutterStarter
from raytrain_events.data.ray.parquet_seek import is_seekable
from raytrain_events.data.ray.row_index import BlockIndex, RankCursor
from raytrain_events.data.ray.shuffle import WindowIndex
from raytrain_events.data.ray.slices import Slice
from raytrain_events.ray import _compat

__all__ = ["EpochFeeder", "rank_rows", "batches_in_epoch", "FEEDER_OPTIONS"]

_AHEAD_BATCHES = 2  # global batches the pull runs ahead of the furthest batch asked for
_RESTART_SLACK = 40  # batches before a reconnecting rank's next batch a rebuilt epoch keeps (2 chunks + prefetch)
# Ray options of the feeder actor: calls served by a thread pool, and the actor restarted if its process dies.
FEEDER_OPTIONS: Dict[str, Any] = {"num_cpus": 0, "max_concurrency": 32, "max_restarts": 16, "max_task_retries": -1}


def rank_rows(start: int, end: int, rank: int, world_size: int) -> Tuple[int, int]:
    """Rank ``rank``'s contiguous part ``[a, b)`` of the global batch ``[start, end)``."""
    return BatchCut.of(start, end, world_size).part(rank)


def batch_end(start: int, rows: int, global_batch: int, world_size: int) -> int:
    """The end of the global batch that starts at row ``start`` of an epoch of ``rows`` rows: ``global_batch``
    rows on, or the epoch's end when the short tail after it has fewer rows than workers (it joins this batch)."""
    end = min(start + global_batch, rows)
    return rows if 0 < rows - end < world_size else end


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


def bundle_blocks(bundle: Any) -> Iterator[Tuple[Any, int, int]]:
    """``(ref, first row, rows)`` of each block of a Ray Data ``RefBundle`` (or a test's stand-in)."""
    slices = getattr(bundle, "slices", None) or [None] * len(bundle.blocks)
    for entry, piece in zip(bundle.blocks, slices):
        ref, meta = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
        offset, count = (0, meta.num_rows) if piece is None else (piece.start_offset, piece.num_rows)
        if count:
            yield ref, offset, count


class _Reopened(Exception):
    """A call waited on a pass that was stopped: the epoch was opened again (`EpochFeeder.start_epoch`)."""


class _Epoch:
    """One epoch's stream of blocks, pulled by a thread and buffered from the oldest row any rank needs.

    Thread-safe: the actor's call threads and the pull thread share one condition variable; the
    streaming execution's ``next`` runs outside it.
    """

    def __init__(
        self,
        bundles: Iterator[Any],
        position: int,
        global_batch: int,
        world_size: int,
        first_batch: int = 0,
        order: EpochOrder = EpochOrder(),
        seek: StreamStart = StreamStart(),
        consumers: int = 1,
    ) -> None:
        """``order``: the epoch's order (its `RowShuffle` permutes rows within windows: `shuffle.py`).
        ``seek``: the global row and shuffle window the stream starts at (a seekable source).
        ``consumers``: ranks served each part (a tensor group); ranks are ``0 .. world_size * consumers - 1``."""
        self.bundles = bundles
        self.position = position
        self.global_batch = global_batch
        self.world_size = world_size
        self.first_batch = first_batch  # batches before it are not served (a rebuilt epoch)
        self.order = order  # what the first rank's request must match to be served this stream
        self.prestarted = False  # started by `EpochFeeder.prestart`, no rank has asked for it yet
        shuffle = order.shuffle
        self.index: Any = (
            BlockIndex(seek.row) if shuffle is None else WindowIndex(shuffle.seed, shuffle.epoch, seek.row, seek.window)
        )
        self.window_rows = 0 if shuffle is None else max(1, shuffle.window_rows)
        self.consumers = consumers
        self.cursor = RankCursor(world_size * consumers, first_batch)  # one cursor per rank, not per part
        self.trimmed = first_batch  # the cursor's oldest batch when the index was last trimmed
        self.cuts: Dict[int, Optional[BatchCut]] = {}  # batch -> its cut into the ranks' parts
        self.done = False
        self.error: Optional[BaseException] = None
        self.stopped = False
        self.cond = threading.Condition()
        keep = position + first_batch * global_batch
        self.keep_from = keep  # rows before it are passed over, never held
        self.demand = keep + global_batch + world_size  # rows the pull makes available (then waits)
        self.ahead = _AHEAD_BATCHES * global_batch
        self.thread = threading.Thread(target=self._pull, name="raytrain-feeder-pull", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop the pull thread at its next block (the epoch is no longer served)."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _pull(self) -> None:
        cond, index = self.cond, self.index
        window: List[Tuple[Any, int, int]] = []  # blocks of the shuffle window being filled
        window_rows = 0
        cutters = CutterStarter()  # the first blocks' nodes get their cutter now, not at a rank's first batch
        try:
            while True:
                with cond:
                    while not self.stopped and index.end >= self.demand + self.ahead:
                        cond.wait()
                    if self.stopped:
                        return
                try:
                    bundle = next(self.bundles)
                except StopIteration:
                    with cond:
                        if window:
                            self._add_window(window, window_rows)
                        self.done = True
                        cond.notify_all()
                    return
                pieces = list(bundle_blocks(bundle))
                cutters([ref for ref, _, _ in pieces])
                with cond:
                    for ref, offset, count in pieces:
                        if self.window_rows:
                            window.append((ref, offset, count))
                            window_rows += count
                            if window_rows >= self.window_rows:
                                self._add_window(window, window_rows)
                                window, window_rows = [], 0
                        elif index.end + count <= self.keep_from:
                            index.skip(count)  # wholly before the rows still needed: not held
                        else:
                            index.append(ref, offset, count)
                    cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to every waiting call, which raises it
            with cond:
                self.error = error
                cond.notify_all()

    def _add_window(self, blocks: List[Tuple[Any, int, int]], rows: int) -> None:
        if self.index.end + rows <= self.keep_from:
            self.index.skip(rows)  # wholly before the rows still needed: not held
        else:
            self.index.append_window(blocks)

    def _wait_for(self, rows: int) -> None:
        """Block (the condition held) until ``rows`` rows of the order are pulled or the stream ends."""
        if rows > self.demand:
            self.demand = rows
            self.cond.notify_all()
        while self.index.end < rows and not self.done and self.error is None and not self.stopped:
            self.cond.wait()
        if self.stopped and self.index.end < rows and not self.done:
            raise _Reopened  # the pass was opened again: the call is answered from the new one (`batches`)
        if self.error is not None:
            raise RuntimeError(f"The train set's streaming execution failed: {self.error!r}") from self.error

    def batch_range(self, k: int) -> Optional[Tuple[int, int]]:
        """Global rows ``[start, end)`` of batch ``k`` of this epoch, or None past its end."""
        g, w = self.global_batch, self.world_size
        start = self.position + k * g
        self._wait_for(start + g + w)  # enough to know whether a short tail follows this batch
        pulled = self.index.end
        left = pulled - start
        if left <= 0 or (k > 0 and self.done and left < w):
            return None  # the epoch is over (a short tail went with the batch before)
        if left < w:
            raise ValueError(
                f"The train data has {left} rows left in this epoch (from row {start}), fewer than the {w} "
                "workers: every worker needs at least one row per batch. Use fewer workers or more data."
            )
        # Once the epoch's rows are all known, a short tail joins this batch.
        return start, batch_end(start, pulled, g, w) if self.done else min(start + g, pulled)

    def serve(self, rank: int, k: int) -> Optional[List[Slice]]:
        """Rank ``rank``'s slices of batch ``k`` (None past the epoch's end); call with ``cond`` held."""
        if k < self.first_batch:
            raise RuntimeError(
                f"The train feeder restarted and rebuilt this epoch from batch {self.first_batch}; rank {rank} "
                f"still needs batch {k}, whose rows it no longer holds. The worker group restarts from its last "
                "checkpoint (set max_failures >= 1 so that Ray Train restarts it)."
            )
        cut = self.cuts.get(k)
        if cut is None:  # once per global batch: its range and the size of each rank's part
            rows = self.batch_range(k)
            cut = self.cuts[k] = None if rows is None else BatchCut.of(rows[0], rows[1], self.world_size)
        cursor = self.cursor
        cursor.advance(rank, k + 1)
        if cut is None:
            return None
        # The data-parallel rank's part: a tensor group's ranks share one.
        out = self.index.slices(*cut.part(rank // self.consumers))
        if cursor.oldest != self.trimmed:  # every rank is past batch `oldest - 1`: drop its blocks
            self.trimmed = oldest = cursor.oldest
            self.index.trim(self.position + oldest * self.global_batch)
            for j in [j for j in self.cuts if j < oldest]:
                del self.cuts[j]
        return out


class EpochFeeder:
    """Serves each rank's batches of the global order (run as a Ray actor with `FEEDER_OPTIONS`)."""

    def __init__(
        self, dataset: Any, world_size: int, global_batch: int, materialize: bool = False, consumers: int = 1
    ) -> None:
        """``dataset``: a Ray Dataset, or a seekable source (a ``stream`` method: `parquet_seek.py`).
        ``world_size``: the parts each global batch is split into (the data-parallel size);
        ``consumers``: the ranks served each part (the tensor-parallel degree; see the module doc)."""
        if isinstance(consumers, bool) or not isinstance(consumers, int) or consumers < 1:
            raise ValueError(f"consumers={consumers!r} must be an integer >= 1 (ranks per tensor group).")
        self.materialize = materialize
        self.dataset: Any = None
        self.seekable = False
        if dataset is not None:
            self._set_dataset(dataset)
        self.world_size = world_size
        self.consumers = consumers
        self.global_batch = global_batch
        self.epochs: Dict[Tuple[int, int], _Epoch] = {}
        self.lock = threading.Lock()  # guards `epochs` (calls run in several threads)
        self.claimed = False  # a feeder made before the worker group: the first group's (`claim`)
        self.report: Dict[str, Any] = {}  # `start_report`: the prestart and the first rank's request

    def _set_dataset(self, dataset: Any) -> None:
        self.seekable = is_seekable(dataset)
        if not self.seekable:
            dataset = dataset.copy(dataset) if hasattr(dataset, "copy") else dataset
            dataset.context.execution_options.preserve_order = True
            dataset = dataset.materialize() if self.materialize else dataset
        self.dataset = dataset

    def _stream(self, epoch: int, order: EpochOrder, row: int) -> Tuple[Iterator[Any], StreamStart]:
        """The epoch's blocks from about global row ``row`` on, and where they start."""
        if self.seekable:
            stream = self.dataset.stream
            switched = {} if order.mixture is None else {"mixture": order.mixture}  # an online mixture's switches
            bundles, first, windows = stream(
                order.block_seed, epoch, row, order.window_rows, global_batch=self.global_batch, **switched
            )
            return bundles, StreamStart(first, windows)
        dataset = self.dataset
        if order.block_seed is not None:
            dataset = dataset.randomize_block_order(seed=order.block_seed + epoch)
        return _compat.iter_block_refs(dataset), StreamStart()

    def start_epoch(
        self,
        epoch: int,
        position: int,
        order: Optional[TrainOrder],
        rank: int,
        resume_batch: int = 0,
        source: Optional[List[Any]] = None,
        mixture: Any = None,
    ) -> bool:
        """Every rank calls this at its epoch start with the same arguments; the first one starts it.

        ``rank`` is the worker's own rank (``0 .. world_size * consumers - 1``).
        Each (epoch, position) is served once per worker group: the blocks a rank is past are
        dropped, so a rank starting a pass it has already taken batches from (a Trainer rebuilt or
        reset to time zero inside the same group) is refused here, not given empty batches later.
        ``order``: the run's `TrainOrder` (the shard's; None: the dataset's own order).
        ``resume_batch``: a rank reconnecting after the feeder restarted, whose next batch is that one.
        ``source``: ``[ObjectRef of the train set]``, for a feeder created without its dataset (see
        the module doc, Restarts); its first call (and a restarted feeder's) loads the dataset from it.
        ``mixture``: a mixture train set's `Mixture` with the switch stages its online policy added (the
        stream follows it; None: the set's own). A switch at position ``p`` enters the epoch at ``p`` under it,
        a new (epoch, p) stream as a resume's (`mixture_loader.MixtureOrderLoader`); it is part of the order
        a prestarted guess must match.
        """
        key = (epoch, position)
        epoch_order = (order or TrainOrder()).of_epoch(epoch, mixture)
        with self.lock:
            self._load(source)
            started = self._prestarted(key, epoch_order)
            if started is not None and resume_batch == 0 and started.cursor.next[rank] > started.first_batch:
                raise RuntimeError(
                    f"Rank {rank} started epoch {epoch} at sample {position} of the train set's global order a "
                    "second time in this worker group; each epoch is served once per group. Train on with "
                    "Trainer.fit(duration=...) (the next epoch), or start a new run (RayTrainer.fit) to begin again."
                )
            if started is not None and 0 < resume_batch < started.trimmed:
                # A start at an older position than the epoch still holds: every group of a replica-groups run
                # restarted from a storage checkpoint older than where this feeder's pass is. Open the pass
                # again there, as a restarted feeder rebuilds it (the same rows: a function of epoch, position, seed).
                self.epochs.pop(key).stop()
                started = None
            if started is None:
                if mixture is not None:  # an online switch: every rank left the epoch's stream before it (the
                    # eval that decided was their barrier), so its buffer goes now, not when the epoch after next opens
                    for old in [k for k, e in self.epochs.items() if k[0] == epoch and k[1] < position]:
                        self.epochs.pop(old).stop()
                self._open(key, epoch_order, max(0, resume_batch - _RESTART_SLACK))
        return True

    def prestart(self, epoch: int, position: int, order: Optional[TrainOrder], source: Any):
        """Start the stream of (epoch, position) before any rank asks: the driver's guess of where the
        run begins, made while Ray Train starts the worker group (see the module doc). The first
        rank's `start_epoch` uses it only if it asks for the same epoch, position and order."""
        with self.lock:
            self._load(source)
            key = (epoch, position)
            if key not in self.epochs and "asked" not in self.report:  # too late once a rank has asked
                self._open(key, (order or TrainOrder()).of_epoch(epoch), 0).prestarted = True
                self.report.setdefault("prestarted", [epoch, position, time.monotonic()])

    def claim(self) -> bool:
        """True once: the first worker group takes this feeder (made on the driver); later ones make their own."""
        with self.lock:
            claimed, self.claimed = self.claimed, True
        return not claimed

    def start_report(self) -> Dict[str, Any]:
        """The prestart (epoch, position) and the first rank's request: ``lead_s`` from one to the other,
        ``used`` whether that request found the prestarted stream, ``rows_ready`` rows in its buffer then
        (the pull stops a few global batches ahead; the source's own reads run further)."""
        return dict(self.report)

    def _load(self, source: Optional[List[Any]]) -> None:
        if self.dataset is None:
            if not source:
                raise RuntimeError("This EpochFeeder was created without a dataset: pass start_epoch(source=[ref]).")
            import ray

            self._set_dataset(ray.get(source[0]))

    def _prestarted(self, key: Tuple[int, int], order: EpochOrder) -> Optional[_Epoch]:
        """The epoch ``key`` if started; the first rank's request drops a prestarted guess that is not it."""
        started = self.epochs.get(key)
        guesses = [k for k, e in self.epochs.items() if e.prestarted]
        if not guesses:
            return started
        if "asked" not in self.report:
            prestart = self.report.get("prestarted")
            used = started is not None and started.prestarted and started.order == order
            self.report.update(
                asked=[key[0], key[1], time.monotonic()],
                used=used,
                rows_ready=started.index.end - started.keep_from if used and started is not None else 0,
                lead_s=None if prestart is None else time.monotonic() - prestart[2],
            )
        for k in guesses:
            guess = self.epochs[k]
            guess.prestarted = False
            if k != key or guess.order != order:  # a wrong guess: never served, its stream stopped
                self.epochs.pop(k).stop()
        return self.epochs.get(key)

    def _open(self, key: Tuple[int, int], order: EpochOrder, first: int) -> _Epoch:
        epoch, position = key
        for old in [k for k in self.epochs if k[0] < epoch - 1]:
            self.epochs.pop(old).stop()
        stream, seek = self._stream(epoch, order, position + first * self.global_batch)
        state = _Epoch(stream, position, self.global_batch, self.world_size, first, order, seek, self.consumers)
        self.epochs[key] = state
        return state

    def batches(
        self, epoch: int, position: int, rank: int, first: int, count: int
    ) -> Optional[List[Optional[List[Slice]]]]:
        """Rank ``rank``'s batches ``first .. first + count - 1`` (from the epoch's start position).

        Each is a list of block slices; a None ends the list at the epoch's end. Several batches per
        call because every call is an actor round trip: one per batch costs a worker more CPU than
        Ray Data's own iterator spends on the batch. None (no list) when this feeder does not know the
        epoch (it restarted since the rank started it): the rank starts it again with ``resume_batch``.
        """
        state = self.epochs.get((epoch, position))
        if state is None:
            return None
        served: List[Optional[List[Slice]]] = []
        with state.cond:
            try:
                for k in range(first, first + count):
                    slices = state.serve(rank, k)
                    served.append(slices)
                    if slices is None:
                        break
            except _Reopened:
                return None  # the rank starts the epoch again (it is the new pass) and asks once more
        return served

    def held_blocks(self) -> Dict[str, int]:
        """Blocks each epoch holds now (for tests and benchmarks of the bounded buffer)."""
        return {f"{e}@{p}": len(s.index) for (e, p), s in self.epochs.items()}
