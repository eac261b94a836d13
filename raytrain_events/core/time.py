"""Training time: units (epochs, batches, samples, tokens, fraction of the run) and the progress counter.

A port of Composer's ``composer.core.time`` so schedules, callbacks and max-duration checks can speak in
"5ep" / "3e4tok" / "0.5dur", plus a cheap immutable ``Timestamp`` the trainer advances once per batch.
"""

from __future__ import annotations

import datetime
import math
import numbers
import operator
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any, Callable, Dict, Generic, TypeGuard, TypeVar, Union, cast

__all__ = ["TimeUnit", "Time", "Timestamp", "ensure_time"]

TValue = TypeVar("TValue", int, float)


class TimeUnit(str, Enum):
    """Unit of training time. Lookup is by value or name, case-insensitively.

    >>> TimeUnit("ep") is TimeUnit.EPOCH and TimeUnit("BATCH") is TimeUnit.BATCH
    True
    """

    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"

    @classmethod
    def _missing_(cls, value: object) -> TimeUnit:
        if isinstance(value, str):
            key = value.strip()
            for member in cls:
                if key.lower() == member.value or key.upper() == member.name:
                    return member
        valid = ", ".join(f"'{m.value}' ({m.name})" for m in cls)
        raise ValueError(f"Invalid time unit {value!r}: expected one of {valid}")


_DUR = TimeUnit.DURATION
_UNITS_TEXT = ", ".join(u.value for u in TimeUnit)
_DIGITS = r"\d(?:_?\d)*"
_TIME_RE = re.compile(
    rf"([+-]?(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:e[+-]?{_DIGITS})?)(ep|ba|sp|tok|dur)",
    re.IGNORECASE | re.ASCII,
)


def _is_real(x: object) -> TypeGuard[float]:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _not_whole(value: object, unit: TimeUnit) -> TypeError:
    return TypeError(
        f"Time value {value!r} is not a whole number, but unit '{unit.value}' ({unit.name}) counts whole items; "
        f"use whole numbers of {unit.value}, or a fraction of the run in 'dur'"
    )


def _coerce_value(value: Any, unit: TimeUnit) -> int | float:
    """Validate ``value`` for ``unit``: int for ep/ba/sp/tok (integral floats accepted), finite float for dur."""
    if type(value) is int and unit is not _DUR:
        return value
    if not _is_real(value):
        raise TypeError(f"Time value must be a number (int or float), got {type(value).__name__}: {value!r}")
    if unit is _DUR:
        f = float(value)
        if not math.isfinite(f):
            raise ValueError(f"Time value for 'dur' must be finite, got {value!r}")
        return f
    if isinstance(value, numbers.Integral) or (math.isfinite(f := float(value)) and f.is_integer()):
        return int(value) if isinstance(value, numbers.Integral) else int(f)
    raise _not_whole(value, unit)


def _snap(x: int | float, unit: TimeUnit) -> int | float:
    """Result of scaling: float for dur; for integer units an int, allowing a few ulps of float rounding."""
    if unit is _DUR:
        return _coerce_value(x, unit)
    if type(x) is int:
        return x
    x = float(x)
    if math.isfinite(x) and abs(x - round(x)) <= 4 * math.ulp(x):
        return int(round(x))
    raise _not_whole(x, unit)


def _time_cmp(op: Callable[[Any, Any], Any]) -> Callable[[Time[Any], object], bool]:
    def compare(self: Time[Any], other: object) -> bool:
        if _is_real(other):  # plain numbers compare against the value
            return bool(op(self._value, other))
        o = self._other(other, "compare")
        return o if o is NotImplemented else bool(op(self._value, o._value))

    return compare


