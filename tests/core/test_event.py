"""Tests for raytrain_events.core.event: the 32 events, their order and their groupings."""

from __future__ import annotations

import pytest

from raytrain_events.core.event import Event

# The order of Composer's loop pseudocode (seed 001): training events, then the eval events.
EXPECTED_NAMES = [
    "INIT",
    "AFTER_LOAD",
    "FIT_START",
    "EPOCH_START",
    "BEFORE_DATALOADER",
    "AFTER_DATALOADER",
    "BATCH_START",
    "BEFORE_TRAIN_BATCH",
    "BEFORE_FORWARD",
    "AFTER_FORWARD",
    "BEFORE_LOSS",
    "AFTER_LOSS",
    "BEFORE_BACKWARD",
    "AFTER_BACKWARD",
    "AFTER_TRAIN_BATCH",
    "BATCH_END",
    "BATCH_CHECKPOINT",
    "EPOCH_END",
    "EPOCH_CHECKPOINT",
    "FIT_END",
    "EVAL_START",
    "EVAL_BATCH_START",
    "EVAL_BEFORE_FORWARD",
    "EVAL_AFTER_FORWARD",
    "EVAL_BATCH_END",
    "EVAL_END",
    "PREDICT_START",
    "PREDICT_BATCH_START",
    "PREDICT_BEFORE_FORWARD",
    "PREDICT_AFTER_FORWARD",
    "PREDICT_BATCH_END",
    "PREDICT_END",
]


def test_exact_events_in_order():
    assert [e.name for e in Event] == EXPECTED_NAMES
    assert len(Event) == 32


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_value_is_lower_name(event):
    assert event.value == event.name.lower()
    assert str(event) == event.value
    assert Event(event.value) is event
    assert event == event.value  # a str enum: callbacks may compare with plain strings


def _pairs():
    # Every *_START/BEFORE_* event and its *_END/AFTER_* partner.
    return [
        ("FIT_START", "FIT_END"),
        ("EPOCH_START", "EPOCH_END"),
        ("BEFORE_DATALOADER", "AFTER_DATALOADER"),
        ("BATCH_START", "BATCH_END"),
        ("BEFORE_TRAIN_BATCH", "AFTER_TRAIN_BATCH"),
        ("BEFORE_FORWARD", "AFTER_FORWARD"),
        ("BEFORE_LOSS", "AFTER_LOSS"),
        ("BEFORE_BACKWARD", "AFTER_BACKWARD"),
        ("EVAL_START", "EVAL_END"),
        ("EVAL_BATCH_START", "EVAL_BATCH_END"),
        ("EVAL_BEFORE_FORWARD", "EVAL_AFTER_FORWARD"),
        ("PREDICT_START", "PREDICT_END"),
        ("PREDICT_BATCH_START", "PREDICT_BATCH_END"),
        ("PREDICT_BEFORE_FORWARD", "PREDICT_AFTER_FORWARD"),
    ]


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_is_before_is_after_follow_the_names(event):
    name = event.name
    stem = name.split("_", 1)[1] if name.startswith(("EVAL_", "PREDICT_")) else name
    assert event.is_before_event == (stem.startswith("BEFORE_") or name.endswith("_START"))
    assert event.is_after_event == (stem.startswith("AFTER_") or name.endswith("_END"))
    assert not (event.is_before_event and event.is_after_event)


def test_before_and_after_sets():
    before = {e.name for e in Event if e.is_before_event}
    after = {e.name for e in Event if e.is_after_event}
    assert before == {b for b, _ in _pairs()}
    # AFTER_LOAD has no BEFORE_LOAD in this (seed) event set, but it is an AFTER_* event: FILO applies.
    assert after == {a for _, a in _pairs()} | {"AFTER_LOAD"}
    neither = {e.name for e in Event} - before - after
    assert neither == {"INIT", "BATCH_CHECKPOINT", "EPOCH_CHECKPOINT"}


def test_before_precedes_after_in_order():
    order = [e.name for e in Event]
    for before, after in _pairs():
        assert order.index(before) < order.index(after), (before, after)


def test_is_eval():
    assert {e.name for e in Event if e.is_eval} == {n for n in EXPECTED_NAMES if n.startswith("EVAL_")}
    assert not Event.BEFORE_FORWARD.is_eval and Event.EVAL_BEFORE_FORWARD.is_eval
    assert {e.name for e in Event if e.is_predict} == {n for n in EXPECTED_NAMES if n.startswith("PREDICT_")}
    assert not any(e.is_predict and e.is_eval for e in Event)
