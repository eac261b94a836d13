"""Float8Training: the torchao conversion (emulated numerics on CPU) and the refusals."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Trainer
from raytrain_events.algorithms import Float8Training, build_algorithm
from raytrain_events.models import ClassifierModel
from raytrain_events.parallel.float8 import Float8Unsupported

pytest.importorskip("torchao.float8")


def _model() -> ClassifierModel:
    torch.manual_seed(0)
    body = torch.nn.Sequential()
    body.add_module("up", torch.nn.Linear(32, 64))
    body.add_module("act", torch.nn.ReLU())
    body.add_module("down", torch.nn.Linear(64, 32))
    body.add_module("odd", torch.nn.Linear(32, 24))  # 24 is not a multiple of 16: kept
    body.add_module("head", torch.nn.Linear(24, 5))  # skipped by name
    return ClassifierModel(body, num_classes=5)


def _trainer(model, algorithm, **kwargs):
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 32, generator=g), torch.randint(0, 5, (32,), generator=g))
    return Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=8),
        max_duration="4ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[algorithm],
        device="cpu",
        **kwargs,
    )


def test_refused_on_cpu_with_the_reason():
    with pytest.raises(Float8Unsupported, match=r"NVIDIA GPU with float8 tensor cores.*device is 'cpu'"):
        _trainer(_model(), Float8Training())


def test_refused_without_torchao(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(Float8Unsupported, match=r"pip install 'raytrain_events\[float8\]'"):
        _trainer(_model(), Float8Training(emulate=True))


def test_refused_when_no_linear_is_eligible():
    model = ClassifierModel(torch.nn.Linear(10, 5), num_classes=5)
    with pytest.raises(Float8Unsupported, match="no nn.Linear with both dimensions divisible by 16"):
        _trainer(model, Float8Training(emulate=True))


def test_conversion_swaps_eligible_linears_and_trains_close_to_fp32():
    from torchao.float8.float8_linear import Float8Linear

    reference = _model()
    algorithm = build_algorithm({"name": "float8", "emulate": True})
    trainer = _trainer(_model(), algorithm)
    body = trainer.state.model.module
    assert algorithm.converted == 2
    assert [type(body.up), type(body.down)] == [Float8Linear, Float8Linear]
    assert type(body.odd) is torch.nn.Linear and type(body.head) is torch.nn.Linear
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = reference.module(x), body(x)
    assert not torch.equal(got, want)  # float8 rounding happened
    assert (got - want).norm() / want.norm() < 0.1  # but float8 e4m3 keeps ~2 significant digits
    before = {k: v.clone() for k, v in trainer.state.model.state_dict().items()}
    trainer.fit()
    after = trainer.state.model.state_dict()
    assert torch.isfinite(trainer.state.loss).all()
    assert not torch.equal(before["module.up.weight"], after["module.up.weight"])
    assert after["module.up.weight"].dtype == torch.float32  # weights stay in their own dtype
