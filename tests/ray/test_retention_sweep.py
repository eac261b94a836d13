"""`delete_unlisted`: after a finished run, committed checkpoints Ray's final snapshot no longer
lists (older than its newest) are deleted; nothing else is. Real checkpoints on a local disk, no Ray.

The case it exists for: Ray updates its run snapshot before deleting what fell out of
``num_to_keep``, so a driver killed in between leaves a committed directory that no snapshot names
and no later run would delete (seen in tests/examples/test_resume_example.py, keep=1 after a kill)."""

from __future__ import annotations

import os

import torch

from raytrain_events.checkpoint import list_checkpoints
from raytrain_events.checkpoint.format import write_checkpoint
from raytrain_events.ray.checkpointing import delete_unlisted


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
