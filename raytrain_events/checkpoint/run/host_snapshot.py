"""`HostSnapshots`: the last two good states of a run in host memory, restored without a storage read.

A snapshot is what a checkpoint restores (`State.state_dict`: model, optimizers, schedulers, loss
scaler, algorithms, callbacks) plus every RNG (``rng.py``'s in-memory capture: the generators' own
state objects, never serialized), copied off the training tensors by a `HostStager` (``staging.py``:
buffers allocated at the first snapshot and reused by every later one, pinned for CUDA sources,
DTensor shards kept as shards). Each rank snapshots its own state at the
same batches, so a restore on every rank gives back one consistent run state.

Two are kept by default (`SpikeGuard` needs the newest one *before* a batch whose spike is agreed one
batch late; judging the loss alone with a snapshot every batch it keeps 3: ``callbacks/spike_rollback.py``);
each holds its own buffers, so memory is two host copies of each rank's state (model +
optimizer state: 3x the weights' bytes for Adam, per copy). Cost per snapshot: one host copy of that
state (a memcpy on the CPU, a device-to-host copy on a GPU); nothing between snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Optional

import torch

from raytrain_events.checkpoint.run.rng import RngInMemory, capture_rng_in_memory, restore_rng_in_memory
from raytrain_events.checkpoint.run.staging import HostStager
from raytrain_events.core.state import State

__all__ = ["HostSnapshots", "Snapshot"]


@dataclass(eq=False)
class Snapshot:
    """One host copy: the `State` tree (no timestamp, no skipped counts), the RNGs, and ``meta`` (what the taker recorded)."""

    tree: Dict[str, Any]
    rng: RngInMemory
    meta: Dict[str, Any]
    stager: HostStager


def _clone(node: Any) -> Any:
    """A copy of a staged tree whose tensors are fresh (a load must never alias the reused buffers)."""
    if torch.is_tensor(node):
        return node.clone()
    if isinstance(node, dict):
        return {k: _clone(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_clone(v) for v in node)
    return node


class HostSnapshots:
    """The newest two snapshots of a `State`; `take` one, `restore` the newest that passes a test.

    Example::

        snapshots = HostSnapshots(state, exclude_callbacks={"SpikeGuard"})
        snapshots.take({"batch": 12})
        chosen = snapshots.restore(lambda meta: meta["batch"] <= 11)   # its meta, or None if none passes

    ``exclude_callbacks``: checkpoint keys of callbacks left out (the taker's own bookkeeping must
    survive the restore), their state never computed (`SpikeGuard`'s holds its quarantine: no per-snapshot cost
    that grows with it).
    """

    def __init__(self, state: State, exclude_callbacks: Collection[str] = (), keep: int = 2) -> None:
        self.state, self.exclude, self.keep = state, set(exclude_callbacks), keep
        self.snapshots: List[Snapshot] = []  # oldest first

    def take(self, meta: Dict[str, Any]) -> None:
        """Copy the state to host memory now, dropping the oldest snapshot beyond ``keep`` (its buffers reused)."""
        stager = self.snapshots.pop(0).stager if len(self.snapshots) >= self.keep else HostStager()
        # The excluded callbacks' state never computed; nor the Timestamp and the skipped counts, kept through a
        # restore (the rollback adds its window to them).
        tree = self.state.state_dict(exclude_callbacks=self.exclude, position=False)
        staged = stager.stage(tree)
        staged.release()  # this slot's buffers are ours alone: the next snapshot into them may overwrite
        self.snapshots.append(Snapshot(staged.tree, capture_rng_in_memory(), dict(meta), stager))

    def newest(self, accept: Callable[[Dict[str, Any]], bool]) -> Optional[Snapshot]:
        """The newest snapshot whose ``meta`` ``accept`` takes, or None."""
        for snapshot in reversed(self.snapshots):
            if accept(snapshot.meta):
                return snapshot
        return None

    def restore(self, accept: Callable[[Dict[str, Any]], bool]) -> Optional[Dict[str, Any]]:
        """Load the newest accepted snapshot into the state (not its timestamp) and the RNGs; drop the
        snapshots newer than it; its ``meta``, or None (nothing restored) when none is accepted."""
        chosen = self.newest(accept)
        if chosen is None:
            return None
        self.state.load_state_dict(_clone(chosen.tree))
        restore_rng_in_memory(chosen.rng)
        self.snapshots = self.snapshots[: next(i for i, s in enumerate(self.snapshots) if s is chosen) + 1]
        return dict(chosen.meta)

    def clear(self) -> None:
        self.snapshots = []
