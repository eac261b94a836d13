"""`Committer`: what rank 0 does to turn a save into a committed, indexed, retained checkpoint.

Runs on the background save thread (or inline for synchronous saves). Per save: upload the
files and write the manifest (``writer.py``), retrying transient storage errors until the
deadline (``retry.py``); then hand the checkpoint to its `CheckpointFolder` (``folder.py``: the
index, one PUT, and retention). Nothing older is listed or read, so a commit costs the same
with 1 or 10,000 checkpoints behind it. A save that fails for good leaves the index and every
committed checkpoint as they were: the previous checkpoint stays "latest"; it is listed in the
index's ``failed`` (`CheckpointFolder.record_failure`), written with the next commit or at the
run's end.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from raytrain_events.checkpoint.folder.folder import CheckpointFolder
from raytrain_events.checkpoint.folder.retry import retry_storage
from raytrain_events.checkpoint.format.manifest import CheckpointInfo, CheckpointNotCommittedError, FileEntry
from raytrain_events.checkpoint.format.reader import read_manifest
from raytrain_events.checkpoint.format.writer import CheckpointSave, write_and_commit
from raytrain_events.storage.errors import RunLockedError
from raytrain_events.storage.locks import acquire_lock
from raytrain_events.storage.run_dir import RunDir

__all__ = ["Committer"]


class Committer:
    """Commits checkpoints into one `CheckpointFolder` (which indexes and retains them; rank 0 only).

    ``run``: the run directory that gets the "ckpt" marker (default: the folder's own run,
    `RunDir.of_checkpoints`)."""

    def __init__(self, folder: CheckpointFolder, *, deadline_s: float, run: Optional[RunDir] = None) -> None:
        self.folder, self.deadline_s = folder, deadline_s
        self.options = folder.options
        self.run = run or RunDir.of_checkpoints(folder.url, folder.options)
        self._marked = False  # the run dir's "ckpt" marker, written once

    def commit(self, save: CheckpointSave, files: Dict[str, Any], entries: List[FileEntry]) -> CheckpointInfo:
        """Upload ``files`` (name -> object) into ``save``'s location and commit them with ``entries``
        (files other processes wrote, checked at commit); index; prune. Raises if it fails for good."""
        attempts = []

        def attempt() -> CheckpointInfo:
            attempts.append(1)
            if len(attempts) > 1:
                try:  # a retry after a commit whose reply was lost: it is committed
                    return read_manifest(save.location)
                except CheckpointNotCommittedError:
                    pass
            return self._upload(save, files, entries)

        info = retry_storage(attempt, deadline_s=self.deadline_s, what=f"checkpoint {save.url}")
        self.folder.committed(info)  # one PUT of index.json and retention: nothing older is listed or read
        if not self._marked:  # ml-starter's marker: this run dir holds a checkpoint
            try:
                acquire_lock(self.run.url, "ckpt", storage_options=self.options, exists_ok=True)
            except RunLockedError:
                pass  # an earlier process of this run marked it already
            self._marked = True
        return info

    def _upload(self, save: CheckpointSave, files: Dict[str, Any], entries: List[FileEntry]) -> CheckpointInfo:
        """One attempt (a separate method so tests can inject failures here)."""
        return write_and_commit(save, files, others=entries)
