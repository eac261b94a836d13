"""Composer's ``*WithWarmupScheduler`` schedules: a linear warmup, then the main schedule.

For ``t < t_warmup`` the multiplier is ``peak * t / t_warmup`` (``peak`` is the value the main
schedule starts from); afterwards the main schedule runs over ``t_max - t_warmup`` with
``tau_w = min(1, (t - t_warmup) / (t_max - t_warmup))``. Formulas match ``composer.optim.scheduler``
(without ``scale_warmup``, which only matters with a scale-schedule ratio).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Sequence

from raytrain_events.core.time import Time, TimeUnit
from raytrain_events.schedulers._convert import TimeLike, as_time, common_unit
from raytrain_events.schedulers.schedulers import MultiStepScheduler, Scheduler, cosine_anneal, now_in

if TYPE_CHECKING:
    from raytrain_events.core.state import State

__all__ = [
    "ConstantWithWarmupScheduler",
    "LinearWithWarmupScheduler",
    "CosineAnnealingWithWarmupScheduler",
    "PolynomialWithWarmupScheduler",
    "MultiStepWithWarmupScheduler",
]


def _warmup_time(value: TimeLike) -> Time:
    """``t_warmup`` parsed; a warmup past the run's end in 'dur' (the LR would never reach its peak) refused."""
    time = as_time(value, "t_warmup")
    if time.unit == TimeUnit.DURATION and time.value > 1:
        raise ValueError(
            f"t_warmup={value!r} is longer than the run ('1dur' is all of it): the learning rate would never reach "
            "its peak. Fix: a fraction of the run, like t_warmup='0.05dur', or a count like '500ba'."
        )
    if time.value < 0:
        raise ValueError(f"t_warmup={value!r} is negative. Fix: t_warmup='0.05dur' (or '0ba' for no warmup).")
    return time


class _WarmupScheduler(Scheduler):
    _time_fields = ("t_warmup", "t_max")
    _peak = 1.0

    def _check(self, converted, state):
        if converted["t_warmup"].value == 0:
            warnings.warn(
                f"{type(self).__name__}: the warmup t_warmup={self.t_warmup.to_timestring()!r} is 0 batches on this run "
                "(a 'dur' warmup is rounded down in the unit of max_duration); no warmup will happen.",
                stacklevel=3,
            )
        if "t_max" in converted:
            converted["t_warmup"], converted["t_max"] = common_unit(
                converted["t_warmup"], converted["t_max"], state, ("t_warmup", "t_max")
            )
            if converted["t_warmup"].value >= converted["t_max"].value > 0:
                warnings.warn(
                    f"{type(self).__name__}: the warmup t_warmup={self.t_warmup.to_timestring()!r} lasts until "
                    f"t_max={self.t_max.to_timestring()!r} or longer on this run (max_duration="
                    f"{state.max_duration.to_timestring() if state.max_duration else None!r}): the learning rate "
                    "reaches its peak only at the end, if at all. Shorten t_warmup (e.g. '0.05dur').",
                    stacklevel=3,
                )
        return converted

    def _warmup(self, state: State):
        """``(in_warmup, warmup multiplier, converted times)``."""
        times = self._times(state)
        t_warmup = times["t_warmup"]
        now = now_in(state, t_warmup)
        if now < t_warmup.value:
            return True, self._peak * min(1.0, now / t_warmup.value), times
        return False, 0.0, times

    def _tau_w(self, state: State, times) -> float:
        t_warmup, t_max = times["t_warmup"], times["t_max"]
        span = t_max.value - t_warmup.value
        if span <= 0:
            return 0.0
        return min(1.0, (now_in(state, t_warmup) - t_warmup.value) / span)


class ConstantWithWarmupScheduler(_WarmupScheduler):
    """Warm up to ``alpha``, hold it until ``t_max``, then 1.0."""

    def __init__(self, t_warmup: TimeLike = "0.05dur", alpha: float = 1.0, t_max: TimeLike = "1dur") -> None:
        super().__init__()
        self.t_warmup, self.alpha, self.t_max = _warmup_time(t_warmup), alpha, as_time(t_max, "t_max")
        self._peak = alpha

    def __call__(self, state: State) -> float:
        warming, value, times = self._warmup(state)
        if warming:
            return value
        return self.alpha if now_in(state, times["t_max"]) < times["t_max"].value else 1.0


class LinearWithWarmupScheduler(_WarmupScheduler):
    """Warm up to ``alpha_i``, then linear from ``alpha_i`` to ``alpha_f`` at ``t_max``."""

    def __init__(
        self, t_warmup: TimeLike = "0.05dur", alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: TimeLike = "1dur"
    ) -> None:
        super().__init__()
        self.t_warmup, self.t_max = _warmup_time(t_warmup), as_time(t_max, "t_max")
        self.alpha_i, self.alpha_f = alpha_i, alpha_f
        self._peak = alpha_i

    def __call__(self, state: State) -> float:
        warming, value, times = self._warmup(state)
        if warming:
            return value
        return self.alpha_i + self._tau_w(state, times) * (self.alpha_f - self.alpha_i)


class CosineAnnealingWithWarmupScheduler(_WarmupScheduler):
    """Warm up to 1, then cosine from 1 to ``alpha_f`` at ``t_max``."""

    def __init__(self, t_warmup: TimeLike = "0.05dur", t_max: TimeLike = "1dur", alpha_f: float = 0.0) -> None:
        super().__init__()
        self.t_warmup, self.t_max, self.alpha_f = _warmup_time(t_warmup), as_time(t_max, "t_max"), alpha_f

    def __call__(self, state: State) -> float:
        warming, value, times = self._warmup(state)
        if warming:
            return value
        return cosine_anneal(self._tau_w(state, times), min_y=self.alpha_f)


class PolynomialWithWarmupScheduler(_WarmupScheduler):
    """Warm up to 1, then ``alpha_f + (1 - alpha_f) * (1 - tau_w) ** power``."""

    def __init__(
        self, t_warmup: TimeLike = "0.05dur", power: float = 2.0, t_max: TimeLike = "1dur", alpha_f: float = 0.0
    ) -> None:
        super().__init__()
        self.t_warmup, self.power = _warmup_time(t_warmup), power
        self.t_max, self.alpha_f = as_time(t_max, "t_max"), alpha_f

    def __call__(self, state: State) -> float:
        warming, value, times = self._warmup(state)
        if warming:
            return value
        return self.alpha_f + (1.0 - self._tau_w(state, times)) ** self.power * (1.0 - self.alpha_f)


class MultiStepWithWarmupScheduler(_WarmupScheduler):
    """Warm up to 1, then ``gamma ** (milestones reached)``."""

    _time_fields = ("t_warmup",)

    def __init__(self, t_warmup: TimeLike, milestones: Sequence[TimeLike], gamma: float = 0.1) -> None:
        super().__init__()
        self.t_warmup = _warmup_time(t_warmup)
        self.milestones = [as_time(m, "milestones") for m in milestones]
        self.gamma = gamma
        self._steps = MultiStepScheduler(self.milestones, gamma)

    def __call__(self, state: State) -> float:
        warming, value, _ = self._warmup(state)
        return value if warming else self._steps(state)
