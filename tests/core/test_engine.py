"""Tests for raytrain_events.core.engine: matching, ordering passes, traces, callback dispatch."""

from __future__ import annotations

import timeit

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Algorithm, Callback, Engine, Event, Logger, State, Trace, Trainer
from raytrain_events.core.engine import filo_on_after_events, sort_by_priority
from raytrain_events.models import ClassifierModel


def make_state(algorithms=(), callbacks=()):
    return State(model=torch.nn.Linear(2, 2), max_duration="1ep", algorithms=algorithms, callbacks=callbacks)


class Recorder(Algorithm):
    """Matches the events in ``events`` (all if None) and logs ``(name, event)`` into a shared list."""

    def __init__(self, name, log, events=None, exit_code=None):
        self.name, self.log, self.events, self.exit_code = name, log, events, exit_code
        self.match_calls = []

    def match(self, event, state):
        self.match_calls.append(event)
        return self.events is None or event in self.events

    def apply(self, event, state, logger):
        self.log.append((self.name, event))
        return self.exit_code


# Distinct classes so traces (named by class) tell them apart.
class AlgoA(Recorder):
    pass


class AlgoB(Recorder):
    pass


class AlgoC(Recorder):
    pass


class LoggingCallback(Callback):
    def __init__(self, log):
        self.log = log

    def run_event(self, event, state, logger):
        self.log.append(("callback", event))


# ---------------------------------------------------------------------------------------------------------------
# algorithms: match, order relative to callbacks, FILO, passes
# ---------------------------------------------------------------------------------------------------------------
def test_algorithm_runs_only_when_match_is_true_and_before_callbacks():
    log = []
    algo = AlgoA("a", log, events={Event.BATCH_START})
    state = make_state(algorithms=[algo], callbacks=[LoggingCallback(log)])
    engine = Engine(state=state, logger=Logger())
    for event in Event:
        engine.run_event(event)
    assert algo.match_calls == list(Event)  # match is asked at every event
    assert [e for name, e in log if name == "a"] == [Event.BATCH_START]
    i = log.index(("a", Event.BATCH_START))
    assert log[i + 1] == ("callback", Event.BATCH_START)
    assert [e for name, e in log if name == "callback"] == list(Event)


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_filo_on_after_events(event):
    log = []
    algos = [AlgoA("a", log), AlgoB("b", log), AlgoC("c", log)]
    engine = Engine(state=make_state(algorithms=algos), logger=Logger())
    engine.run_event(event)
    order = [name for name, _ in log]
    stem = event.name.split("_", 1)[1] if event.name.startswith(("EVAL_", "PREDICT_")) else event.name
    is_after = stem.startswith("AFTER_") or event.name.endswith("_END")
    assert order == (["c", "b", "a"] if is_after else ["a", "b", "c"])


def test_filo_records_undo_order_over_a_forward_pair():
    log = []
    algos = [AlgoA("a", log), AlgoB("b", log)]
    engine = Engine(state=make_state(algorithms=algos), logger=Logger())
    engine.run_event(Event.BEFORE_FORWARD)
    engine.run_event(Event.AFTER_FORWARD)
    assert log == [
        ("a", Event.BEFORE_FORWARD),
        ("b", Event.BEFORE_FORWARD),
        ("b", Event.AFTER_FORWARD),
        ("a", Event.AFTER_FORWARD),
    ]


def test_custom_ordering_pass_runs_after_filo():
    log = []
    algos = [AlgoA("a", log), AlgoB("b", log), AlgoC("c", log)]
    engine = Engine(state=make_state(algorithms=algos), logger=Logger())
    engine.register_pass(sort_by_priority({AlgoC: -1, AlgoA: 1}))
    engine.run_event(Event.BEFORE_LOSS)
    engine.run_event(Event.AFTER_LOSS)  # FILO gives c, b, a; the priority pass then sorts c, b, a
    assert [n for n, _ in log] == ["c", "b", "a", "c", "b", "a"]

    log.clear()
    seen = []

    def drop_b_and_record(algorithms, event):
        seen.append((event, [type(a).__name__ for a in algorithms]))
        return [a for a in algorithms if not isinstance(a, AlgoB)]

    engine = Engine(state=make_state(algorithms=algos), logger=Logger(), algorithm_passes=[filo_on_after_events])
    engine.register_pass(drop_b_and_record, index=0)  # before FILO: sees registration order
    engine.run_event(Event.AFTER_LOSS)
    assert seen == [(Event.AFTER_LOSS, ["AlgoA", "AlgoB", "AlgoC"])]
    assert [n for n, _ in log] == ["c", "a"]


