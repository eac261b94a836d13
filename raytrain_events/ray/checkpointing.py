"""Checkpoints on Ray: our checkpoint directories, registered with Ray Train as they commit.

Checkpoints live under Ray's experiment directory (``<storage>/<run name>/checkpoints``), so
Ray manages them: ``ray.train.report(..., checkpoint_upload_mode=ASYNC)`` with an upload
function that only waits for our background save to commit, then hands Ray the same
directory (no copy). When Ray restarts a failed worker group (``FailureConfig``),
``ray.train.get_checkpoint()`` names the latest registered checkpoint and the new group
resumes from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from raytrain_events.checkpoint.checkpointer import SavedCheckpoint
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.ray.spec import RunSpec
from raytrain_events.storage.fs import basename, join

__all__ = ["ray_checkpoint_config", "report_with_checkpoint"]


def ray_checkpoint_config(spec: RunSpec) -> CheckpointConfig:
    """The worker's `CheckpointConfig`: save under the run dir; resume from Ray's latest on restart."""
    import ray.train

    config: CheckpointConfig = spec.checkpoint
    folder = config.save_folder or join(spec.run_url, "checkpoints")
    options = dict(spec.storage_options)
    options.update(config.storage_options)
    # keep_best: Ray Train's checkpoint manager keeps the best and the newest (the driver's RunConfig).
    updates: Dict[str, Any] = {"save_folder": folder, "storage_options": options, "keep_best": None}
    restored = ray.train.get_checkpoint()
    if restored is not None:  # a restart after a failure: continue from Ray's latest checkpoint
        updates["load_from"] = join(folder, basename(restored.path))
        updates["autoresume"] = False
        updates["load_weights_only"] = False
    return dataclasses.replace(config, **updates)


def report_with_checkpoint(report: Dict[str, Any], saved: SavedCheckpoint) -> None:
    """``ray.train.report`` that registers ``saved`` with Ray once it is committed (rank 0 passes it)."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    checkpoint = None
    if saved.rank == 0:
        storage = ray.train.get_context().get_storage()
        path = join(storage.experiment_fs_path, "checkpoints", saved.name)
        checkpoint = Checkpoint(path=path, filesystem=storage.storage_filesystem)

    def _wait_for_commit(checkpoint: Any, dir_name: str) -> Any:
        saved.wait()  # raises if the background save failed
        return checkpoint

    ray.train.report(
        report,
        checkpoint=checkpoint,
        checkpoint_dir_name=saved.name,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        checkpoint_upload_fn=_wait_for_commit,
        delete_local_checkpoint_after_upload=False,
    )
