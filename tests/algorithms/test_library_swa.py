"""SWA: the final weights are the mean of the snapshots taken from swa_start on."""

from __future__ import annotations

import pytest
import torch
from library_helpers import Record, classifier, loader, trainer

from raytrain_events import Event
from raytrain_events.algorithms import SWA


def _params(state):
    return [p.detach().clone() for p in state.model.parameters()]


def test_final_weights_are_the_mean_of_epoch_snapshots():
    algo = SWA(swa_start="0.5dur", update_interval="1ep")
    rec = Record({Event.EPOCH_END: _params})  # callbacks run after SWA's EPOCH_END update
    model = classifier(hidden=4)
    trainer(model, max_duration="4ep", algorithms=[algo], callbacks=[rec]).fit()
    snapshots = rec.values[Event.EPOCH_END][1:]  # epochs 2, 3, 4 (elapsed >= 0.5)
    assert algo.num_averaged == 3
    for i, param in enumerate(model.parameters()):
        torch.testing.assert_close(param.detach(), torch.stack([s[i] for s in snapshots]).mean(0))
    assert not torch.equal(snapshots[-1][0], list(model.parameters())[0].detach())


def test_batch_interval_window_and_lr_annealing():
    algo = SWA(swa_start="4ba", swa_end="8ba", update_interval="2ba", swa_lr=0.01, anneal_steps=2)
    rec = Record({Event.BATCH_END: lambda s: (s.step, _params(s))})
    lrs = Record({Event.BATCH_START: lambda s: s.optimizers[0].param_groups[0]["lr"]})
    model = classifier()
    trainer(model, lr=0.1, max_duration="3ep", algorithms=[algo], callbacks=[rec, lrs]).fit()  # 12 batches
    snapshots = [p for step, p in rec.values[Event.BATCH_END] if step in (4, 6)]  # 8ba ends the window
    assert algo.num_averaged == 2
    for i, param in enumerate(model.parameters()):
        torch.testing.assert_close(param.detach(), torch.stack([s[i] for s in snapshots]).mean(0))
    # averaging started after batch 4: LR 0.1 until then, halfway after one batch, swa_lr after two.
    assert lrs.values[Event.BATCH_START][:5] == [pytest.approx(0.1)] * 5
    assert lrs.values[Event.BATCH_START][5] == pytest.approx(0.055)
    assert lrs.values[Event.BATCH_START][6:] == [pytest.approx(0.01)] * 6


def test_state_dict_resumes_the_average():
    algo = SWA(swa_start="0dur", update_interval="1ba")
    trainer(classifier(), max_duration="2ba", algorithms=[algo]).fit()
    saved = algo.state_dict()
    fresh = SWA(swa_start="0dur", update_interval="1ba")
    fresh.load_state_dict(saved)
    trainer(classifier(), max_duration="1ba", algorithms=[fresh]).fit()
    assert fresh.num_averaged == 3


def test_bad_interval():
    with pytest.raises(ValueError, match="update_interval"):
        SWA(update_interval="100sp")


def test_update_bn_recomputes_batchnorm_on_the_batches_the_model_sees():
    """``update_bn=True``: after the swap, BatchNorm's statistics are those of the train data as the loop hands
    it to the model, after the DataSpec's ``device_transforms`` (here ``x * 10 + 3``), not the raw batches."""
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.models import ClassifierModel

    data = loader(n=32, batch_size=8)
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(4, affine=False), torch.nn.Linear(4, 3))
    spec = DataSpec(data, device_transforms=lambda batch: (batch[0] * 10 + 3, batch[1]))
    algo = SWA(swa_start="0.5dur", update_interval="1ep", update_bn=True)
    trainer(ClassifierModel(net, num_classes=3), train_dataloader=spec, max_duration="2ep", algorithms=[algo]).fit()
    seen = torch.cat([batch[0] for batch in data]) * 10 + 3
    assert algo.num_averaged >= 1
    torch.testing.assert_close(net[0].running_mean, seen.mean(0))  # equal batches: the mean of their means
