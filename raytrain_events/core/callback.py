"""The `Callback` interface: code that observes the loop (logging, monitoring, saving).

A callback overrides a method named after each event it cares about, for example
``batch_end(state, logger)``. The `Engine` works out once which events a callback overrides,
so events it ignores cost nothing per step.

Three hooks come outside the fixed per-batch order of `Event`: ``on_exception`` (the loop raised),
``on_quorum_change`` (replica groups: a group left or joined, described by a `QuorumChange`) and
``on_rollback`` (`SpikeGuard` restored the state from a host snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict

from raytrain_events.core.event import Event

if TYPE_CHECKING:
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State
    from raytrain_events.core.timestamp import Timestamp

__all__ = ["Callback", "QuorumChange"]


@dataclass(frozen=True)
class QuorumChange:
    """A change of the replica groups training together, seen before a step (`Callback.on_quorum_change`).

    ``timestamp``: the global `Timestamp` of the step about to be trained (every group's, after a
    joining group recovered it from a peer); ``before`` / ``after``: how many groups were in the
    previous step's quorum and are in this one; ``healed``: this group itself recovered its state
    from a peer in this quorum.
    """

    timestamp: Timestamp
    before: int
    after: int
    healed: bool = False

    @property
    def batch(self) -> int:
        """The global batch number of the step about to be trained."""
        return int(self.timestamp.batch)

    @property
    def left(self) -> bool:
        """True when groups left (fewer groups than before), False when groups joined."""
        return self.after < self.before

    def line(self) -> str:
        """The run's console line for it, e.g. ``replica groups: 3 -> 2 (a group left) before batch 27``."""
        what = "left" if self.left else "joined"
        heal = ", this group recovered from a peer" if self.healed else ""
        return f"replica groups: {self.before} -> {self.after} (a group {what}) before batch {self.batch}{heal}"


class Callback:
    """Base class for callbacks: override the events you need.

    Example::

        class PrintLoss(Callback):
            def batch_end(self, state, logger):
                if int(state.timestamp.batch) % 100 == 0:
                    print(float(state.loss))
    """

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        """Dispatch ``event`` to the method of the same name."""
        getattr(self, event.value)(state, logger)

    def overridden_events(self) -> list[Event]:
        """The events whose method this callback's class overrides (cached by the Engine)."""
        if type(self).run_event is not Callback.run_event:
            return list(Event)  # custom dispatch: must see every event
        return [e for e in Event if getattr(type(self), e.value) is not getattr(Callback, e.value)]

    def on_exception(self, state: State, logger: Logger, exc: BaseException) -> None:
        """Called when the loop raises, before the exception propagates."""

    def on_quorum_change(self, state: State, logger: Logger, change: QuorumChange) -> None:
        """Replica groups (``RayTrainer(fault_tolerance="replica_groups")``): a group left or joined.

        Called on every group still training, before the step at ``change.timestamp`` and outside
        the per-batch event order (inside the dataloader's ``next``); the step's batch is not chosen yet.
        """

    def on_rollback(self, state: State, logger: Logger) -> None:
        """`SpikeGuard` restored the run's state (this callback's too) from a host snapshot inside this fit.

        Called on every callback right after the restore, outside the per-batch event order; the
        Timestamp stayed at its position (the rows between were skipped).
        """

    def close(self, state: State, logger: Logger) -> None:
        """Release resources (files, threads). Called once after FIT_END or an exception."""

    def post_close(self) -> None:
        """Called after every callback's `close`."""

    def state_dict(self) -> Dict[str, Any]:
        """State to save in checkpoints (tensors and plain Python values only)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        del state


def _noop(self: Callback, state: State, logger: Logger) -> None:  # one shared no-op for every event method
    return None


for _event in Event:
    setattr(Callback, _event.value, _noop)
del _event
