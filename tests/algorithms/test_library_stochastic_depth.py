"""StochasticDepth: marked residual branches are dropped per sample with the configured rates."""

from __future__ import annotations

import pytest
import torch
from library_helpers import RecordAlgorithm, trainer

from raytrain_events import Event
from raytrain_events.algorithms import StochasticDepth, mark_residual_branch
from raytrain_events.models import ClassifierModel


class Block(torch.nn.Module):
    def __init__(self, dim: int, mark: bool = True) -> None:
        super().__init__()
        self.branch = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.Tanh())
        if mark:
            mark_residual_branch(self.branch)

    def forward(self, x):
        return x + self.branch(x)


def _net(dim=4, blocks=4, mark=True):
    return torch.nn.Sequential(*[Block(dim, mark) for _ in range(blocks)], torch.nn.Linear(dim, 3))


def test_rates_hooks_and_eval_identity():
    net = _net()
    reference = _net()
    reference.load_state_dict(net.state_dict())
    algo = StochasticDepth(drop_rate=0.4, drop_distribution="linear")
    trainer(ClassifierModel(net, num_classes=3), lr=0.0, algorithms=[algo], max_duration="1ba").fit()
    assert algo.rates == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert algo.branch_names == [f"module.{i}.branch" for i in range(4)]
    x = torch.randn(16, 4)
    net.eval(), reference.eval()
    torch.testing.assert_close(net(x), reference(x))  # evaluation uses every branch, unscaled
    assert list(net.state_dict()) == list(reference.state_dict())  # names unchanged


def test_each_sample_gets_zero_or_rescaled_branch():
    torch.manual_seed(0)
    block = Block(4)
    algo = StochasticDepth(drop_rate=0.5, drop_distribution="uniform", mode="sample")
    algo._install(block)
    block.train()
    x = torch.randn(4000, 4)
    with torch.no_grad():
        full = block.branch[1](block.branch[0](x))  # the branch without the hook
        delta = block(x) - x
    dropped = delta.abs().sum(1) == 0
    kept = ~dropped
    torch.testing.assert_close(delta[kept], full[kept] / 0.5)
    assert abs(dropped.float().mean().item() - 0.5) < 0.03
    # batch mode: the whole batch shares one draw
    algo_batch = StochasticDepth(drop_rate=0.5, drop_distribution="uniform", mode="batch")
    block_b = Block(4)
    algo_batch._install(block_b)
    with torch.no_grad():
        outs = {bool((block_b(x) - x).abs().sum() == 0) for _ in range(20)}
    assert outs == {True, False}


def test_target_modules_by_pattern_and_class_and_error_when_none():
    algo = StochasticDepth(target_modules="*.branch")
    algo._install(_net(mark=False))
    assert len(algo.branch_names) == 4
    algo = StochasticDepth(target_modules=[torch.nn.Tanh])
    algo._install(_net(mark=False))
    assert len(algo.branch_names) == 4
    with pytest.raises(ValueError, match="mark_residual_branch"):
        StochasticDepth()._install(_net(mark=False))


def test_drop_warmup_ramps_rates():
    algo = StochasticDepth(drop_rate=0.4, drop_distribution="uniform", drop_warmup="0.5dur")
    spy = RecordAlgorithm({Event.BEFORE_TRAIN_BATCH: lambda s: algo.current_rates[0]})
    trainer(ClassifierModel(_net(), num_classes=3), algorithms=[algo, spy], max_duration="4ba").fit()
    assert spy.values[Event.BEFORE_TRAIN_BATCH] == pytest.approx([0.0, 0.2, 0.4, 0.4])
