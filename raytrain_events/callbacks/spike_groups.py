"""`SpikeGuard` under replica groups (``RayTrainer(fault_tolerance="replica_groups")``): every group takes the
same decision on the same step, rolls back to the same committed step and skips the same rows.

Each replica group is a world of its own: its loop's per-batch agreement reaches no other group. The one
collective across the groups is the step's gradient all-reduce, followed by torchft's commit vote
(``ray/replica_groups.py``: `CommitOptimizer`, `ReplicaCommit`, a `StepVote`). So under groups the guard
judges a step *before* its optimizer step (``AFTER_TRAIN_BATCH``, this group's loss and gradient norm) and its
vote rides at the end of that all-reduce (`core/spikes.group_vote`: a spike flag and how far back its newest
host snapshot is: seven integers, no collective of its own). After the step every group reads the same sums
(`read_group_votes`):

* the step did not commit (a group failed): it counts for nothing here either (no window record, no detector
  update); the loader serves the same rows again and they are judged again;
* it committed and some group saw a spike: every group rolls back at this step (the window ends with it) to
  its newest snapshot (judging the loss alone, the newest a committed step's loss vouched for:
  ``spike_rollback.rollback_target``), the same committed step in every group (checked by the vote: if they
  differ, every group stops with `SpikeRollbackError` instead of diverging), and skips the same global-order
  range (the window's records are the global `Timestamp` s and global batches of committed steps);
* it committed and no group saw one: the batch joins this group's trailing window.

The replicas are identical after every commit, so each group's snapshot of a step holds the same model,
optimizer and schedulers, and a rollback leaves the replicas identical. Snapshots are taken at the same steps
in every group: at the fit's start and every ``snapshot_interval`` committed steps (counted from the latest
snapshot or rollback, the same in every group), and at every quorum change, before its step (none when one of
that step is held: the same state): the groups
already training at `Callback.on_quorum_change`, a group that has just recovered its state from a peer (a
replacement) at its first ``BATCH_START`` (its Timestamp jumped: its own snapshots, of the state it started
with, are dropped). The peer's state it recovers carries the run's skip list, rollbacks and skipped counts
(`ReplicaState`), so whichever group leads saves the same. Should the groups' newest snapshots ever differ
(a group joined while another left, in one quorum: no group saw the count change), the vote says so at the
next committed step and every group takes a snapshot there, aligned again; a spike before that stops the run.

Each group's detector judges its own part of the global batch (as each DDP rank judges its own); the flag is
the OR over the groups. Cost per step: seven floats more in the all-reduce and one read of the loss (and
norm) before the optimizer step; per quorum change, one host snapshot.

Groups of several workers (``replica_group_size=k > 1``, the model sharded inside each group): each worker
all-reduces its own shards with the same *position* of the other groups (one torchft process group per position),
so the vote rides on ``k`` all-reduces, one per position, and every worker of every group reads the same sums only
if the ``k`` workers of a group vote the same. They do: each worker's loss (its own rows) and its share of the
gradient norm (its shards' squares, each counted once over the group: `spike_norm.group_share_norm`) are summed over
the group's own process group first (`StepVote.group_sum`: one all-reduce of three floats inside the group, on the
group's ``k`` workers only, never across groups), and each worker's detector judges the group's values: the mean
loss over the group's workers and the whole model's gradient norm. The detectors of a group see the same values
from the same state, so they decide the same, take their snapshots (each of its own shards) at the same steps,
and roll back to the same step (each restoring its own shards); a replacement group's position ``p`` receives the
skip list, rollbacks and skipped counts from position ``p`` of a live group (`ShardedReplicaState`). Cost per step
in such a group: that one in-group all-reduce (the loop's own per-batch sum runs before the batch, too early to
carry the batch's loss), beside FSDP's per-layer collectives.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from raytrain_events.callbacks.spike_rollback import judged_good, roll_back, rollback_target, take_snapshot
from raytrain_events.checkpoint.run.host_snapshot import HostSnapshots
from raytrain_events.core.agreement import StepVote
from raytrain_events.core.callback import Callback, QuorumChange
from raytrain_events.core.interval import is_done
from raytrain_events.core.logger import Logger
from raytrain_events.core.spikes import SpikeRollbackError, Verdict, group_vote, read_group_votes
from raytrain_events.core.state import State

__all__ = ["GroupVoting", "find_step_vote"]


def find_step_vote(state: State) -> Optional[StepVote]:
    """The loop's `StepVote` (replica groups' commit callback), or None (one world: the loop's agreement)."""
    return next((c for c in state.callbacks if isinstance(c, StepVote)), None)


class GroupVoting(Callback):
    """The guard's part under replica groups (see the module doc), added by the guard at INIT."""

    def __init__(self, guard: Any, vote: StepVote) -> None:  # noqa: D107
        self.guard, self.vote = guard, vote
        self.pending: Optional[Tuple[float, Optional[float], Optional[Verdict]]] = None  # this step's values
        self.at = 0  # the step's batch before it (its snapshot distance is counted from here)
        self.seen = -1  # the Timestamp's batch this group last left a step at (a heal moves it)
        vote.carry(self.ballot)

    def start(self, state: State) -> None:
        """At the guard's FIT_START, after its first snapshot."""
        self.seen, self.pending = int(state.timestamp.batch), None

    def batch_start(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) != self.seen:  # recovered from a peer (or loaded at the first quorum)
            self.retake(state)

    def on_quorum_change(self, state: State, logger: Logger, change: QuorumChange) -> None:
        self.retake(state, drop=False)  # the snapshot a joining group takes too, at the same step

    def retake(self, state: State, drop: bool = True) -> None:
        guard, now = self.guard, int(state.timestamp.batch)
        snapshots = guard._snapshots.snapshots if guard._snapshots is not None else []
        if not drop and snapshots and snapshots[-1].meta["batch"] == now:
            # Already one of this step (no step since: the same state): a second would only push out the snapshot
            # a rollback needs (judging the loss alone, the newest vouched for) and cost a host copy.
            self.seen = now
            return
        if drop:  # this group's snapshots are of a state it no longer has
            keep = guard._snapshots.keep if guard._snapshots is not None else 2
            guard._snapshots = HostSnapshots(state, exclude_callbacks={guard._key}, keep=keep)
            guard._history.clear()
        take_snapshot(guard, state)
        self.seen = now

    def judge(self, state: State, loss: Any, norm: Any) -> None:
        """At ``AFTER_TRAIN_BATCH`` (before the optimizer step and its all-reduce): this group's verdict."""
        self.at = int(state.timestamp.batch)
        if loss is None:  # nothing to judge (no loss this batch): no verdict, nothing joins the window
            self.pending = None
            return
        value = float(loss.item())
        grad = float(norm.item()) if norm is not None else None
        # The group's values (a group of several workers: each worker's own rows and shards; see the module doc).
        loss_sum, squares, workers = self.vote.group_sum([value, 0.0 if grad is None else grad * grad, 1.0])
        if workers > 1:
            value, grad = loss_sum / workers, (math.sqrt(squares) if grad is not None else None)
        self.pending = (value, grad, self.guard.detector.judge(value, grad))

    def ballot(self) -> list:
        """This group's vote, called by the step's all-reduce (`StepVote.carry`)."""
        pending, target = self.pending, rollback_target(self.guard, self.at + 1)
        assert target is not None
        spike = pending is not None and pending[2] is not None
        # How far back the snapshot a spike on this step restores is (`spike_rollback.rollback_target`): equal in
        # every group, or no rollback is the same everywhere.
        return group_vote(spike, self.at - int(target.meta["batch"]))

    def step_end(self, state: State, logger: Logger) -> None:
        """Called by the guard's ``BATCH_END``, last among the callbacks (after `ReplicaCommit` settled the step's
        Timestamp); not a hook of its own, so the Engine does not call it earlier."""
        guard, pending, self.pending = self.guard, self.pending, None
        ts = state.timestamp
        self.seen = int(ts.batch)
        sums = self.vote.vote_sums()
        if sums is None:  # not committed: the same rows come again, and are judged again
            return
        verdict = read_group_votes(*sums)
        guard._history.append((ts, state.global_batch_num_samples, state.global_batch_num_tokens, None))
        if verdict.spike:
            if pending is not None and pending[2] is not None:
                guard._spike = (int(ts.batch), pending[2])
            if not verdict.same_snapshot:
                raise SpikeRollbackError(
                    f"A loss spike at batch {int(ts.batch)} and the replica groups' newest host snapshots are of "
                    "different steps (a group joined while another left, in one quorum), so no rollback is the same "
                    "in every group. Resume the run from its last checkpoint (autoresume)."
                )
            roll_back(guard, state, logger, int(ts.batch), elsewhere="seen in another replica group")
            return
        judged_good(guard)  # committed, no spike in any group: the snapshot this step started from is vouched for
        if pending is not None:
            guard.detector.observe(pending[0], pending[1])
        guard._since += 1
        if (state.stop_requested and state.stop_consistent) or is_done(state):
            return
        if guard._since >= guard.snapshot_interval or not verdict.same_snapshot:
            take_snapshot(guard, state)  # every group at this step: aligned again if a quorum change left them apart
