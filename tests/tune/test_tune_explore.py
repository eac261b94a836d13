"""A PBT copy keeps its own explored optimizer settings after loading the donor's optimizer state (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raytrain_events.tune.explore import KeepExploredOptimizerSettings


def _state(lr: float, momentum: float, schedule: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)] if schedule else []
    return SimpleNamespace(model=model, optimizers=[opt], schedulers=schedulers)


def _train_steps(state, steps: int) -> None:
    for _ in range(steps):
        state.optimizers[0].zero_grad()
        state.model(torch.ones(2, 3)).sum().backward()
        state.optimizers[0].step()
        for s in state.schedulers:
            s.step()


@pytest.mark.parametrize("schedule", [False, True])
def test_the_copy_trains_with_its_own_lr_and_momentum_but_the_donors_moments(schedule):
    donor = _state(lr=0.4, momentum=0.9, schedule=schedule)
    _train_steps(donor, 2)
    saved = {
        "optimizers": [o.state_dict() for o in donor.optimizers],
        "schedulers": [s.state_dict() for s in donor.schedulers],
    }

    copy = _state(lr=0.1, momentum=0.5, schedule=schedule)  # the trial's explored config
    keep = KeepExploredOptimizerSettings()
    keep.init(copy, None)  # before the checkpoint loads
    copy.optimizers[0].load_state_dict(saved["optimizers"][0])
    for s, sd in zip(copy.schedulers, saved["schedulers"]):
        s.load_state_dict(sd)
    assert copy.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.4 * (0.25 if schedule else 1))  # torch's load
    keep.fit_start(copy, None)

    group = copy.optimizers[0].param_groups[0]
    assert group["momentum"] == 0.5
    # Without a schedule: the explored lr. With one: the explored base lr at the donor's schedule position.
    assert group["lr"] == pytest.approx(0.1 * (0.25 if schedule else 1))
    donor_buffer = donor.optimizers[0].state[donor.optimizers[0].param_groups[0]["params"][0]]["momentum_buffer"]
    copy_buffer = copy.optimizers[0].state[group["params"][0]]["momentum_buffer"]
    assert torch.equal(copy_buffer, donor_buffer)  # the donor's moments stay
    if schedule:
        assert copy.schedulers[0].base_lrs == [0.1]
        _train_steps(copy, 1)  # the schedule goes on from its position with the trial's base lr
        assert group["lr"] == pytest.approx(0.1 * 0.125)
