"""`SWA`: stochastic weight averaging over the last part of training.

From ``swa_start`` (default the last 30% of the run) the weights are averaged every
``update_interval`` with ``torch.optim.swa_utils.AveragedModel`` (an equal-weight running mean
of the snapshots). Optionally the learning rate is annealed to ``swa_lr`` over
``anneal_steps`` batches once averaging starts (the run's schedulers keep their state; their
rate is overridden while SWA is active). At ``FIT_END`` the averaged weights are copied into
the model in place, and with ``update_bn=True`` BatchNorm statistics are recomputed with one
pass over the train data. Izmailov et al., 2018; Composer's ``SWA``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch.optim.swa_utils import AveragedModel

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event
from raytrain_events.core.time import Time, TimeUnit, ensure_time
from raytrain_events.trainer._batch import move_to_device

__all__ = ["SWA"]


@register_algorithm("swa")
class SWA(Algorithm):
    """Average weights from ``swa_start`` on; the average replaces the weights at the end.

    Example::

        Trainer(..., algorithms=[SWA(swa_start="0.7dur", swa_lr=0.01)])
    """

    def __init__(
        self,
        swa_start: Union[str, Time] = "0.7dur",
        swa_end: Union[str, Time] = "1dur",
        update_interval: Union[str, Time] = "1ep",
        swa_lr: Optional[float] = None,
        anneal_steps: int = 10,
        update_bn: bool = False,
    ) -> None:
        self.swa_start = ensure_time(swa_start, TimeUnit.DURATION)
        self.swa_end = ensure_time(swa_end, TimeUnit.DURATION)
        self.update_interval = ensure_time(update_interval, TimeUnit.EPOCH)
        if self.update_interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or self.update_interval.value <= 0:
            raise ValueError(
                f"update_interval={update_interval!r} must be a positive number of 'ba' or 'ep', like '1ep'."
            )
        if swa_lr is not None and swa_lr < 0:
            raise ValueError(f"swa_lr={swa_lr!r} must be >= 0.")
        if anneal_steps < 0:
            raise ValueError(f"anneal_steps={anneal_steps!r} must be >= 0.")
        self.swa_lr, self.anneal_steps, self.update_bn = swa_lr, int(anneal_steps), bool(update_bn)
        self._event = Event.BATCH_END if self.update_interval.unit == TimeUnit.BATCH else Event.EPOCH_END
        self.averaged: Optional[AveragedModel] = None
        self._pending: Optional[Dict[str, Any]] = None
        self._start_lrs: Optional[List[List[float]]] = None
        self._active_batches = 0

    @property
    def num_averaged(self) -> int:
        """How many snapshots are in the average."""
        return int(self.averaged.n_averaged.item()) if self.averaged is not None else 0

    def _reached(self, state, time: Time) -> bool:
        if time.unit == TimeUnit.DURATION:
            return float(state.get_elapsed_duration().value) >= time.value
        return state.timestamp.get_value(time.unit) >= time.value

    def _in_window(self, state) -> bool:
        if not self._reached(state, self.swa_start):
            return False
        if self.swa_end.unit == TimeUnit.DURATION and self.swa_end.value >= 1.0:
            return True  # through the last batch
        return not self._reached(state, self.swa_end)

    def match(self, event: Event, state) -> bool:
        if event == self._event or event == Event.FIT_START or event == Event.FIT_END:
            return True
        return event == Event.BATCH_END and self.swa_lr is not None and self.averaged is not None

    def apply(self, event: Event, state, logger) -> None:
        if event == Event.FIT_START:
            if self._pending is not None:
                self._ensure_averaged(state.model)
            return None
        if event == Event.FIT_END:
            self._swap_in(state)
            return None
        if event == Event.BATCH_END and self.swa_lr is not None and self.averaged is not None:
            self._anneal_lr(state)
        if event == self._event:
            count = state.timestamp.get_value(self.update_interval.unit)
            in_window = self._in_window(state)
            if in_window and count % int(self.update_interval.value) == 0:
                self._ensure_averaged(state.model)
                self.averaged.update_parameters(state.model)
                logger.log_metrics({"swa/num_averaged": self.num_averaged}, step=state.step)
        return None

    def _ensure_averaged(self, model: torch.nn.Module) -> None:
        if self.averaged is None:
            self.averaged = AveragedModel(model)
            if self._pending is not None:
                self.averaged.load_state_dict(self._pending)
                self._pending = None

    def _anneal_lr(self, state) -> None:
        """Move each group's LR linearly from its value at the start of SWA to ``swa_lr``."""
        if self._start_lrs is None:
            self._start_lrs = [[g["lr"] for g in opt.param_groups] for opt in state.optimizers]
        self._active_batches += 1
        alpha = 1.0 if self.anneal_steps == 0 else min(1.0, self._active_batches / self.anneal_steps)
        for opt, start in zip(state.optimizers, self._start_lrs):
            for group, lr0 in zip(opt.param_groups, start):
                group["lr"] = (1.0 - alpha) * lr0 + alpha * self.swa_lr

    @torch.no_grad()
    def _swap_in(self, state) -> None:
        if self.averaged is None or self.num_averaged == 0:
            return
        model = state.model
        for param, avg in zip(model.parameters(), self.averaged.module.parameters()):
            param.copy_(avg)
        if self.update_bn:
            _recompute_batchnorm(model, state.train_dataloader, state.device_transforms)

    def state_dict(self) -> Dict[str, Any]:
        averaged = self.averaged.state_dict() if self.averaged is not None else self._pending
        return {"averaged": averaged, "start_lrs": self._start_lrs, "active_batches": self._active_batches}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._pending = state.get("averaged")
        self._start_lrs = state.get("start_lrs")
        self._active_batches = int(state.get("active_batches", 0))
        if self._pending is not None and self.averaged is not None:
            self.averaged.load_state_dict(self._pending)
            self._pending = None

    def __repr__(self) -> str:
        return f"SWA(swa_start={self.swa_start.to_timestring()!r}, update_interval={self.update_interval.to_timestring()!r}, swa_lr={self.swa_lr})"


@torch.no_grad()
def _recompute_batchnorm(model: torch.nn.Module, loader: Any, finish: Optional[Callable[[Any], Any]]) -> None:
    """One pass over ``loader`` in train mode with cumulative BatchNorm averages (like ``swa_utils.update_bn``),
    each batch finished as the loop finishes it (``finish``: the train DataSpec's ``device_transforms``)."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms or loader is None:
        return

    device = next(model.parameters()).device
    momenta = {}
    for bn in norms:
        bn.reset_running_stats()
        momenta[bn] = bn.momentum
        bn.momentum = None
    was_training = model.training
    model.train()
    for batch in loader:
        batch = move_to_device(batch, device)
        model(finish(batch) if finish is not None else batch)
    for bn, momentum in momenta.items():
        bn.momentum = momentum
    model.train(was_training)
