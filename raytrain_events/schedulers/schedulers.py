"""Composer's stateless LR schedules: each is ``scheduler(state) -> multiplier`` of the global Timestamp.

Pass them to the Trainer as ``schedulers=CosineAnnealingScheduler()``; the trainer wraps each in
a ``LambdaLR`` that is stepped after every batch, so the LR of batch ``k`` is
``base_lr * scheduler(state)`` evaluated with ``k`` batches done. Times are `Time` values or
strings: ``"0.5dur"`` is half of ``max_duration``, ``"2ep"``, ``"100ba"``, ``"1e6tok"`` (see
`raytrain_events.schedulers._convert`). The formulas match ``composer.optim.scheduler``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

from raytrain_events.core.time import Time
from raytrain_events.schedulers._convert import TimeLike, as_time, convert_time

if TYPE_CHECKING:
    from raytrain_events.core.state import State

__all__ = [
    "Scheduler",
    "ConstantScheduler",
    "LinearScheduler",
    "StepScheduler",
    "MultiStepScheduler",
    "ExponentialScheduler",
    "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler",
    "PolynomialScheduler",
    "cosine_anneal",
]


def cosine_anneal(x: float, min_y: float = 0.0, max_y: float = 1.0) -> float:
    """``cos`` on ``[0, pi]`` stretched to ``x`` in ``[0, 1]`` (clipped) and ``y`` in ``[min_y, max_y]``."""
    x = min(max(x, 0.0), 1.0)
    return min_y + (max_y - min_y) * (1 + math.cos(x * math.pi)) / 2


def _fraction(current: int, total: int) -> float:
    """``current / total``; a zero-length phase counts as finished."""
    return current / total if total > 0 else 1.0


class Scheduler:
    """Base class: converts its Time arguments once per (max_duration, steps_per_epoch)."""

    _time_fields: Tuple[str, ...] = ()

    def __init__(self) -> None:
        self._cache_key: Any = None
        self._converted: Dict[str, Any] = {}

    def _times(self, state: State) -> Dict[str, Any]:
        key = (state.max_duration, state.steps_per_epoch)
        if key != self._cache_key:
            converted = {}
            for name in self._time_fields:
                value = getattr(self, name)
                if isinstance(value, (list, tuple)):
                    converted[name] = [convert_time(v, state, name) for v in value]
                else:
                    converted[name] = convert_time(value, state, name)
            self._converted = self._check(converted, state)
            self._cache_key = key
        return self._converted

    def _check(self, converted: Dict[str, Any], state: State) -> Dict[str, Any]:
        return converted

    def __call__(self, state: State) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(
            f"{k}={v.to_timestring()!r}" if isinstance(v, Time) else f"{k}={v!r}"
            for k, v in vars(self).items()
            if not k.startswith("_")
        )
        return f"{type(self).__name__}({args})"


def now_in(state: State, time: Time) -> int:
    return state.timestamp.get_value(time.unit)


class ConstantScheduler(Scheduler):
    """``alpha`` until ``t_max``, then 1.0.

    >>> ConstantScheduler(alpha=0.5, t_max="10ba")  # doctest: +ELLIPSIS
    ConstantScheduler(alpha=0.5, t_max='10ba')
    """

    _time_fields = ("t_max",)

    def __init__(self, alpha: float = 1.0, t_max: TimeLike = "1dur") -> None:
        super().__init__()
        self.alpha, self.t_max = alpha, as_time(t_max, "t_max")

    def __call__(self, state: State) -> float:
        t_max = self._times(state)["t_max"]
        return self.alpha if now_in(state, t_max) < t_max.value else 1.0


class LinearScheduler(Scheduler):
    """``alpha_i + (alpha_f - alpha_i) * min(1, t / t_max)``."""

    _time_fields = ("t_max",)

    def __init__(self, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: TimeLike = "1dur") -> None:
        super().__init__()
        self.alpha_i, self.alpha_f, self.t_max = alpha_i, alpha_f, as_time(t_max, "t_max")

    def __call__(self, state: State) -> float:
        t_max = self._times(state)["t_max"]
        frac = min(1.0, _fraction(now_in(state, t_max), t_max.value))
        return self.alpha_i + frac * (self.alpha_f - self.alpha_i)


class StepScheduler(Scheduler):
    """``gamma ** floor(t / step_size)``."""

    _time_fields = ("step_size",)

    def __init__(self, step_size: TimeLike, gamma: float = 0.1) -> None:
        super().__init__()
        self.step_size, self.gamma = as_time(step_size, "step_size"), gamma

    def _check(self, converted, state):
        if converted["step_size"].value <= 0:
            raise ValueError(
                f"StepScheduler step_size={self.step_size.to_timestring()!r} is 0 on this run; make it larger."
            )
        return converted

    def __call__(self, state: State) -> float:
        step = self._times(state)["step_size"]
        return self.gamma ** (now_in(state, step) // int(step.value))


class MultiStepScheduler(Scheduler):
    """``gamma ** (number of milestones reached)``."""

    _time_fields = ("milestones",)

    def __init__(self, milestones: Sequence[TimeLike], gamma: float = 0.1) -> None:
        super().__init__()
        self.milestones: List[Time] = [as_time(m, "milestones") for m in milestones]
        self.gamma = gamma

    def __call__(self, state: State) -> float:
        reached = sum(1 for m in self._times(state)["milestones"] if now_in(state, m) >= m.value)
        return self.gamma**reached


class ExponentialScheduler(Scheduler):
    """``gamma ** (t / decay_period)``."""

    _time_fields = ("decay_period",)

    def __init__(self, gamma: float, decay_period: TimeLike = "1ep") -> None:
        super().__init__()
        self.gamma, self.decay_period = gamma, as_time(decay_period, "decay_period")

    def _check(self, converted, state):
        if converted["decay_period"].value <= 0:
            raise ValueError(f"decay_period={self.decay_period.to_timestring()!r} is 0 on this run; make it larger.")
        return converted

    def __call__(self, state: State) -> float:
        period = self._times(state)["decay_period"]
        return self.gamma ** (now_in(state, period) / period.value)


class CosineAnnealingScheduler(Scheduler):
    """``alpha_f + (1 - alpha_f) * (1 + cos(pi * min(1, t / t_max))) / 2``."""

    _time_fields = ("t_max",)

    def __init__(self, t_max: TimeLike = "1dur", alpha_f: float = 0.0) -> None:
        super().__init__()
        self.t_max, self.alpha_f = as_time(t_max, "t_max"), alpha_f

    def __call__(self, state: State) -> float:
        t_max = self._times(state)["t_max"]
        return cosine_anneal(_fraction(now_in(state, t_max), t_max.value), min_y=self.alpha_f)


class CosineAnnealingWarmRestartsScheduler(Scheduler):
    """Cosine annealing restarted every cycle; cycle ``i`` lasts ``t_0 * t_mult ** i``."""

    _time_fields = ("t_0",)

    def __init__(self, t_0: TimeLike, t_mult: float = 1.0, alpha_f: float = 0.0) -> None:
        super().__init__()
        self.t_0, self.t_mult, self.alpha_f = as_time(t_0, "t_0"), t_mult, alpha_f

    def _check(self, converted, state):
        if converted["t_0"].value <= 0:
            raise ValueError(f"t_0={self.t_0.to_timestring()!r} is 0 on this run; make it larger.")
        return converted

    def __call__(self, state: State) -> float:
        t_0 = self._times(state)["t_0"]
        now = now_in(state, t_0)
        length = end = int(t_0.value)
        while end <= now:
            length = int(self.t_mult * length)
            if length <= 0:
                raise ValueError("The cosine warm-restarts cycle length decayed to 0: use t_mult >= 1.")
            end += length
        return cosine_anneal((now - (end - length)) / length, min_y=self.alpha_f)


class PolynomialScheduler(Scheduler):
    """``alpha_f + (1 - alpha_f) * (1 - min(1, t / t_max)) ** power``."""

    _time_fields = ("t_max",)

    def __init__(self, power: float, t_max: TimeLike = "1dur", alpha_f: float = 0.0) -> None:
        super().__init__()
        self.power, self.t_max, self.alpha_f = power, as_time(t_max, "t_max"), alpha_f

    def __call__(self, state: State) -> float:
        t_max = self._times(state)["t_max"]
        frac = min(1.0, _fraction(now_in(state, t_max), t_max.value))
        return self.alpha_f + (1.0 - frac) ** self.power * (1.0 - self.alpha_f)
