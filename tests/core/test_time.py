"""Tests for raytrain_events.core.time (port of Composer's composer.core.time)."""

from __future__ import annotations

import ast
import copy
import datetime
import doctest
import json
import math
import pickle
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import raytrain_events.core.time as time_module
import raytrain_events.core.time_value as time_value_module
import raytrain_events.core.timestamp as timestamp_module
from raytrain_events.core.time import Time, Timestamp, TimeUnit, ensure_time

INT_UNITS = [TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN]
ALL_UNITS = INT_UNITS + [TimeUnit.DURATION]
EVAL_NS = {"Time": Time, "TimeUnit": TimeUnit, "Timestamp": Timestamp, "datetime": datetime}
td = datetime.timedelta


# ---------------------------------------------------------------------------------------------------------------
# module hygiene
# ---------------------------------------------------------------------------------------------------------------
TIME_MODULES = [time_module, time_value_module, timestamp_module]


@pytest.mark.parametrize("module", TIME_MODULES, ids=lambda m: m.__name__)
def test_module_imports_only_stdlib(module):
    tree = ast.parse(Path(module.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module or "")
    ours = {r for r in roots if r.startswith("raytrain_events")}
    assert ours <= {"raytrain_events.core.time_value", "raytrain_events.core.timestamp"}, ours
    stdlib = {r.split(".")[0] for r in roots - ours}
    assert stdlib, "expected some imports"
    assert stdlib <= set(sys.stdlib_module_names) | {"__future__"}, stdlib - set(sys.stdlib_module_names)


def test_docstring_examples_run():
    attempted = 0
    for module in TIME_MODULES:
        result = doctest.testmod(module)
        assert result.failed == 0, module.__name__
        attempted += result.attempted
    assert attempted >= 10


def test_the_split_modules_are_one_api():
    """``raytrain_events.core.time`` is the import path; the classes and the counter map are the same objects."""
    assert time_module.Time is time_value_module.Time and time_module.TimeUnit is time_value_module.TimeUnit
    assert time_module.Timestamp is timestamp_module.Timestamp
    assert time_module.COUNTER_UNITS is timestamp_module.COUNTER_UNITS
    assert time_module.report_key("sp") == "time/sample" and time_module.report_key("token") == "time/token"
    assert time_module.counters_of(Timestamp(epoch=1, batch=3, sample=12)) == {
        "epoch": 1,
        "batch": 3,
        "sample": 12,
        "token": 0,
    }
    with pytest.raises(ValueError, match="not a counter"):
        time_module.report_key("dur")


def test_public_api_has_docstrings():
    assert time_module.__doc__ and len(time_module.__doc__) > 40
    for obj in (Time, Timestamp, TimeUnit, ensure_time, Time.from_timestring, Timestamp.to_next_batch):
        assert obj.__doc__, obj
    assert set(time_module.__all__) == {"TimeUnit", "Time", "Timestamp", "ensure_time", "training_duration"}


# ---------------------------------------------------------------------------------------------------------------
# TimeUnit
# ---------------------------------------------------------------------------------------------------------------
def test_time_unit_values():
    assert [u.value for u in TimeUnit] == ["ep", "ba", "sp", "tok", "dur"]
    assert TimeUnit("ep") is TimeUnit.EPOCH
    assert TimeUnit("tok") is TimeUnit.TOKEN
    assert TimeUnit.DURATION == "dur"  # str enum
    assert isinstance(TimeUnit.BATCH, str)


@pytest.mark.parametrize(
    "text,unit",
    [("EP", TimeUnit.EPOCH), ("epoch", TimeUnit.EPOCH), ("BATCH", TimeUnit.BATCH), ("Dur", TimeUnit.DURATION)],
)
def test_time_unit_lookup_by_name_case_insensitive(text, unit):
    assert TimeUnit(text) is unit


@pytest.mark.parametrize("bad", ["epochs", "x", "", 5, None])
def test_time_unit_bad_value_lists_valid_units(bad):
    with pytest.raises(ValueError, match=r"Invalid time unit .*'ep'.*'ba'.*'sp'.*'tok'.*'dur'"):
        TimeUnit(bad)


# ---------------------------------------------------------------------------------------------------------------
# Time construction
# ---------------------------------------------------------------------------------------------------------------
def test_time_construction_and_properties():
    t = Time(5, TimeUnit.EPOCH)
    assert t.value == 5 and type(t.value) is int and t.unit is TimeUnit.EPOCH
    assert Time(5, "ep") == t
    assert Time(5, "ba").unit is TimeUnit.BATCH


def test_integral_float_becomes_int():
    t = Time(3e4, "tok")
    assert t.value == 30000 and type(t.value) is int
    assert type(Time(2.0, "ep").value) is int
    assert type(Time(Fraction(6, 2), "sp").value) is int


def test_duration_is_float():
    t = Time(1, "dur")
    assert t.value == 1.0 and type(t.value) is float
    assert Time(Fraction(1, 4), "dur").value == 0.25


@pytest.mark.parametrize("unit", INT_UNITS)
def test_non_integral_value_for_integer_unit_is_type_error(unit):
    with pytest.raises(
        TypeError,
        match=rf"not a whole number.*use whole numbers of {unit.value}, "
        r"or a fraction of the run in 'dur'",
    ):
        Time(1.5, unit)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_rejected(value):
    with pytest.raises(TypeError, match="whole number"):
        Time(value, "ep")
    with pytest.raises(ValueError, match="must be finite"):
        Time(value, "dur")


@pytest.mark.parametrize("value", ["5", None, [1], True, False])
def test_non_number_value_rejected(value):
    with pytest.raises(TypeError, match="must be a number"):
        Time(value, "ep")


def test_bad_unit_in_time():
    with pytest.raises(ValueError, match="Invalid time unit 'minutes'"):
        Time(5, "minutes")


def test_negative_values_allowed():
    assert Time(-3, "ep").value == -3
    assert Time(1, "ep") - Time(4, "ep") == Time(-3, "ep")


def test_from_helpers():
    assert Time.from_epoch(2) == Time(2, TimeUnit.EPOCH)
    assert Time.from_batch(3) == Time(3, TimeUnit.BATCH)
    assert Time.from_sample(4) == Time(4, TimeUnit.SAMPLE)
    assert Time.from_token(5) == Time(5, TimeUnit.TOKEN)
    d = Time.from_duration(0.5)
    assert d.unit is TimeUnit.DURATION and d.value == 0.5
    for f, u in [(Time.from_epoch, "ep"), (Time.from_batch, "ba"), (Time.from_sample, "sp"), (Time.from_token, "tok")]:
        assert f(1).unit is TimeUnit(u)
        with pytest.raises(TypeError, match=f"whole numbers of {u}"):
            f(0.5)


def test_repr_and_timestring():
    assert repr(Time(5, "ep")) == "Time(5, TimeUnit.EPOCH)"
    assert repr(Time(30_000, "tok")) == "Time(30000, TimeUnit.TOKEN)"
    assert repr(Time(0.5, "dur")) == "Time(0.5, TimeUnit.DURATION)"
    assert Time(5, "ep").to_timestring() == "5ep"
    assert Time(0.5, "dur").to_timestring() == "0.5dur"
    assert Time(-2, "ba").to_timestring() == "-2ba"
    for t in [Time(5, "ep"), Time(0.5, "dur"), Time(-7, "tok")]:
        assert eval(repr(t), EVAL_NS) == t


def test_time_is_immutable_and_slotted():
    t = Time(1, "ep")
    with pytest.raises(AttributeError):
        t.value = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        t.unit = TimeUnit.BATCH  # type: ignore[misc]
    with pytest.raises(AttributeError):
        t.other = 1  # type: ignore[attr-defined]
    assert t == Time(1, "ep")


def test_time_pickle_and_copy():
    for t in [Time(3, "ba"), Time(0.25, "dur")]:
        assert pickle.loads(pickle.dumps(t)) == t
        assert copy.deepcopy(t) == t and copy.copy(t).unit is t.unit


# ---------------------------------------------------------------------------------------------------------------
# Time arithmetic
# ---------------------------------------------------------------------------------------------------------------
def test_add_sub_same_unit():
    assert Time(1, TimeUnit.EPOCH) + Time(2, TimeUnit.EPOCH) == Time(3, TimeUnit.EPOCH)
    assert Time(5, "ba") - Time(2, "ba") == Time(3, "ba")
    assert (Time(0.25, "dur") + Time(0.5, "dur")).value == 0.75


def test_add_sub_numbers_and_strings_either_side():
    assert Time(1, "ep") + 1 == Time(2, "ep")
    assert 1 + Time(1, "ep") == Time(2, "ep")
    assert Time(1, "ep") + "2ep" == Time(3, "ep")
    assert "2ep" + Time(1, "ep") == Time(3, "ep")
    assert Time(5, "ep") - 2 == Time(3, "ep")
    assert 10 - Time(3, "ep") == Time(7, "ep")
    assert "10ba" - Time(3, "ba") == Time(7, "ba")
    assert Time(1, "ep") + 2.0 == Time(3, "ep")
    assert (Time(1, "ep") + 2.0).value.__class__ is int


def test_add_non_integral_number_to_integer_unit():
    with pytest.raises(TypeError, match="whole numbers of ep"):
        Time(1, "ep") + 0.5


@pytest.mark.parametrize(
    "op,name",
    [
        (lambda a, b: a + b, "add"),
        (lambda a, b: a - b, "subtract"),
        (lambda a, b: a / b, "divide"),
        (lambda a, b: a % b, "modulo"),
        (lambda a, b: a < b, "compare"),
        (lambda a, b: a == b, "compare"),
    ],
)
def test_mixing_units_is_runtime_error(op, name):
    with pytest.raises(
        RuntimeError,
        match=rf"Cannot .*{name}.*Time\(1, TimeUnit.EPOCH\) in ep with "
        r"Time\(1, TimeUnit.BATCH\) in ba",
    ):
        op(Time(1, "ep"), Time(1, "ba"))


def test_mixing_units_via_string_is_runtime_error():
    with pytest.raises(RuntimeError, match="in ep with .* in ba"):
        Time(1, "ep") + "1ba"


def test_multiplication():
    assert Time(2, TimeUnit.EPOCH) * 0.5 == Time(1, TimeUnit.EPOCH)
    assert Time(2, "ep") * Time(0.5, "dur") == Time(1, "ep")
    assert Time(0.5, "dur") * Time(2, "ep") == Time(1, "ep")
    assert (Time(0.5, "dur") * Time(2, "ep")).unit is TimeUnit.EPOCH
    assert 3 * Time(2, "ep") == Time(6, "ep")
    assert Time(2, "ep") * "0.5dur" == Time(1, "ep")
    assert Time(0.5, "dur") * Time(0.5, "dur") == Time(0.25, "dur")
    r = Time(2, "ep") * 0.5
    assert type(r.value) is int and r.unit is TimeUnit.EPOCH
    # float rounding noise is absorbed for integer units: 10 * 0.3 == 3.0000000000000004
    assert Time(10, "ep") * 0.3 == Time(3, "ep")


def test_multiplication_non_integral_result_is_type_error():
    with pytest.raises(TypeError, match="whole numbers of ep"):
        Time(3, "ep") * 0.5
    with pytest.raises(TypeError, match="whole numbers of tok"):
        Time(3, "tok") * Time(0.5, "dur")


def test_multiplication_by_non_duration_time_is_runtime_error():
    with pytest.raises(RuntimeError, match="multiplier must be a number or a Time in 'dur'"):
        Time(2, "ep") * Time(2, "ep")
    with pytest.raises(RuntimeError, match=r"in ep by .* in ba"):
        Time(2, "ep") * Time(2, "ba")


def test_division():
    q = Time(4, TimeUnit.EPOCH) / Time(2, TimeUnit.EPOCH)
    assert q.unit is TimeUnit.DURATION and q.value == 2.0 and type(q.value) is float
    assert Time(1, "ba") / Time(4, "ba") == Time(0.25, "dur")
    assert Time(1, "ba") / "4ba" == Time(0.25, "dur")
    d = Time(4, TimeUnit.EPOCH) / 2
    assert d == Time(2, "ep") and d.unit is TimeUnit.EPOCH and type(d.value) is int
    assert Time(9, "sp") / 1.5 == Time(6, "sp")
    assert Time(1, "dur") / 4 == Time(0.25, "dur")
    with pytest.raises(TypeError, match="whole numbers of ep"):
        Time(5, "ep") / 2
    with pytest.raises(ZeroDivisionError):
        Time(5, "ep") / 0
    with pytest.raises(ZeroDivisionError):
        Time(5, "ep") / Time(0, "ep")
    with pytest.raises(RuntimeError, match="in ep with .* in dur"):
        Time(5, "ep") / Time(0.5, "dur")


def test_modulo():
    assert Time(7, "ba") % Time(3, "ba") == Time(1, "ba")
    assert Time(7, "ba") % 3 == Time(1, "ba")
    assert (Time(7, "ba") % "3ba").unit is TimeUnit.BATCH
    assert Time(0.75, "dur") % Time(0.5, "dur") == Time(0.25, "dur")


def test_unary_and_conversions():
    t = Time(3, "ep")
    assert -t == Time(-3, "ep") and (-t).unit is TimeUnit.EPOCH
    assert +t is t
    assert abs(Time(-3, "ep")) == t
    assert float(Time(3, "ep")) == 3.0 and type(float(t)) is float
    assert int(Time(0.75, "dur")) == 0 and int(t) == 3


@pytest.mark.parametrize("other", [None, [1], object(), True, td(seconds=1)])
def test_unsupported_operand_types(other):
    t = Time(3, "ep")
    with pytest.raises(TypeError):
        t + other
    with pytest.raises(TypeError):
        t * other
    with pytest.raises(TypeError):
        t / other
    with pytest.raises(TypeError):
        t < other
    assert (t == other) is False and (t != other) is True


# ---------------------------------------------------------------------------------------------------------------
# Time comparisons and hashing
# ---------------------------------------------------------------------------------------------------------------
def test_comparisons():
    a, b = Time(1, "ep"), Time(2, "ep")
    assert a < b and a <= b and b > a and b >= a and a != b and not a == b
    assert a == Time(1, "ep") and a <= Time(1, "ep") and a >= Time(1, "ep")
    # numbers compare against the value (without needing to be valid Time values)
    assert a == 1 and a < 1.5 and a > 0.5 and a != 1.5 and 1 == a and 0 < a
    assert Time(0.5, "dur") == 0.5
    # strings are parsed
    assert a == "1ep" and a < "2ep" and "3ep" > a
    with pytest.raises(ValueError, match="Invalid time string"):
        a < "soon"


def test_hash_consistent_with_eq():
    assert hash(Time(2, "ep")) == hash(Time(2.0, "ep"))
    assert hash(Time(0.0, "dur")) == hash(Time(-0.0, "dur"))
    assert len({Time(2, "ep"), Time(2.0, "ep"), Time(2, "ba"), Time(3, "ep")}) == 3
    assert {Time(1, "ep"): "x"}[Time(1, "ep")] == "x"


# ---------------------------------------------------------------------------------------------------------------
# time strings
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [
        ("5ep", Time(5, "ep")),
        ("3e4tok", Time(30000, "tok")),
        ("4_000tok", Time(4000, "tok")),
        ("1.5e-1dur", Time(0.15, "dur")),
        (" 5ep ", Time(5, "ep")),
        ("\t12ba\n", Time(12, "ba")),
        ("-3ba", Time(-3, "ba")),
        ("+2sp", Time(2, "sp")),
        ("0.5dur", Time(0.5, "dur")),
        (".5dur", Time(0.5, "dur")),
        ("1.dur", Time(1.0, "dur")),
        ("1.0ep", Time(1, "ep")),
        ("2.5e1sp", Time(25, "sp")),
        ("1E3ba", Time(1000, "ba")),
        ("3e+2tok", Time(300, "tok")),
        ("5EP", Time(5, "ep")),
        ("1_000.000_1dur", Time(1000.0001, "dur")),
        ("12345678901234567891tok", Time(12345678901234567891, "tok")),
    ],
)
def test_from_timestring(text, expected):
    t = Time.from_timestring(text)
    assert t.unit is expected.unit and t.value == expected.value
    assert type(t.value) is type(expected.value)


