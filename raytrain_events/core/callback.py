"""The `Callback` interface: code that observes the loop (logging, monitoring, saving).

A callback overrides a method named after each event it cares about, for example
``batch_end(state, logger)``. The `Engine` works out once which events a callback overrides,
so events it ignores cost nothing per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from raytrain_events.core.event import Event

if TYPE_CHECKING:
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State

__all__ = ["Callback"]


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