class Time(Generic[TValue]):
    """An immutable amount of training time in one :class:`TimeUnit`.

    >>> Time(5, TimeUnit.EPOCH)
    Time(5, TimeUnit.EPOCH)
    >>> Time(3e4, "tok")
    Time(30000, TimeUnit.TOKEN)
    >>> Time(2, "ep") * 0.5, Time(4, "ep") / Time(2, "ep"), Time(1, "ep") + "2ep"
    (Time(1, TimeUnit.EPOCH), Time(2.0, TimeUnit.DURATION), Time(3, TimeUnit.EPOCH))
    """

    __slots__ = ("_value", "_unit")
    _value: TValue
    _unit: TimeUnit

    def __init__(self, value: TValue, unit: TimeUnit | str):
        unit = unit if type(unit) is TimeUnit else TimeUnit(unit)
        self._value = cast(TValue, _coerce_value(value, unit))
        self._unit = unit

    @classmethod
    def _make(cls, value: Any, unit: TimeUnit) -> Time[Any]:
        # Unvalidated constructor for values already known to be valid.
        t = object.__new__(cls)
        t._value = value
        t._unit = unit
        return t

    @property
    def value(self) -> TValue:
        """The numeric value (int for ep/ba/sp/tok, float for dur)."""
        return self._value

    @property
    def unit(self) -> TimeUnit:
        """The :class:`TimeUnit`."""
        return self._unit

    @classmethod
    def from_epoch(cls, epoch: int) -> Time[int]:
        """``Time(epoch, TimeUnit.EPOCH)``."""
        return Time(epoch, TimeUnit.EPOCH)

    @classmethod
    def from_batch(cls, batch: int) -> Time[int]:
        """``Time(batch, TimeUnit.BATCH)``."""
        return Time(batch, TimeUnit.BATCH)

    @classmethod
    def from_sample(cls, sample: int) -> Time[int]:
        """``Time(sample, TimeUnit.SAMPLE)``."""
        return Time(sample, TimeUnit.SAMPLE)

    @classmethod
    def from_token(cls, token: int) -> Time[int]:
        """``Time(token, TimeUnit.TOKEN)``."""
        return Time(token, TimeUnit.TOKEN)

    @classmethod
    def from_duration(cls, duration: float) -> Time[float]:
        """``Time(duration, TimeUnit.DURATION)``; 0 is the start of training and 1 the end."""
        return Time(duration, TimeUnit.DURATION)

    @classmethod
    def from_timestring(cls, timestring: str) -> Time[Any]:
        """Parse a number followed by a unit suffix.

        >>> Time.from_timestring("3e4tok"), Time.from_timestring("4_000sp"), Time.from_timestring("0.5dur")
        (Time(30000, TimeUnit.TOKEN), Time(4000, TimeUnit.SAMPLE), Time(0.5, TimeUnit.DURATION))
        """
        if not isinstance(timestring, str):
            raise TypeError(f"Time string must be a str, got {type(timestring).__name__}: {timestring!r}")
        m = _TIME_RE.fullmatch(timestring.strip())
        if m is None:
            raise ValueError(
                f"Invalid time string {timestring!r}: expected a number followed by one of {_UNITS_TEXT}, "
                f"like '5ep', '3e4tok', '0.5dur', '4_000tok'"
            )
        number, unit = m.group(1), TimeUnit(m.group(2).lower())
        if unit is _DUR:
            return Time(float(number), unit)
        if not any(c in number for c in ".eE"):
            return Time(int(number), unit)  # exact, even beyond float precision
        f = float(number)
        if not (math.isfinite(f) and f.is_integer()):
            raise _not_whole(number, unit)
        return Time(int(f), unit)

    def to_timestring(self) -> str:
        """Inverse of :meth:`from_timestring`.

        >>> Time(5, "ep").to_timestring()
        '5ep'
        """
        return f"{self._value}{self._unit.value}"

    def __repr__(self) -> str:
        return f"Time({self._value!r}, TimeUnit.{self._unit.name})"

    def __reduce__(self) -> tuple[type[Time[Any]], tuple[TValue, TimeUnit]]:
        return (self.__class__, (self._value, self._unit))

    # --- arithmetic -------------------------------------------------------------------------------------------
    def _other(self, other: object, op: str) -> Any:
        """``other`` as a Time in this unit (numbers assume this unit); NotImplemented for foreign types."""
        if isinstance(other, Time):
            if other._unit is not self._unit:
                raise RuntimeError(
                    f"Cannot {op} {self!r} in {self._unit.value} with {other!r} in {other._unit.value}: "
                    f"both must have the same unit"
                )
            return other
        if isinstance(other, str):
            return self._other(Time.from_timestring(other), op)
        if _is_real(other):
            return Time(other, self._unit)
        return NotImplemented

    def __add__(self, other: object) -> Time[Any]:
        o = self._other(other, "add")
        return o if o is NotImplemented else Time._make(self._value + o._value, self._unit)

    __radd__ = __add__

    def __sub__(self, other: object) -> Time[Any]:
        o = self._other(other, "subtract")
        return o if o is NotImplemented else Time._make(self._value - o._value, self._unit)

    def __rsub__(self, other: object) -> Time[Any]:
        o = self._other(other, "subtract")
        return o if o is NotImplemented else Time._make(o._value - self._value, self._unit)

    def __mul__(self, other: object) -> Time[Any]:
        if isinstance(other, str):
            other = Time.from_timestring(other)
        if isinstance(other, Time):
            if other._unit is _DUR:
                factor, unit, base = other._value, self._unit, self._value
            elif self._unit is _DUR:
                factor, unit, base = self._value, other._unit, other._value
            else:
                raise RuntimeError(
                    f"Cannot multiply {self!r} in {self._unit.value} by {other!r} in {other._unit.value}: "
                    f"the multiplier must be a number or a Time in 'dur'"
                )
            return Time._make(_snap(base * factor, unit), unit)
        if _is_real(other):
            return Time._make(_snap(self._value * other, self._unit), self._unit)
        return NotImplemented

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Time[Any]:
        if _is_real(other):
            if self._unit is not _DUR and type(self._value) is int and isinstance(other, numbers.Integral):
                q, r = divmod(self._value, int(other))
                if r:
                    raise _not_whole(self._value / int(other), self._unit)
                return Time._make(q, self._unit)
            return Time._make(_snap(self._value / other, self._unit), self._unit)
        o = self._other(other, "divide")
        return o if o is NotImplemented else Time(self._value / o._value, _DUR)

    def __mod__(self, other: object) -> Time[Any]:
        o = self._other(other, "take the modulo of")
        return o if o is NotImplemented else Time._make(self._value % o._value, self._unit)

    def __neg__(self) -> Time[Any]:
        return Time._make(-self._value, self._unit)

    def __pos__(self) -> Time[Any]:
        return self

    def __abs__(self) -> Time[Any]:
        return Time._make(abs(self._value), self._unit)

    def __float__(self) -> float:
        return float(self._value)

    def __int__(self) -> int:
        return int(self._value)

    __eq__, __ne__ = _time_cmp(operator.eq), _time_cmp(operator.ne)
    __lt__, __le__ = _time_cmp(operator.lt), _time_cmp(operator.le)
    __gt__, __ge__ = _time_cmp(operator.gt), _time_cmp(operator.ge)

    def __hash__(self) -> int:
        return hash((self._unit.value, self._value))