def test_passes_only_see_matching_algorithms():
    log, seen = [], []
    algos = [AlgoA("a", log, events={Event.INIT}), AlgoB("b", log, events={Event.FIT_START})]
    engine = Engine(
        state=make_state(algorithms=algos),
        logger=Logger(),
        algorithm_passes=[lambda algs, ev: seen.append([type(a).__name__ for a in algs]) or list(algs)],
    )
    engine.run_event(Event.FIT_START)
    engine.run_event(Event.EPOCH_START)  # nothing matches: the pass is not even called
    assert seen == [["AlgoB"]]


def test_trace_contents():
    log = []
    algos = [AlgoA("a", log, exit_code=3), AlgoB("b", log, events={Event.BATCH_END}), AlgoC("c", log, exit_code=7)]
    engine = Engine(state=make_state(algorithms=algos), logger=Logger())
    traces = engine.run_event(Event.BATCH_END)
    assert traces == {
        "AlgoC/BATCH_END": Trace(name="AlgoC", event=Event.BATCH_END, exit_code=7, order=0),
        "AlgoB/BATCH_END": Trace(name="AlgoB", event=Event.BATCH_END, exit_code=None, order=1),
        "AlgoA/BATCH_END": Trace(name="AlgoA", event=Event.BATCH_END, exit_code=3, order=2),
    }
    assert all(t.run for t in traces.values())
    traces = engine.run_event(Event.BATCH_START)
    assert traces == {
        "AlgoA/BATCH_START": Trace("AlgoA", Event.BATCH_START, 3, 0),
        "AlgoC/BATCH_START": Trace("AlgoC", Event.BATCH_START, 7, 1),
    }
    assert [(t.name, t.event, t.order) for t in engine.traces] == [
        ("AlgoC", Event.BATCH_END, 0),
        ("AlgoB", Event.BATCH_END, 1),
        ("AlgoA", Event.BATCH_END, 2),
        ("AlgoA", Event.BATCH_START, 0),
        ("AlgoC", Event.BATCH_START, 1),
    ]
    assert engine.run_event(Event.INIT).keys() == {"AlgoA/INIT", "AlgoC/INIT"}
    assert make_engine_without_algorithms().run_event(Event.BATCH_END) == {}


def make_engine_without_algorithms():
    return Engine(state=make_state(), logger=Logger())


def test_trace_history_is_bounded():
    log = []
    engine = Engine(state=make_state(algorithms=[AlgoA("a", log)]), logger=Logger(), trace_history=5)
    for _ in range(20):
        engine.run_event(Event.BATCH_END)
    assert len(engine.traces) == 5


def test_algorithm_may_change_state_seen_by_callbacks():
    class SetLoss(Algorithm):
        def match(self, event, state):
            return event == Event.AFTER_LOSS

        def apply(self, event, state, logger):
            state.loss = "changed"

    seen = []

    class Peek(Callback):
        def after_loss(self, state, logger):
            seen.append(state.loss)

    state = make_state(algorithms=[SetLoss()], callbacks=[Peek()])
    Engine(state=state, logger=Logger()).run_event(Event.AFTER_LOSS)
    assert seen == ["changed"]


@pytest.mark.parametrize("bad", [object(), "LabelSmoothing", lambda event, state: True])
def test_non_algorithm_raises_type_error(bad):
    with pytest.raises(TypeError, match="not an Algorithm"):
        Engine(state=make_state(algorithms=[bad]), logger=Logger())


def test_non_callback_raises_type_error():
    with pytest.raises(TypeError, match="not a Callback"):
        Engine(state=make_state(callbacks=[object()]), logger=Logger())


# ---------------------------------------------------------------------------------------------------------------
# callbacks
# ---------------------------------------------------------------------------------------------------------------
class BatchEndOnly(Callback):
    def __init__(self):
        self.calls = 0

    def batch_end(self, state, logger):
        self.calls += 1


def test_callback_dispatch_only_for_overridden_methods(monkeypatch):
    # Replace every other event method on the base class with a spy: a callback that does not
    # override it inherits the spy, so a call to any of them would show up here.
    called = []
    for event in Event:
        if event is not Event.BATCH_END:
            monkeypatch.setattr(Callback, event.value, lambda self, state, logger, _e=event: called.append(_e))
    run_event_calls = []
    original_run_event = Callback.run_event
    monkeypatch.setattr(
        Callback, "run_event", lambda self, *a: run_event_calls.append(a) or original_run_event(self, *a)
    )

    cb = BatchEndOnly()
    assert cb.overridden_events() == [Event.BATCH_END]
    engine = Engine(state=make_state(callbacks=[cb]), logger=Logger())
    for event in Event:
        engine.run_event(event)
    assert cb.calls == 1
    assert called == []
    assert run_event_calls == []  # direct dispatch to the bound method, no getattr by name per event


