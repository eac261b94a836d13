"""SAM: the loop's ``optimizer.step(closure)`` gives exactly a hand-written two-step SAM update,
with grad accumulation and on two DDP ranks."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from raytrain_events import Callback
from raytrain_events.algorithms import SAM, SAMOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
from gloo_ranks import run_ranks  # noqa: E402
from oom_ranks import BATCH, OOMModel, dataset, make_trainer, train_sam, weights  # noqa: E402

RHO = 0.5


def reference_sam(model, batches_per_step, epochs, rho=RHO, eps=1e-12):
    """Two forward/backward passes per step, written out: g at w, e = rho g/||g||, g' at w + e, step with g'."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())

    def loss_of(batches):  # the mean loss over the step's batches (all ranks' data under DDP)
        return sum(model.loss(model(b), b) for b in batches) / len(batches)

    for _ in range(epochs):
        for batches in batches_per_step:
            opt.zero_grad()
            loss_of(batches).backward()
            with torch.no_grad():
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
                e = [p.grad * (rho / (norm + eps)) for p in params]
                for p, d in zip(params, e):
                    p.add_(d)
            opt.zero_grad()
            loss_of(batches).backward()
            with torch.no_grad():
                for p, d in zip(params, e):
                    p.sub_(d)
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class FirstLoss(Callback):
    def __init__(self):
        self.loss = None

    def batch_end(self, state, logger):
        if self.loss is None:
            self.loss = state.loss.detach().clone()


def train(algorithms, grad_accum=1, callbacks=()):
    model = OOMModel()
    trainer = make_trainer(model, algorithms=algorithms, grad_accum=grad_accum, callbacks=list(callbacks))
    trainer.fit()
    return trainer, weights(model)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_sam_equals_the_two_step_reference(grad_accum):
    first = FirstLoss()
    trainer, got = train([SAM(rho=RHO)], grad_accum, [first])
    assert isinstance(trainer.state.optimizers[0], SAMOptimizer)
    want = reference_sam(OOMModel(), [[b] for b in DataLoader(dataset(), batch_size=BATCH)], epochs=2)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    _, plain = train([])
    assert not torch.allclose(plain["head.weight"], got["head.weight"], atol=1e-4)  # SAM changed the updates
    # The batch's loss is the one at the trained weights (the closure's, at w + e, is not kept).
    batch = next(iter(DataLoader(dataset(), batch_size=BATCH)))
    model = OOMModel()
    torch.testing.assert_close(first.loss, model.loss(model(batch), batch).detach())
    assert trainer.state.optimizers[0].state_dict()["state"]  # checkpoints hold the base SGD's momentum


def test_sam_on_two_ddp_ranks_equals_the_reference_on_both_ranks_data():
    ranks = run_ranks(train_sam, 2, rho=RHO)
    loaders = [list(DataLoader(dataset(seed=r), batch_size=BATCH)) for r in range(2)]
    want = reference_sam(OOMModel(), list(zip(*loaders)), epochs=2)
    for name, value in want.items():
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranks[1]["weights"][name], ranks[0]["weights"][name], rtol=0, atol=0)


def test_interval_and_bad_arguments():
    _, every_other = train([SAM(rho=RHO, interval=2)])
    _, every = train([SAM(rho=RHO)])
    assert not torch.allclose(every_other["head.weight"], every["head.weight"])
    with pytest.raises(ValueError, match="rho"):
        SAM(rho=0)
    with pytest.raises(ValueError, match="interval"):
        SAM(interval=0)
    with pytest.raises(ValueError, match="closure"):
        SAMOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)).step()


def test_a_resumed_run_does_its_sam_steps_on_the_same_batches():
    """SAM's step count is checkpointed: with interval=2 a run resumed after an odd step goes on in phase."""
    from types import SimpleNamespace

    def wrapped(algorithm):
        model = torch.nn.Linear(2, 1)
        state = SimpleNamespace(optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
        algorithm.apply(None, state, None)
        return model, state.optimizers[0]

    def closure():  # SAM's step runs under no_grad; the loop's closure turns grad back on the same way
        with torch.enable_grad():
            model(torch.ones(1, 2)).sum().backward()

    first = SAM(rho=0.05, interval=2)
    model, optimizer = wrapped(first)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step(closure)
    assert first.state_dict() == {"steps": [3]}

    resumed = SAM(rho=0.05, interval=2)
    _, resumed_optimizer = wrapped(resumed)  # INIT wraps before the checkpoint loads
    resumed.load_state_dict(first.state_dict())
    assert resumed_optimizer._steps == 3  # the next step (the 4th) is a SAM step, as without the restart
    resumed.load_state_dict({})  # a checkpoint saved before SAM's count was saved: the count stays
    assert resumed_optimizer._steps == 3
