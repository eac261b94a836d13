"""`SpikeGuard`'s part under replica groups (``callbacks/spike_groups.py``) in a local `Trainer`, the other groups'
votes scripted (a `StepVote` standing in for torchft's all-reduce; the real one: tests/ray/fault_tolerance/test_spike_replica_groups.py):
the guard judges a step before its optimizer step and rolls back *at that step* when any group saw a spike; a
step that did not commit counts for nothing; groups whose newest snapshots differ realign at the next step, or
stop on a spike there rather than roll back apart."""

from __future__ import annotations

import pytest

from raytrain_events import Callback
from raytrain_events.callbacks import SpikeGuard, SpikeRollbackError
from raytrain_events.core.agreement import StepVote
from raytrain_events.core.spikes import SkipRange, group_vote
from tests.trainer.test_spike_guard import ROWS, Record, _fit, _rows, _trained_ids

GROUPS = 4


class ScriptedVote(Callback):
    """This group's vote summed with 3 scripted groups' (``others(batch, own) -> votes``, ``batch``: the step's
    Timestamp batch after it); ``uncommitted``: steps (their batch after) that do not commit. First among the
    callbacks (as `ReplicaCommit`), so its BATCH_END decides the step before the guard's."""

    def __init__(self, others=None, uncommitted=()):
        self.others = others or (lambda batch, own: [own] * (GROUPS - 1))
        self.uncommitted, self.vote, self.sums, self.votes = set(uncommitted), None, None, []

    def carry(self, vote):
        self.vote = vote

    def vote_sums(self):
        return self.sums

    def batch_start(self, state, logger):
        self.before = state.timestamp

    def batch_end(self, state, logger):
        own = self.vote()  # the all-reduce's moment: after the guard judged the step at AFTER_TRAIN_BATCH
        batch = int(state.timestamp.batch)
        self.votes.append((batch, own))
        if batch in self.uncommitted:
            self.uncommitted.discard(batch)
            self.sums, state.timestamp = None, self.before  # as ReplicaCommit: nothing of this step counts
            return
        self.sums = ([sum(c) for c in zip(own, *self.others(batch, own))], GROUPS)


def test_the_step_vote_is_found_and_the_guard_rolls_back_at_the_spiking_step_itself():
    vote, guard, record = ScriptedVote(), SpikeGuard(snapshot_interval=5), Record()
    assert isinstance(vote, StepVote)
    _, state = _fit(_rows(planted=[203]), [vote, record, guard])
    # Judged before the step, agreed in it: batch 26 (rows [200, 208)) rolled back at 26 to the snapshot of 25,
    # one batch skipped (one world's agreement takes a batch more: test_spike_guard's window is two).
    assert [(r["batch"], r["spike_batch"], r["restored_batch"]) for r in guard.rollbacks] == [(26, 26, 25)]
    assert "loss" in guard.rollbacks[0]["reason"]
    assert guard.skips.ranges == [SkipRange(0, 200, 208, batches=1, tokens=0)]
    assert sorted(_trained_ids(record.lineage, guard)) == [i for i in range(ROWS) if not 200 <= i < 208]
    assert guard.trained(state) == {"batch": 49, "sample": 392, "token": 0}
    # Each vote said how far back this group's newest snapshot was: 0 right after one, 4 before the next.
    assert [own[0] for _, own in vote.votes[:26]] == [0] * 25 + [1]
    assert [own[1] for b, own in vote.votes[:26] if b in (5, 6, 10)] == [4, 0, 4]


def test_another_groups_spike_rolls_this_one_back_and_an_uncommitted_step_counts_for_nothing():
    def others(batch, own):  # group 2 holds the spiking rows of batch 31
        return [own, [1, *own[1:]] if batch == 31 else own, own]

    vote, guard = ScriptedVote(others, uncommitted={12}), SpikeGuard(snapshot_interval=5)
    _, state = _fit(_rows(), [vote, Record(), guard], duration="40ba")
    assert [(r["batch"], r["restored_batch"], r["reason"]) for r in guard.rollbacks] == [
        (31, 30, "seen in another replica group")
    ]
    # The uncommitted step 12 was voted on twice (its rows again: here the next ones) and judged once.
    assert [b for b, _ in vote.votes].count(12) == 2
    # The detector's window: the 30 committed steps before the spike (the snapshot of 30 restored it) and the 9
    # after, not the uncommitted attempt (40 if it had joined).
    assert len(guard.detector.state_dict()["losses"]) == 30 + 9


def test_groups_whose_snapshots_differ_realign_at_the_next_step_or_stop_on_a_spike_there():
    def apart(batch, own):  # one group's newest snapshot is a step older at batch 8 (a quorum change it missed)
        return [own, own, group_vote(False, own[1] + 1) if batch == 8 else own]

    vote, guard = ScriptedVote(apart), SpikeGuard(snapshot_interval=5)
    _fit(_rows(), [vote, guard], duration="12ba")
    # Snapshots at 0, 5, then 8 (realigned: every group takes one there), then 13 would be next.
    assert [own[1] for b, own in vote.votes if b in (8, 9, 12)] == [2, 0, 3]

    def apart_on_a_spike(batch, own):
        return [own, [1, *own[1:]] if batch == 8 else own, group_vote(batch == 8, own[1] + 1) if batch == 8 else own]

    with pytest.raises(SpikeRollbackError, match="newest host snapshots are of different steps"):
        _fit(_rows(), [ScriptedVote(apart_on_a_spike), SpikeGuard(snapshot_interval=5)], duration="12ba")
