"""Checkpoints on Ray: our checkpoint directories, registered with Ray Train as they commit.

Checkpoints live under Ray's experiment directory (``<storage>/<run name>/checkpoints``):
``ray.train.report(..., checkpoint_upload_mode=ASYNC)`` with an upload function that only waits
for our background save to commit, then hands Ray the same directory (no copy).

One owner of retention: Ray. Its run snapshot lists every checkpoint reported to it and a later
run with the same name refuses a snapshot naming a deleted one, so on Ray our `Checkpointer`
never prunes (``keep=None`` on the workers) and the driver passes ``keep`` to Ray as
``CheckpointConfig(num_to_keep)``; Ray deletes what it no longer lists, after updating its
snapshot. Our own deletions are limited to directories Ray never heard of, and all of them are
made by the run's `CheckpointFolder` under its Ray-managed retention (``checkpoint/folder/folder.py``):
rank 0's folder (the `Checkpointer`'s own, the one index it loaded) is handed to Ray before
training (`hand_retention_to_ray`) and deletes leftovers of crashed saves and committed
checkpoints newer than Ray's latest at start-up (saved by a group that died before reporting
them) once a newer checkpoint is registered; the driver's folder deletes, after a finished run,
committed checkpoints older than Ray's newest that its final snapshot no longer lists (a driver
killed while Ray was pruning leaves one behind: `delete_unlisted`).

One notion of latest: the newest committed checkpoint of the run directory (by global batch).
Every continuation resumes from it: a restart by ``FailureConfig``, an elastic resize, and a new
run with the same name (Ray restores its snapshot; ``autoresume`` / ``resume=true``). It is what
Ray reports last too (every save is reported), so ``result.checkpoint`` points at it. The driver
reads its position (`resume_position`: the folder's index and one manifest) to start the train
stream while the worker group starts (``feeder.py``, Started early).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.checkpoint.folder.folder import CheckpointFolder, RayRetention
from raytrain_events.checkpoint.folder.retention import CheckpointPlan
from raytrain_events.checkpoint.folder.store import latest_checkpoint
from raytrain_events.checkpoint.run.checkpointer import Checkpointer, SavedCheckpoint
from raytrain_events.storage.fs import basename
from raytrain_events.storage.run_dir import RunDir

__all__ = [
    "delete_unlisted",
    "hand_retention_to_ray",
    "ray_checkpoint_config",
    "report_with_checkpoint",
    "resume_position",
]

logger = logging.getLogger(__name__)


def resume_position(plan: Optional[CheckpointPlan]) -> Tuple[int, int]:
    """``(epoch, global sample in epoch)`` where the run's train data will start: the newest committed
    checkpoint's (what every continuation resumes from; its manifest's ``data_position``), or ``(0, 0)``.
    Read on the driver from the checkpoint folder's index and that manifest (one LIST, a GET or two). A guess for
    starting the stream early: a worker that loads another checkpoint (this one turned out unreadable,
    or a newer one committed since) asks the feeder for its own position, which then starts there.
    ``plan``: the run plan's `CheckpointPlan` (None: no checkpoints)."""
    if plan is None:
        return 0, 0

    try:
        info = latest_checkpoint(plan.worker.save_folder, storage_options=plan.worker.storage_options)
    except Exception as exc:  # noqa: BLE001 - a guess: the workers read the folder themselves and raise there
        logger.info("The newest checkpoint's position could not be read (%r): the train stream starts at 0.", exc)
        return 0, 0
    if info is None:
        return 0, 0
    data = info.metadata.get("data_position") or {}  # the loop's epoch and global sample in it, at the save
    epoch = int(data.get("epoch", info.timestamp.get("epoch", 0)))
    return epoch, int(data.get("sample_in_epoch", 0)) if data.get("batch_in_epoch") else 0


def ray_checkpoint_config(plan: Optional[CheckpointPlan]) -> Any:
    """Ray Train's ``CheckpointConfig`` for the run plan's `CheckpointPlan` (None without checkpoints): Ray
    prunes (see module doc)."""
    import ray.train

    if plan is None:
        return None
    if plan.score_attribute is None:  # keep the newest ``keep`` (None: all)
        return ray.train.CheckpointConfig(num_to_keep=plan.num_to_keep)
    return ray.train.CheckpointConfig(
        num_to_keep=plan.num_to_keep,
        checkpoint_score_attribute=plan.score_attribute,
        checkpoint_score_order=plan.score_order,
    )


def hand_retention_to_ray(checkpointer: Checkpointer, plan: CheckpointPlan) -> None:
    """Rank 0, before training: its `CheckpointFolder` leaves retention to Ray Train, and notes what
    Ray never listed (committed checkpoints newer than Ray's latest at this group's start)."""
    import ray.train

    latest = ray.train.get_checkpoint()
    name = None if latest is None else basename(latest.path.rstrip("/"))
    checkpointer.checkpoints.retain_with_ray(RayRetention(prunes=plan.prunes, latest_reported=name))


def report_with_checkpoint(report: Dict[str, Any], saved: SavedCheckpoint, validation: bool = False) -> None:
    """``ray.train.report`` that registers ``saved`` with Ray once it is committed (rank 0 passes it).

    ``validation``: ask Ray Train to run the run's asynchronous validation on it (`ray/checkpointing/validation.py`)."""
    import ray.train
    from ray.train import Checkpoint, CheckpointUploadMode

    checkpoint = None
    if saved.rank == 0:
        storage = ray.train.get_context().get_storage()
        path = RunDir(storage.experiment_fs_path).checkpoint(saved.name)
        checkpoint = Checkpoint(path=path, filesystem=storage.storage_filesystem)

    def _wait_for_commit(checkpoint: Any, dir_name: str) -> Any:
        saved.wait()  # raises if the background save failed
        if saved.folder is not None:  # rank 0: the first registration deletes what Ray never listed
            saved.folder.registered(saved.name)
        return checkpoint

    ray.train.report(
        report,
        checkpoint=checkpoint,
        checkpoint_dir_name=saved.name,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        checkpoint_upload_fn=_wait_for_commit,
        delete_local_checkpoint_after_upload=False,
        validation=validation and checkpoint is not None,  # Ray takes the flag of the rank holding the checkpoint
    )


def delete_unlisted(folder: str, options: Dict[str, Any], listed: List[str]) -> List[str]:
    """The driver, after a finished fit: delete committed checkpoints older than the newest of
    ``listed`` (the names Ray's final snapshot holds) that it does not list; returns their URLs.

    Ray updates its snapshot before it deletes what fell out of ``num_to_keep``, so a driver
    killed in between leaves a committed directory no snapshot names: no later run would ever
    delete it. Once the fit has finished Ray's snapshot is final, so nothing deleted here is
    referenced by it. Newer unlisted ones are left alone (a later run resumes from the newest)."""
    return CheckpointFolder(folder, options, RayRetention(prunes=True)).delete_unlisted(listed)
