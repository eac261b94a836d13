"""The RNG copy `HostSnapshots` keeps (`SpikeGuard`'s rollback): the generators' own state objects, never
serialized, put back exactly (Python's and numpy's cached Gaussian included), and a copy: drawing after the
capture does not change what a later restore puts back. (Through the Trainer: a rollback under dropout
ends with the weights of a run that never saw the window, tests/trainer/test_spike_guard.py.) And what a snapshot
leaves out: its taker's own state, never computed."""

from __future__ import annotations

import random

import numpy as np
import torch

from raytrain_events.checkpoint.run.host_snapshot import HostSnapshots
from raytrain_events.checkpoint.run.rng import capture_rng_in_memory, restore_rng_in_memory
from raytrain_events.core.state import State


def _draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), random.gauss(0, 1), np.random.randn(3).tolist()


def test_the_in_memory_rng_capture_restores_every_generator_exactly():
    random.gauss(0, 1)  # a cached second Gaussian on each side: part of the state
    np.random.randn(1)
    captured = capture_rng_in_memory()
    first = _draws()
    _draws()
    restore_rng_in_memory(captured)
    assert _draws() == first
    restore_rng_in_memory(captured)  # the capture was not changed by the draws after it
    assert _draws() == first


def test_a_host_snapshot_restores_the_rngs_it_took():
    model = torch.nn.Linear(3, 2)
    snapshots = HostSnapshots(State(model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)]))
    snapshots.take({"batch": 1})
    first = _draws()
    snapshots.take({"batch": 2})
    assert snapshots.restore(lambda meta: meta["batch"] == 1) == {"batch": 1}
    assert _draws() == first


def test_a_host_snapshot_never_computes_an_excluded_callbacks_state():
    """The taker's own bookkeeping is left out of its snapshots, and not computed only to be dropped: `SpikeGuard`'s
    state holds its quarantine (a file of an earlier run's culprits may name 1e5 rows: ~30 ms to build per snapshot,
    every ``snapshot_interval`` batches). Another callback's state is taken, and restored."""
    from raytrain_events import Callback

    class Taker(Callback):
        def state_dict(self):
            raise AssertionError("an excluded callback's state_dict was computed")

    class Other(Callback):
        def __init__(self):
            self.count = 0

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    model, other = torch.nn.Linear(3, 2), Other()
    state = State(model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)], callbacks=[Taker(), other])
    snapshots = HostSnapshots(state, exclude_callbacks={"Taker"})
    other.count = 3
    snapshots.take({"batch": 1})
    other.count = 9
    snapshots.restore(lambda meta: True)
    assert other.count == 3 and set(snapshots.snapshots[0].tree["callbacks"]) == {"Other"}


def test_a_host_snapshot_leaves_the_position_out_and_a_restore_keeps_it():
    """A snapshot's tree is `State.state_dict(position=False)`: the checkpoint's tree, in its order, without the
    Timestamp and the skipped counts (never computed); a restore leaves both as they are (the rollback goes on at the
    run's position and adds its window to the skipped counts)."""
    from raytrain_events.core.timestamp import Timestamp

    model = torch.nn.Linear(3, 2)
    state = State(model=model, optimizers=[torch.optim.SGD(model.parameters(), lr=0.1)])
    full = state.state_dict()
    lean = state.state_dict(position=False)
    assert list(lean) == [k for k in full if k not in ("timestamp", "skipped")]
    before = model.weight.detach().clone()
    snapshots = HostSnapshots(state)
    snapshots.take({"batch": 0})
    assert "timestamp" not in snapshots.snapshots[0].tree and "skipped" not in snapshots.snapshots[0].tree
    state.timestamp, state.skipped.batches = Timestamp(batch=7), 2
    with torch.no_grad():
        model.weight.add_(1.0)
    snapshots.restore(lambda meta: True)
    assert torch.equal(model.weight, before)  # the weights restored, the position kept
    assert int(state.timestamp.batch) == 7 and state.skipped.batches == 2
