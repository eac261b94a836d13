"""Turning a schedule's Time arguments into counts the global `Timestamp` can be compared with.

Composer's rule (``composer.optim.scheduler._convert_time``): a fraction of the run (``"dur"``)
becomes ``int(fraction * max_duration)`` in the unit of ``max_duration``; epochs become batches
when the number of batches per epoch is known (so a schedule over a run in epochs moves every
batch, not every epoch). Other units are used as they are: ``"100ba"`` on a run in tokens is
compared with the global batch count. Schedules read ``state.timestamp``, which counts global
batches, samples and tokens, so a schedule means the same on 1 or 64 workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple, Union

from raytrain_events.core.time import Time, TimeUnit

if TYPE_CHECKING:
    from raytrain_events.core.state import State

__all__ = ["as_time", "convert_time", "common_unit"]

TimeLike = Union[str, Time]


def as_time(value: TimeLike, what: str) -> Time:
    """Parse a schedule argument: a `Time` or a time string like ``"100ba"`` / ``"0.1dur"``."""
    if isinstance(value, Time):
        return value
    if isinstance(value, str):
        return Time.from_timestring(value)
    raise TypeError(
        f"{what}={value!r} must be a Time or a time string with a unit, like '100ba', '2ep', '1e6tok' or '0.1dur'."
    )


def convert_time(time: Time, state: State, what: str = "time") -> Time:
    """``time`` as an integer count in a unit the timestamp has (see the module docstring)."""
    max_duration = state.max_duration
    if max_duration is None:
        raise ValueError(
            f"Schedulers need state.max_duration to place {what}={time.to_timestring()!r}: "
            "give the Trainer max_duration=, like '10ep'."
        )
    spe = state.steps_per_epoch if (time.unit in (TimeUnit.DURATION, TimeUnit.EPOCH)) else None
    if time.unit == TimeUnit.DURATION:
        if max_duration.unit == TimeUnit.EPOCH:
            if spe:
                return Time(int(time.value * spe * max_duration.value), TimeUnit.BATCH)
            return Time(int(time.value * max_duration.value), TimeUnit.EPOCH)
        return Time(int(time.value * max_duration.value), max_duration.unit)
    if time.unit == TimeUnit.EPOCH and spe:
        return Time(int(time.value) * spe, TimeUnit.BATCH)
    return time


def common_unit(first: Time, second: Time, state: State, names: Tuple[str, str]) -> Tuple[Time, Time]:
    """Bring two converted times to one unit (batches <-> epochs only); ValueError otherwise."""
    if first.unit == second.unit:
        return first, second
    units = {first.unit, second.unit}
    if units == {TimeUnit.BATCH, TimeUnit.EPOCH}:
        spe = state.steps_per_epoch
        if spe:
            convert = lambda t: Time(int(t.value) * spe, TimeUnit.BATCH) if t.unit == TimeUnit.EPOCH else t  # noqa: E731
            return convert(first), convert(second)
        raise ValueError(
            f"{names[0]}={first.to_timestring()!r} and {names[1]}={second.to_timestring()!r} need the number of "
            "batches per epoch, which is unknown (the train dataloader has no len()): give both in 'ep', or set "
            "state.steps_per_epoch."
        )
    raise ValueError(
        f"{names[0]} is {first.to_timestring()!r} but {names[1]} is {second.to_timestring()!r} on a run with "
        f"max_duration={state.max_duration.to_timestring()!r}: these units cannot be converted into each other. "
        f"Give {names[0]} and {names[1]} in the same unit, or as fractions of the run ('0.05dur')."
    )
