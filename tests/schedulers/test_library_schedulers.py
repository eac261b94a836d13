"""Schedulers: multipliers equal Composer's closed forms, in any unit, including runs in tokens."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from library_helpers import Record, TinyLM, token_batches, trainer

from raytrain_events import DataSpec, Event, State, Timestamp
from raytrain_events.schedulers import (
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    CosineAnnealingWithWarmupScheduler,
    ExponentialScheduler,
    LinearScheduler,
    LinearWithWarmupScheduler,
    MultiStepScheduler,
    MultiStepWithWarmupScheduler,
    PolynomialScheduler,
    PolynomialWithWarmupScheduler,
    StepScheduler,
)

_MODEL = torch.nn.Linear(1, 1)


def _state(max_duration: str, steps_per_epoch=None, **counts) -> State:
    state = State(model=_MODEL, max_duration=max_duration, steps_per_epoch=steps_per_epoch)
    state.timestamp = Timestamp(**counts)
    return state


def _cos(x, alpha_f=0.0):
    x = min(max(x, 0.0), 1.0)
    return alpha_f + (1 - alpha_f) * 0.5 * (1 + math.cos(math.pi * x))


T = 200  # max_duration in batches for the property tests
batches = st.integers(0, 2 * T)


@settings(max_examples=40, deadline=None)
@given(t=batches, alpha_i=st.floats(0, 2), alpha_f=st.floats(0, 2), t_max=st.integers(1, T))
def test_linear(t, alpha_i, alpha_f, t_max):
    got = LinearScheduler(alpha_i, alpha_f, f"{t_max}ba")(_state(f"{T}ba", batch=t))
    assert got == pytest.approx(alpha_i + (alpha_f - alpha_i) * min(1.0, t / t_max))


@settings(max_examples=40, deadline=None)
@given(t=batches, step=st.integers(1, 50), gamma=st.floats(0.05, 1.0))
def test_step(t, step, gamma):
    assert StepScheduler(f"{step}ba", gamma)(_state(f"{T}ba", batch=t)) == pytest.approx(gamma ** (t // step))


@settings(max_examples=40, deadline=None)
@given(t=batches, milestones=st.lists(st.integers(0, T), max_size=4), gamma=st.floats(0.05, 1.0))
def test_multistep(t, milestones, gamma):
    got = MultiStepScheduler([f"{m}ba" for m in milestones], gamma)(_state(f"{T}ba", batch=t))
    assert got == pytest.approx(gamma ** sum(t >= m for m in milestones))


@settings(max_examples=40, deadline=None)
@given(t=batches, period=st.integers(1, 50), gamma=st.floats(0.05, 1.0))
def test_exponential(t, period, gamma):
    assert ExponentialScheduler(gamma, f"{period}ba")(_state(f"{T}ba", batch=t)) == pytest.approx(gamma ** (t / period))


@settings(max_examples=40, deadline=None)
@given(t=batches, frac=st.floats(0.05, 1.0), alpha_f=st.floats(0, 1))
def test_cosine_with_dur_t_max(t, frac, alpha_f):
    t_max = int(frac * T)  # Composer: int(fraction * max_duration)
    got = CosineAnnealingScheduler(t_max=f"{frac}dur", alpha_f=alpha_f)(_state(f"{T}ba", batch=t))
    assert got == pytest.approx(_cos(t / t_max if t_max else 1.0, alpha_f))


@settings(max_examples=40, deadline=None)
@given(t=batches, power=st.floats(0.5, 3), alpha_f=st.floats(0, 1))
def test_polynomial(t, power, alpha_f):
    got = PolynomialScheduler(power, "1dur", alpha_f)(_state(f"{T}ba", batch=t))
    assert got == pytest.approx(alpha_f + (1 - alpha_f) * (1 - min(1.0, t / T)) ** power)


def test_constant():
    sched = ConstantScheduler(alpha=0.3, t_max="0.5dur")
    assert [sched(_state("10ba", batch=t)) for t in (0, 4, 5, 9)] == [0.3, 0.3, 1.0, 1.0]


def test_cosine_warm_restarts():
    sched = CosineAnnealingWarmRestartsScheduler(t_0="10ba", t_mult=2.0)
    assert sched(_state("100ba", batch=5)) == pytest.approx(_cos(0.5))
    assert sched(_state("100ba", batch=10)) == pytest.approx(1.0)  # restart
    assert sched(_state("100ba", batch=20)) == pytest.approx(_cos(0.5))  # second cycle is 20 long


@settings(max_examples=40, deadline=None)
@given(t=batches, warm=st.integers(1, 50), alpha_f=st.floats(0, 1), power=st.floats(0.5, 3))
def test_warmup_variants(t, warm, alpha_f, power):
    state = _state(f"{T}ba", batch=t)
    tau = min(1.0, (t - warm) / (T - warm))
    if t < warm:
        for sched in (
            CosineAnnealingWithWarmupScheduler(f"{warm}ba", alpha_f=alpha_f),
            PolynomialWithWarmupScheduler(f"{warm}ba", power=power, alpha_f=alpha_f),
            MultiStepWithWarmupScheduler(f"{warm}ba", ["100ba"], 0.5),
        ):
            assert sched(state) == pytest.approx(t / warm)
        assert LinearWithWarmupScheduler(f"{warm}ba", alpha_i=0.8)(state) == pytest.approx(0.8 * t / warm)
        assert ConstantWithWarmupScheduler(f"{warm}ba", alpha=0.6)(state) == pytest.approx(0.6 * t / warm)
    else:
        assert CosineAnnealingWithWarmupScheduler(f"{warm}ba", alpha_f=alpha_f)(state) == pytest.approx(
            _cos(tau, alpha_f)
        )
        assert PolynomialWithWarmupScheduler(f"{warm}ba", power=power, alpha_f=alpha_f)(state) == pytest.approx(
            alpha_f + (1 - alpha_f) * (1 - tau) ** power
        )
        assert LinearWithWarmupScheduler(f"{warm}ba", alpha_i=0.8, alpha_f=alpha_f)(state) == pytest.approx(
            0.8 + (alpha_f - 0.8) * tau
        )
        assert ConstantWithWarmupScheduler(f"{warm}ba", alpha=0.6)(state) == pytest.approx(0.6 if t < T else 1.0)
        assert MultiStepWithWarmupScheduler(f"{warm}ba", ["100ba"], 0.5)(state) == pytest.approx(
            0.5 if t >= 100 else 1.0
        )


def test_dur_warmup_rounds_down_like_composer():
    sched = CosineAnnealingWithWarmupScheduler(t_warmup="0.05dur")  # int(0.05 * 30) = 1 batch
    assert sched(_state("3ep", steps_per_epoch=10, batch=0)) == 0.0
    assert sched(_state("3ep", steps_per_epoch=10, batch=1)) == pytest.approx(1.0)
    assert sched(_state("3ep", steps_per_epoch=10, batch=16)) == pytest.approx(_cos(15 / 29))


def test_epoch_runs_are_scheduled_per_batch():
    sched = CosineAnnealingScheduler()
    # 2 epochs x 10 batches: "1dur" is 20 batches, so the cosine moves within an epoch
    assert sched(_state("2ep", steps_per_epoch=10, epoch=0, batch=5)) == pytest.approx(_cos(5 / 20))
    assert StepScheduler("1ep", 0.5)(_state("4ep", steps_per_epoch=10, epoch=1, batch=15)) == 0.5
    # unknown batches per epoch: fall back to whole epochs
    assert sched(_state("4ep", epoch=1, batch=7)) == pytest.approx(_cos(1 / 4))


def test_dur_schedule_on_a_run_in_tokens():
    sched = CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur")
    assert sched(_state("1000tok", token=50, batch=3)) == pytest.approx(0.5)
    assert sched(_state("1000tok", token=550, batch=30)) == pytest.approx(_cos(450 / 900))
    assert LinearScheduler(t_max="1dur")(_state("1000tok", token=250)) == pytest.approx(0.75)


def test_unconvertible_units_raise_a_clear_error():
    with pytest.raises(ValueError, match="cannot be converted"):
        LinearWithWarmupScheduler(t_warmup="10ba")(_state("1000tok", token=5))
    with pytest.raises(ValueError, match="batches per epoch"):
        LinearWithWarmupScheduler(t_warmup="10ba", t_max="2ep")(_state("4ep", batch=3))
    with pytest.raises(TypeError, match="time string"):
        LinearScheduler(t_max=100)
    with pytest.warns(UserWarning, match="no warmup"):
        CosineAnnealingWithWarmupScheduler(t_warmup="0.01dur")(_state("10ba", batch=1))


def test_trainer_lr_follows_schedule_in_tokens():
    spec = DataSpec(
        token_batches(10, batch_size=2, seq_len=25), get_num_tokens_in_batch=lambda b: b["input_ids"].numel()
    )
    rec = Record({Event.BATCH_START: lambda s: (s.timestamp.get_value("tok"), s.optimizers[0].param_groups[0]["lr"])})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer(
            TinyLM(),
            lr=0.5,
            train_dataloader=spec,
            max_duration="500tok",
            callbacks=[rec],
            schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="0.2dur"),
        ).fit()
    rows = rec.values[Event.BATCH_START]
    assert [tok for tok, _ in rows] == [0, 50, 100, 150, 200, 250, 300, 350, 400, 450]
    for tok, lr in rows:
        want = tok / 100 if tok < 100 else _cos((tok - 100) / 400)
        assert lr == pytest.approx(0.5 * want)
