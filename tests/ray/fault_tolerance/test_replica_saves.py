"""Replica groups' saving group (`lead_saves`), without Ray: two groups' `Checkpointer`s share one folder and
the lead changes between them; ``keep`` holds across the change, and a save point the old lead died writing is
saved once, late, by the new lead."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from raytrain_events import CheckpointConfig, Timestamp, Trainer
from raytrain_events.checkpoint.folder.store import list_checkpoints
from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
from raytrain_events.core.save_points import SavePoints
from raytrain_events.ray.replica_groups import lead_saves
from tests.resume_helpers import make_model, make_sgd


def _group(folder: str, lead: dict, me: int):
    """A group's Trainer whose saving follows `lead_saves` (its quorum rank 0 when ``lead["group"] == me``)."""
    model = make_model()
    config = CheckpointConfig(save_folder=folder, keep=2, lock_run_dir=False)
    data = [{"x": torch.zeros(4), "y": 0}] * 4
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer = Trainer(
        model=model, optimizers=make_sgd(model), train_dataloader=loader, max_duration="10ba", checkpoint=config
    )
    manager = SimpleNamespace(participating_rank=lambda: 0 if lead["group"] == me else 1)
    loader = SimpleNamespace(manager=manager, group_position=0)
    commit = SimpleNamespace(loader=loader, optimizer=SimpleNamespace(committed=True), save_points=SavePoints())
    commit.followed = True  # as `ReplicaCommit` starts
    lead_saves(trainer.state, commit)
    return trainer, commit


def _save(trainer, batch: int) -> None:
    trainer.state.timestamp = Timestamp(batch=batch)
    saved = find_checkpointer(trainer.state).save()
    if saved is not None:
        saved.wait()


def test_a_new_lead_prunes_the_old_leads_checkpoints(tmp_path):
    """Group 1 saves first (its copy of the folder's index is loaded then), group 0 leads for two saves, then
    group 1 leads again: its save reloads the index, so ``keep=2`` deletes group 0's older checkpoint too.
    Before, group 1 pruned by its stale copy ([1, 4]: nothing to delete) and wrote it back: batches 2 and 3
    stayed in the folder for good, unknown to the index."""
    folder = str(tmp_path / "checkpoints")
    lead = {"group": 1}
    a, commit_a = _group(folder, lead, 0)
    b, commit_b = _group(folder, lead, 1)
    _save(b, 1)
    _save(a, 1)  # not the lead: saves nothing
    lead["group"], commit_b.followed = 0, True  # group 0 leads a committed step (what ReplicaCommit notes)
    _save(a, 2)
    _save(a, 3)
    lead["group"], commit_a.followed = 1, True
    _save(b, 4)
    names = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
    assert [int(n.split("-")[1]) for n in names] == [3, 4], names
    for trainer in (a, b):
        find_checkpointer(trainer.state).close()


def test_a_save_point_the_lead_died_writing_is_saved_once_late_by_the_next_lead(tmp_path):
    """Group 0 leads and saves batch 1; at batch 2 it dies writing its save (its file, no manifest). Group 1,
    leading from then on, checks at its first step (`ReplicaCommit.after_dataloader`'s ``take_over``): the folder's
    newest committed checkpoint is batch 1, so its next save stands in for batch 2 (``late_for``), and its commit
    deletes the half-written directory. A save point the old lead did commit is not saved again."""
    folder = str(tmp_path / "checkpoints")
    lead = {"group": 0}
    a, commit_a = _group(folder, lead, 0)
    b, commit_b = _group(folder, lead, 1)
    _save(a, 1)  # group 0 saves; group 1 notes each save point (it follows)
    _save(b, 1)
    _save(b, 2)
    half = os.path.join(folder, "ckpt-000000000002-deadbeef")  # group 0's save of batch 2, killed mid-upload
    os.makedirs(half)
    with open(os.path.join(half, "state.pt"), "wb") as f:
        f.write(b"partial")
    lead["group"] = 1  # group 0 left the quorum: group 1 leads
    commit_b.take_over()
    assert find_checkpointer(b.state).late.missed == (2,)
    _save(b, 3)  # its first committed step
    saved = {c.batch: c.metadata.get("late_for") for c in list_checkpoints(folder)}
    assert saved == {1: None, 3: [2]}, saved
    assert not os.path.exists(half)  # deleted by the late save's commit (the folder's owner)
    _save(b, 4)  # an ordinary save point: nothing late any more; keep=2
    assert {c.batch: c.metadata.get("late_for") for c in list_checkpoints(folder)} == {3: [2], 4: None}
    lead["group"], commit_a.followed = 0, True  # group 0 (its replacement) leads again and commits batch 5
    _save(b, 5)
    _save(a, 5)
    lead["group"] = 1
    commit_b.take_over()
    assert find_checkpointer(b.state).late is None  # batch 5 is committed: not saved again
    for trainer in (a, b):
        find_checkpointer(trainer.state).close()
