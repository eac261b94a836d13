"""EMA: shadow weights follow the closed form; eval sees them; training weights come back after eval."""

from __future__ import annotations

import pytest
import torch
from library_helpers import Record, trainer

from raytrain_events import Event
from raytrain_events.algorithms import EMA


class OneWeight(torch.nn.Module):
    """loss = mean(w * x) with x = 1, so dloss/dw = 1 and SGD gives w_k = w_0 - lr * k."""

    def __init__(self, w0: float = 2.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w0))

    def forward(self, batch):
        return self.w * batch[0]

    def loss(self, outputs, batch):
        return outputs.mean()


def _ones_loader(n_batches: int = 6):
    return [(torch.ones(2), torch.zeros(2)) for _ in range(n_batches)]


def _closed_form(w0, lr, smoothing, n_batches, every=1):
    ema, history = w0, []
    for k in range(1, n_batches + 1):
        if k % every == 0:
            ema = smoothing * ema + (1 - smoothing) * (w0 - lr * k)
        history.append(ema)
    return history


def test_ema_matches_closed_form_and_eval_uses_it():
    w0, lr = 2.0, 0.1
    algo = EMA(half_life="2ba")
    smoothing = 0.5 ** (1 / 2)
    assert algo.smoothing == pytest.approx(smoothing)
    rec = Record(
        {
            Event.BATCH_END: lambda s: (s.step, algo.ema_model_state()["w"].item(), s.model.w.item()),
            Event.EVAL_BEFORE_FORWARD: lambda s: (s.step, s.model.w.item()),
            Event.BATCH_CHECKPOINT: lambda s: (s.step, s.model.w.item()),
        }
    )
    model = OneWeight(w0)
    trainer(
        model,
        lr=lr,
        train_dataloader=_ones_loader(6),
        eval_dataloader=[(torch.ones(2), torch.zeros(2))],
        eval_interval="2ba",
        max_duration="6ba",
        algorithms=[algo],
        callbacks=[rec],
    ).fit()
    expected = _closed_form(w0, lr, smoothing, 6)
    for (step, ema, w), want in zip(rec.values[Event.BATCH_END], expected):
        assert ema == pytest.approx(want, abs=1e-6)
        assert w == pytest.approx(w0 - lr * step, abs=1e-6)
    # eval at steps 2, 4, 6 saw the EMA weights ...
    assert [s for s, _ in rec.values[Event.EVAL_BEFORE_FORWARD]] == [2, 4, 6]
    for step, w_eval in rec.values[Event.EVAL_BEFORE_FORWARD]:
        assert w_eval == pytest.approx(expected[step - 1], abs=1e-6)
        assert w_eval != pytest.approx(w0 - lr * step, abs=1e-3)
    # ... and training weights were back right after each eval.
    for step, w in rec.values[Event.BATCH_CHECKPOINT]:
        assert w == pytest.approx(w0 - lr * step, abs=1e-6)
    assert model.w.item() == pytest.approx(w0 - lr * 6, abs=1e-6)


def test_ema_update_interval_and_explicit_smoothing():
    w0, lr = 1.0, 0.2
    algo = EMA(smoothing=0.5, update_interval="2ba")
    trainer(OneWeight(w0), lr=lr, train_dataloader=_ones_loader(6), max_duration="6ba", algorithms=[algo]).fit()
    assert algo.ema_model_state()["w"].item() == pytest.approx(_closed_form(w0, lr, 0.5, 6, every=2)[-1], abs=1e-6)


def test_ema_state_dict_round_trip_holds_shadow_weights():
    algo = EMA(half_life="1ba")
    trainer(OneWeight(), train_dataloader=_ones_loader(3), max_duration="3ba", algorithms=[algo]).fit()
    saved = algo.state_dict()
    assert set(saved["shadow"]) == {"w"}
    fresh = EMA(half_life="1ba")
    fresh.load_state_dict(saved)
    assert fresh.ema_model_state()["w"].item() == pytest.approx(algo.ema_model_state()["w"].item())
    # a resumed run starts averaging from the saved shadow, not from the current weights
    model = OneWeight(w0=100.0)
    trainer(model, lr=0.0, train_dataloader=_ones_loader(1), max_duration="1ba", algorithms=[fresh]).fit()
    expected = 0.5 * saved["shadow"]["w"].item() + 0.5 * 100.0
    assert fresh.ema_model_state()["w"].item() == pytest.approx(expected, abs=1e-5)


def test_ema_argument_errors():
    with pytest.raises(ValueError, match="same unit"):
        EMA(half_life="10ba", update_interval="1ep")
    with pytest.raises(ValueError, match="not both"):
        EMA(half_life="10ba", smoothing=0.9)
    with pytest.raises(ValueError, match="smoothing"):
        EMA(smoothing=1.5)
