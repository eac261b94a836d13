"""`ReplicaLayout`: which worker is in which replica group, and which rows of a global batch each one trains.

A run of ``workers`` Ray Train workers under replica groups of ``group_size`` workers each has
``workers / group_size`` groups. Group ``g`` is the ``group_size`` consecutive world ranks from ``g * group_size``
(Ray Train's order; `ray/_compat.py` makes its worker group build them so), and a worker's *position* is its rank
inside its group: its rank in the group's own torch process group, where the model is sharded (FSDP2, or HSDP
inside the group). torchft manages the other dimension, across groups: the workers at the same position in every
group form one torchft process group (they hold the same shards), and a group that rejoins heals each position
from the same position of a live group.

Rows: every group is served the whole global batch and cuts it by the step's quorum (``participants`` groups, this
group the ``participant``-th of them); inside a group each position trains its own contiguous part. Together: the
global batch cut into ``participants * group_size`` near-equal contiguous parts, this worker's the
``participant * group_size + position``-th, so the step trains each row of the global batch exactly once at any
quorum, and with equal parts the averaged gradient (FSDP's mean over the group's ranks, then torchft's over the
groups) is the mean over the whole global batch: the step an uninterrupted run takes.

Tensor parallelism inside a group (``tensor_parallel=t``): the group's mesh is ``(group_size // t, t)``, the tensor
dimension innermost, so ``t`` consecutive positions form one tensor group, compute one replica together and train
the same rows (`quorum_part`): the global batch is cut into ``participants * group_size // t`` parts. torchft's
dimension is unchanged: the same position in every group holds the same (FSDP x TP) shards.

Eval sets: cut by position only (`ReplicaLayout.eval_part`): data-parallel position ``p`` of every group evaluates
part ``p`` of `data_parts` equal parts, so each group evaluates the whole set, alone, at the global Timestamp's eval points.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

__all__ = ["ReplicaLayout", "layout_problem", "part_rows", "quorum_part"]


def part_rows(rows: int, part: int, parts: int) -> Tuple[int, int]:
    """Part ``part``'s rows ``[a, b)`` of ``parts`` near-equal contiguous parts of ``rows`` rows."""
    q, rem = divmod(rows, parts)
    a = part * q + min(part, rem)
    return a, a + q + (1 if part < rem else 0)


def quorum_part(
    participant: int, participants: int, position: int, group_size: int = 1, tensor_parallel: int = 1
) -> Tuple[int, int]:
    """``(part, parts)``: which of a global batch's ``parts`` near-equal contiguous parts the worker at ``position`` of
    the quorum's ``participant``-th group trains. A tensor group (``tensor_parallel`` consecutive positions) computes
    one replica together, so its ranks train the same part: a group holds ``group_size // tensor_parallel``
    data-parallel parts (`ReplicaLayout.rows` and the workers' `ReplicaLoader` both cut by this)."""
    data = group_size // tensor_parallel
    return participant * data + position // tensor_parallel, participants * data