@pytest.mark.parametrize(
    "bad",
    [
        "x",
        "",
        "  ",
        "5",
        "ep",
        "5 ep",
        "5epoch",
        "5ep5",
        "1__0ep",
        "_1ep",
        "1_ep",
        "5e",
        "e5ep",
        "--5ep",
        "5min",
        "0x10ep",
        "nandur",
        "infdur",
        "1e5.5ep",
        "5ep ba",
        "½ep",
        "٣ep",
        ".ep",
        "1._5dur",
    ],
)
def test_from_timestring_invalid(bad):
    with pytest.raises(
        ValueError,
        match=r"Invalid time string .*expected a number followed by one of "
        r"ep, ba, sp, tok, dur, like '5ep', '3e4tok', '0.5dur', '4_000tok'",
    ):
        Time.from_timestring(bad)


def test_from_timestring_message_quotes_string():
    with pytest.raises(ValueError, match=r"Invalid time string 'x':"):
        Time.from_timestring("x")


@pytest.mark.parametrize("text,unit", [("1.5ep", "ep"), ("1e-1ba", "ba"), ("2.5tok", "tok"), ("1e400sp", "sp")])
def test_from_timestring_non_integral_for_integer_unit(text, unit):
    with pytest.raises(TypeError, match=f"whole numbers of {unit}, or a fraction of the run in 'dur'"):
        Time.from_timestring(text)


