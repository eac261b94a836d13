"""`SpikeGuard`'s part under replica groups (``callbacks/spike_groups.py``) in a local `Trainer`, the other groups'
votes scripted (a `StepVote` standing in for torchft's all-reduce; the real one: tests/ray/fault_tolerance/test_spike_replica_groups.py):
the guard judges a step before its optimizer step and rolls back *at that step* when any group saw a spike; a
step that did not commit counts for nothing; groups whose newest snapshots differ realign at the next step, or
stop on a spike there rather than roll back apart. Groups of several workers: each worker (a local `Trainer` on its
own thread, its own rows of each global batch) votes on values summed over its group (`StepVote.group_sum`), so the
workers of a group vote the same on their positions' all-reduces and roll back together."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader

from raytrain_events import Callback, Trainer
from raytrain_events.callbacks import SpikeGuard, SpikeRollbackError
from raytrain_events.core.agreement import StepVote
from raytrain_events.core.spikes import SkipRange, group_vote
from raytrain_events.models import ClassifierModel
from tests.trainer.test_spike_guard import BATCH, DIM, ROWS, Record, _fit, _rows, _trained_ids

GROUPS = 4


class ScriptedVote(Callback):
    """This group's vote summed with 3 scripted groups' (``others(batch, own) -> votes``, ``batch``: the step's
    Timestamp batch after it); ``uncommitted``: steps (their batch after) that do not commit. First among the
    callbacks (as `ReplicaCommit`), so its BATCH_END decides the step before the guard's."""

    def __init__(self, others=None, uncommitted=(), group_sum=None):
        self.others = others or (lambda batch, own: [own] * (GROUPS - 1))
        self.uncommitted, self.vote, self.sums, self.votes = set(uncommitted), None, None, []
        self.in_group = group_sum or list  # a group of one worker: its own values

    def carry(self, vote):
        self.vote = vote

    def vote_sums(self):
        return self.sums

    def group_sum(self, values):
        return self.in_group(values)

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


POSITIONS = 2  # workers per replica group (GROUPS groups): each a local Trainer on a thread of its own


class GroupSum:
    """The in-group all-reduce of one replica group whose workers are threads: ``sum(position, values)``."""

    def __init__(self, workers):
        self.barrier, self.slots = threading.Barrier(workers, timeout=60), [None] * workers

    def sum(self, position, values):
        self.slots[position] = list(values)
        self.barrier.wait()
        out = [sum(column) for column in zip(*self.slots)]
        self.barrier.wait()  # every worker has read the sums before the next step's values land
        return out


