"""Checkpoints on any fsspec URL: a new directory per checkpoint, committed by its manifest.

The subpackages, each built only on those above it in this list:

* ``format/``: one checkpoint on storage: its manifest (what commits it), checksums, the packed
  layout, the torch floor safe loads need, the writer and the reader. Imports no other part of
  ``checkpoint/``.
* ``folder/``: a folder of checkpoints: its index, retention, every deletion (`CheckpointFolder`),
  the commit that adds a checkpoint (with upload retries), and listing/loading the newest valid
  one (``store.py``).
* ``dcp/``: sharded checkpoints through torch.distributed.checkpoint, made safe to load, with
  ranged reads on a reshard and safetensors export/import.
* ``run/``: the loop's side: `Checkpointer` saves at checkpoint events (device-to-host staging, a
  background upload) and restores at start-up; loading for inference; saving on SIGTERM; RNGs.

A save, top to bottom: ``run/checkpointer.py`` -> ``dcp/sharded.py`` (sharded) or
``format/writer.py`` (each rank's files) -> ``folder/committer.py`` -> ``format/writer.py``
(the manifest) -> ``folder/folder.py`` (index, retention). A load: ``run/loading.py`` ->
``folder/store.py`` (which checkpoint) -> ``format/reader.py`` or ``dcp/safe_dcp.py``.

The public names below are imported from here (``from raytrain_events.checkpoint import
CheckpointConfig``); each loads its module on first use. Every other name has one import path:
the module that defines it.

Files:

* ``config.py``: `CheckpointConfig`: when to save, how many to keep, and what to load (Composer +
  ml-starter knobs).
* ``host.py``: What the checkpoint code needs from the loop it saves and restores (a `Trainer` is
  one).
"""

from typing import TYPE_CHECKING

from raytrain_events.lazy_names import lazy_names

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads these on first use
    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.checkpoint.dcp.safetensors_io import export_safetensors, load_safetensors
    from raytrain_events.checkpoint.folder.store import (
        latest_checkpoint,
        list_checkpoints,
        load_latest_valid,
        prune_checkpoints,
    )
    from raytrain_events.checkpoint.format.manifest import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointInfo,
        CheckpointNotCommittedError,
        UnsafeCheckpointError,
        UnsupportedCheckpointVersionError,
    )
    from raytrain_events.checkpoint.format.reader import read_checkpoint

_MANIFEST = "raytrain_events.checkpoint.format.manifest"
_STORE = "raytrain_events.checkpoint.folder.store"
_SAFETENSORS = "raytrain_events.checkpoint.dcp.safetensors_io"
_LAZY = {
    "CheckpointConfig": "raytrain_events.checkpoint.config",
    "CheckpointCorruptError": _MANIFEST,
    "CheckpointError": _MANIFEST,
    "CheckpointInfo": _MANIFEST,
    "CheckpointNotCommittedError": _MANIFEST,
    "UnsafeCheckpointError": _MANIFEST,
    "UnsupportedCheckpointVersionError": _MANIFEST,
    "export_safetensors": _SAFETENSORS,
    "latest_checkpoint": _STORE,
    "list_checkpoints": _STORE,
    "load_latest_valid": _STORE,
    "load_safetensors": _SAFETENSORS,
    "prune_checkpoints": _STORE,
    "read_checkpoint": "raytrain_events.checkpoint.format.reader",
}

__all__ = [
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotCommittedError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointVersionError",
    "export_safetensors",
    "latest_checkpoint",
    "list_checkpoints",
    "load_latest_valid",
    "load_safetensors",
    "prune_checkpoints",
    "read_checkpoint",
]

__getattr__ = lazy_names(__name__, _LAZY, globals())


def __dir__() -> "list[str]":
    return sorted(set(globals()) | set(__all__))
