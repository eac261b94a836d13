"""When to evaluate (or do anything periodic): small pure functions of the `Timestamp`.

`make_interval(interval, max_duration, ...)` turns ``"1ep"``, ``"100ba"``, ``"5e4sp"``,
``"1e6tok"``, ``"0.25dur"``, an int (epochs) or a callable into a predicate
``(state, event) -> bool`` that is true at ``BATCH_END`` or ``EPOCH_END`` when the interval
is crossed. Training's last batch or epoch always counts, so a run ends with a fresh result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Union

from raytrain_events.core.event import Event
from raytrain_events.core.time import Time, TimeUnit, ensure_time
from raytrain_events.core.time_value import check_countable
from raytrain_events.core.timestamp import FIELD_OF_UNIT

if TYPE_CHECKING:
    from raytrain_events.core.state import State

__all__ = ["make_interval", "IntervalFn", "is_done", "crossed"]

IntervalFn = Callable[["State", Event], bool]


def is_done(state: State) -> bool:
    """True once the global timestamp has reached ``state.max_duration``."""
    max_duration = state.max_duration
    if max_duration is None:  # a State without a duration (tests, tools) never finishes by itself
        return False
    # Time's and Timestamp's fields directly: this runs once per batch, and their methods are Python calls.
    field = FIELD_OF_UNIT.get(max_duration._unit)
    if field is None:  # 'dur', which a Timestamp cannot count: get_value raises and says why
        state.timestamp.get_value(max_duration._unit)
        return False
    done: bool = getattr(state.timestamp, field) >= max_duration._value
    return done


def crossed(previous: int, current: int, every: int) -> bool:
    """True if a multiple of ``every`` lies in ``(previous, current]``."""
    return previous // every < current // every


def make_interval(
    interval: Union[str, int, Time[Any], IntervalFn],
    max_duration: Time[Any],
    *,
    counts_tokens: bool = True,
    what: str = "eval_interval",
) -> IntervalFn:
    """Build the predicate for ``interval``; raise ValueError for an interval that cannot fire."""
    if callable(interval) and not isinstance(interval, (str, Time)):
        return interval
    time = ensure_time(interval, TimeUnit.EPOCH)
    if time.unit == TimeUnit.DURATION:
        if not 0 < time.value <= 1:
            raise ValueError(f"{what}={time.to_timestring()!r}: a duration interval must be in (0, 1], like '0.25dur'.")
        return _fraction_interval(time.value, max_duration, counts_tokens, what)
    check_countable(time, counts_tokens=counts_tokens, what=what)
    unit, every = time.unit, int(time.value)

    if unit == TimeUnit.EPOCH:

        def _epoch_interval(state: State, event: Event) -> bool:
            if event != Event.EPOCH_END:
                return False
            return state.epoch % every == 0 or is_done(state)

        return _epoch_interval

    def _batch_interval(state: State, event: Event) -> bool:
        if event != Event.BATCH_END:
            return False
        ts = state.timestamp
        current = ts.get_value(unit)
        if unit == TimeUnit.BATCH:
            previous = current - 1
        elif unit == TimeUnit.SAMPLE:
            previous = current - state.global_batch_num_samples
        else:
            previous = current - state.global_batch_num_tokens
        return crossed(previous, current, every) or is_done(state)

    return _batch_interval


def _fraction_interval(fraction: float, max_duration: Time[Any], counts_tokens: bool, what: str) -> IntervalFn:
    """``fraction`` of ``state.max_duration`` as it is when asked, not as it was when built.

    A further ``fit(duration=...)`` moves ``max_duration``; the interval follows it (re-resolved
    once per change, checked by identity: one comparison per call otherwise).
    """

    def resolve(total: Time[Any]) -> IntervalFn:
        every = Time(max(1, int(round(fraction * total.value))), total.unit)
        return make_interval(every, total, counts_tokens=counts_tokens, what=what)

    resolved: Dict[str, Any] = {"total": max_duration, "fn": resolve(max_duration)}

    def _duration_interval(state: State, event: Event) -> bool:
        total = state.max_duration
        if total is not None and total is not resolved["total"]:
            resolved.update(total=total, fn=resolve(total))
        fires: bool = resolved["fn"](state, event)
        return fires

    return _duration_interval
