"""`EarlyStopper`: stop training when a monitored eval metric stops improving.

After every evaluation (``EVAL_END``) it reads the monitored value (``metrics/<label>/<name>``,
as the loop logs it). A value better than the best so far by more than ``min_delta`` becomes
the new best. Once more than ``patience`` (a `Time`, e.g. ``"2ep"`` or ``"500ba"``) has passed
since the best value, it calls ``state.stop_training(..., consistent=True)``: eval metrics are
synchronized across ranks, so every rank takes the same decision at the same batch.
Composer's ``EarlyStopper``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

from raytrain_events.callbacks._monitor import Comparator, check_monitor_label, read_metric, resolve_comparator
from raytrain_events.core.callback import Callback
from raytrain_events.core.plain import to_python
from raytrain_events.core.time import Time, TimeUnit, ensure_time

__all__ = ["EarlyStopper"]


class EarlyStopper(Callback):
    """Stop when ``monitor`` has not improved for more than ``patience``.

    Example::

        Trainer(..., eval_dataloader=val, callbacks=[EarlyStopper("metrics/eval/accuracy", "max", patience="2ep")])

    Args:
        monitor: the logged metric key.
        comparator: ``"max"`` (higher is better), ``"min"``, or a function ``(new, best) -> bool``.
        patience: how long without improvement to tolerate; an int means epochs.
        min_delta: the smallest change that counts as an improvement.
    """

    def __init__(
        self,
        monitor: str = "metrics/eval/accuracy",
        comparator: Comparator = "max",
        patience: Union[str, int, Time] = "2ep",
        min_delta: float = 0.0,
    ) -> None:
        self.monitor = monitor
        self.comparator = comparator
        self._better = resolve_comparator(comparator, inclusive=False)
        self.patience = ensure_time(patience, TimeUnit.EPOCH)
        if self.patience.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.TOKEN):
            raise ValueError(f"patience={patience!r} must be in 'ep', 'ba', 'sp' or 'tok', like '2ep'.")
        if min_delta < 0:
            raise ValueError(f"min_delta={min_delta!r} must be >= 0.")
        self.min_delta = float(min_delta)
        self.best: Optional[float] = None
        self.best_at: Optional[int] = None  # timestamp count in patience's unit
        self._seen: Any = None

    def fit_start(self, state, logger) -> None:
        check_monitor_label(self.monitor, state, "EarlyStopper")

    def eval_end(self, state, logger) -> None:
        value = read_metric(self.monitor, state, logger, "EarlyStopper")
        if value is None or value is self._seen:
            return  # not computed yet, or another eval dataset finished (same object as last time)
        self._seen = value
        value = float(to_python(value))
        now = state.timestamp.get_value(self.patience.unit)
        if self.best is None or (self._better(value, self.best) and abs(value - self.best) > self.min_delta):
            self.best, self.best_at = value, now
        elif now - self.best_at > self.patience.value:
            state.stop_training(
                f"EarlyStopper: {self.monitor} has not improved on {self.best:.6g} for {now - self.best_at}"
                f"{self.patience.unit.value} (patience {self.patience.to_timestring()})",
                consistent=True,
            )

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best, "best_at": self.best_at}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.best, self.best_at = state.get("best"), state.get("best_at")
