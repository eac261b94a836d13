"""The Trainer fires exactly the events of the seed pseudocode (001), in its order.

A callback that overrides ``run_event`` records every event; each test compares the full
sequence with `expected_events`, a small pure function written from the pseudocode::

    INIT, AFTER_LOAD, FIT_START
    for epoch:
        EPOCH_START
        while True:
            BEFORE_DATALOADER; batch = next(dataloader); if exhausted: break
            AFTER_DATALOADER, BATCH_START, BEFORE_TRAIN_BATCH
            for microbatch: BEFORE_FORWARD, AFTER_FORWARD, BEFORE_LOSS, AFTER_LOSS, BEFORE_BACKWARD, AFTER_BACKWARD
            AFTER_TRAIN_BATCH, BATCH_END, [eval], BATCH_CHECKPOINT
        EPOCH_END, [eval], EPOCH_CHECKPOINT
    FIT_END

with the stop rules of ``max_duration``: training stops right after the batch that reaches it
(no further BEFORE_DATALOADER), and EPOCH_END fires only when the data ran out or the epoch's
known length was reached.
"""

from __future__ import annotations

from collections import Counter as Count
from typing import Iterable, List, Optional

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, DataSpec, Event, Trainer
from raytrain_events.models import ClassifierModel

E = Event
MICROBATCH = [E.BEFORE_FORWARD, E.AFTER_FORWARD, E.BEFORE_LOSS, E.AFTER_LOSS, E.BEFORE_BACKWARD, E.AFTER_BACKWARD]


def eval_block(num_eval_batches: int, num_evaluators: int = 1) -> List[Event]:
    one = [E.EVAL_START]
    one += [E.EVAL_BATCH_START, E.EVAL_BEFORE_FORWARD, E.EVAL_AFTER_FORWARD, E.EVAL_BATCH_END] * num_eval_batches
    one += [E.EVAL_END]
    return one * num_evaluators


def expected_events(
    *,
    batches_per_epoch: int,
    max_epochs: Optional[int] = None,
    stop_after_batch: Optional[int] = None,
    has_len: bool = True,
    grad_accum: int = 1,
    eval_after_batches: Iterable[int] = (),
    eval_after_epochs: Iterable[int] = (),
    num_eval_batches: int = 0,
    num_evaluators: int = 1,
) -> List[Event]:
    """The event sequence of the seed pseudocode.

    ``batches_per_epoch``: batches the dataloader yields per pass. Training ends after
    ``max_epochs`` epochs or right after global batch ``stop_after_batch`` (1-based), whichever
    comes first. ``eval_after_batches`` / ``eval_after_epochs``: the 1-based global batch /
    epoch counts after which evaluation runs.
    """
    assert max_epochs is not None or stop_after_batch is not None
    eval_batches, eval_epochs = set(eval_after_batches), set(eval_after_epochs)
    events = [E.INIT, E.AFTER_LOAD, E.FIT_START]
    batch = epoch = 0
    stopped = False
    while not stopped and (max_epochs is None or epoch < max_epochs):
        events.append(E.EPOCH_START)
        in_epoch = 0
        exhausted = False
        while True:
            events.append(E.BEFORE_DATALOADER)
            if in_epoch == batches_per_epoch:
                exhausted = True
                break
            events += [E.AFTER_DATALOADER, E.BATCH_START, E.BEFORE_TRAIN_BATCH]
            events += MICROBATCH * grad_accum
            events += [E.AFTER_TRAIN_BATCH, E.BATCH_END]
            in_epoch += 1
            batch += 1
            if batch in eval_batches:
                events += eval_block(num_eval_batches, num_evaluators)
            events.append(E.BATCH_CHECKPOINT)
            if stop_after_batch is not None and batch >= stop_after_batch:
                stopped = True
                break
        if exhausted or (has_len and in_epoch == batches_per_epoch):
            epoch += 1
            events.append(E.EPOCH_END)
            if epoch in eval_epochs:
                events += eval_block(num_eval_batches, num_evaluators)
            events.append(E.EPOCH_CHECKPOINT)
    events.append(E.FIT_END)
    return events