def test_from_timestring_non_str():
    with pytest.raises(TypeError, match="must be a str"):
        Time.from_timestring(5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# ensure_time
# ---------------------------------------------------------------------------------------------------------------
def test_ensure_time():
    t = Time(3, "ep")
    assert ensure_time(t, "ba") is t
    assert ensure_time("2ep", TimeUnit.BATCH) == Time(2, "ep")
    assert ensure_time(7, TimeUnit.BATCH) == Time(7, "ba")
    assert ensure_time(7, "ba").unit is TimeUnit.BATCH
    assert ensure_time(7.0, "sp") == Time(7, "sp")
    assert ensure_time(0.5, "dur") == Time(0.5, "dur")
    with pytest.raises(TypeError, match="whole numbers of ba"):
        ensure_time(7.5, "ba")
    with pytest.raises(ValueError, match="Invalid time string"):
        ensure_time("seven", "ba")


@pytest.mark.parametrize("bad", [None, [1], td(seconds=1), b"5ep", True])
def test_ensure_time_bad_type(bad):
    with pytest.raises(TypeError, match="Expected a Time, a time string like '5ep', or an int/float number"):
        ensure_time(bad, "ep")


# ---------------------------------------------------------------------------------------------------------------
# Timestamp
# ---------------------------------------------------------------------------------------------------------------
COUNTER_UNITS = {
    "epoch": "ep",
    "batch": "ba",
    "sample": "sp",
    "token": "tok",
    "batch_in_epoch": "ba",
    "sample_in_epoch": "sp",
    "token_in_epoch": "tok",
}


def test_timestamp_defaults():
    ts = Timestamp()
    for name, unit in COUNTER_UNITS.items():
        v = getattr(ts, name)
        assert isinstance(v, Time) and v == Time(0, unit) and v.unit is TimeUnit(unit)
    assert ts.epoch == Time(0, "ep")
    assert ts.total_wct == td(0) and ts.epoch_wct == td(0) and ts.batch_wct == td(0)
    assert isinstance(ts.total_wct, datetime.timedelta)


def test_timestamp_accepts_ints_and_matching_times():
    ts = Timestamp(
        epoch=Time(1, "ep"),
        batch=10,
        sample=Time(640, "sp"),
        token=3.0,
        batch_in_epoch=Time(2, "ba"),
        total_wct=td(seconds=5),
    )
    assert ts.epoch == Time(1, "ep") and ts.batch == Time(10, "ba") and ts.sample == Time(640, "sp")
    assert ts.token == Time(3, "tok") and ts.batch_in_epoch == Time(2, "ba")
    assert ts.total_wct == td(seconds=5)


@pytest.mark.parametrize("name,unit", sorted(COUNTER_UNITS.items()))
def test_timestamp_wrong_unit_rejected(name, unit):
    wrong = Time(1, "dur") if unit != "dur" else Time(1, "ep")
    with pytest.raises(ValueError, match=rf"Timestamp '{name}' must be in '{unit}'.*got Time\(1.0, TimeUnit.DURATION"):
        Timestamp(**{name: wrong})


def test_timestamp_invalid_values():
    with pytest.raises(ValueError, match="'batch' must be >= 0, got -1"):
        Timestamp(batch=-1)
    with pytest.raises(TypeError, match="whole numbers of sp"):
        Timestamp(sample=1.5)
    with pytest.raises(TypeError, match="must be a number"):
        Timestamp(epoch="1ep")
    with pytest.raises(TypeError, match="'total_wct' must be a datetime.timedelta or None"):
        Timestamp(total_wct=5.0)


def test_timestamp_is_immutable():
    ts = Timestamp()
    with pytest.raises(AttributeError):
        ts.epoch = Time(1, "ep")  # type: ignore[misc]
    with pytest.raises(AttributeError):
        ts.extra = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        hash(ts)


def test_timestamp_get_and_get_value():
    ts = Timestamp(epoch=1, batch=2, sample=3, token=4)
    for unit, expected in [("ep", 1), ("ba", 2), ("sp", 3), ("tok", 4)]:
        assert ts.get(unit) == Time(expected, unit) and ts.get(unit).unit is TimeUnit(unit)
        assert ts.get(TimeUnit(unit)) == Time(expected, unit)
        assert ts.get_value(unit) == expected and type(ts.get_value(unit)) is int
        assert ts.get_value(TimeUnit(unit)) == expected
    assert ts.get_value("EPOCH") == 1
    for unit in ("dur", TimeUnit.DURATION):
        with pytest.raises(ValueError, match=r"use State.get_elapsed_duration\(\)"):
            ts.get(unit)
        with pytest.raises(ValueError, match=r"use State.get_elapsed_duration\(\)"):
            ts.get_value(unit)
    with pytest.raises(ValueError, match="Invalid time unit"):
        ts.get("minutes")


def test_timestamp_copy():
    ts = Timestamp(epoch=1, batch=2, total_wct=td(seconds=3))
    c = ts.copy(epoch=5, batch_wct=td(seconds=1))
    assert c.epoch == Time(5, "ep") and c.batch == Time(2, "ba") and c.total_wct == td(seconds=3)
    assert c.batch_wct == td(seconds=1)
    assert ts.epoch == Time(1, "ep") and c is not ts
    assert ts.copy() == ts and ts.copy() is not ts
    assert ts.copy(epoch=0).epoch == Time(0, "ep")
    with pytest.raises(ValueError, match="'sample' must be in 'sp'"):
        ts.copy(sample=Time(1, "ba"))


def _reference_next_batch(ts, samples, tokens, duration):
    """The seed doc's "Equivalent to" formula for Timestamp.to_next_batch."""
    return ts.copy(
        batch=ts.batch + 1,
        batch_in_epoch=ts.batch_in_epoch + 1,
        sample=ts.sample + samples,
        sample_in_epoch=ts.sample_in_epoch + samples,
        token=ts.token + tokens,
        token_in_epoch=ts.token_in_epoch + tokens,
        total_wct=ts.total_wct + duration,
        epoch_wct=ts.epoch_wct + duration,
        batch_wct=duration,
    )


def _reference_next_epoch(ts):
    return ts.copy(
        epoch=ts.epoch + 1,
        batch_in_epoch=0,
        sample_in_epoch=0,
        token_in_epoch=0,
        epoch_wct=td(seconds=0),
        batch_wct=td(seconds=0),
    )


def _full(ts):
    return ts.state_dict()


def test_to_next_batch():
    ts = Timestamp(
        epoch=1,
        batch=10,
        sample=640,
        token=9,
        batch_in_epoch=3,
        sample_in_epoch=192,
        token_in_epoch=5,
        total_wct=td(seconds=10),
        epoch_wct=td(seconds=4),
        batch_wct=td(seconds=1),
    )
    before = _full(ts)
    nxt = ts.to_next_batch(samples=64, tokens=100, duration=td(seconds=2))
    assert _full(ts) == before, "to_next_batch must not mutate"
    assert type(nxt) is Timestamp and nxt is not ts
    assert _full(nxt) == _full(_reference_next_batch(ts, 64, 100, td(seconds=2)))
    assert nxt.batch == Time(11, "ba") and nxt.sample == Time(704, "sp") and nxt.batch_wct == td(seconds=2)
    # Time arguments and default duration
    nxt2 = ts.to_next_batch(samples=Time(64, "sp"), tokens=Time(100, "tok"))
    assert _full(nxt2) == _full(_reference_next_batch(ts, 64, 100, td(0)))
    assert nxt2.batch_wct == td(0) and nxt2.total_wct == td(seconds=10)
    assert Timestamp().to_next_batch().batch == Time(1, "ba")


def test_to_next_batch_invalid_arguments():
    ts = Timestamp()
    with pytest.raises(ValueError, match="'samples' must be in 'sp'"):
        ts.to_next_batch(samples=Time(3, "tok"))
    with pytest.raises(ValueError, match="'tokens' must be in 'tok'"):
        ts.to_next_batch(tokens=Time(3, "sp"))
    with pytest.raises(ValueError, match="'samples' must be >= 0"):
        ts.to_next_batch(samples=-1)
    with pytest.raises(TypeError, match="whole numbers of tok"):
        ts.to_next_batch(tokens=1.5)
    with pytest.raises(TypeError, match="'duration' must be a datetime.timedelta"):
        ts.to_next_batch(duration=1.0)
    assert ts.to_next_batch(samples=2.0).sample == Time(2, "sp")


def test_to_next_epoch():
    ts = Timestamp(
        epoch=1,
        batch=10,
        sample=640,
        token=9,
        batch_in_epoch=3,
        sample_in_epoch=192,
        token_in_epoch=5,
        total_wct=td(seconds=10),
        epoch_wct=td(seconds=4),
        batch_wct=td(seconds=1),
    )
    before = _full(ts)
    nxt = ts.to_next_epoch()
    assert _full(ts) == before
    assert _full(nxt) == _full(_reference_next_epoch(ts))
    assert nxt.epoch == Time(2, "ep") and nxt.batch == Time(10, "ba") and nxt.sample == Time(640, "sp")
    assert nxt.batch_in_epoch == Time(0, "ba") and nxt.sample_in_epoch == 0 and nxt.token_in_epoch == 0
    assert nxt.total_wct == td(seconds=10) and nxt.epoch_wct == td(0) and nxt.batch_wct == td(0)


def test_state_dict_is_plain_and_round_trips():
    ts = Timestamp(
        epoch=1,
        batch=10,
        sample=640,
        token=9,
        batch_in_epoch=3,
        sample_in_epoch=192,
        token_in_epoch=5,
        total_wct=td(seconds=10, microseconds=7),
        epoch_wct=td(seconds=4),
    )
    sd = ts.state_dict()
    assert sd == {
        "epoch": 1,
        "batch": 10,
        "sample": 640,
        "token": 9,
        "batch_in_epoch": 3,
        "sample_in_epoch": 192,
        "token_in_epoch": 5,
        "total_wct": 10.000007,
        "epoch_wct": 4.0,
        "batch_wct": 0.0,
    }
    assert all(type(v) in (int, float) for v in sd.values())
    restored = Timestamp.from_state_dict(json.loads(json.dumps(sd)))
    assert restored.state_dict() == sd and restored == ts
    assert restored.total_wct == td(seconds=10, microseconds=7)


def test_from_state_dict_returns_a_new_timestamp_and_accepts_get_state():
    ts = Timestamp(epoch=2, batch=5, total_wct=td(seconds=3))
    loaded = Timestamp.from_state_dict(ts.get_state())
    assert loaded is not ts and loaded.epoch == Time(2, "ep") and loaded.total_wct == td(seconds=3)
    assert not hasattr(Timestamp, "load_state_dict")  # documented immutable: nothing mutates one in place
    # wall-clock keys are optional (older checkpoints)
    sd = ts.state_dict()
    for k in ("total_wct", "epoch_wct", "batch_wct"):
        del sd[k]
    t2 = Timestamp.from_state_dict(sd)
    assert t2.batch == Time(5, "ba") and t2.total_wct == td(0)


def test_from_state_dict_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"missing keys \['token_in_epoch'\]"):
        Timestamp.from_state_dict({k: 0 for k in COUNTER_UNITS if k != "token_in_epoch"})
    bad = Timestamp().state_dict()
    bad["batch"] = -4
    with pytest.raises(ValueError, match="'batch' must be >= 0"):
        Timestamp.from_state_dict(bad)
    with pytest.raises(TypeError, match="must be a mapping"):
        Timestamp.from_state_dict([1, 2])  # type: ignore[arg-type]


