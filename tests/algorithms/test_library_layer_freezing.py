"""LayerFreezing: frozen layers receive no update (not even momentum or weight decay)."""

from __future__ import annotations

import pytest
import torch
from library_helpers import Record, classifier, trainer

from raytrain_events import Event
from raytrain_events.algorithms import LayerFreezing
from raytrain_events.algorithms.layer_freezing import freeze_schedule


def _snapshot(state):
    layers = [m for m in state.model.modules() if isinstance(m, torch.nn.Linear)]
    return [layer.weight.detach().clone() for layer in layers], [layer.weight.requires_grad for layer in layers]


def test_earliest_layers_freeze_progressively_and_stop_changing():
    model = classifier(hidden=8)  # three Linear layers
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    algo = LayerFreezing(freeze_start=0.0, freeze_level=1.0)
    assert algo.find_unused_parameters
    rec = Record({Event.EPOCH_END: _snapshot})
    trainer(model, optimizer=opt, max_duration="3ep", algorithms=[algo], callbacks=[rec]).fit()
    (w1, g1), (w2, g2), (w3, g3) = rec.values[Event.EPOCH_END]
    assert g1 == [False, True, True] and g2 == [False, False, True] and g3 == [False, False, False]
    assert torch.equal(w1[0], w3[0])  # frozen after epoch 1: identical through epochs 2 and 3
    assert torch.equal(w2[1], w3[1])  # frozen after epoch 2
    assert not torch.equal(w1[1], w2[1])  # still trained in epoch 2
    assert not torch.equal(w2[2], w3[2])  # last layer trained until the end
    assert algo.state_dict() == {"num_frozen": 3}


def test_resume_refreezes_saved_layers():
    algo = LayerFreezing(freeze_start=0.0)
    algo.load_state_dict({"num_frozen": 2})
    model = classifier(hidden=8)
    before = [m.weight.detach().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    trainer(model, max_duration="1ba", algorithms=[algo]).fit()
    after = [m.weight.detach().clone() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert not torch.equal(before[2], after[2])


def test_freeze_schedule():
    assert freeze_schedule(0.4, 0.5, 1.0) == 0.0
    assert freeze_schedule(0.75, 0.5, 1.0) == pytest.approx(0.5)
    assert freeze_schedule(1.0, 0.5, 0.6) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="freeze_start"):
        LayerFreezing(freeze_start=1.0)
