"""Tests for raytrain_events.core.state: batch views, elapsed duration, state_dict round trips."""

from __future__ import annotations

import copy

import pytest
import torch

from raytrain_events import Algorithm, Callback, State, Time, Timestamp, TimeUnit
from raytrain_events.core.state import CheckpointMismatchError


def linear(seed=0, d_in=4, d_out=3):
    torch.manual_seed(seed)
    return torch.nn.Linear(d_in, d_out)


# ---------------------------------------------------------------------------------------------------------------
# batch views
# ---------------------------------------------------------------------------------------------------------------
def test_batch_pair_and_dict():
    state = State(model=linear(), max_duration="1ep")
    x, y = torch.zeros(2, 4), torch.zeros(2)
    state.batch = (x, y)
    assert state.batch_pair[0] is x
    state.batch = [x, y]
    assert state.batch_pair[1] is y
    state.batch = {"x": x, "y": y}
    assert state.batch_dict["x"] is x


@pytest.mark.parametrize("batch", [torch.zeros(2, 4), (torch.zeros(2),), (1, 2, 3), {"x": 1}, None, "xy"])
def test_batch_pair_type_error(batch):
    state = State(model=linear(), max_duration="1ep")
    state.batch = batch
    with pytest.raises(TypeError, match="pair"):
        state.batch_pair


@pytest.mark.parametrize("batch", [torch.zeros(2, 4), (torch.zeros(2), torch.zeros(2)), [1], None])
def test_batch_dict_type_error(batch):
    state = State(model=linear(), max_duration="1ep")
    state.batch = batch
    with pytest.raises(TypeError, match="dict"):
        state.batch_dict


# ---------------------------------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "max_duration, timestamp, expected",
    [
        ("4ep", Timestamp(epoch=1, batch=10, sample=640), 0.25),
        ("40ba", Timestamp(epoch=1, batch=10, sample=640), 0.25),
        ("1280sp", Timestamp(epoch=1, batch=10, sample=640), 0.5),
        ("1000tok", Timestamp(epoch=1, batch=10, sample=640, token=250), 0.25),
        ("3ep", Timestamp(), 0.0),
        ("10ba", Timestamp(batch=15), 1.5),
    ],
)
def test_get_elapsed_duration_in_each_unit(max_duration, timestamp, expected):
    state = State(model=linear(), max_duration=max_duration)
    state.timestamp = timestamp
    elapsed = state.get_elapsed_duration()
    assert isinstance(elapsed, Time) and elapsed.unit == TimeUnit.DURATION
    assert elapsed.value == pytest.approx(expected)


def test_time_properties_and_max_epochs():
    state = State(model=linear(), max_duration=3)  # an int is epochs
    assert state.max_duration == Time(3, TimeUnit.EPOCH)
    assert state.max_epochs == Time(3, TimeUnit.EPOCH)
    state.timestamp = Timestamp(epoch=2, batch=9, batch_in_epoch=1)
    assert (state.epoch, state.step, state.batch_idx) == (2, 9, 1)
    with pytest.raises(ValueError, match="epochs"):
        State(model=linear(), max_duration="10ba").max_epochs
    with pytest.raises(ValueError, match="max_duration"):
        State(model=linear()).get_elapsed_duration()


def test_steps_per_epoch():
    assert State(model=linear(), train_dataloader=[1, 2, 3]).steps_per_epoch == 3
    assert State(model=linear(), train_dataloader=iter([1, 2])).steps_per_epoch is None
    state = State(model=linear(), train_dataloader=[1, 2, 3], steps_per_epoch=2)
    assert state.steps_per_epoch == 2


# ---------------------------------------------------------------------------------------------------------------
# serialization
# ---------------------------------------------------------------------------------------------------------------
class Counter(Algorithm):
    def __init__(self):
        self.count = 0
        self.history = []

    def match(self, event, state):
        return True

    def apply(self, event, state, logger):
        self.count += 1

    def state_dict(self):
        return {"count": self.count, "history": list(self.history)}

    def load_state_dict(self, state):
        self.count, self.history = state["count"], list(state["history"])


class Required(Counter):
    @staticmethod
    def required_on_load():
        return True