def test_expected_events_generator_itself():
    # One epoch of two batches, written out by hand from the pseudocode.
    assert expected_events(batches_per_epoch=2, max_epochs=1) == [
        E.INIT,
        E.AFTER_LOAD,
        E.FIT_START,
        E.EPOCH_START,
        E.BEFORE_DATALOADER,
        E.AFTER_DATALOADER,
        E.BATCH_START,
        E.BEFORE_TRAIN_BATCH,
        *MICROBATCH,
        E.AFTER_TRAIN_BATCH,
        E.BATCH_END,
        E.BATCH_CHECKPOINT,
        E.BEFORE_DATALOADER,
        E.AFTER_DATALOADER,
        E.BATCH_START,
        E.BEFORE_TRAIN_BATCH,
        *MICROBATCH,
        E.AFTER_TRAIN_BATCH,
        E.BATCH_END,
        E.BATCH_CHECKPOINT,
        E.BEFORE_DATALOADER,
        E.EPOCH_END,
        E.EPOCH_CHECKPOINT,
        E.FIT_END,
    ]
    # Stopping on the first batch: no EPOCH_END, no second BEFORE_DATALOADER.
    assert expected_events(batches_per_epoch=2, stop_after_batch=1) == [
        E.INIT,
        E.AFTER_LOAD,
        E.FIT_START,
        E.EPOCH_START,
        E.BEFORE_DATALOADER,
        E.AFTER_DATALOADER,
        E.BATCH_START,
        E.BEFORE_TRAIN_BATCH,
        *MICROBATCH,
        E.AFTER_TRAIN_BATCH,
        E.BATCH_END,
        E.BATCH_CHECKPOINT,
        E.FIT_END,
    ]


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
class RecordAll(Callback):
    def __init__(self):
        self.events: List[Event] = []
        self.steps: List[int] = []

    def run_event(self, event, state, logger):
        self.events.append(event)
        if event == E.BATCH_END:
            self.steps.append(state.step)


