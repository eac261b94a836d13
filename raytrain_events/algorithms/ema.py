"""`EMA`: keep an exponential moving average of the weights and evaluate with it.

After every ``update_interval`` the shadow weights move toward the model's:
``ema = smoothing * ema + (1 - smoothing) * w`` for floating-point parameters (buffers such as
BatchNorm statistics are copied). ``smoothing = 0.5 ** (update_interval / half_life)``, so a
weight's influence halves every ``half_life``. From ``EVAL_START`` to ``EVAL_END`` the shadow
weights are copied into the model (in place, so optimizers keep their references) and the
training weights are put back afterwards. Composer's ``EMA``.

``state_dict()`` holds the shadow weights, so checkpoints resume the average; ``ema_model_state()``
is a model ``state_dict`` with the averaged weights, ready for ``model.load_state_dict``.

Under FSDP each rank averages its shards; under pipeline parallelism each rank averages its stages'
parameters (``ema_model_state()`` holds those), a checkpoint names every stage's averages and a
resume on another stage count (or one process) gives each rank those of its own stages
(``checkpoint/dcp/sharded.py``); evaluation swaps them in stage by stage.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import torch

from raytrain_events._torch_compat import foreach_lerp_
from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event
from raytrain_events.core.time import Time, TimeUnit, ensure_time

__all__ = ["EMA"]


@register_algorithm("ema")
class EMA(Algorithm):
    """Exponential moving average of the model weights, used for evaluation.

    Example::

        Trainer(..., algorithms=[EMA(half_life="100ba")])      # or EMA(smoothing=0.999)

    Args:
        half_life: time for a weight's contribution to halve, in the unit of ``update_interval``
            (default ``"100ba"`` when ``smoothing`` is not given).
        smoothing: the per-update decay directly (give this or ``half_life``).
        update_interval: how often to update, in batches (``"1ba"``) or epochs (``"1ep"``).
    """

    def __init__(
        self,
        half_life: Union[str, Time, None] = None,
        smoothing: Optional[float] = None,
        update_interval: Union[str, Time, None] = None,
    ) -> None:
        if smoothing is not None and half_life is not None:
            raise ValueError("Give EMA either half_life (like '100ba') or smoothing (like 0.999), not both.")
        if smoothing is not None:
            if not 0.0 <= smoothing < 1.0:
                raise ValueError(f"smoothing={smoothing!r} must be in [0, 1), like 0.999.")
            self.half_life = None
            interval = ensure_time(update_interval or "1ba", TimeUnit.BATCH)
            self.smoothing = float(smoothing)
        else:
            self.half_life = ensure_time(half_life or "100ba", TimeUnit.BATCH)
            interval = ensure_time(update_interval or Time(1, self.half_life.unit), TimeUnit.BATCH)
            if self.half_life.unit != interval.unit:
                raise ValueError(
                    f"half_life={self.half_life.to_timestring()!r} and update_interval={interval.to_timestring()!r} "
                    "must be in the same unit ('ba' or 'ep')."
                )
            if self.half_life.value <= 0:
                raise ValueError(f"half_life={self.half_life.to_timestring()!r} must be positive.")
            self.smoothing = 0.5 ** (interval.value / self.half_life.value)
        if interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or interval.value <= 0:
            raise ValueError(f"update_interval={interval.to_timestring()!r} must be a positive number of 'ba' or 'ep'.")
        self.update_interval = interval
        self._event = Event.BATCH_END if interval.unit == TimeUnit.BATCH else Event.EPOCH_END
        self._every = int(interval.value)
        self._shadow: Optional[Dict[str, torch.Tensor]] = None
        self._pending: Optional[Dict[str, torch.Tensor]] = None
        self._backup: Optional[List[torch.Tensor]] = None
        self._names: List[str] = []
        self._params: List[torch.Tensor] = []  # model tensors (params, then buffers), in _names order
        self._shadow_float: List[torch.Tensor] = []
        self._model_float: List[torch.Tensor] = []
        self._shadow_other: List[torch.Tensor] = []
        self._model_other: List[torch.Tensor] = []

    # ------------------------------------------------------------------ engine
    def match(self, event: Event, state) -> bool:
        if event == self._event:
            return True
        return event in (Event.FIT_START, Event.EVAL_START, Event.EVAL_END)

    def apply(self, event: Event, state, logger) -> None:
        if event == Event.FIT_START or self._shadow is None:
            self._bind(state.model)
        if event == self._event:
            count = state.timestamp.get_value(self.update_interval.unit)
            if count % self._every == 0:
                self._update()
        elif event == Event.EVAL_START:
            self._swap_in()
        elif event == Event.EVAL_END:
            self._swap_out()
        return None

    # ---------------------------------------------------------------- internals
    def _bind(self, model: torch.nn.Module) -> None:
        """Match shadow tensors to the model's tensors (creating them from the model if new)."""
        params = dict(model.named_parameters())
        named = dict(params)
        named.update(model.named_buffers())
        if self._pending is not None:
            missing = sorted(set(named) - set(self._pending))
            if missing:
                raise ValueError(f"The EMA state does not fit this model: missing {missing[:5]}.")
            shadow = {k: self._pending[k].to(named[k].device, named[k].dtype).clone() for k in named}
            self._pending = None
        elif self._shadow is not None and set(self._shadow) == set(named):
            shadow = self._shadow
        else:
            shadow = {k: t.detach().clone() for k, t in named.items()}
        self._shadow = shadow
        self._names = list(named)
        self._params = list(named.values())
        averaged = [k for k, t in params.items() if t.is_floating_point()]
        copied = [k for k in named if k not in set(averaged)]
        self._shadow_float = [shadow[k] for k in averaged]
        self._model_float = [named[k] for k in averaged]
        self._shadow_other = [shadow[k] for k in copied]
        self._model_other = [named[k] for k in copied]

    @torch.no_grad()
    def _update(self) -> None:
        if self._shadow_float:
            model = [t.detach() for t in self._model_float]
            foreach_lerp_(self._shadow_float, model, 1.0 - self.smoothing)
        for shadow, tensor in zip(self._shadow_other, self._model_other):
            shadow.copy_(tensor)

    @torch.no_grad()
    def _swap_in(self) -> None:
        if self._backup is not None:
            return  # already holding EMA weights (nested or repeated EVAL_START)
        self._backup = [t.detach().clone() for t in self._params]
        for tensor, name in zip(self._params, self._names):
            tensor.copy_(self._shadow[name])

    @torch.no_grad()
    def _swap_out(self) -> None:
        if self._backup is None:
            return
        for tensor, saved in zip(self._params, self._backup):
            tensor.copy_(saved)
        self._backup = None

    def on_exception(self, state, logger, exc: BaseException) -> None:
        """An error during eval must not leave the EMA weights in the training model."""
        self._swap_out()

    # ----------------------------------------------------------------- public
    def ema_model_state(self) -> Dict[str, torch.Tensor]:
        """The averaged weights as a model ``state_dict`` (copies)."""
        source = self._shadow if self._shadow is not None else self._pending
        if source is None:
            raise RuntimeError("EMA has no averaged weights yet: they are created at FIT_START.")
        return {k: v.detach().clone() for k, v in source.items()}

    def state_dict(self) -> Dict[str, Any]:
        source = self._shadow if self._shadow is not None else self._pending
        return {"shadow": {k: v.detach().clone() for k, v in source.items()} if source is not None else None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        shadow = state.get("shadow")
        if shadow is None:
            return
        if self._shadow is not None:
            missing = sorted(set(self._shadow) - set(shadow))
            if missing:
                raise ValueError(f"The EMA state does not fit this model: missing {missing[:5]}.")
            with torch.no_grad():
                for k, v in self._shadow.items():
                    v.copy_(shadow[k])
        else:
            self._pending = dict(shadow)

    def __repr__(self) -> str:
        return f"EMA(smoothing={self.smoothing:.6g}, update_interval={self.update_interval.to_timestring()!r})"
