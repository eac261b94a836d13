"""The run's progress counter: `Timestamp` (epochs, batches, samples, tokens, wall-clock times), and the
one map between counter names and units (`COUNTER_UNITS`, `report_key`, `counters_of`).

Part of `raytrain_events.core.time` (import from there). A `Timestamp` is immutable: the trainer
advances it once per batch by building the next one (`to_next_batch`, `to_next_epoch`).
"""

from __future__ import annotations

import datetime
import operator
from collections.abc import Mapping
from typing import Any, Callable, Dict, Union, cast

from raytrain_events.core.time_value import Time, TimeUnit, coerce_value, is_real

__all__ = ["Timestamp", "COUNTER_UNITS", "report_key", "counters_of"]

#: The run's four counters by name and unit ("sample" counts in TimeUnit.SAMPLE, "sp"): the one
#: map between counter names and units. Reports carry each as ``time/<name>`` (`report_key`).
COUNTER_UNITS: Dict[str, TimeUnit] = {
    "epoch": TimeUnit.EPOCH,
    "batch": TimeUnit.BATCH,
    "sample": TimeUnit.SAMPLE,
    "token": TimeUnit.TOKEN,
}
_NAME_OF_UNIT = {unit: name for name, unit in COUNTER_UNITS.items()}


def report_key(unit: Union[TimeUnit, str]) -> str:
    """The history/report key of a counter: ``"sp"`` or ``"sample"`` -> ``"time/sample"``."""
    name = unit if unit in COUNTER_UNITS else _NAME_OF_UNIT.get(TimeUnit(unit))
    if name is None:
        raise ValueError(f"{unit!r} is not a counter; counters: {', '.join(COUNTER_UNITS)}.")
    return f"time/{name}"


def counters_of(timestamp: Timestamp) -> Dict[str, int]:
    """``{"epoch": 2, "batch": 24, "sample": 3000, "token": 0}`` of a Timestamp."""
    return {name: timestamp.get_value(unit) for name, unit in COUNTER_UNITS.items()}