def layout_problem(workers: Any, size: Any, tensor_parallel: int = 1) -> str:
    """Why ``workers`` in replica groups of ``size`` (each made of tensor groups of ``tensor_parallel`` workers) make
    no layout (empty: they do), with the fix."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return (
            f"replica_group_size={size!r} must be a whole number of workers >= 1. Fix: replica_group_size=1 (each "
            "worker a group) or the workers that shard one replica, e.g. 2."
        )
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        return (
            f"num_workers={workers!r} must be a whole number of workers >= 1. Fix: num_workers=2 x replica_group_size."
        )
    if workers % size:
        lower, upper = workers // size * size, -(-workers // size) * size
        near = " or ".join(str(n) for n in sorted({lower, upper}) if n >= 2 * size)
        return (
            f"replica_group_size={size} does not divide num_workers={workers}: every replica group needs the "
            f"same number of workers (each position holds the same shards in every group). Fix: num_workers "
            f"a multiple of {size}" + (f" (e.g. {near})" if near else "") + ", or another replica_group_size."
        )
    if size % tensor_parallel:
        return (
            f"replica_group_size={size} is not a whole number of tensor groups of tensor_parallel={tensor_parallel} "
            f"workers (each group shards its model over its own workers). Fix: replica_group_size a multiple of "
            f"{tensor_parallel} (e.g. {2 * tensor_parallel}), or another tensor_parallel."
        )
    if workers // size < 2:
        return (
            f"num_workers={workers} with replica_group_size={size} makes {workers // size} replica group; "
            f"replica groups need at least two (one trains on while another is replaced). Fix: num_workers="
            f"{2 * size} or more, or replica_group_size={max(1, workers // 2)}."
        )
    return ""


@dataclass(frozen=True)
class ReplicaLayout:
    """``workers`` world ranks in replica groups of ``group_size`` consecutive ranks (see the module doc)."""

    workers: int
    group_size: int = 1
    tensor_parallel: int = 1  #: consecutive positions that form one tensor group (the same rows)

    def __post_init__(self) -> None:
        problem = layout_problem(self.workers, self.group_size, self.tensor_parallel)
        if problem:
            raise ValueError(problem)

    @property
    def groups(self) -> int:
        """The number of replica groups."""
        return self.workers // self.group_size

    @property
    def data_parts(self) -> int:
        """The data-parallel parts of a group: its positions over its tensor groups' size."""
        return self.group_size // self.tensor_parallel

    def group_of(self, world_rank: int) -> int:
        """The replica group of world rank ``world_rank``."""
        self._check_rank(world_rank)
        return world_rank // self.group_size

    def position_of(self, world_rank: int) -> int:
        """``world_rank``'s position in its group (its rank in the group's process group)."""
        self._check_rank(world_rank)
        return world_rank % self.group_size

    def ranks_of(self, group: int) -> List[int]:
        """The world ranks of replica group ``group``, by position."""
        if not 0 <= group < self.groups:
            raise ValueError(f"replica group {group} is not one of this run's {self.groups} groups")
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def peers_of(self, world_rank: int) -> List[int]:
        """The world ranks at ``world_rank``'s position in every group (one torchft process group; its own included)."""
        position = self.position_of(world_rank)
        return [g * self.group_size + position for g in range(self.groups)]

    def eval_part(self, world_rank: int) -> int:
        """Which of an eval set's `data_parts` equal parts ``world_rank`` evaluates: its position's (a tensor
        group's ranks share one, as they share rows in training: `quorum_part`). The set is cut
        by position only, never by group, so every group evaluates the whole set alone (its metrics synced over its
        own process group) and needs no other group: one that is away, or dies mid-eval, holds nobody back, and
        whichever group leads next has the same metrics."""
        return self.position_of(world_rank) // self.tensor_parallel

    def rows(self, global_rows: int, participant: int, participants: int, position: int) -> Tuple[int, int]:
        """The rows ``[a, b)`` of a ``global_rows``-row global batch the worker at ``position`` of the quorum's
        ``participant``-th group trains, in a quorum of ``participants`` groups."""
        if not 0 <= participant < participants <= self.groups:
            raise ValueError(f"participant {participant} of {participants} groups (this run has {self.groups})")
        if not 0 <= position < self.group_size:
            raise ValueError(f"position {position} of a group of {self.group_size}")
        part, parts = quorum_part(participant, participants, position, self.group_size, self.tensor_parallel)
        if global_rows < parts:
            raise ValueError(
                f"a global batch of {global_rows} rows cannot give each of {parts} data-parallel parts a row "
                f"({participants} groups x {self.data_parts}); raise batch_size or global_batch_size."
            )
        return part_rows(global_rows, part, parts)

    def _check_rank(self, world_rank: int) -> None:
        if not 0 <= world_rank < self.workers:
            raise ValueError(f"world rank {world_rank} is not one of this run's {self.workers} workers")
