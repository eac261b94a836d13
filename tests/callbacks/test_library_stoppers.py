"""EarlyStopper and ThresholdStopper: stop exactly when the rule says, from synchronized eval metrics."""

from __future__ import annotations

import pytest
import torch
from library_helpers import classifier, loader, trainer
from torchmetrics import Metric

from raytrain_events.callbacks import EarlyStopper, ThresholdStopper
from raytrain_events.models import ClassifierModel


class Scripted(Metric):
    """Returns the next value of a shared script at each compute (deep copies share the script)."""

    def __init__(self, next_value) -> None:
        super().__init__()
        self.next_value = next_value  # a function: deepcopy keeps the same object
        self.add_state("n", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, *args) -> None:
        self.n += 1

    def compute(self):
        return torch.tensor(self.next_value())


class ScriptedModel(ClassifierModel):
    def __init__(self, values):
        super().__init__(torch.nn.Linear(4, 3), num_classes=3)
        it = iter(values)
        self._next = lambda: next(it)

    def get_metrics(self, is_train=False):
        return {"score": Scripted(self._next)}


def _fit(values, callback, **kwargs):
    kwargs.setdefault("max_duration", "20ep")
    t = trainer(
        ScriptedModel(values),
        train_dataloader=loader(n=8, batch_size=4),
        eval_dataloader=loader(n=4, batch_size=4),
        callbacks=[callback],
        **kwargs,
    )
    t.fit()
    return t.state


def test_early_stopper_stops_once_patience_is_exceeded():
    # best 0.6 at epoch 2; no improvement after; stop when more than 2 epochs have passed (epoch 5)
    stopper = EarlyStopper("metrics/eval/score", "max", patience="2ep")
    state = _fit([0.5, 0.6, 0.6, 0.55, 0.6, 0.9, 0.9], stopper)
    assert state.epoch == 5 and state.stop_requested and "EarlyStopper" in state.stop_reason
    assert stopper.state_dict() == {"best": pytest.approx(0.6), "best_at": 2}


def test_early_stopper_min_delta_min_comparator_and_batch_patience():
    # improvements smaller than min_delta do not reset patience
    stopper = EarlyStopper("metrics/eval/score", "min", patience="2ep", min_delta=0.05)
    assert _fit([1.0, 0.99, 0.98, 0.97, 0.5], stopper).epoch == 4
    # patience in batches, eval every 2 batches: best at batch 2; stop at batch 8 (8 - 2 > 4)
    stopper = EarlyStopper("metrics/eval/score", min, patience="4ba")
    state = _fit([1.0, 1.0, 1.0, 1.0, 1.0], stopper, eval_interval="2ba")
    assert state.step == 8


def test_early_stopper_resumes_from_state_dict():
    stopper = EarlyStopper("metrics/eval/score", "max", patience="1ep")
    stopper.load_state_dict({"best": 0.9, "best_at": 0})
    assert _fit([0.5, 0.5, 0.5], stopper).epoch == 2


def test_threshold_stopper():
    assert _fit([0.1, 0.5, 0.95, 0.99], ThresholdStopper("metrics/eval/score", 0.9)).epoch == 3
    assert _fit([2.0, 1.0, 0.25], ThresholdStopper("metrics/eval/score", 0.3, comparator="min")).epoch == 3


def test_monitor_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"eval datasets are \['eval'\]"):
        _fit([0.1], EarlyStopper("metrics/val/score"))
    with pytest.raises(KeyError, match="metrics/eval/score"):
        _fit([0.1], EarlyStopper("metrics/eval/accuracy"))
    with pytest.raises(ValueError, match="no eval_dataloader"):
        trainer(classifier(), callbacks=[ThresholdStopper("metrics/eval/accuracy", 0.5)]).fit()
    with pytest.raises(ValueError, match="comparator"):
        EarlyStopper(comparator="bigger")