def test_get_state():
    ts = Timestamp(epoch=1, token=7, batch_wct=td(seconds=2))
    st_ = ts.get_state()
    assert set(st_) == set(COUNTER_UNITS) | {"total_wct", "epoch_wct", "batch_wct"}
    assert st_["epoch"] == Time(1, "ep") and st_["token"] == Time(7, "tok") and isinstance(st_["epoch"], Time)
    assert st_["batch_wct"] == td(seconds=2)


def test_timestamp_equality_compares_counters_only():
    a = Timestamp(epoch=1, batch=2, total_wct=td(seconds=1))
    b = Timestamp(epoch=1, batch=2, total_wct=td(seconds=50))
    assert a == b and not a != b
    assert a != Timestamp(epoch=1, batch=3)
    assert (a == 5) is False and a != 5 and (a == None) is False  # noqa: E711


def test_timestamp_time_comparisons():
    ts = Timestamp(epoch=1, batch=10, sample=640)
    assert ts < Time(10, "ep") and ts <= Time(1, "ep") and ts >= Time(100, "sp") and ts > Time(9, "ba")
    assert ts == Time(10, "ba") and ts != Time(11, "ba") and ts == Time(1, "ep")
    assert not ts < Time(1, "ep") and not ts > Time(640, "sp")
    # reflected
    assert Time(10, "ep") > ts and Time(10, "ba") == ts and Time(0, "tok") <= ts
    # strings
    assert ts == "10ba" and ts < "2ep" and ts >= "640sp"
    with pytest.raises(ValueError, match="get_elapsed_duration"):
        ts < Time(0.5, "dur")
    with pytest.raises(TypeError):
        ts < 5
    with pytest.raises(TypeError):
        ts < Timestamp()


