"""`ThresholdStopper`: stop training once a monitored eval metric reaches a threshold.

After every evaluation (``EVAL_END``) the monitored value is compared with ``threshold``:
``"max"`` stops when ``value >= threshold``, ``"min"`` when ``value <= threshold``; a function
``(value, threshold) -> bool`` decides otherwise. The stop is ``consistent=True`` (eval metrics
are synchronized across ranks). Composer's ``ThresholdStopper``.
"""

from __future__ import annotations

from typing import Any, Dict

from raytrain_events.callbacks._monitor import Comparator, check_monitor_label, read_metric, resolve_comparator
from raytrain_events.core.callback import Callback
from raytrain_events.core.plain import to_python

__all__ = ["ThresholdStopper"]


class ThresholdStopper(Callback):
    """Stop once ``monitor`` reaches ``threshold``.

    Example::

        Trainer(..., callbacks=[ThresholdStopper("metrics/eval/accuracy", threshold=0.9)])
    """

    def __init__(self, monitor: str, threshold: float, comparator: Comparator = "max") -> None:
        self.monitor, self.threshold, self.comparator = monitor, float(threshold), comparator
        self._reached = resolve_comparator(comparator, inclusive=True)
        self.stopped_at_value = None

    def fit_start(self, state, logger) -> None:
        check_monitor_label(self.monitor, state, "ThresholdStopper")

    def eval_end(self, state, logger) -> None:
        value = read_metric(self.monitor, state, logger, "ThresholdStopper")
        if value is None:
            return
        value = float(to_python(value))
        if self._reached(value, self.threshold):
            self.stopped_at_value = value
            state.stop_training(
                f"ThresholdStopper: {self.monitor}={value:.6g} reached {self.threshold:.6g}", consistent=True
            )

    def state_dict(self) -> Dict[str, Any]:
        return {"stopped_at_value": self.stopped_at_value}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.stopped_at_value = state.get("stopped_at_value")
