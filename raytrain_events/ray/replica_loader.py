"""Replica groups on the worker: each group's loader (`ReplicaLoader`), a quorum before every step, then this
group's part of the global batch (see `replica_groups.py`'s module doc for the whole design).

Before each step a quorum (synchronous: a joining group heals there); then the global batch at the state's
position in the global order (the feeder serves every group the whole global batch), cut into one part per
*participating* group (`core/replica_layout.quorum_part`: and per position inside a group of several workers).
A group's share goes to the others while it is away: the global batch, the step's samples and the LR schedule
stay those of an uninterrupted run. A step that did not commit is served the same global batch again.

Cost per step: one quorum round trip and one ``feeder.batches`` call per worker (every group fetches the whole
global batch's blocks: k x the data reads of plain DDP).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from raytrain_events.core.callback import QuorumChange
from raytrain_events.core.data_spec import cut_rows
from raytrain_events.core.replica_layout import part_rows, quorum_part
from raytrain_events.data.ray import block_fetch  # cluster_node read through it: tests stand in another node
from raytrain_events.data.ray.block_fetch import finish_fetch, start_fetch
from raytrain_events.data.ray.loader import GlobalOrderLoader
from raytrain_events.ray.replica_groups import ReplicaState
from raytrain_events.ray.replica_lighthouse import lighthouse_lost

__all__ = ["ReplicaLoader"]


class ReplicaLoader(GlobalOrderLoader):
    """This group's part of each global batch, from the quorum of the step (see the module doc)."""

    def __init__(  # noqa: D107, PLR0913 (the worker's place in its group, handed over once)
        self,
        shard: Any,
        manager: Any,
        replicas: ReplicaState,
        group_size: int = 1,
        position: int = 0,
        tensor_parallel: int = 1,
        **options: Any,
    ) -> None:
        super().__init__(shard, **options)
        self.group_size, self.group_position = group_size, position  # this worker in its group (`ReplicaLayout`)
        self.tensor_parallel = tensor_parallel  # positions of one tensor group: the same rows (`quorum_part`)
        self.manager = manager
        self.replicas = replicas
        self.on_change: Callable[[QuorumChange], None] = lambda change: None
        self.participants = 0
        self._stream: Optional[Tuple[int, int]] = None  # the feeder pass in use: (epoch, start position)
        self._next: Optional[Tuple[int, int, int]] = None  # (epoch, position, batch index) it serves next
        self._held: Optional[Tuple[Tuple[int, int], Any]] = None  # the last global batch, for a retry
        self.global_rows = 0
        # A start of the whole run's storage load (`load_at_first_quorum`): run once, after this process's first quorum.
        self.start_load: Optional[Callable[[], Any]] = None

    def __iter__(self):
        batches = len(self)
        while True:
            before = self.replicas.state.timestamp
            if int(before.batch_in_epoch) >= batches:
                # The epoch is over: no quorum for a step that will not come (a group joining in that quorum
                # would heal to an epoch's end, where its loop has no batch left to train).
                return
            try:
                self.manager.start_quorum()  # synchronous: a joining group has the peer's state after it
            except Exception as error:
                lost = lighthouse_lost(error)  # the Lighthouse is gone: the run stops, naming it
                if lost is not None:
                    raise lost from error
                raise
            if self.start_load is not None:
                load, self.start_load = self.start_load, None
                if self.manager.current_step() == 0:  # no group has committed yet: a start of the whole run
                    load()  # else this group just took a live peer's state (the quorum healed it): storage has older
            state = self.replicas.state
            n = self.manager.num_participants()
            if n != self.participants:
                healed = state.timestamp is not before
                if self.participants:
                    self.on_change(QuorumChange(state.timestamp, self.participants, n, healed))
                self.participants = n
            ts = state.timestamp
            batch = self._global_batch(int(ts.epoch), int(ts.sample_in_epoch))
            if batch is None:
                return
            rank = self.manager.participating_rank()
            part, parts = quorum_part(
                0 if rank is None else rank, n, self.group_position, self.group_size, self.tensor_parallel
            )
            yield _cut(batch, part, parts)

    def _global_batch(self, epoch: int, position: int) -> Any:
        """The global batch at ``position`` of ``epoch`` (None past the epoch's end)."""
        if self._held is not None and self._held[0] == (epoch, position):
            return self._held[1]  # the step did not commit: the same rows again
        if self._next is None or self._next[:2] != (epoch, position):
            # An epoch start, a rejoin or a heal: this rank enters the epoch's one pass (epoch, 0) at batch k,
            # the pass the other groups are in, so its cursor there moves on and the feeder trims behind it
            # (a pass of its own would leave its old cursor, and all the epoch's blocks after it, held).
            k, off = divmod(position, self.shard.global_batch)
            start = (epoch, 0) if off == 0 else (epoch, position)
            k = k if off == 0 else 0
            self._start(epoch, start[1], max(k, 1))  # resume_batch >= 1: this rank number may have served it
            self._stream, self._next = start, (epoch, position, k)
        assert self._stream is not None
        k = self._next[2]
        feeder, rank = self.shard.feeder, self.shard.rank
        pending = feeder.batches.remote(epoch, self._stream[1], rank, k, 1)
        served = self._served(pending, epoch, self._stream[1], k, 1)
        if not served or served[0] is None:
            return None
        batch = self._to_batch(served[0], finish_fetch(start_fetch(served, block_fetch.cluster_node())))
        rows = _rows(batch)
        self._next = (epoch, position + rows, k + 1)
        self._held = ((epoch, position), batch)
        self.global_rows = rows
        return batch


def _rows(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    elif isinstance(batch, (list, tuple)):
        batch = batch[0]
    return len(batch)


def _cut(batch: Any, part: int, parts: int) -> Any:
    """Part ``part`` of ``parts`` near-equal contiguous parts of a batch (`core.data_spec.cut_rows`: any form)."""
    return cut_rows(batch, *part_rows(_rows(batch), part, parts))