def test_timestamp_repr_round_trips():
    ts = Timestamp(
        epoch=1,
        batch=10,
        sample=640,
        batch_in_epoch=10,
        sample_in_epoch=640,
        total_wct=td(seconds=3, microseconds=5),
        batch_wct=td(milliseconds=250),
    )
    r = repr(ts)
    assert r.startswith(
        "Timestamp(epoch=1, batch=10, sample=640, token=0, batch_in_epoch=10, sample_in_epoch=640, "
        "token_in_epoch=0, total_wct=datetime.timedelta("
    )
    back = eval(r, EVAL_NS)
    assert back.state_dict() == ts.state_dict()


def test_timestamp_pickle_and_deepcopy():
    ts = Timestamp(epoch=1, batch=10, total_wct=td(seconds=3))
    for clone in (pickle.loads(pickle.dumps(ts)), copy.deepcopy(ts), copy.copy(ts)):
        assert clone.state_dict() == ts.state_dict()


# ---------------------------------------------------------------------------------------------------------------
# hypothesis properties
# ---------------------------------------------------------------------------------------------------------------
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
big_ints = st.integers(min_value=-(10**30), max_value=10**30)
int_units = st.sampled_from(INT_UNITS)


@st.composite
def times(draw, unit=None):
    unit = draw(st.sampled_from(ALL_UNITS)) if unit is None else unit
    if unit is TimeUnit.DURATION:
        return Time(draw(finite_floats), unit)
    return Time(draw(big_ints), unit)


