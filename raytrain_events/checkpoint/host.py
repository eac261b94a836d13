"""What the checkpoint code needs from the loop it saves and restores (a `Trainer` is one).

Two narrow protocols, so that no checkpoint module reaches past them (``getattr(host, ...)``) or
takes the whole `Trainer`: `ShardHost` for the sharded (DCP) reader and writer, `CheckpointHost`
for the `Checkpointer` and the loading helpers. A module of its own, so that ``loading.py`` names it
without importing ``checkpointer.py`` (which builds the `CheckpointLoader`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Protocol

if TYPE_CHECKING:
    from raytrain_events.core.engine import Engine
    from raytrain_events.core.state import State
    from raytrain_events.dist import Dist
    from raytrain_events.parallel.wrap import Parallel

__all__ = ["CheckpointHost", "ShardHost"]


class ShardHost(Protocol):
    """What `ShardedCheckpointIO` reads: the run's `State` (model, optimizers) and its `Dist`."""

    @property
    def state(self) -> State: ...

    @property
    def dist(self) -> Dist: ...


class CheckpointHost(ShardHost, Protocol):
    """What a `Checkpointer` needs from the loop it saves (a `Trainer` is one)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def parallel(self) -> Parallel:
        """How the model is parallelised: whether it is sharded, and its kind (stored in the metadata)."""
        ...

    @property
    def config(self) -> Dict[str, Any]:
        """The run's config, stored in each checkpoint's metadata (may be empty)."""
        ...
