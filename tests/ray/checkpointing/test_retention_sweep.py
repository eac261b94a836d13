"""`delete_unlisted`: after a finished run, committed checkpoints Ray's final snapshot no longer
lists (older than its newest) are deleted; nothing else is. Real checkpoints on a local disk, no Ray.

The case it exists for: Ray updates its run snapshot before deleting what fell out of
``num_to_keep``, so a driver killed in between leaves a committed directory that no snapshot names
and no later run would delete (seen in tests/examples/test_resume_example.py, keep=1 after a kill)."""

from __future__ import annotations

import os

import torch

from raytrain_events.checkpoint import list_checkpoints
from raytrain_events.checkpoint.format.writer import write_checkpoint
from raytrain_events.ray.checkpointing.checkpointing import delete_unlisted


def _save(folder: str, batch: int) -> str:
    info = write_checkpoint(
        folder, files={"state.pt": {"w": torch.ones(2) * batch}}, timestamp={"batch": batch}, world_size=1
    )
    return info.name


def test_orphans_older_than_rays_newest_are_deleted_and_nothing_else(tmp_path):
    folder = str(tmp_path / "checkpoints")
    orphan, listed_old, unlisted_new = _save(folder, 10), _save(folder, 12), _save(folder, 40)
    listed_new = _save(folder, 36)
    os.makedirs(os.path.join(folder, "not-a-checkpoint"))  # not ours: left alone
    deleted = delete_unlisted(folder, {}, [listed_old, listed_new])
    assert [os.path.basename(u.rstrip("/")) for u in deleted] == [orphan]
    assert [c.name for c in list_checkpoints(folder)] == [listed_old, listed_new, unlisted_new]
    assert not os.path.exists(os.path.join(folder, orphan))
    assert os.path.isdir(os.path.join(folder, "not-a-checkpoint"))


def test_nothing_is_deleted_when_ray_lists_none_of_them(tmp_path):
    folder = str(tmp_path / "checkpoints")
    names = [_save(folder, b) for b in (5, 10)]
    assert delete_unlisted(folder, {}, []) == []
    assert delete_unlisted(folder, {}, ["ckpt-from-another-run"]) == []
    assert [c.name for c in list_checkpoints(folder)] == names


def test_rank_0s_checkpoint_folder_hands_retention_to_ray_with_its_one_index(tmp_path, monkeypatch):
    """What a Ray worker's rank 0 does (`hand_retention_to_ray`), without Ray: the `Checkpointer`'s own
    `CheckpointFolder` (the one index it loaded to resume: no second one) leaves retention to Ray's
    snapshot, and at the first registration deletes only what Ray never listed: the committed checkpoint
    newer than Ray's latest and an older crashed save. Ray's latest and the new one stay."""
    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.checkpoint.folder.folder import RayRetention
    from raytrain_events.checkpoint.folder.index import CheckpointIndex
    from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
    from raytrain_events.trainer import Trainer
    from tests.checkpoint.test_trainer_checkpoints import loader, model

    folder = str(tmp_path / "run" / "checkpoints")
    config = CheckpointConfig(
        save_folder=folder, save_every_n_steps=2, save_every_n_seconds=None, save_final=False, autoresume=True,
        async_save=False, lock_run_dir=False,
    )  # fmt: skip

    def trainer(batches):
        m = model()
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        return Trainer(
            model=m, train_dataloader=loader(), max_duration=f"{batches}ba", optimizers=optimizer, checkpoint=config
        )

    trainer(4).fit()
    ray_latest, unreported = [c.name for c in list_checkpoints(folder)]  # batches 2 and 4; Ray heard of 2 only
    os.makedirs(os.path.join(folder, "ckpt-000000000003-deadbeef"))  # a save that crashed before committing
    loads = []
    real_load = CheckpointIndex.load
    monkeypatch.setattr(CheckpointIndex, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    second = trainer(6)  # resumes from batch 4 (the newest committed)
    checkpointer = find_checkpointer(second.state)
    checkpointer.checkpoints.retain_with_ray(RayRetention(prunes=True, latest_reported=ray_latest))
    second.fit()
    saved = checkpointer.saved[-1]
    assert saved.folder is checkpointer.checkpoints and os.path.isdir(os.path.join(folder, unreported))
    deleted = saved.folder.registered(saved.name)  # what the upload function Ray calls does once it committed
    assert sorted(os.path.basename(u.rstrip("/")) for u in deleted) == sorted(
        [unreported, "ckpt-000000000003-deadbeef"]
    )
    assert [c.name for c in list_checkpoints(folder)] == [ray_latest, saved.name]
    assert saved.folder.registered(saved.name) == []  # once per worker group
    assert len(loads) == 1  # one index on rank 0: resuming and retention share it
