"""Trainer arguments: every max_duration unit, and the errors for arguments that cannot work."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Algorithm, Callback, DataSpec, Event, Trainer
from raytrain_events.models import ClassifierModel


def pairs(n, d=4, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)


def trainer(loader=None, *, m=None, **kwargs):
    m = m if m is not None else model()
    loader = loader if loader is not None else DataLoader(pairs(32), batch_size=8)
    kwargs.setdefault("max_duration", "1ep")
    return Trainer(model=m, train_dataloader=loader, optimizers=torch.optim.SGD(m.parameters(), lr=0.1), **kwargs)


class BatchSizes(Callback):
    def __init__(self):
        self.samples = []

    def batch_end(self, state, logger):
        self.samples.append(int(state.timestamp.sample))


# ---------------------------------------------------------------------------------------------------------------
# max_duration units
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_duration, epochs, steps", [("2ep", 2, 8), (3, 3, 12), ("1ep", 1, 4)])
def test_max_duration_epochs(max_duration, epochs, steps):
    state = trainer(max_duration=max_duration).fit()
    assert (state.epoch, state.step, int(state.timestamp.sample)) == (epochs, steps, steps * 8)


@pytest.mark.parametrize("max_duration, steps, epoch", [("1ba", 1, 0), ("5ba", 5, 1), ("12ba", 12, 3)])
def test_max_duration_batches(max_duration, steps, epoch):
    state = trainer(max_duration=max_duration).fit()
    assert (state.step, state.epoch) == (steps, epoch)


@pytest.mark.parametrize(
    "max_duration, steps, samples",
    [
        ("20sp", 3, 24),  # 8, 16, 24: the first batch where samples >= 20
        ("24sp", 3, 24),  # exactly reached
        ("25sp", 4, 32),
        ("1sp", 1, 8),
    ],
)
def test_max_duration_samples(max_duration, steps, samples):
    cb = BatchSizes()
    state = trainer(max_duration=max_duration, callbacks=[cb]).fit()
    assert (state.step, int(state.timestamp.sample)) == (steps, samples)
    assert cb.samples == [8 * (i + 1) for i in range(steps)]


def test_max_duration_samples_with_a_short_last_batch():
    loader = DataLoader(pairs(20), batch_size=8)  # 8, 8, 4 per epoch
    cb = BatchSizes()
    state = trainer(loader, max_duration="36sp", callbacks=[cb]).fit()
    assert cb.samples == [8, 16, 20, 28, 36]
    assert (state.step, state.epoch) == (5, 1)


def token_spec(token_counts=(5, 9, 2, 7)):
    batches = []
    g = torch.Generator().manual_seed(0)
    for tokens in token_counts:
        mask = torch.zeros(4, 4, dtype=torch.long)
        mask.view(-1)[:tokens] = 1
        batches.append({"x": torch.randn(4, 4, generator=g), "y": torch.randint(0, 2, (4,), generator=g), "mask": mask})
    return DataSpec(batches, get_num_tokens_in_batch=lambda b: b["mask"].sum())


@pytest.mark.parametrize(
    "max_duration, steps, tokens",
    [("5tok", 1, 5), ("6tok", 2, 14), ("16tok", 3, 16), ("17tok", 4, 23), ("30tok", 6, 37), ("46tok", 8, 46)],
)
def test_max_duration_tokens(max_duration, steps, tokens):
    state = trainer(token_spec(), max_duration=max_duration).fit()
    assert (state.step, int(state.timestamp.token)) == (steps, tokens)
    assert int(state.timestamp.sample) == 4 * steps


def test_tokens_are_counted_only_with_a_counter():
    state = trainer(max_duration="2ba").fit()
    assert int(state.timestamp.token) == 0


def test_dict_batches_and_custom_sample_counter():
    batches = [{"x": torch.randn(6, 4), "y": torch.randint(0, 2, (6,))} for _ in range(3)]
    state = trainer(DataSpec(batches, get_num_samples_in_batch=lambda b: 100), max_duration="250sp").fit()
    assert (state.step, int(state.timestamp.sample)) == (3, 300)


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------
def test_max_duration_in_dur_is_rejected():
    with pytest.raises(ValueError, match="'ep', 'ba', 'sp' or 'tok'"):
        trainer(max_duration="0.5dur")


def test_max_duration_in_tokens_needs_a_counter():
    with pytest.raises(ValueError, match="get_num_tokens_in_batch"):
        trainer(max_duration="100tok")


@pytest.mark.parametrize("bad", ["abc", "10", "5 epochs", "10xx", "", "ep"])
def test_bad_time_string(bad):
    with pytest.raises(ValueError, match="time string"):
        trainer(max_duration=bad)


@pytest.mark.parametrize("bad", ["0ep", "0ba", 0, "-2ba"])
def test_non_positive_max_duration(bad):
    with pytest.raises(ValueError, match="positive"):
        trainer(max_duration=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2"])
def test_grad_accum_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="grad_accum"):
        trainer(grad_accum=bad)


def test_grad_accum_larger_than_batch_names_both():
    t = trainer(DataLoader(pairs(32), batch_size=8), grad_accum=16)
    with pytest.raises(ValueError) as info:
        t.fit()
    msg = str(info.value)
    assert "grad_accum=16" in msg and "8 samples" in msg


def test_model_without_loss_names_the_fix():
    net = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match="ClassifierModel") as info:
        Trainer(model=net, train_dataloader=[], max_duration="1ep", optimizers=torch.optim.SGD(net.parameters(), lr=1))
    assert "loss(outputs, batch)" in str(info.value)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Trainer(model=lambda b: b, train_dataloader=[], max_duration="1ep", optimizers=object())


def test_optimizers_required():
    m = model()
    with pytest.raises(ValueError, match="optimizers"):
        Trainer(model=m, train_dataloader=[], max_duration="1ep")


@pytest.mark.parametrize("bad", [object(), "LabelSmoothing", Callback()])
def test_non_algorithm_in_algorithms(bad):
    with pytest.raises(TypeError, match="not an Algorithm"):
        trainer(algorithms=[bad])


def test_unknown_precision():
    with pytest.raises(ValueError, match="amp_bf16"):
        trainer(precision="fp8")


@pytest.mark.parametrize("interval", ["0dur", "1.5dur", "0ba", "0ep", "-64sp"])
def test_eval_interval_that_cannot_fire(interval):
    with pytest.raises(ValueError, match="eval_interval"):
        trainer(eval_dataloader=DataLoader(pairs(8), batch_size=8), eval_interval=interval)


def test_eval_interval_in_tokens_needs_a_counter():
    with pytest.raises(ValueError, match="get_num_tokens_in_batch"):
        trainer(eval_dataloader=DataLoader(pairs(8), batch_size=8), eval_interval="100tok")


def test_eval_interval_in_tokens_with_a_counter():
    evals = []

    class Count(Callback):
        def eval_end(self, state, logger):
            evals.append(int(state.timestamp.token))

    # cumulative tokens 5, 14, 16, 23, 28, 37, 39, 46: multiples of 10 crossed at 14, 23, 37, 46(end)
    trainer(
        token_spec(),
        max_duration="2ep",
        eval_dataloader=DataLoader(pairs(8), batch_size=8),
        eval_interval="10tok",
        callbacks=[Count()],
    ).fit()
    assert evals == [14, 23, 37, 46]


def test_eval_interval_callable():
    evals = []

    class Count(Callback):
        def eval_end(self, state, logger):
            evals.append((state.step, state.epoch))

    trainer(
        max_duration="2ep",
        eval_dataloader=DataLoader(pairs(8), batch_size=8),
        callbacks=[Count()],
        eval_interval=lambda state, event: event == Event.BATCH_END and state.step == 3,
    ).fit()
    assert evals == [(3, 0)]


def test_empty_dataloader_is_an_error():
    with pytest.raises(RuntimeError, match="no batches"):
        trainer([], max_duration="1ep").fit()


def test_algorithm_added_at_init_runs():
    ran = []

    class Late(Algorithm):
        def match(self, event, state):
            return event == Event.FIT_START

        def apply(self, event, state, logger):
            ran.append(event)

    class AddAtInit(Algorithm):
        def match(self, event, state):
            return event == Event.INIT

        def apply(self, event, state, logger):
            state.algorithms.append(Late())

    trainer(algorithms=[AddAtInit()], max_duration="1ba").fit()
    assert ran == [Event.FIT_START]


def test_dict_batches_are_counted_by_their_first_tensor_column():
    from raytrain_events.core.data_spec import default_num_samples

    assert default_num_samples({"id": ["a", "b", "c"], "x": torch.zeros(3, 2), "y": torch.zeros(5)}) == 3
    assert default_num_samples([torch.zeros(4, 2), torch.zeros(4)]) == 4
    with pytest.raises(TypeError, match="Cannot count samples.*get_num_samples_in_batch"):
        default_num_samples({"id": ["a"]})


def test_classifier_reads_dict_batches_by_its_keys_and_names_missing_columns():
    model = ClassifierModel(torch.nn.Linear(2, 3), num_classes=3, input_key="features", target_key="label")
    batch = {"features": torch.randn(4, 2), "label": torch.tensor([0, 1, 2, 0])}
    torch.testing.assert_close(model(batch), model.module(batch["features"]))
    assert model.loss(model(batch), batch).ndim == 0
    with pytest.raises(KeyError, match="has columns \\['features', 'y'\\].*'label'.*target_key="):
        model.loss(model(batch), {"features": batch["features"], "y": batch["label"]})
    with pytest.raises(KeyError, match="needs 'features'"):
        model({"x": batch["features"]})
