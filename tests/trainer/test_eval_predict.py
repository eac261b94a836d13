"""`Trainer.eval()`, `Trainer.predict()` (the PREDICT_* events) and evaluators with their own interval and subset."""

from __future__ import annotations

import pytest
import torch
from oom_ranks import Recorder
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, Event, Trainer
from raytrain_events.checkpoint.config import CheckpointConfig
from raytrain_events.models import ClassifierModel
from raytrain_events.trainer.evaluation import Evaluator

N, D = 64, 5


def data(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def model(seed=0):
    torch.manual_seed(seed)
    return ClassifierModel(
        torch.nn.Sequential(torch.nn.Linear(D, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)), num_classes=2
    )


class Events(Callback):
    def __init__(self):
        self.events = []

    def run_event(self, event, state, logger):
        self.events.append((event, state.model.training))


def make(m=None, *, eval_dataloader=None, callbacks=(), loggers=(), checkpoint=None, **kw):
    m = m if m is not None else model()
    return Trainer(
        model=m,
        train_dataloader=DataLoader(data(), batch_size=8),
        max_duration=kw.pop("max_duration", "2ep"),
        optimizers=torch.optim.SGD(m.parameters(), lr=0.5),
        eval_dataloader=eval_dataloader,
        callbacks=list(callbacks),
        loggers=list(loggers),
        checkpoint=checkpoint,
        **kw,
    )


def test_predict_fires_the_predict_events_and_returns_the_outputs():
    events = Events()
    trainer = make(callbacks=[events])
    trainer.fit()
    events.events.clear()
    loader = DataLoader(data(seed=1, n=20), batch_size=8)
    outputs = trainer.predict(loader)
    net = trainer.state.model
    expected = [net(batch) for batch in loader]
    assert len(outputs) == 3
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want.detach())
        assert not got.requires_grad and got.device.type == "cpu"
    names = [e for e, _ in events.events]
    per_batch = [
        Event.PREDICT_BATCH_START,
        Event.PREDICT_BEFORE_FORWARD,
        Event.PREDICT_AFTER_FORWARD,
        Event.PREDICT_BATCH_END,
    ]
    assert names == [Event.PREDICT_START, *per_batch * 3, Event.PREDICT_END]
    assert all(e.is_predict for e in names)
    assert not any(training for _, training in events.events)  # eval mode throughout
    assert net.training  # and back to train mode afterwards
    assert len(trainer.predict(loader, subset_num_batches=2)) == 2
    assert trainer.predict(loader, return_outputs=False) == []
    with pytest.raises(ValueError, match="subset_num_batches"):
        trainer.predict(loader, subset_num_batches=0)


def test_predict_and_eval_on_a_loaded_model(tmp_path):
    folder = str(tmp_path / "run" / "checkpoints")
    trained = make(checkpoint=CheckpointConfig(save_folder=folder, save_every_n_seconds=None, save_final=True))
    trained.fit()
    loader = DataLoader(data(seed=2, n=24), batch_size=8)
    want = torch.cat(trained.predict(loader))
    loaded = make(
        model(seed=5),  # other initial weights: only the checkpoint makes the outputs match
        checkpoint=CheckpointConfig(save_folder=str(tmp_path / "other" / "checkpoints"), load_from=folder),
    )
    fresh = torch.cat(make(model(seed=5)).predict(loader))
    got = torch.cat(loaded.predict(loader))
    assert torch.equal(got, want) and not torch.allclose(fresh, want)
    metrics = loaded.eval(loader)
    expected = (want.argmax(1) == torch.cat([y for _, y in loader])).float().mean()
    assert float(metrics["metrics/eval/accuracy"]) == pytest.approx(float(expected))