def test_unhandled_event_is_cheap(record_property):
    """Measured, not asserted (timings are noisy on shared machines)."""
    engine = Engine(state=make_state(callbacks=[BatchEndOnly()]), logger=Logger())
    n = 20000
    unhandled = min(timeit.repeat(lambda: engine.run_event(Event.EPOCH_START), number=n, repeat=3)) / n
    handled = min(timeit.repeat(lambda: engine.run_event(Event.BATCH_END), number=n, repeat=3)) / n
    record_property("unhandled_event_us", unhandled * 1e6)
    record_property("handled_event_us", handled * 1e6)
    print(f"run_event: unhandled {unhandled * 1e6:.3f} us, handled by one callback {handled * 1e6:.3f} us")


def test_custom_run_event_override_sees_every_event():
    seen = []

    class Everything(Callback):
        def run_event(self, event, state, logger):
            seen.append(event)

    cb = Everything()
    assert cb.overridden_events() == list(Event)
    engine = Engine(state=make_state(callbacks=[cb]), logger=Logger())
    for event in Event:
        engine.run_event(event)
    assert seen == list(Event)


def test_callbacks_run_in_registration_order():
    log = []

    class First(Callback):
        def fit_start(self, state, logger):
            log.append("first")

    class Second(Callback):
        def fit_start(self, state, logger):
            log.append("second")

    engine = Engine(state=make_state(callbacks=[Second(), First()]), logger=Logger())
    engine.run_event(Event.FIT_START)
    engine.run_event(Event.FIT_END)  # callbacks are not reversed on *_END events
    assert log == ["second", "first"]


def test_refresh_picks_up_new_callbacks():
    state = make_state()
    engine = Engine(state=state, logger=Logger())
    cb = BatchEndOnly()
    state.callbacks.append(cb)
    engine.run_event(Event.BATCH_END)
    assert cb.calls == 0
    engine.refresh()
    engine.run_event(Event.BATCH_END)
    assert cb.calls == 1


# ---------------------------------------------------------------------------------------------------------------
# exceptions and close (through the Trainer, which owns the try/except)
# ---------------------------------------------------------------------------------------------------------------
def _trainer(callbacks, **kwargs):
    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    return Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=8),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=callbacks,
        **kwargs,
    )


class Boom(RuntimeError):
    pass


class Watcher(Callback):
    def __init__(self, log, raise_at=None):
        self.log, self.raise_at = log, raise_at

    def batch_end(self, state, logger):
        if self.raise_at is not None and state.step == self.raise_at:
            raise Boom("at batch_end")

    def on_exception(self, state, logger, exc):
        self.log.append(("on_exception", type(exc).__name__, state.step))

    def close(self, state, logger):
        self.log.append("close")

    def post_close(self):
        self.log.append("post_close")


def test_on_exception_then_reraise_then_close_once():
    log = []
    other = []
    trainer = _trainer([Watcher(log, raise_at=3), Watcher(other)])
    with pytest.raises(Boom, match="at batch_end"):
        trainer.fit()
    assert log == [("on_exception", "Boom", 3), "close", "post_close"]
    assert other == [("on_exception", "Boom", 3), "close", "post_close"]
    trainer.close()  # closing again is a no-op
    assert log.count("close") == 1


def test_exception_in_model_reaches_callbacks():
    log = []

    class BadLoss(Algorithm):
        def match(self, event, state):
            return event == Event.AFTER_LOSS

        def apply(self, event, state, logger):
            raise ValueError("bad loss")

    trainer = _trainer([Watcher(log)], algorithms=[BadLoss()])
    with pytest.raises(ValueError, match="bad loss"):
        trainer.fit()
    assert log == [("on_exception", "ValueError", 0), "close", "post_close"]


def test_close_called_once_after_successful_fit():
    log = []
    trainer = _trainer([Watcher(log)])
    trainer.fit()
    trainer.close()
    assert log == ["close", "post_close"]
    with pytest.raises(RuntimeError, match="already ran"):
        trainer.fit()
    assert log == ["close", "post_close"]


def test_quorum_change_reaches_every_callback_outside_the_event_order():
    """`Engine.run_quorum_change`: each callback's ``on_quorum_change`` hears it (replica groups), with the
    Timestamp of the step about to be trained and the group counts; no per-batch event runs."""
    from raytrain_events import QuorumChange, Timestamp

    heard, events = [], []

    class Hears(Callback):
        def on_quorum_change(self, state, logger, change):
            heard.append((self, change))

    quiet, hears = LoggingCallback(events), Hears()
    engine = Engine(state=make_state(callbacks=[quiet, hears]), logger=Logger())
    change = QuorumChange(Timestamp().to_next_batch(12, 0), before=3, after=2)
    engine.run_quorum_change(change)
    assert heard == [(hears, change)] and events == []
    assert change.batch == 1 and change.left
    assert change.line() == "replica groups: 3 -> 2 (a group left) before batch 1"
    joined = QuorumChange(Timestamp(), before=2, after=3, healed=True)
    assert not joined.left and joined.line().endswith(
        "(a group joined) before batch 0, this group recovered from a peer"
    )
