"""Checkpoints on any fsspec URL: a new directory per checkpoint, committed by its manifest.

``config`` says when to save and what to load; ``checkpointer`` does it for a `Trainer`;
``format`` writes/reads one checkpoint (torch.save payloads, weights_only loads, a manifest
with each file's sha256, or CRC32 when ``packed``; ``checksums`` computes them); ``store`` lists, prunes and loads the newest valid one, and saves in the background.
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
