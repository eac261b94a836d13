"""`Committer`: what rank 0 does to turn a save into a committed, indexed, retained checkpoint.

Runs on the background save thread (or inline for synchronous saves). Per save: upload the
files and write the manifest (``writer.py``), retrying transient storage errors until the
deadline (``retry.py``); then add the checkpoint to the folder's `CheckpointIndex` (one PUT) and
prune to ``keep`` from that index. Nothing older is listed or read, so a commit costs the same
with 1 or 10,000 checkpoints behind it. A save that fails for good leaves the index and every
committed checkpoint as they were: the previous checkpoint stays "latest"; it is listed in the
index's ``failed`` (`record_failure`), written with the next commit or at `flush` (the run's end).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

from raytrain_events.checkpoint.index import CheckpointIndex
from raytrain_events.checkpoint.manifest import CheckpointInfo, CheckpointNotCommittedError, FileEntry
from raytrain_events.checkpoint.reader import read_manifest
from raytrain_events.checkpoint.retry import retry_storage
from raytrain_events.checkpoint.writer import write_and_commit
from raytrain_events.storage.errors import RunLockedError
from raytrain_events.storage.exp_dir import run_url_of_checkpoints
from raytrain_events.storage.locks import acquire_lock

__all__ = ["Committer"]

_log = logging.getLogger(__name__)


class Committer:
    """Commits checkpoints into one folder and keeps its index and retention (rank 0 only)."""

    def __init__(self, folder: str, options: Dict[str, Any], *, keep: Optional[int], deadline_s: float) -> None:
        self.folder, self.options, self.keep, self.deadline_s = folder, options, keep, deadline_s
        self._index: Optional[CheckpointIndex] = None
        self._marked = False  # the run dir's "ckpt" marker, written once

    @property
    def index(self) -> CheckpointIndex:
        """The folder's index: loaded once (one GET, one LIST), then kept up to date by `commit`."""
        if self._index is None:
            self._index = CheckpointIndex.load(self.folder, self.options)
        return self._index

    def commit(
        self,
        url: str,
        files: Dict[str, Any],
        entries: List[FileEntry],
        *,
        timestamp: Dict[str, int],
        world_size: int,
        metadata: Dict[str, Any],
    ) -> CheckpointInfo:
        """Upload ``files`` (name -> object) into ``url`` and commit them with ``entries`` (files other
        processes wrote, checked at commit); index; prune. Raises if it fails for good."""
        attempts = []

        def attempt() -> CheckpointInfo:
            attempts.append(1)
            if len(attempts) > 1:
                try:  # a retry after a commit whose reply was lost: it is committed
                    return read_manifest(url, storage_options=self.options)
                except CheckpointNotCommittedError:
                    pass
            return self._upload(url, files, entries, timestamp, world_size, metadata)

        info = retry_storage(attempt, deadline_s=self.deadline_s, what=f"checkpoint {url}")
        index = self.index
        index.add(info)  # one PUT of index.json: nothing older is listed or read
        if self.keep is not None:
            index.prune(self.keep)
        if not self._marked:  # ml-starter's marker: this run dir holds a checkpoint
            try:
                acquire_lock(run_url_of_checkpoints(self.folder), "ckpt", storage_options=self.options, exists_ok=True)
            except RunLockedError:
                pass  # an earlier process of this run marked it already
            self._marked = True
        return info

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

    def _upload(
        self,
        url: str,
        files: Dict[str, Any],
        entries: List[FileEntry],
        timestamp: Dict[str, int],
        world_size: int,
        metadata: Dict[str, Any],
    ) -> CheckpointInfo:
        return write_and_commit(
            url,
            files=files,
            timestamp=timestamp,
            world_size=world_size,
            metadata=metadata,
            storage_options=self.options,
            others=entries,
        )