@st.composite
def same_unit_pair(draw):
    unit = draw(st.sampled_from(ALL_UNITS))
    return draw(times(unit)), draw(times(unit))


@given(times())
def test_prop_timestring_round_trip(t):
    back = Time.from_timestring(t.to_timestring())
    assert back == t and back.unit is t.unit and type(back.value) is type(t.value)


@given(times())
def test_prop_repr_round_trip(t):
    back = eval(repr(t), EVAL_NS)
    assert back == t and back.unit is t.unit and type(back.value) is type(t.value)


@given(int_units, big_ints, big_ints)
def test_prop_add_sub_inverse_int_units(unit, a, b):
    ta, tb = Time(a, unit), Time(b, unit)
    assert (ta + tb) - tb == ta
    assert ta + tb == tb + ta
    assert (ta + tb).value == a + b and (ta - tb).value == a - b
    assert ta + b == b + ta == ta + tb


@given(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6))
def test_prop_add_sub_inverse_duration(a, b):
    ta, tb = Time(a, "dur"), Time(b, "dur")
    assert math.isclose(((ta + tb) - tb).value, a, rel_tol=1e-9, abs_tol=1e-9)
    assert ta + tb == tb + ta


@given(same_unit_pair())
def test_prop_comparisons_match_values(pair):
    a, b = pair
    assert (a < b) == (a.value < b.value)
    assert (a <= b) == (a.value <= b.value)
    assert (a > b) == (a.value > b.value)
    assert (a >= b) == (a.value >= b.value)
    assert (a == b) == (a.value == b.value)
    assert (a != b) == (a.value != b.value)
    assert (a < b.value) == (a.value < b.value) and (a == b.value) == (a.value == b.value)
    if a == b:
        assert hash(a) == hash(b)