class Stream:
    """An iterable with no ``__len__`` (like a streaming dataset): yields the same batches per pass."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def pairs(n, batch_size, d=4, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g))


def run(loader, *, eval_dataloader=None, **kwargs):
    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    rec = RecordAll()
    trainer = Trainer(
        model=model,
        train_dataloader=loader,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[rec],
        eval_dataloader=eval_dataloader,
        **kwargs,
    )
    state = trainer.fit()
    return rec, state


def assert_sequence(actual, expected):
    if actual != expected:  # a readable first difference, then the full comparison
        first = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
        lo = max(0, first - 3)
        pytest.fail(
            f"event sequences differ at index {first} (len {len(actual)} vs expected {len(expected)}):\n"
            f"  actual:   {[e.name for e in actual[lo : first + 4]]}\n  expected: {[e.name for e in expected[lo : first + 4]]}"
        )


# ---------------------------------------------------------------------------------------------------------------
# training events
# ---------------------------------------------------------------------------------------------------------------
def test_several_epochs_known_length():
    rec, state = run(DataLoader(pairs(24, 8), batch_size=8), max_duration="3ep")
    expected = expected_events(batches_per_epoch=3, max_epochs=3)
    assert_sequence(rec.events, expected)
    counts = Count(rec.events)
    assert counts[E.BATCH_END] == 9 and counts[E.EPOCH_END] == 3 and counts[E.BEFORE_DATALOADER] == 12
    assert counts[E.INIT] == counts[E.AFTER_LOAD] == counts[E.FIT_START] == counts[E.FIT_END] == 1
    assert rec.steps == list(range(1, 10))
    assert (state.epoch, state.step, int(state.timestamp.sample)) == (3, 9, 72)


def test_last_partial_batch_counts():
    rec, state = run(DataLoader(pairs(20, 8), batch_size=8), max_duration="2ep")  # 8, 8, 4
    assert_sequence(rec.events, expected_events(batches_per_epoch=3, max_epochs=2))
    assert int(state.timestamp.sample) == 40


def test_max_duration_in_batches_stops_mid_epoch():
    rec, state = run(DataLoader(pairs(32, 8), batch_size=8), max_duration="6ba")  # 4 batches per epoch
    assert_sequence(rec.events, expected_events(batches_per_epoch=4, stop_after_batch=6))
    assert Count(rec.events)[E.EPOCH_END] == 1
    assert (state.epoch, state.step, state.timestamp.batch_in_epoch.value) == (1, 6, 2)


def test_max_duration_in_batches_within_first_epoch():
    rec, state = run(DataLoader(pairs(32, 8), batch_size=8), max_duration="3ba")
    assert_sequence(rec.events, expected_events(batches_per_epoch=4, stop_after_batch=3))
    assert E.EPOCH_END not in rec.events and state.epoch == 0


def test_max_duration_lands_on_the_last_batch_of_an_epoch():
    rec, state = run(DataLoader(pairs(32, 8), batch_size=8), max_duration="8ba")
    expected = expected_events(batches_per_epoch=4, stop_after_batch=8)
    assert_sequence(rec.events, expected)
    assert Count(rec.events)[E.EPOCH_END] == 2
    assert rec.events[-4:] == [E.BATCH_CHECKPOINT, E.EPOCH_END, E.EPOCH_CHECKPOINT, E.FIT_END]
    assert Count(rec.events)[E.BEFORE_DATALOADER] == 9  # the epoch's end is known from len(), not by asking for more
    assert (state.epoch, state.step, state.timestamp.batch_in_epoch.value) == (2, 8, 0)


@pytest.mark.parametrize("grad_accum", [2, 4])
def test_grad_accum_events(grad_accum):
    rec, _ = run(DataLoader(pairs(24, 8), batch_size=8), max_duration="2ep", grad_accum=grad_accum)
    assert_sequence(rec.events, expected_events(batches_per_epoch=3, max_epochs=2, grad_accum=grad_accum))
    counts = Count(rec.events)
    assert counts[E.BEFORE_FORWARD] == counts[E.AFTER_BACKWARD] == 6 * grad_accum
    assert counts[E.BEFORE_TRAIN_BATCH] == counts[E.AFTER_TRAIN_BATCH] == counts[E.BATCH_END] == 6


def test_iterable_without_len_runs_epochs_until_exhausted():
    batches = list(DataLoader(pairs(24, 8), batch_size=8))
    rec, state = run(Stream(batches), max_duration="2ep")
    assert_sequence(rec.events, expected_events(batches_per_epoch=3, max_epochs=2, has_len=False))
    assert state.steps_per_epoch is None and (state.epoch, state.step) == (2, 6)


def test_iterable_without_len_stops_on_its_last_batch_without_epoch_end():
    batches = list(DataLoader(pairs(24, 8), batch_size=8))
    rec, state = run(Stream(batches), max_duration="3ba")
    # Without a length the loop cannot know the epoch is over without asking for another batch.
    assert_sequence(rec.events, expected_events(batches_per_epoch=3, stop_after_batch=3, has_len=False))
    assert E.EPOCH_END not in rec.events and state.epoch == 0


def test_iterable_without_len_with_max_duration_in_batches_across_epochs():
    batches = list(DataLoader(pairs(24, 8), batch_size=8))
    rec, _ = run(Stream(batches), max_duration="5ba")
    assert_sequence(rec.events, expected_events(batches_per_epoch=3, stop_after_batch=5, has_len=False))


def test_events_see_consistent_state():
    """Between BATCH_START and BATCH_END the step is the previous count; at BATCH_END it is advanced."""
    seen = []

    class Check(Callback):
        def batch_start(self, state, logger):
            seen.append(("start", state.step, state.timestamp.batch_in_epoch.value))

        def batch_end(self, state, logger):
            seen.append(("end", state.step, state.timestamp.batch_in_epoch.value))

        def epoch_end(self, state, logger):
            seen.append(("epoch_end", state.epoch, state.timestamp.batch_in_epoch.value))

    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    Trainer(
        model=model,
        train_dataloader=DataLoader(pairs(16, 8), batch_size=8),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[Check()],
    ).fit()
    assert seen == [("start", 0, 0), ("end", 1, 1), ("start", 1, 1), ("end", 2, 2), ("epoch_end", 1, 0)]


# ---------------------------------------------------------------------------------------------------------------
# evaluation events
# ---------------------------------------------------------------------------------------------------------------
EVAL = DataLoader(pairs(12, 4, seed=1), batch_size=4)  # 3 eval batches


def test_eval_every_epoch():
    rec, state = run(
        DataLoader(pairs(24, 8), batch_size=8), max_duration="3ep", eval_dataloader=EVAL, eval_interval="1ep"
    )
    assert_sequence(
        rec.events, expected_events(batches_per_epoch=3, max_epochs=3, eval_after_epochs={1, 2, 3}, num_eval_batches=3)
    )
    assert set(state.eval_metrics["eval"]) == {"accuracy", "cross_entropy"}


def test_eval_every_two_batches_and_at_the_end():
    rec, _ = run(DataLoader(pairs(32, 8), batch_size=8), max_duration="5ba", eval_dataloader=EVAL, eval_interval="2ba")
    expected = expected_events(
        batches_per_epoch=4, stop_after_batch=5, eval_after_batches={2, 4, 5}, num_eval_batches=3
    )
    assert_sequence(rec.events, expected)


def test_eval_at_half_duration_in_epochs():
    rec, _ = run(
        DataLoader(pairs(16, 8), batch_size=8), max_duration="4ep", eval_dataloader=EVAL, eval_interval="0.5dur"
    )
    assert_sequence(
        rec.events, expected_events(batches_per_epoch=2, max_epochs=4, eval_after_epochs={2, 4}, num_eval_batches=3)
    )


def test_eval_at_half_duration_in_batches():
    rec, _ = run(
        DataLoader(pairs(32, 8), batch_size=8), max_duration="6ba", eval_dataloader=EVAL, eval_interval="0.5dur"
    )
    assert_sequence(
        rec.events,
        expected_events(batches_per_epoch=4, stop_after_batch=6, eval_after_batches={3, 6}, num_eval_batches=3),
    )


def test_eval_every_64_samples():
    # 24-sample batches: 24, 48, 72 (crosses 64), 96, 120, 144 (crosses 128), 168, 192 (crosses 192)
    rec, _ = run(
        DataLoader(pairs(96, 24), batch_size=24), max_duration="2ep", eval_dataloader=EVAL, eval_interval="64sp"
    )
    assert_sequence(
        rec.events, expected_events(batches_per_epoch=4, max_epochs=2, eval_after_batches={3, 6, 8}, num_eval_batches=3)
    )


def test_eval_with_two_evaluators_and_grad_accum():
    evals = {"a": EVAL, "b": DataLoader(pairs(8, 4, seed=2), batch_size=8)}  # b has 1 batch
    rec, state = run(
        DataLoader(pairs(16, 8), batch_size=8),
        max_duration="2ep",
        eval_dataloader=evals,
        eval_interval="1ep",
        grad_accum=2,
    )
    one_eval = eval_block(3) + eval_block(1)
    expected = expected_events(batches_per_epoch=2, max_epochs=2, grad_accum=2)
    # insert one_eval after each EPOCH_END
    with_eval = []
    for event in expected:
        with_eval.append(event)
        if event == E.EPOCH_END:
            with_eval += one_eval
    assert_sequence(rec.events, with_eval)
    assert set(state.eval_metrics) == {"a", "b"}


def test_eval_restores_training_mode_and_batch():
    seen = []

    class Check(Callback):
        def eval_batch_start(self, state, logger):
            seen.append(("eval", state.model.training, torch.is_grad_enabled()))

        def batch_checkpoint(self, state, logger):
            seen.append(("train", state.model.training, state.batch[0].shape[0]))

    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    Trainer(
        model=model,
        train_dataloader=DataLoader(pairs(8, 8), batch_size=8),
        max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[Check()],
        eval_dataloader=DataLoader(pairs(4, 4), batch_size=4),
        eval_interval="1ba",
    ).fit()
    assert seen == [("eval", False, False), ("train", True, 8)]


# ---------------------------------------------------------------------------------------------------------------
# early stop
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 4, 6])
def test_stop_training_at_batch_k(k):
    class StopAt(Callback):
        def batch_end(self, state, logger):
            if state.step == k:
                state.stop_training("test")

    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    rec = RecordAll()
    state = Trainer(
        model=model,
        train_dataloader=DataLoader(pairs(32, 8), batch_size=8),
        max_duration="10ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[StopAt(), rec],
    ).fit()
    assert_sequence(rec.events, expected_events(batches_per_epoch=4, stop_after_batch=k))
    assert rec.events[-2:] == [E.BATCH_CHECKPOINT, E.FIT_END] or rec.events[-2:] == [E.EPOCH_CHECKPOINT, E.FIT_END]
    assert state.step == k and state.stop_reason == "test"


def test_stop_training_before_fit_start_trains_nothing():
    class StopNow(Callback):
        def fit_start(self, state, logger):
            state.stop_training()

    rec, state = run(DataLoader(pairs(16, 8), batch_size=8), max_duration="2ep")
    assert state.step == 2 * 2  # sanity: a normal run trains
    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    rec = RecordAll()
    state = Trainer(
        model=model,
        train_dataloader=DataLoader(pairs(16, 8), batch_size=8),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[StopNow(), rec],
    ).fit()
    assert rec.events == [E.INIT, E.AFTER_LOAD, E.FIT_START, E.FIT_END] and state.step == 0


# ---------------------------------------------------------------------------------------------------------------
# token durations (variable tokens per batch)
# ---------------------------------------------------------------------------------------------------------------
def token_batches():
    # Each batch: x (4, 4) plus a mask whose sum is the token count: 5, 9, 2, 7 tokens.
    out = []
    g = torch.Generator().manual_seed(0)
    for tokens in (5, 9, 2, 7):
        mask = torch.zeros(4, 4)
        mask.view(-1)[:tokens] = 1
        out.append({"x": torch.randn(4, 4, generator=g), "y": torch.randint(0, 2, (4,), generator=g), "mask": mask})
    return out


def test_max_duration_in_tokens():
    spec = DataSpec(token_batches(), get_num_tokens_in_batch=lambda b: int(b["mask"].sum()))
    # cumulative tokens: 5, 14, 16, 23 | 28, 37, ...: 30 tokens are first reached at global batch 6
    rec, state = run(spec, max_duration="30tok")
    assert_sequence(rec.events, expected_events(batches_per_epoch=4, stop_after_batch=6))
    assert (int(state.timestamp.token), state.step, state.epoch) == (37, 6, 1)
