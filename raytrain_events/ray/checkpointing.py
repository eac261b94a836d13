"""Checkpoints on Ray: our checkpoint directories, registered with Ray Train as they commit.

Checkpoints live under Ray's experiment directory (``<storage>/<run name>/checkpoints``):
``ray.train.report(..., checkpoint_upload_mode=ASYNC)`` with an upload function that only waits
for our background save to commit, then hands Ray the same directory (no copy).

One owner of retention: Ray. Its run snapshot lists every checkpoint reported to it and a later
run with the same name refuses a snapshot naming a deleted one, so on Ray our `Checkpointer`
never prunes (``keep=None`` on the workers) and the driver passes ``keep`` to Ray as
``CheckpointConfig(num_to_keep)``; Ray deletes what it no longer lists, after updating its
snapshot. Our own deletions are limited to directories Ray never heard of: leftovers of crashed
saves, and committed checkpoints newer than Ray's latest at start-up (saved by a group that died
before reporting them), removed once a newer checkpoint is registered; and, after a finished
run, committed checkpoints older than Ray's newest that its final snapshot no longer lists (a
driver killed while Ray was pruning leaves one behind: `delete_unlisted`).

One notion of latest: the newest committed checkpoint of the run directory (by global batch).
Every continuation resumes from it: a restart by ``FailureConfig``, an elastic resize, and a new
run with the same name (Ray restores its snapshot; ``autoresume`` / ``resume=true``). It is what
Ray reports last too (every save is reported), so ``result.checkpoint`` points at it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from raytrain_events.checkpoint.checkpointer import SavedCheckpoint
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.ray.spec import RunSpec
from raytrain_events.storage.fs import join

__all__ = ["delete_unlisted", "ray_checkpoint_config", "report_with_checkpoint", "unreported_checkpoints"]


def ray_checkpoint_config(spec: RunSpec) -> CheckpointConfig:
    """The worker's `CheckpointConfig`: save under the run dir, Ray prunes, resume from the newest."""
    import ray.train

    config: CheckpointConfig = spec.checkpoint
    folder = config.save_folder or join(spec.run_url, "checkpoints")
    options = dict(spec.storage_options)
    options.update(config.storage_options)
    # keep_best: Ray Train's checkpoint manager keeps the best and the newest (the driver's RunConfig).
    updates: Dict[str, Any] = {"save_folder": folder, "storage_options": options, "keep_best": None}
    updates.update(keep=None, only_save_most_recent=False)  # Ray's num_to_keep prunes (see module doc)
    from raytrain_events.checkpoint.store import latest_checkpoint

    if ray.train.get_checkpoint() is not None or latest_checkpoint(folder, storage_options=options) is not None:
        # A restart, an elastic resize, or a run continued by name: take the newest committed
        # checkpoint of the run dir (it may be newer than Ray's latest: saved, never reported).
        # ``load_from`` / ``load_weights_only`` / ``load_ignore_keys`` were for this run's start only.
        updates.update(autoresume=True, load_from=None, load_weights_only=False, load_ignore_keys=[])
    return dataclasses.replace(config, **updates)


def unreported_checkpoints(folder: str, options: Dict[str, Any]) -> List[str]:
    """Committed checkpoints newer than Ray's latest at this group's start: Ray never listed them."""
    import ray.train

    from raytrain_events.checkpoint.store import list_checkpoints

    latest = ray.train.get_checkpoint()
    committed = list_checkpoints(folder, storage_options=options)
    names = [c.name for c in committed]
    name = None if latest is None else latest.path.rstrip("/").rsplit("/", 1)[-1]
    if name is None:
        return [c.url for c in committed]  # Ray lists none of this run's checkpoints
    if name not in names:
        return []  # unexpected: delete nothing
    return [c.url for c in committed[names.index(name) + 1 :]]


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
        _forget_unreported(saved)
        return checkpoint

    ray.train.report(
        report,
        checkpoint=checkpoint,
        checkpoint_dir_name=saved.name,
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        checkpoint_upload_fn=_wait_for_commit,
        delete_local_checkpoint_after_upload=False,
    )


class _Cleanup:
    """Rank 0's deletions of directories Ray never listed, done when the next checkpoint commits."""

    def __init__(self, folder: str, options: Dict[str, Any], unreported: List[str]) -> None:
        self.folder, self.options, self.unreported = folder, options, unreported

    def after_commit(self, saved: SavedCheckpoint) -> None:
        from raytrain_events.checkpoint.format import CHECKPOINT_NAME_RE
        from raytrain_events.checkpoint.store import _scan, delete_checkpoint
        from raytrain_events.storage.fs import basename

        doomed, self.unreported = [u for u in self.unreported if not u.rstrip("/").endswith("/" + saved.name)], []
        _, uncommitted = _scan(self.folder, self.options)
        match = CHECKPOINT_NAME_RE.match(saved.name)
        newest = int(match.group(1)) if match else -1
        for url in uncommitted:  # leftovers of crashed saves (Ray registers only committed ones)
            m = CHECKPOINT_NAME_RE.match(basename(url))
            if m and int(m.group(1)) < newest:
                doomed.append(url)
        for url in doomed:
            delete_checkpoint(url, storage_options=self.options)


_cleanup: Optional[_Cleanup] = None  # set on rank 0 by `start_retention`


def start_retention(config: CheckpointConfig, keep: Optional[int]) -> None:
    """Rank 0, before training: what to delete besides Ray's pruning (nothing when keeping all)."""
    global _cleanup
    folder, options = config.save_folder, dict(config.storage_options)
    _cleanup = _Cleanup(folder, options, unreported_checkpoints(folder, options) if keep is not None else [])


def _forget_unreported(saved: SavedCheckpoint) -> None:
    if _cleanup is not None:
        _cleanup.after_commit(saved)


def delete_unlisted(folder: str, options: Dict[str, Any], listed: List[str]) -> List[str]:
    """The driver, after a finished fit: delete committed checkpoints older than the newest of
    ``listed`` (the names Ray's final snapshot holds) that it does not list; returns their URLs.

    Ray updates its snapshot before it deletes what fell out of ``num_to_keep``, so a driver
    killed in between leaves a committed directory no snapshot names: no later run would ever
    delete it. Once the fit has finished Ray's snapshot is final, so nothing deleted here is
    referenced by it. Newer unlisted ones are left alone (a later run resumes from the newest)."""
    from raytrain_events.checkpoint.store import delete_checkpoint, list_checkpoints

    committed = list_checkpoints(folder, storage_options=options)
    kept = [c.batch for c in committed if c.name in listed]
    if not kept:
        return []  # Ray lists none of them: not ours to judge
    doomed = [c.url for c in committed if c.name not in listed and c.batch < max(kept)]
    for url in doomed:
        delete_checkpoint(url, storage_options=options)
    return doomed