@given(st.floats(-1e9, 1e9), st.floats(-1e9, 1e9).filter(lambda x: abs(x) > 1e-9))
def test_prop_div_mul_inverse_duration(a, b):
    ta, tb = Time(a, "dur"), Time(b, "dur")
    q = ta / tb
    assert q.unit is TimeUnit.DURATION
    assert math.isclose((q * tb).value, a, rel_tol=1e-9, abs_tol=1e-9)


@given(int_units, st.integers(-(10**12), 10**12), st.integers(-(10**12), 10**12).filter(bool))
def test_prop_div_mul_inverse_int_units(unit, a, b):
    ta, tb = Time(a, unit), Time(b, unit)
    q = ta / tb
    assert q.unit is TimeUnit.DURATION
    back = q * tb  # dur * unit -> unit, float noise absorbed
    assert back == ta and back.unit is unit and type(back.value) is int


@given(int_units, st.integers(-(10**12), 10**12), st.integers(1, 1000))
def test_prop_scaling_int_units(unit, a, k):
    t = Time(a * k, unit)
    assert t / k == Time(a, unit)
    assert Time(a, unit) * k == t


@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**9), st.integers(0, 10**7)), max_size=50),
    st.integers(0, 10**6),
)
def test_prop_to_next_batch_accumulates(steps, start_batch):
    ts = Timestamp(batch=start_batch)
    for samples, tokens, micros in steps:
        ts = ts.to_next_batch(samples=samples, tokens=tokens, duration=td(microseconds=micros))
    n = len(steps)
    assert ts.batch == Time(start_batch + n, "ba") and ts.batch_in_epoch == Time(n, "ba")
    assert ts.get_value("sp") == sum(s for s, _, _ in steps) == ts.get_value("sp")
    assert ts.sample_in_epoch == ts.sample
    assert ts.token == Time(sum(t for _, t, _ in steps), "tok") and ts.token_in_epoch == ts.token
    total = td(microseconds=sum(m for _, _, m in steps))
    assert ts.total_wct == total and ts.epoch_wct == total
    assert ts.batch_wct == (td(microseconds=steps[-1][2]) if steps else td(0))
    assert ts.epoch == Time(0, "ep")


