"""Replica groups' saving group (`lead_saves`), without Ray: two groups' `Checkpointer`s share one folder and
the lead changes between them; ``keep`` holds across the change."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from raytrain_events import CheckpointConfig, Timestamp, Trainer
from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
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
    commit = SimpleNamespace(loader=SimpleNamespace(manager=manager), optimizer=SimpleNamespace(committed=True))
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
