"""Checkpoints on any fsspec URL: a new directory per checkpoint, committed by its manifest.

``config`` says when to save and what to load; ``checkpointer`` does it for a `Trainer`;
``format`` writes/reads one checkpoint (``writer``/``reader``: torch.save payloads, weights_only
loads, a manifest with each file's CRC32, ``packed`` for small ones; ``checksums`` computes them;
``safety`` holds the torch floor loads need); ``index`` keeps a folder's committed checkpoints so
commits cost O(1), ``committer`` commits, indexes and prunes (retrying, ``retry``); ``retention``
maps a config to local or Ray retention; ``store`` lists, prunes and loads the newest valid one,
and saves in the background.
"""

from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    CheckpointNotCommittedError,
    UnsafeCheckpointError,
    UnsupportedCheckpointVersionError,
    read_checkpoint,
)
from raytrain_events.checkpoint.store import latest_checkpoint, list_checkpoints, load_latest_valid, prune_checkpoints

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotCommittedError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointVersionError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_latest_valid",
    "prune_checkpoints",
    "read_checkpoint",
]
