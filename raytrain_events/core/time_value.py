"""A quantity of training time: `TimeUnit` (epochs, batches, samples, tokens, fraction of the run) and `Time`.

Part of `raytrain_events.core.time` (import from there): parsing "5ep" / "3e4tok" / "0.5dur",
arithmetic and comparisons in one unit, and `ensure_time` for arguments given as a Time, a time
string or a plain number.
"""

from __future__ import annotations

import math
import numbers
import operator
import re
from enum import Enum
from typing import Any, Callable, Generic, TypeGuard, TypeVar, cast

__all__ = ["TimeUnit", "Time", "ensure_time"]

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


def is_real(x: object) -> TypeGuard[float]:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _not_whole(value: object, unit: TimeUnit) -> TypeError:
    return TypeError(
        f"Time value {value!r} is not a whole number, but unit '{unit.value}' ({unit.name}) counts whole items; "
        f"use whole numbers of {unit.value}, or a fraction of the run in 'dur'"
    )


def coerce_value(value: Any, unit: TimeUnit) -> int | float:
    """Validate ``value`` for ``unit``: int for ep/ba/sp/tok (integral floats accepted), finite float for dur."""
    if type(value) is int and unit is not _DUR:
        return value
    if not is_real(value):
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
        return coerce_value(x, unit)
    if type(x) is int:
        return x
    x = float(x)
    if math.isfinite(x) and abs(x - round(x)) <= 4 * math.ulp(x):
        return int(round(x))
    raise _not_whole(x, unit)


def _time_cmp(op: Callable[[Any, Any], Any]) -> Callable[[Time[Any], object], bool]:
    def compare(self: Time[Any], other: object) -> bool:
        if is_real(other):  # plain numbers compare against the value
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
        self._value = cast(TValue, coerce_value(value, unit))
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
        if is_real(other):
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
        if is_real(other):
            return Time._make(_snap(self._value * other, self._unit), self._unit)
        return NotImplemented

    __rmul__ = __mul__

    def __truediv__(self, other: object) -> Time[Any]:
        if is_real(other):
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
    if is_real(maybe_time):
        return Time(maybe_time, int_unit)
    raise TypeError(
        f"Expected a Time, a time string like '5ep', or an int/float number of {int_unit!s}; "
        f"got {type(maybe_time).__name__}: {maybe_time!r}"
    )


def training_duration(
    value: Time[Any] | str | int, *, counts_tokens: bool = True, what: str = "max_duration"
) -> Time[Any]:
    """A run's length checked once, where it enters (``Trainer``, ``RunSpec``, ``fit(duration=...)``).

    A positive `Time` in ``ep``, ``ba``, ``sp`` or ``tok`` (an int is epochs); a fraction of the run
    (``dur``) has no length to be a fraction of. ``counts_tokens=False``: the data has no token
    counter, so ``tok`` cannot be counted either. What passes is the `Time` the rest receives.
    """
    duration = ensure_time(value, TimeUnit.EPOCH)
    if duration.unit == TimeUnit.DURATION:
        raise ValueError(
            f"{what}={duration.to_timestring()!r} is a fraction of the run, which has no length yet: "
            "give it in 'ep', 'ba', 'sp' or 'tok', like '10ep'."
        )
    check_countable(duration, counts_tokens=counts_tokens, what=what)
    return duration


def check_countable(time: Time[Any], *, counts_tokens: bool, what: str) -> None:
    """Raise unless the loop can count ``time``: positive, and in tokens only with a token counter."""
    if time.value <= 0:
        raise ValueError(f"{what}={time.to_timestring()!r} must be positive, like '10ep' or '500ba'.")
    if time.unit == TimeUnit.TOKEN and not counts_tokens:
        raise ValueError(
            f"{what}={time.to_timestring()!r} is in tokens but the train data has no token counter: wrap it as "
            "DataSpec(loader, get_num_tokens_in_batch=fn) (RayTrainer: get_num_tokens_in_batch=fn), or use 'ep', "
            "'ba' or 'sp'."
        )