@st.composite
def timestamps(draw):
    c = {name: draw(st.integers(0, 10**15)) for name in COUNTER_UNITS}
    w = {name: td(microseconds=draw(st.integers(0, 10**15))) for name in ("total_wct", "epoch_wct", "batch_wct")}
    return Timestamp(**c, **w)


@given(timestamps(), st.integers(0, 10**6), st.integers(0, 10**6))
def test_prop_to_next_epoch_resets(ts, samples, tokens):
    mid = ts.to_next_batch(samples=samples, tokens=tokens, duration=td(seconds=1))
    nxt = mid.to_next_epoch()
    assert nxt.epoch == mid.epoch + 1
    assert nxt.batch_in_epoch == Time(0, "ba") and nxt.sample_in_epoch == Time(0, "sp")
    assert nxt.token_in_epoch == Time(0, "tok")
    assert nxt.batch == mid.batch and nxt.sample == mid.sample and nxt.token == mid.token
    assert nxt.total_wct == mid.total_wct and nxt.epoch_wct == td(0) and nxt.batch_wct == td(0)
    assert nxt.state_dict() == _reference_next_epoch(mid).state_dict()
    after = nxt.to_next_batch(samples=samples, tokens=tokens)
    assert after.sample_in_epoch == Time(samples, "sp") and after.batch_in_epoch == Time(1, "ba")


@given(timestamps(), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**9))
def test_prop_to_next_batch_matches_reference(ts, samples, tokens, micros):
    d = td(microseconds=micros)
    expected = _reference_next_batch(ts, samples, tokens, d)
    assert ts.to_next_batch(samples, tokens, d).state_dict() == expected.state_dict()


@given(timestamps())
def test_prop_state_dict_round_trip(ts):
    sd = ts.state_dict()
    assert all(type(v) in (int, float) for v in sd.values())
    restored = Timestamp.from_state_dict(json.loads(json.dumps(sd)))
    assert restored.state_dict() == sd
    assert restored == ts
    for name in ("total_wct", "epoch_wct", "batch_wct"):
        assert getattr(restored, name) == getattr(ts, name)
    assert eval(repr(ts), EVAL_NS).state_dict() == sd


def _grouped(digits: str, draw) -> str:
    """Insert single underscores between random digits."""
    out = digits[0]
    for ch in digits[1:]:
        if draw(st.booleans()):
            out += "_"
        out += ch
    return out


@st.composite
def number_strings(draw):
    digits = st.text("0123456789", min_size=1, max_size=12)
    sign = draw(st.sampled_from(["", "+", "-"]))
    intpart = _grouped(draw(digits), draw)
    kind = draw(st.sampled_from(["int", "frac", "leading_dot", "trailing_dot"]))
    if kind == "int":
        body = intpart
    elif kind == "frac":
        body = intpart + "." + _grouped(draw(digits), draw)
    elif kind == "leading_dot":
        body = "." + _grouped(draw(digits), draw)
    else:
        body = intpart + "."
    if draw(st.booleans()):
        body += draw(st.sampled_from(["e", "E"])) + draw(st.sampled_from(["", "+", "-"]))
        body += _grouped(draw(st.text("0123456789", min_size=1, max_size=3)), draw)
    return sign + body


@given(number_strings(), st.sampled_from(ALL_UNITS), st.sampled_from(["", " ", "\t"]))
def test_prop_parse_matches_python_number_parsing(number, unit, pad):
    text = f"{pad}{number}{unit.value}{pad}"
    expected_float = float(number)
    if unit is TimeUnit.DURATION:
        if not math.isfinite(expected_float):
            with pytest.raises(ValueError):
                Time.from_timestring(text)
            return
        assert Time.from_timestring(text) == Time(expected_float, unit)
        return
    if not any(c in number for c in ".eE"):
        t = Time.from_timestring(text)
        assert t.value == int(number) and type(t.value) is int and t.unit is unit
    elif math.isfinite(expected_float) and expected_float.is_integer():
        t = Time.from_timestring(text)
        assert t.value == int(expected_float) and type(t.value) is int
    else:
        with pytest.raises(TypeError, match=f"whole numbers of {unit.value}"):
            Time.from_timestring(text)


_garbage_alphabet = st.sampled_from(list("0123456789._eE+- \t\nxpabstokudr") + ["ep", "ba", "sp", "tok", "dur"])


@settings(max_examples=300)
@given(st.one_of(st.text(), st.lists(_garbage_alphabet, max_size=12).map("".join)))
def test_prop_garbage_strings_only_raise_value_or_type_error(s):
    try:
        t = Time.from_timestring(s)
    except (ValueError, TypeError):
        return
    assert isinstance(t, Time)
    assert Time.from_timestring(t.to_timestring()) == t


@given(
    st.one_of(st.none(), st.booleans(), st.binary(), st.lists(st.integers()), st.text(), finite_floats, big_ints),
    st.sampled_from(ALL_UNITS),
)
def test_prop_ensure_time_only_raises_documented_errors(x, unit):
    try:
        t = ensure_time(x, unit)
    except (ValueError, TypeError):
        return
    assert isinstance(t, Time)
