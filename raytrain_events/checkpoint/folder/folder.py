"""`CheckpointFolder`: the one owner of a checkpoint folder's index and of every checkpoint deletion.

A folder of checkpoints (``<run>/checkpoints``) is kept by one `CheckpointFolder` per process
that writes it (rank 0 of a run, or the driver after a fit), given a retention policy:

* `LocalRetention(keep)`: a plain `Trainer` prunes to the newest ``keep`` after each commit,
  from its index (no listing per commit), and deletes leftovers of crashed saves older than the
  newest committed checkpoint. ``keep=None`` keeps every checkpoint (and deletes those leftovers: a replica
  groups' lead that died mid-save leaves one, `core/save_points.py`).
* `RayRetention(prunes)`: Ray Train's run snapshot decides. Ray lists every checkpoint reported
  to it and a later run with the same name refuses a snapshot naming a deleted one, so this folder
  never prunes by age; Ray deletes what falls out of its ``num_to_keep``. What is left to this
  folder are directories Ray never heard of: leftovers of crashed saves and committed checkpoints
  newer than Ray's latest at this worker group's start (saved by a group that died before
  reporting them), deleted once, when the first checkpoint of this group is registered with Ray
  (`registered`); and, after a finished fit, committed checkpoints older than the newest Ray's
  final snapshot lists that it no longer lists (`delete_unlisted`). With ``prunes=False``
  (``keep`` unset) nothing is deleted.

The index (``index.py``) is loaded once per folder object (one GET, one LIST) and updated with one
PUT per commit; nothing older is listed or read, so a commit or a prune costs the same with 1 or
10,000 checkpoints behind it. Every deletion is best effort: a delete that fails (an outage) is
logged and found again by the next start's listing, never raised into the commit before it.

The node-local tier's copies (``local_tier.py``) are deleted here too (`prune_local_copies`): each saving
process keeps the newest ``local_keep`` copies on its node's disk.

No other module deletes a checkpoint (``tests/test_ownership.py`` scans the package for it).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from raytrain_events.checkpoint.folder.index import CheckpointIndex, batch_of_name
from raytrain_events.checkpoint.format.manifest import MANIFEST, CheckpointInfo
from raytrain_events.storage.fs import delete, join, resolve

__all__ = [
    "CheckpointFolder",
    "LocalRetention",
    "RayRetention",
    "Retention",
    "delete_checkpoint",
    "prune_local_copies",
]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalRetention:
    """Keep the newest ``keep`` committed checkpoints (None: all); pruned after each commit."""

    keep: Optional[int] = None

    def __post_init__(self) -> None:
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep={self.keep} would delete every checkpoint. Fix: pass keep >= 1 (or None).")


@dataclass(frozen=True)
class RayRetention:
    """Ray Train's snapshot decides what is kept; ``prunes``: Ray deletes something (``keep`` is set),
    so directories it never listed are deleted here too. ``latest_reported``: the name of Ray's latest
    checkpoint when this worker group started (None: Ray lists none of this run's checkpoints)."""

    prunes: bool
    latest_reported: Optional[str] = None


Retention = Union[LocalRetention, RayRetention]


class CheckpointFolder:
    """One folder of checkpoints: its index, its retention, and every deletion in it."""

    def __init__(
        self, url: str, storage_options: Optional[Dict[str, Any]] = None, retention: Optional[Retention] = None
    ) -> None:
        self.url = url
        self.options: Dict[str, Any] = dict(storage_options or {})
        self.retention: Retention = retention if retention is not None else LocalRetention()
        self._index: Optional[CheckpointIndex] = None
        self._unreported: List[str] = []  # RayRetention: committed checkpoints Ray never listed
        self._registered = False

    @property
    def index(self) -> CheckpointIndex:
        """The folder's index: loaded once (one GET, one LIST), then kept up to date by `committed`."""
        if self._index is None:
            self._index = CheckpointIndex.load(self.url, self.options)
        return self._index

    def reload(self) -> None:
        """Forget the index held in memory: the next use loads it again (one GET, one LIST). For a process that
        starts committing here after another did (replica groups' lead changed), whose index may lack the other's
        checkpoints, which its retention would then never delete."""
        self._index = None

    # ------------------------------------------------------------------ the committing process
    def committed(self, info: CheckpointInfo) -> List[str]:
        """Index a checkpoint just committed (one PUT) and apply local retention; the deleted URLs."""
        index = self.index
        index.add(info)
        if isinstance(self.retention, LocalRetention) and self.retention.keep is not None:
            return self.prune(self.retention.keep)
        newest = index.newest()
        if isinstance(self.retention, LocalRetention) and newest is not None:  # every checkpoint kept, not leftovers
            return self.drop_leftovers_below(newest.batch)
        return []

    def record_failure(self, url: str, batch: Optional[int], error: str) -> None:
        """Note a save that failed for good in the index (no I/O now: the store is likely down)."""
        try:
            self.index.add_failure(url, batch, error, time.time())
        except Exception as e:  # the index could not even be loaded: the log line is the record
            _log.warning("Could not record the failed save %s in the checkpoint index: %s", url, e)

    def flush(self) -> None:
        """Write failures recorded since the last commit (the run's end; one PUT, best effort)."""
        if self._index is not None and self._index.unsaved:
            self._index.save()

    def prune(self, keep: int) -> List[str]:
        """Delete all but the newest ``keep`` committed checkpoints and the leftovers of crashed saves
        older than the newest; returns the deleted URLs. Call only after a commit succeeded."""
        if keep < 1:
            raise ValueError(f"prune(keep={keep}) would delete every checkpoint. Fix: pass keep >= 1.")
        index = self.index
        doomed = index.entries[:-keep]
        deleted = self._delete_each([index.url(e) for e in doomed])
        if doomed:
            index.forget([e.name for e in doomed])
        newest = index.newest()
        return deleted + (self.drop_leftovers_below(newest.batch) if newest is not None else [])

    def drop_leftovers_below(self, batch: int) -> List[str]:
        """Delete uncommitted directories (crashed saves) of batches below ``batch``, and the temp files of index
        writes whose writer died (a rank 0 killed mid-write); their URLs."""
        index = self.index
        return self._delete_each(index.take_leftovers_below(batch)) + self._delete_each(
            index.take_dead_writes(), _delete_file
        )

    # ------------------------------------------------------------------ Ray-managed retention
    def retain_with_ray(self, retention: RayRetention) -> None:
        """Hand retention to Ray Train (before the first commit of this worker group): note the
        committed checkpoints newer than Ray's latest, which Ray never listed (from the index this
        folder holds already: no second load)."""
        self.retention = retention
        self._registered = False
        self._unreported = []
        if not retention.prunes:
            return
        index = self.index
        names = [e.name for e in index.entries]
        if retention.latest_reported is None:
            self._unreported = [index.url(e) for e in index.entries]  # Ray lists none of this run's checkpoints
        elif retention.latest_reported in names:
            later = index.entries[names.index(retention.latest_reported) + 1 :]
            self._unreported = [index.url(e) for e in later]
        # else unexpected (Ray's latest is not in this folder): delete nothing

    def registered(self, name: str) -> List[str]:
        """Checkpoint ``name`` is committed and handed to Ray: the first time, delete what Ray never
        listed (older leftovers of crashed saves; unreported checkpoints but this one). The URLs."""
        if self._registered or not isinstance(self.retention, RayRetention) or not self.retention.prunes:
            return []
        self._registered = True
        doomed = [u for u in self._unreported if not u.rstrip("/").endswith("/" + name)]
        self._unreported = []
        deleted = self.drop_leftovers_below(batch_of_name(name, unknown=-1))
        return deleted + self._delete_each(doomed)

    def delete_unlisted(self, listed: List[str]) -> List[str]:
        """After a finished fit: delete committed checkpoints older than the newest of ``listed`` (the
        names Ray's final snapshot holds) that it does not list; returns their URLs.

        Ray updates its snapshot before it deletes what fell out of ``num_to_keep``, so a driver killed
        in between leaves a committed directory no snapshot names: no later run would ever delete it.
        Once the fit has finished Ray's snapshot is final, so nothing deleted here is referenced by it.
        Newer unlisted ones are left alone (a later run resumes from the newest)."""
        index = self.index  # names and batches: no manifest read per checkpoint
        kept = [e.batch for e in index.entries if e.name in listed]
        if not kept:
            return []  # Ray lists none of them: not ours to judge
        doomed = [e for e in index.entries if e.name not in listed and e.batch < max(kept)]
        deleted = self._delete_each([index.url(e) for e in doomed])
        index.forget([e.name for e in doomed if index.url(e) in deleted], save=False)
        return deleted

    def _delete_each(self, urls: List[str], delete_one: Any = None) -> List[str]:
        """Delete each URL (a checkpoint, or with ``delete_one`` what it deletes); returns those deleted. Best
        effort (see the module docstring)."""
        deleted = []
        for url in urls:
            try:
                (delete_one or delete_checkpoint)(url, storage_options=self.options)
                deleted.append(url)
            except Exception as e:
                _log.warning("Retention could not delete %s (%s); it is found again at the next start.", url, e)
        return deleted


def delete_checkpoint(url: str, *, storage_options: Optional[Dict[str, Any]] = None) -> None:
    """Delete one checkpoint directory, its manifest first: a half-deleted one reads as uncommitted."""
    fs, path = resolve(url, storage_options)
    delete(fs, join(path, MANIFEST))
    delete(fs, path, recursive=True)


def _delete_file(url: str, *, storage_options: Optional[Dict[str, Any]] = None) -> None:
    """Delete one file of the folder that is not a checkpoint (a dead writer's index temp)."""
    fs, path = resolve(url, storage_options)
    delete(fs, path)


def prune_local_copies(root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoint copies (``ckpt-*`` directories, newest by name: by batch)
    under the local tier's ``root``; their paths. Best effort: the ranks of a node share ``root`` and prune it
    alike, so a directory another rank deleted first is not an error."""
    if keep < 1:
        raise ValueError(f"prune_local_copies(keep={keep}) would delete every copy. Fix: pass keep >= 1.")
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("ckpt-"))
    except FileNotFoundError:
        return []
    doomed = [os.path.join(root, n) for n in names[:-keep]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
