"""`LocalTier`: the node-local copies of one checkpoint folder's checkpoints (``CheckpointConfig(local_dir=...)``).

Layout, on each node's disk::

    <local_dir>/<run>-<hash12 of the folder URL>/ckpt-<batch>-<id8>/   one directory per checkpoint
        state.pt, rng-rank0.pt, __0_0.distcp, .metadata ...          the files processes of this node wrote

Each process that saves writes its own files there in the same pass as the upload (``format/local_copy.py``):
rank 0 its ``state.pt``, the RNG files and (sharded) ``.metadata``; every rank of a sharded save its
``__<rank>_*.distcp`` shards. Object storage stays the source of truth: a load reads a local file only if it
matches the committed manifest (size and CRC32), file by file, and storage otherwise.

Where ranks land on a restart: a rank on the same node as before finds its files (and those of the other
ranks of that node: they share the directory); a rank placed on another node finds none, or other ranks'
files (read when the manifest matches them, else storage): it reads storage for what it lacks, the others
still read local. A full (unsharded) checkpoint's ``state.pt`` is written by rank 0 only, so only rank 0's node
has it; at a restart rank 0 sends it to the ranks whose node lacks it, which keep it in their tier
(``run/peer_fill.py``): no rank reads it from storage while rank 0's node has it.

Bounded like storage: after each save the process keeps the newest ``keep`` local copies of this folder
(``CheckpointConfig.local_keep``, default ``keep``); the deletion goes through the folder's one owner of
deletions (``folder.py``, `prune_local_copies`).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Dict, Optional

from raytrain_events.checkpoint.folder.folder import prune_local_copies
from raytrain_events.checkpoint.format.local_copy import LocalCopies
from raytrain_events.storage.fs import basename

__all__ = ["LocalTier"]


class LocalTier:
    """Where the node-local copies of the checkpoints of ``folder_url`` go, and how many are kept."""

    def __init__(self, local_dir: str, folder_url: str, keep: Optional[int]) -> None:
        run = basename(folder_url.rstrip("/").rsplit("/", 1)[0]) if folder_url.rstrip("/").count("/") else "run"
        run = re.sub(r"[^A-Za-z0-9._-]", "_", run)[:64] or "run"
        self.root = os.path.join(local_dir, f"{run}-{hashlib.sha256(folder_url.encode()).hexdigest()[:12]}")
        self.keep = keep
        self._read: Dict[str, LocalCopies] = {}  # what a load read of each checkpoint, from which tier

    def copies(self, name: str) -> LocalCopies:
        """The local copy of checkpoint ``name`` (a directory name like ``ckpt-000000000040-1a2b3c4d``) to read
        from; the same object for every read of one load, so its record says what each tier served."""
        if name not in self._read:
            self._read[name] = LocalCopies(os.path.join(self.root, name))
        return self._read[name]

    def for_save(self, name: str) -> LocalCopies:
        """The local copy that a save of checkpoint ``name`` writes this process's files into."""
        return LocalCopies(os.path.join(self.root, name))

    def saved(self) -> list[str]:
        """After this process wrote a local copy: keep the newest ``keep``; the directories deleted."""
        if self.keep is None:
            return []
        return prune_local_copies(self.root, self.keep)