class Seen(Callback):
    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def build_state(seed, algorithms=None, scheduler="step"):
    model = torch.nn.Sequential(linear(seed), torch.nn.ReLU(), linear(seed + 1, 3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if scheduler == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        sched = scheduler(opt)
    algorithms = [Counter(), Counter()] if algorithms is None else algorithms
    return State(
        model=model,
        max_duration="4ep",
        optimizers=opt,
        schedulers=sched,
        algorithms=algorithms,
        callbacks=[Seen()],
        run_name="r",
        seed=seed,
    )


def train_steps(state, n):
    for _ in range(n):
        opt = state.optimizers[0]
        opt.zero_grad()
        state.model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        for s in state.schedulers:
            s.step()
        state.timestamp = state.timestamp.to_next_batch(samples=8, tokens=3)


def assert_same_tensors(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_tensors(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_tensors(x, y)
    else:
        assert a == b


def test_state_dict_round_trip():
    torch.manual_seed(0)
    src = build_state(0)
    train_steps(src, 5)
    src.timestamp = src.timestamp.to_next_epoch().to_next_batch(samples=8, tokens=5)
    src.algorithms[0].count, src.algorithms[1].count = 11, 22
    src.algorithms[1].history = [1, 2]
    src.callbacks[0].seen = 4
    saved = copy.deepcopy(src.state_dict())

    dst = build_state(1)
    assert not torch.equal(dst.model[0].weight, src.model[0].weight)
    dst.load_state_dict(saved)
    assert_same_tensors(dst.model.state_dict(), src.model.state_dict())
    assert_same_tensors(dst.optimizers[0].state_dict(), src.optimizers[0].state_dict())
    assert dst.schedulers[0].state_dict() == src.schedulers[0].state_dict()
    assert dst.schedulers[0].get_last_lr() == src.schedulers[0].get_last_lr() == [0.01 * 0.5**2]
    assert dst.timestamp == src.timestamp
    assert dst.timestamp.state_dict() == src.timestamp.state_dict()
    assert (dst.epoch, dst.step, int(dst.timestamp.token)) == (1, 6, 20)
    assert [a.count for a in dst.algorithms] == [11, 22] and dst.algorithms[1].history == [1, 2]
    assert dst.callbacks[0].seen == 4
    # loading did not change the checkpoint
    assert_same_tensors(saved, src.state_dict())

    # Training continues identically from the restored state.
    torch.manual_seed(5)
    train_steps(src, 2)
    torch.manual_seed(5)
    train_steps(dst, 2)
    assert_same_tensors(dst.model.state_dict(), src.model.state_dict())


def test_state_dict_is_plain_data():
    state = build_state(0)
    train_steps(state, 1)
    sd = state.state_dict()
    assert set(sd) >= {"model", "optimizers", "schedulers", "algorithms", "callbacks", "timestamp"}
    assert sd["algorithms"].keys() == {"Counter", "Counter#2"}
    assert all(isinstance(v, (int, float)) for v in sd["timestamp"].values())


def test_function_scheduler_round_trip():
    """A scheduler given as ``fn(state) -> multiplier`` is wrapped by the Trainer; it must checkpoint."""
    from torch.utils.data import DataLoader, TensorDataset

    from raytrain_events import Trainer
    from raytrain_events.models import ClassifierModel

    def make(seed):
        torch.manual_seed(seed)
        model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
        data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
        return Trainer(
            model=model,
            train_dataloader=data,
            max_duration="2ep",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            schedulers=lambda state: 1.0 / (1 + state.step),
        )

    src = make(0)
    src.fit()
    saved = copy.deepcopy(src.state.state_dict())
    dst = make(1)
    dst.state.load_state_dict(saved)
    assert dst.state.schedulers[0].last_epoch == src.state.schedulers[0].last_epoch == 8
    assert dst.state.schedulers[0].get_last_lr() == src.state.schedulers[0].get_last_lr()
    assert_same_tensors(dst.state.model.state_dict(), src.state.model.state_dict())


def test_loading_a_checkpoint_of_another_shape_names_the_keys():
    saved = State(model=linear(0, 4, 3), max_duration="1ep").state_dict()
    state = State(model=linear(1, 4, 5), max_duration="1ep")
    before = copy.deepcopy(state.model.state_dict())
    for strict in (True, False):
        with pytest.raises(CheckpointMismatchError) as info:
            state.load_state_dict(saved, strict=strict)
        msg = str(info.value)
        assert "weight: checkpoint (3, 4) vs model (5, 4)" in msg and "bias: checkpoint (3,) vs model (5,)" in msg
    assert_same_tensors(state.model.state_dict(), before)


def test_loading_a_checkpoint_with_other_keys_names_the_keys():
    saved = State(model=torch.nn.Sequential(linear(0)), max_duration="1ep").state_dict()
    state = State(model=linear(1), max_duration="1ep")
    before = copy.deepcopy(state.model.state_dict())
    with pytest.raises(CheckpointMismatchError) as info:
        state.load_state_dict(saved, strict=True)
    msg = str(info.value)
    assert "'bias'" in msg and "'weight'" in msg and "'0.weight'" in msg and "'0.bias'" in msg
    # Not strict: a checkpoint that shares no key with the model would load nothing at all.
    with pytest.raises(CheckpointMismatchError, match="0.weight"):
        state.load_state_dict(saved, strict=False)
    assert_same_tensors(state.model.state_dict(), before)


def test_non_strict_load_of_a_partial_checkpoint():
    full = torch.nn.Sequential(linear(0), torch.nn.ReLU(), linear(1, 3, 2))
    saved = {
        "model": {k: v for k, v in full.state_dict().items() if k.startswith("0.")},
        "timestamp": Timestamp(batch=3).state_dict(),
    }
    state = State(model=torch.nn.Sequential(linear(5), torch.nn.ReLU(), linear(6, 3, 2)), max_duration="1ep")
    with pytest.raises(CheckpointMismatchError, match="2.weight"):
        state.load_state_dict(saved, strict=True)
    state.load_state_dict(saved, strict=False)
    assert torch.equal(state.model[0].weight, full[0].weight)
    assert not torch.equal(state.model[2].weight, full[2].weight)
    assert state.step == 3


def test_required_on_load_algorithm_missing_raises_before_loading_anything():
    src = build_state(0, algorithms=[Required()])
    train_steps(src, 2)
    saved = src.state_dict()
    assert saved["algorithms_required"] == ["Required"]

    dst = build_state(1, algorithms=[Counter()])
    before = copy.deepcopy(dst.model.state_dict())
    with pytest.raises(CheckpointMismatchError, match="Required"):
        dst.load_state_dict(saved)
    assert_same_tensors(dst.model.state_dict(), before)
    assert dst.step == 0

    ok = build_state(1, algorithms=[Required()])
    ok.load_state_dict(saved)
    assert ok.algorithms[0].count == 0 and ok.step == 2


def test_optional_algorithm_may_be_missing_on_load():
    src = build_state(0, algorithms=[Counter()])
    dst = build_state(1, algorithms=[])
    dst.load_state_dict(src.state_dict())
    assert_same_tensors(dst.model.state_dict(), src.model.state_dict())


def test_optimizer_count_mismatch():
    src = build_state(0)
    dst = build_state(1)
    dst.optimizers = []
    with pytest.raises(CheckpointMismatchError, match="1 optimizers but this run has 0"):
        dst.load_state_dict(src.state_dict())


def test_stop_training_flags():
    state = State(model=linear(), max_duration="1ep")
    assert not state.stop_requested
    state.stop_training("enough")
    assert state.stop_requested and state.stop_consistent and state.stop_reason == "enough"
    multi = State(model=linear(), max_duration="1ep", world_size=2)
    multi.stop_training()
    assert multi.stop_requested and not multi.stop_consistent
    multi.stop_training(consistent=True)
    assert multi.stop_consistent


def test_model_mismatch_names_shapes_and_keys():
    from raytrain_events.core.state import model_mismatch

    model = {"w": (2, 3), "b": (2,)}
    assert model_mismatch(model, {"w": (2, 3), "b": (2,)}, strict=True) is None
    assert "shape mismatch: w: checkpoint (3, 3) vs model (2, 3)" in model_mismatch(
        model, {"w": (3, 3), "b": (2,)}, strict=False
    )
    assert model_mismatch(model, {"w": (2, 3)}, strict=False) is None  # partial load allowed when not strict
    assert "missing in checkpoint: ['b']" in model_mismatch(model, {"w": (2, 3)}, strict=True)
    assert "not in model: ['x']" in model_mismatch(model, {"x": None}, strict=False)  # shares no key: loads nothing


@pytest.mark.parametrize(
    "max_duration,done_at",
    [
        ("2ep", Timestamp(epoch=2)),
        ("5ba", Timestamp(batch=5)),
        ("320sp", Timestamp(sample=320)),
        ("1000tok", Timestamp(token=1000)),
    ],
)
def test_is_done_compares_the_timestamp_in_the_durations_unit(max_duration: str, done_at: Timestamp) -> None:
    from raytrain_events.core.interval import is_done

    state = State(model=linear(), max_duration=max_duration)
    assert not is_done(state)
    state.timestamp = done_at.copy(epoch=done_at.epoch.value, batch=max(0, done_at.batch.value - 1))
    assert is_done(state) == (done_at.batch.value == 0)  # one batch short in 'ba'; the others reached
    state.timestamp = done_at
    assert is_done(state)
    state.max_duration = None
    assert not is_done(state)


def test_is_done_refuses_a_duration_a_timestamp_cannot_count() -> None:
    from raytrain_events.core.interval import is_done

    state = State(model=linear(), max_duration="1ep")
    state.max_duration = Time(0.5, TimeUnit.DURATION)  # set by hand, past the checks of the Trainer
    with pytest.raises(ValueError, match="State.get_elapsed_duration"):
        is_done(state)