_COUNTERS = (*COUNTER_UNITS, "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
_COUNTER_UNIT = {
    **COUNTER_UNITS,
    "batch_in_epoch": TimeUnit.BATCH,
    "sample_in_epoch": TimeUnit.SAMPLE,
    "token_in_epoch": TimeUnit.TOKEN,
    "samples": TimeUnit.SAMPLE,
    "tokens": TimeUnit.TOKEN,
}
_WCTS = ("total_wct", "epoch_wct", "batch_wct")
# Keyed by str values, which TimeUnit members hash and compare equal to.
FIELD_OF_UNIT = {unit.value: "_" + name for name, unit in COUNTER_UNITS.items()}
_ZERO = datetime.timedelta(0)
_get_counters = operator.attrgetter(*("_" + n for n in _COUNTERS))


def _counter(name: str, value: Any) -> int:
    unit = _COUNTER_UNIT[name]
    if type(value) is not int:
        if isinstance(value, Time):
            if value._unit is not unit:
                raise ValueError(f"Timestamp '{name}' must be in '{unit.value}' ({unit.name}), got {value!r}")
            value = value._value
        else:
            value = coerce_value(value, unit)
    if value < 0:
        raise ValueError(f"Timestamp '{name}' must be >= 0, got {value}")
    return int(value)


def _wct(name: str, value: Any) -> datetime.timedelta:
    if value is None:
        return _ZERO
    if not isinstance(value, datetime.timedelta):
        raise TypeError(f"Timestamp '{name}' must be a datetime.timedelta or None, got {type(value).__name__}")
    return value


def _counter_property(name: str, doc: str) -> property:
    attr, unit = "_" + name, _COUNTER_UNIT[name]
    return property(lambda self: Time._make(getattr(self, attr), unit), doc=doc)


def _timestamp_cmp(op: Callable[[Any, Any], Any]) -> Callable[[Timestamp, object], bool]:
    def compare(self: Timestamp, other: object) -> bool:  # compares in the other Time's unit
        if isinstance(other, str):
            other = Time.from_timestring(other)
        if isinstance(other, Time):
            return bool(op(self.get_value(other._unit), other._value))
        return cast(bool, NotImplemented)

    return compare


class Timestamp:
    """Immutable snapshot of training progress; the trainer replaces it via :meth:`to_next_batch`.

    >>> ts = Timestamp().to_next_batch(samples=64).to_next_batch(samples=64)
    >>> ts.batch, ts.sample, ts < Time(1, "ep"), ts.get_value("sp")
    (Time(2, TimeUnit.BATCH), Time(128, TimeUnit.SAMPLE), True, 128)
    """

    __slots__ = tuple("_" + n for n in _COUNTERS + _WCTS)
    _epoch: int
    _batch: int
    _sample: int
    _token: int
    _batch_in_epoch: int
    _sample_in_epoch: int
    _token_in_epoch: int
    _total_wct: datetime.timedelta
    _epoch_wct: datetime.timedelta
    _batch_wct: datetime.timedelta

    def __init__(
        self,
        epoch: int | Time[int] = 0,
        batch: int | Time[int] = 0,
        sample: int | Time[int] = 0,
        token: int | Time[int] = 0,
        batch_in_epoch: int | Time[int] = 0,
        sample_in_epoch: int | Time[int] = 0,
        token_in_epoch: int | Time[int] = 0,
        total_wct: datetime.timedelta | None = None,
        epoch_wct: datetime.timedelta | None = None,
        batch_wct: datetime.timedelta | None = None,
    ):
        counters = (epoch, batch, sample, token, batch_in_epoch, sample_in_epoch, token_in_epoch)
        for name, count in zip(_COUNTERS, counters):
            setattr(self, "_" + name, _counter(name, count))
        for name, wct in zip(_WCTS, (total_wct, epoch_wct, batch_wct)):
            setattr(self, "_" + name, _wct(name, wct))

    @classmethod
    def _make(
        cls,
        ep: int,
        ba: int,
        sp: int,
        tok: int,
        ba_ep: int,
        sp_ep: int,
        tok_ep: int,
        total_wct: datetime.timedelta,
        epoch_wct: datetime.timedelta,
        batch_wct: datetime.timedelta,
    ) -> Timestamp:
        # Unvalidated constructor for the per-step hot path.
        ts = object.__new__(cls)
        ts._epoch, ts._batch, ts._sample, ts._token = ep, ba, sp, tok
        ts._batch_in_epoch, ts._sample_in_epoch, ts._token_in_epoch = ba_ep, sp_ep, tok_ep
        ts._total_wct, ts._epoch_wct, ts._batch_wct = total_wct, epoch_wct, batch_wct
        return ts

    epoch = _counter_property("epoch", "Total epochs.")
    batch = _counter_property("batch", "Total batches (optimizer steps).")
    sample = _counter_property("sample", "Total samples.")
    token = _counter_property("token", "Total tokens.")
    batch_in_epoch = _counter_property("batch_in_epoch", "Batches in the current epoch.")
    sample_in_epoch = _counter_property("sample_in_epoch", "Samples in the current epoch.")
    token_in_epoch = _counter_property("token_in_epoch", "Tokens in the current epoch.")
    total_wct = property(lambda self: self._total_wct, doc="Wall-clock time since the start of training.")
    epoch_wct = property(lambda self: self._epoch_wct, doc="Wall-clock time of the current epoch.")
    batch_wct = property(lambda self: self._batch_wct, doc="Wall-clock time of the last batch.")

    def get_value(self, unit: TimeUnit | str) -> int:
        """Raw int count in ``unit`` (ep/ba/sp/tok) without building a Time; e.g. ``ts.get_value("ba")``."""
        attr = FIELD_OF_UNIT.get(unit)
        if attr is None:
            unit = TimeUnit(unit)  # raises for unknown units
            if unit is TimeUnit.DURATION:
                raise ValueError(
                    "Timestamp does not know the total run length; use State.get_elapsed_duration() for 'dur'"
                )
            attr = FIELD_OF_UNIT[unit.value]
        value: int = getattr(self, attr)
        return value

    def get(self, unit: TimeUnit | str) -> Time[int]:
        """The current total in ``unit``, e.g. ``ts.get("ep") == ts.epoch``; 'dur' raises ValueError."""
        unit = unit if type(unit) is TimeUnit else TimeUnit(unit)
        return Time._make(self.get_value(unit), unit)

    def copy(
        self,
        epoch: int | Time[int] | None = None,
        batch: int | Time[int] | None = None,
        sample: int | Time[int] | None = None,
        token: int | Time[int] | None = None,
        batch_in_epoch: int | Time[int] | None = None,
        sample_in_epoch: int | Time[int] | None = None,
        token_in_epoch: int | Time[int] | None = None,
        total_wct: datetime.timedelta | None = None,
        epoch_wct: datetime.timedelta | None = None,
        batch_wct: datetime.timedelta | None = None,
    ) -> Timestamp:
        """A new Timestamp with the given (non-None) fields overridden, e.g. ``ts.copy(epoch=3)``."""
        given = locals()
        return Timestamp(**{n: getattr(self, "_" + n) if given[n] is None else given[n] for n in _COUNTERS + _WCTS})

    def to_next_batch(
        self, samples: int | Time[int] = 0, tokens: int | Time[int] = 0, duration: datetime.timedelta | None = None
    ) -> Timestamp:
        """A new Timestamp one batch later, with ``samples``/``tokens`` added to the totals and in-epoch counts.

        ``samples``/``tokens`` should be global (summed over ranks); ``duration`` is the batch's wall-clock time,
        e.g. ``ts = ts.to_next_batch(samples=64, tokens=8192, duration=timedelta(seconds=0.2))``.
        """
        if type(samples) is not int or samples < 0:
            samples = _counter("samples", samples)
        if type(tokens) is not int or tokens < 0:
            tokens = _counter("tokens", tokens)
        if duration is None:
            duration = _ZERO
        elif type(duration) is not datetime.timedelta:
            duration = _wct("duration", duration)
        # `_make`, inlined, one field per statement (no tuples built): this runs once per batch.
        ts = object.__new__(type(self))
        ts._epoch = self._epoch
        ts._batch = self._batch + 1
        ts._sample = self._sample + samples
        ts._token = self._token + tokens
        ts._batch_in_epoch = self._batch_in_epoch + 1
        ts._sample_in_epoch = self._sample_in_epoch + samples
        ts._token_in_epoch = self._token_in_epoch + tokens
        ts._total_wct = self._total_wct + duration
        ts._epoch_wct = self._epoch_wct + duration
        ts._batch_wct = duration
        return ts

    def to_next_epoch(self) -> Timestamp:
        """A new Timestamp at the next epoch's start (in-epoch counters, epoch/batch wct reset to 0).

        >>> Timestamp(batch=5, batch_in_epoch=5).to_next_epoch().batch_in_epoch
        Time(0, TimeUnit.BATCH)
        """
        return self._make(
            self._epoch + 1, self._batch, self._sample, self._token, 0, 0, 0, self._total_wct, _ZERO, _ZERO
        )

    def state_dict(self) -> dict[str, int | float]:
        """Plain ints (counters) and float seconds (wall-clock), safe for JSON / ``torch.load(weights_only=True)``.

        >>> Timestamp(epoch=1).state_dict()["epoch"]
        1
        """
        d: dict[str, int | float] = {n: getattr(self, "_" + n) for n in _COUNTERS}
        d.update((n, getattr(self, "_" + n).total_seconds()) for n in _WCTS)
        return d

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Timestamp:
        """A new Timestamp from what `state_dict` (or `get_state`) returned; bad input raises, naming the key.

        >>> Timestamp.from_state_dict(Timestamp(epoch=2).state_dict()).epoch
        Time(2, TimeUnit.EPOCH)
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"Timestamp state must be a mapping, got {type(state).__name__}")
        missing = [n for n in _COUNTERS if n not in state]
        if missing:
            raise ValueError(f"Timestamp state dict is missing keys {missing}")
        kwargs = {n: state[n] for n in _COUNTERS}
        for n in _WCTS:
            v = state.get(n)
            kwargs[n] = datetime.timedelta(seconds=float(v)) if is_real(v) else v
        return cls(**kwargs)

    def get_state(self) -> dict[str, Time[int] | datetime.timedelta]:
        """All fields as Time objects / timedeltas, e.g. ``ts.get_state()["epoch"] == Time(0, "ep")``."""
        return {n: getattr(self, n) for n in _COUNTERS + _WCTS}

    _eq_time = _timestamp_cmp(operator.eq)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timestamp):  # counters only; wall-clock times are not compared
            return _get_counters(self) == _get_counters(other)
        return self._eq_time(other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __lt__, __le__ = _timestamp_cmp(operator.lt), _timestamp_cmp(operator.le)
    __gt__, __ge__ = _timestamp_cmp(operator.gt), _timestamp_cmp(operator.ge)

    __hash__ = None  # type: ignore[assignment]  # equal to `Time` values of any unit, so no consistent hash

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, '_' + n)!r}" for n in _COUNTERS + _WCTS)
        return f"Timestamp({fields})"