def _positions(data, duration, others, group_sum):
    """Fit one replica group of POSITIONS workers: worker ``p`` trains part ``p`` of each global batch of
    ``POSITIONS x BATCH`` rows (the rows ``ReplicaLayout.rows`` gives it), votes through ``group_sum`` (or alone) and
    sees this position's all-reduce across the GROUPS groups (``others``: the other groups' votes). Returns each
    worker's (vote, guard, record, state)."""
    workers = []
    for position in range(POSITIONS):
        torch.manual_seed(0)  # the same initial weights in every worker (FSDP's shards of one model)
        model = ClassifierModel(
            torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)), num_classes=2
        )
        rows = [r for r in data if r["id"] // BATCH % POSITIONS == position]
        add = (lambda v, p=position: group_sum.sum(p, v)) if group_sum is not None else None
        vote, guard, record = ScriptedVote(others, group_sum=add), SpikeGuard(snapshot_interval=5), Record()
        trainer = Trainer(
            model=model,
            train_dataloader=DataLoader(rows, batch_size=BATCH),
            max_duration=duration,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            callbacks=[vote, record, guard],
            seed=0,
        )
        workers.append([vote, guard, record, trainer])
    errors = []

    def fit(worker):
        try:
            worker[3] = worker[3].fit()
        except BaseException as error:  # noqa: BLE001 (raised below, on the test's thread)
            errors.append(error)
            if group_sum is not None:
                group_sum.barrier.abort()

    threads = [threading.Thread(target=fit, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return workers


def test_the_workers_of_a_group_of_several_vote_on_the_groups_values_and_roll_back_together():
    """4 groups x 2 workers. Row 203 is in global batch 13 (rows [192, 208)), in position 1's part ([200, 208));
    position 0's own rows are clean. Its vote is on the group's loss (the mean over the group's workers) and norm (over
    the group's shards), so both positions vote the same at every step, on their own all-reduces, and every worker
    rolls back at 13; a spike another group saw at 20 rolls both back too."""

    def others(batch, own):  # the 3 other groups: group 3 holds spiking rows at batch 20 (at every position)
        return [own, own, [1, *own[1:]] if batch == 20 else own]

    workers = _positions(_rows(planted=[203]), "25ba", others, GroupSum(POSITIONS))
    (vote0, guard0, record0, state0), (vote1, guard1, record1, state1) = workers
    assert vote0.votes == vote1.votes  # the same vote on every position's all-reduce, every step
    for guard in (guard0, guard1):
        assert [(r["batch"], r["spike_batch"], r["restored_batch"]) for r in guard.rollbacks] == [
            (13, 13, 10),
            (20, 20, 18),
        ]
        # Judged from the group's values: position 0, whose rows were clean, saw the loss spike itself.
        assert (
            "loss" in guard.rollbacks[0]["reason"] and guard.rollbacks[1]["reason"] == "seen in another replica group"
        )
        # Each worker's positions are its own part's (8 rows a step): the same windows in both.
        assert guard.skips.ranges == [SkipRange(0, 80, 104, 3, 0), SkipRange(0, 144, 160, 2, 0)]
    assert state0.timestamp == state1.timestamp and guard0.trained(state0) == guard1.trained(state1)
    assert guard0.detector.state_dict() == guard1.detector.state_dict()  # the group's values, not each its own
    kept = sorted(_trained_ids(record0.lineage, guard0) + _trained_ids(record1.lineage, guard1))
    assert kept == [i for i in range(25 * POSITIONS * BATCH) if not (160 <= i < 208 or 288 <= i < 320)]

    # Each worker judging its own rows alone: position 0 votes no spike at 13 on its all-reduce, position 1 a
    # spike on its own: the positions' sums differ, and the two halves of one model would roll back apart.
    apart = _positions(_rows(planted=[203]), "15ba", None, None)
    assert [r["batch"] for r in apart[0][1].rollbacks] == [] and [r["batch"] for r in apart[1][1].rollbacks] == [13]


def test_judging_the_loss_alone_every_group_passes_over_the_snapshot_after_a_blow_up():
    """The weights wrecked after step 25 (its loss finite): step 26 spikes; the snapshot of 25 had no step judged
    good from it, so every group rolls back to 20's, and each vote said how far back that target was (5 at step
    26, not 0: the groups compare targets, not newest snapshots)."""
    from tests.trainer.test_spike_guard import BlowUpAfterStep

    vote, guard = ScriptedVote(), SpikeGuard(snapshot_interval=5, grad_zscore=None)
    _, state = _fit(_rows(), [vote, BlowUpAfterStep(25), guard])
    assert [(r["batch"], r["spike_batch"], r["restored_batch"]) for r in guard.rollbacks] == [(26, 26, 20)]
    assert guard.skips.ranges == [SkipRange(0, 160, 208, batches=6, tokens=0)]
    assert guard.trained(state) == {"batch": 44, "sample": 352, "token": 0}
    assert [own[1] for b, own in vote.votes if b in (20, 21, 22, 26)] == [4, 5, 1, 5]


def test_a_quorum_change_right_after_a_snapshot_keeps_the_one_a_rollback_needs():
    """A quorum change before step 26, just after the snapshot of 25: no second snapshot of 25 (the same state)
    pushes out 20's, so the blow-up after step 25 still rolls back to 20 (a second one of 25 left only the
    damaged ones, and the run stopped after max_rollbacks)."""
    from tests.trainer.test_spike_guard import BlowUpAfterStep

    class QuorumBefore26(Callback):
        def batch_start(self, state, logger):
            if int(state.timestamp.batch) == 25:
                guard._group.on_quorum_change(state, logger, None)

    vote, guard = ScriptedVote(), SpikeGuard(snapshot_interval=5, grad_zscore=None)
    _fit(_rows(), [vote, BlowUpAfterStep(25), QuorumBefore26(), guard])
    assert [(r["spike_batch"], r["restored_batch"]) for r in guard.rollbacks] == [(26, 20)]