def ensure_time(maybe_time: Time[Any] | str | int | float, int_unit: TimeUnit | str) -> Time[Any]:
    """Coerce a Time, time string or number (interpreted in ``int_unit``) to :class:`Time`.

    >>> ensure_time("2ep", "ba"), ensure_time(7, "ba")
    (Time(2, TimeUnit.EPOCH), Time(7, TimeUnit.BATCH))
    """
    if isinstance(maybe_time, Time):
        return maybe_time
    if isinstance(maybe_time, str):
        return Time.from_timestring(maybe_time)
    if _is_real(maybe_time):
        return Time(maybe_time, int_unit)
    raise TypeError(
        f"Expected a Time, a time string like '5ep', or an int/float number of {int_unit!s}; "
        f"got {type(maybe_time).__name__}: {maybe_time!r}"
    )


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
_ATTR_OF_UNIT = {unit.value: "_" + name for name, unit in COUNTER_UNITS.items()}
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
            value = _coerce_value(value, unit)
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
        attr = _ATTR_OF_UNIT.get(unit)
        if attr is None:
            unit = TimeUnit(unit)  # raises for unknown units
            if unit is _DUR:
                raise ValueError(
                    "Timestamp does not know the total run length; use State.get_elapsed_duration() for 'dur'"
                )
            attr = _ATTR_OF_UNIT[unit.value]
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
        return self._make(
            self._epoch,
            self._batch + 1,
            self._sample + samples,
            self._token + tokens,
            self._batch_in_epoch + 1,
            self._sample_in_epoch + samples,
            self._token_in_epoch + tokens,
            self._total_wct + duration,
            self._epoch_wct + duration,
            duration,
        )

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
            kwargs[n] = datetime.timedelta(seconds=float(v)) if _is_real(v) else v
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
