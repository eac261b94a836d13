"""The `Engine`: runs algorithms, then callbacks, at each event, and records `Trace`s.

Per event: the algorithms whose ``match`` is true are ordered by the ordering passes (pure
functions ``(algorithms, event) -> algorithms``; the default pass reverses them on ``*_END``
and ``AFTER_*`` events so the first one in is the last one out), applied, and recorded;
then the callbacks that override that event run in registration order. `run_exception` and
`run_quorum_change` reach every callback outside that order (the loop raised; replica groups changed).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Deque, Dict, List, Mapping, Optional, Sequence

from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.callback import Callback, QuorumChange
from raytrain_events.core.event import Event

if TYPE_CHECKING:
    from raytrain_events.core.logger import Logger
    from raytrain_events.core.state import State

__all__ = ["Engine", "Trace", "AlgorithmPass", "filo_on_after_events", "sort_by_priority"]

AlgorithmPass = Callable[[Sequence[Algorithm], Event], List[Algorithm]]
_EVERY_EVENT: Mapping[Event, bool] = {event: True for event in Event}


@dataclass(frozen=True)
class Trace:
    """One algorithm run: which algorithm, at which event, its exit code, and its position."""

    name: str
    event: Event
    exit_code: Optional[int]
    order: int
    run: bool = True


def filo_on_after_events(algorithms: Sequence[Algorithm], event: Event) -> List[Algorithm]:
    """Reverse the order on ``*_END``/``AFTER_*`` events so each algorithm undoes its own change."""
    return list(reversed(algorithms)) if event.is_after_event else list(algorithms)


def sort_by_priority(priority: Dict[type, int]) -> AlgorithmPass:
    """Make a pass that runs algorithms with a lower ``priority[type]`` first (default 0)."""

    def _pass(algorithms: Sequence[Algorithm], event: Event) -> List[Algorithm]:
        return sorted(algorithms, key=lambda a: priority.get(type(a), 0))

    return _pass


class Engine:
    """Runs the algorithms and callbacks of ``state`` at each event.

    Example::

        engine = Engine(state=state, logger=logger)
        traces = engine.run_event(Event.BATCH_END)
    """

    def __init__(
        self,
        *,
        state: State,
        logger: Logger,
        algorithm_passes: Optional[Sequence[AlgorithmPass]] = None,
        trace_history: int = 4096,
    ) -> None:
        self.state = state
        self.logger = logger
        self.algorithm_passes: List[AlgorithmPass] = (
            [filo_on_after_events] if algorithm_passes is None else list(algorithm_passes)
        )
        self.traces: Deque[Trace] = collections.deque(maxlen=trace_history)
        self._callback_methods: Dict[Event, List[Callable[[State, Logger], None]]] = {}
        self._closed = False
        self.refresh()

    def refresh(self) -> None:
        """Recompute which callbacks handle which event (call after changing ``state.callbacks``)."""
        for algorithm in self.state.algorithms:
            if not isinstance(algorithm, Algorithm):
                raise TypeError(
                    f"{algorithm!r} is not an Algorithm: subclass raytrain_events.Algorithm "
                    "and implement match(event, state) and apply(event, state, logger)."
                )
        methods: Dict[Event, List[Callable[[State, Logger], None]]] = {event: [] for event in Event}
        for callback in self.state.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(f"{callback!r} is not a Callback: subclass raytrain_events.Callback.")
            for event in callback.overridden_events():
                if type(callback).run_event is Callback.run_event:
                    methods[event].append(getattr(callback, event.value))
                else:
                    methods[event].append(_bind_run_event(callback, event))
        self._callback_methods = methods
        self._callback_events = {event: bool(methods[event]) for event in Event}

    def active_events(self) -> Mapping[Event, bool]:
        """Per event: whether `run_event` can do anything now, so a loop may skip idle events.

        With any algorithm every event is active (``match`` decides at run time); otherwise an
        event is active when a callback overrides it (worked out in `refresh`).
        """
        return _EVERY_EVENT if self.state.algorithms else self._callback_events

    def register_pass(self, algorithm_pass: AlgorithmPass, index: int = -1) -> None:
        """Add an ordering pass; ``index=-1`` appends it after the existing passes."""
        if index == -1:
            self.algorithm_passes.append(algorithm_pass)
        else:
            self.algorithm_passes.insert(index, algorithm_pass)

    def run_event(self, event: Event) -> Dict[str, Trace]:
        """Run matching algorithms then callbacks for ``event``; return this event's traces."""
        state = self.state
        traces: Dict[str, Trace] = {}
        if state.algorithms:
            traces = self._run_algorithms(event)
        methods = self._callback_methods[event]
        if methods:
            logger = self.logger
            for method in methods:
                method(state, logger)
        return traces

    def _run_algorithms(self, event: Event) -> Dict[str, Trace]:
        state = self.state
        matched = [a for a in state.algorithms if a.match(event, state)]
        if not matched:
            return {}
        for algorithm_pass in self.algorithm_passes:
            matched = algorithm_pass(matched, event)
        traces: Dict[str, Trace] = {}
        for order, algorithm in enumerate(matched):
            exit_code = algorithm.apply(event, state, self.logger)
            name = type(algorithm).__name__
            trace = Trace(name=name, event=event, exit_code=exit_code, order=order)
            traces[f"{name}/{event.name}"] = trace
            self.traces.append(trace)
        return traces

    def run_exception(self, exc: BaseException) -> None:
        """Tell algorithms (optional ``on_exception``) and callbacks that the loop raised ``exc``.

        Algorithms get the chance to undo a temporary change (EMA puts the training weights
        back); the loop re-raises ``exc`` afterwards.
        """
        for algorithm in self.state.algorithms:
            handler = getattr(algorithm, "on_exception", None)
            if handler is not None:
                handler(self.state, self.logger, exc)
        for callback in self.state.callbacks:
            callback.on_exception(self.state, self.logger, exc)

    def run_quorum_change(self, change: QuorumChange) -> None:
        """Tell every callback (``on_quorum_change``) that the replica groups training together changed."""
        for callback in self.state.callbacks:
            callback.on_quorum_change(self.state, self.logger, change)

    @property
    def closed(self) -> bool:
        """True once `close` ran (callbacks and logger destinations are closed)."""
        return self._closed

    def reopen(self) -> None:
        """After `close`: run again (a further ``Trainer.fit``); destinations reopen their files lazily."""
        self._closed = False

    def close(self) -> None:
        """Close callbacks and logger destinations once; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for callback in self.state.callbacks:
            callback.close(self.state, self.logger)
        for callback in self.state.callbacks:
            callback.post_close()
        self.logger.close()


def _bind_run_event(callback: Callback, event: Event) -> Callable[[State, Logger], None]:
    def _method(state: State, logger: Logger) -> None:
        callback.run_event(event, state, logger)

    return _method