def test_a_trainer_without_train_data_evaluates_and_predicts_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default save_folder would be ./runs/<run_name>/checkpoints
    folder = str(tmp_path / "run" / "checkpoints")
    val = DataLoader(data(seed=2, n=24), batch_size=8)
    trained = make(
        eval_dataloader={"val": val},
        checkpoint=CheckpointConfig(save_folder=folder, save_every_n_seconds=None, save_final=True),
    )
    trained.fit()
    want_outputs, want_metrics = torch.cat(trained.predict(val)), trained.eval()
    assert float(want_metrics["metrics/val/accuracy"]) > 0.5  # trained: the comparison below is not vacuous

    events = Events()
    loaded = Trainer(  # only the model, its eval data and the checkpoint: no train data, duration, optimizer
        model=model(seed=5),
        eval_dataloader={"val": val},
        callbacks=[events],
        checkpoint=CheckpointConfig(load_from=folder),
    )
    # The full state loaded (optimizers aside), not just the weights.
    assert loaded.state.timestamp.state_dict() == trained.state.timestamp.state_dict()
    assert torch.equal(torch.cat(loaded.predict(val)), want_outputs)
    got_metrics = loaded.eval()
    assert got_metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert torch.equal(got_metrics[name], value), name
    assert Event.PREDICT_END in [e for e, _ in events.events] and Event.EVAL_END in [e for e, _ in events.events]
    assert not (tmp_path / "runs").exists()  # it neither saves nor locks a run directory
    with pytest.raises(RuntimeError, match="fit\\(\\) needs train_dataloader, max_duration, optimizers.*AdamW"):
        loaded.fit()


def test_a_trainer_without_train_data_needs_a_checkpoint_to_load(tmp_path):
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        Trainer(model=model(), checkpoint=CheckpointConfig(load_from=str(tmp_path / "nothing")))
    with pytest.raises(ValueError, match="only loads checkpoints: pass CheckpointConfig\\(load_from"):
        Trainer(model=model(), checkpoint=CheckpointConfig(save_folder=str(tmp_path / "c")))
    empty = CheckpointConfig(save_folder=str(tmp_path / "empty" / "checkpoints"), autoresume=True)
    with pytest.raises(FileNotFoundError, match="No committed checkpoint in save_folder"):
        Trainer(model=model(), checkpoint=empty)
    with pytest.raises(ValueError, match="without max_duration"):
        Trainer(model=model(), train_dataloader=DataLoader(data(), batch_size=8))


def test_eval_after_fit_uses_the_evaluators_and_subset():
    val = DataLoader(data(seed=3, n=32), batch_size=8)
    trainer = make(eval_dataloader={"val": val})
    trainer.fit()
    net = trainer.state.model
    full = trainer.eval()["metrics/val/accuracy"]
    first = trainer.eval(subset_num_batches=1)["metrics/val/accuracy"]
    batches = list(val)
    accuracy = [float((net(b).argmax(1) == b[1]).float().mean()) for b in batches]
    assert float(full) == pytest.approx(sum(accuracy) / len(accuracy))
    assert float(first) == pytest.approx(accuracy[0])
    with pytest.raises(ValueError, match="Nothing to evaluate"):
        make().eval()


class EvalBatches(Callback):
    """Per evaluation: the step and how many eval batches ran."""

    def __init__(self):
        self.runs = []

    def eval_start(self, state, logger):
        self.runs.append([state.step, 0])

    def eval_batch_start(self, state, logger):
        self.runs[-1][1] += 1


def test_evaluators_with_their_own_interval_and_subset():
    recorder, counter = Recorder(), EvalBatches()
    val = data(seed=4, n=40)  # 5 batches of 8
    quick = Evaluator(
        label="quick", dataloader=DataLoader(val, batch_size=8), eval_interval="3ba", subset_num_batches=2
    )
    full = Evaluator(label="full", dataloader=DataLoader(val, batch_size=8))  # the Trainer's eval_interval: 1ep
    trainer = make(eval_dataloader=[quick, full], callbacks=[counter], loggers=[recorder])
    trainer.fit()  # 8 batches per epoch, 16 in all
    # quick: every 3 batches on 2 batches (an epoch end is not a batch interval's event); full: each epoch.
    quick = [[3, 2], [6, 2], [9, 2], [12, 2], [15, 2]]
    assert counter.runs == quick[:2] + [[8, 5]] + quick[2:] + [[16, 5]]
    logged = [sorted(m) for m in recorder.metrics if any(k.startswith("metrics/") for k in m)]
    quick_keys, full_keys = (
        ["metrics/quick/accuracy", "metrics/quick/cross_entropy"],
        ["metrics/full/accuracy", "metrics/full/cross_entropy"],
    )
    assert logged.count(quick_keys) == 5 and logged.count(full_keys) == 2


@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_bad_subset_num_batches(bad):
    with pytest.raises(ValueError, match="subset_num_batches"):
        Evaluator(label="x", dataloader=[], subset_num_batches=bad)


def test_label_with_a_slash_is_refused():
    with pytest.raises(ValueError, match="without '/'"):
        Evaluator(label="a/b", dataloader=[])
