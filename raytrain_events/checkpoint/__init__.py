"""Checkpoints on any fsspec URL: a new directory per checkpoint, committed by its manifest.

``config`` says when to save and what to load; ``checkpointer`` does it for a `Trainer`;
``format`` writes/reads one checkpoint (``writer``/``reader``: torch.save payloads, weights_only
loads, a manifest with each file's CRC32, ``packed`` for small ones; ``checksums`` computes them;
``safety`` holds the torch floor loads need); ``index`` keeps a folder's committed checkpoints so
commits cost O(1); ``folder`` (`CheckpointFolder`) owns that index and every deletion of a
checkpoint, under a local or a Ray-managed retention; ``committer`` commits (retrying, ``retry``)
and hands each checkpoint to its folder; ``retention`` maps a config to local or Ray retention;
``store`` lists, prunes (through a folder) and loads the newest valid one, and saves in the
background.

Files:

* ``checkpointer.py``: `Checkpointer`: saves the run at checkpoint events and restores it at
  start-up.
* ``checksums.py``: Checksums of checkpoint files: the hashing thread, torch's zip CRC switched off
  (CRC arithmetic: storage/crc32.py).
* ``committer.py``: `Committer`: what rank 0 does to turn a save into a committed, indexed,
  retained checkpoint.
* ``config.py``: `CheckpointConfig`: when to save, how many to keep, and what to load (Composer +
  ml-starter knobs).
* ``folder.py``: `CheckpointFolder`: the one owner of a checkpoint folder's index and of every
  checkpoint deletion.
* ``format.py``: On-storage checkpoint format: one new directory per checkpoint, committed by its
  manifest.
* ``host.py``: What the checkpoint code needs from the loop it saves and restores (a `Trainer` is
  one).
* ``index.py``: `CheckpointIndex`: which checkpoints of a folder are committed, kept so that a
  commit costs O(1).
* ``inference.py``: Load a checkpoint into a `Trainer` built for ``eval()``/``predict()`` only (no
  train data, no optimizer).
* ``item_stream.py``: A read-only stream over the saved items of one DCP file that fetches each
  item once, exactly.
* ``loading.py``: Restoring a checkpoint into a run: the newest one chosen once and shared, then
  applied to the `State`.
* ``manifest.py``: The manifest of a checkpoint: its data model, parsing (both layouts) and input
  checks.
* ``packed.py``: Packed checkpoints: the manifest and every payload file in ONE object, written
  with ONE request.
* ``preemption.py``: SIGTERM (spot reclaim) during a local ``fit()``: save a checkpoint, then stop.
* ``ranged_dcp.py``: Read only the bytes a rank needs of each saved DCP tensor item (ranged reads
  on a reshard).
* ``reader.py``: Reading one committed checkpoint: its manifest, then its files, verified and
  ``weights_only``-loaded.
* ``retention.py``: Checkpoint retention and placement, decided once: what each process deletes and
  where it saves.
* ``retry.py``: Retrying a checkpoint's uploads through an object store's bad minutes: backoff,
  then a deadline.
* ``rng.py``: Capture and restore every RNG a run uses (torch, CUDA, numpy, Python) as safe-to-load
  data.
* ``safe_dcp.py``: torch.distributed.checkpoint (DCP) made safe to load, and writing that hashes as
  it goes.
* ``safetensors_io.py``: Safetensors out and in: a checkpoint's model as a Hugging Face-style
  safetensors directory, and such a directory loaded into a (sharded) model.
* ``safety.py``: The torch floor that our "safe to load" promise rests on, checked before any
  checkpoint load.
* ``save_channel.py``: `SaveChannel`: what the ranks share so that a save costs the training thread
  only its copy.
* ``sharded.py``: Sharded checkpoints: each rank writes its own shards with
  torch.distributed.checkpoint (DCP).
* ``staging.py``: `HostStager`: the device-to-host copy of an async save, into host buffers reused
  by later saves.
* ``store.py``: A directory of checkpoints: list, pick the latest, prune, load with fallback, save
  async.
* ``writer.py``: Writing one checkpoint: payload files uploaded atomically, then the manifest that
  commits them.
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
