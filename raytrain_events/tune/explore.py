"""Keep a PBT trial's explored optimizer settings when it loads another trial's checkpoint.

A copied run fully loads the donor's checkpoint, optimizer included, and torch's
``Optimizer.load_state_dict`` replaces every param-group value (``lr``, ``momentum``,
``weight_decay``, ...) with the donor's: the LR that PBT just perturbed in the trial's config
would be silently dropped. `KeepExploredOptimizerSettings` remembers the values the trial's own
optimizers were built with (at ``INIT``, before the checkpoint loads) and puts them back at
``FIT_START``, after it loaded; the donor's moments (momentum buffers, Adam's averages) stay. An LR
schedule keeps its position: a scheduler's ``base_lrs`` become the trial's, and the LR is the
trial's base LR times the schedule's factor at the donor's Timestamp (``donor lr / donor base lr``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from raytrain_events.core.callback import Callback

__all__ = ["KeepExploredOptimizerSettings"]


class KeepExploredOptimizerSettings(Callback):
    """After a checkpoint load, the optimizers' param-group settings come from this run's config again."""

    def __init__(self) -> None:
        self._built: Optional[List[List[Dict[str, Any]]]] = None

    def init(self, state, logger) -> None:
        self._built = [
            [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            for opt in state.optimizers
        ]

    def fit_start(self, state, logger) -> None:
        if self._built is None:
            return
        for opt, built_groups in zip(state.optimizers, self._built):
            for group, built in zip(opt.param_groups, built_groups):
                loaded_lr, loaded_base = group.get("lr"), group.get("initial_lr")
                group.update(built)
                if "initial_lr" in group and _is_number(loaded_lr) and _is_number(loaded_base) and loaded_base:
                    group["initial_lr"] = built.get("initial_lr", built.get("lr"))
                    group["lr"] = group["initial_lr"] * (loaded_lr / loaded_base)  # the schedule's position
        for scheduler in state.schedulers:
            if hasattr(scheduler, "base_lrs") and getattr(scheduler, "optimizer", None) is not None:
                scheduler.base_lrs = [g.get("initial_lr", g["lr"]) for g in scheduler.optimizer.param_groups]
        self._built = None  # once: a later fit() of the same trainer continues as it is


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
