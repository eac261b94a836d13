"""Loggers on Ray: the shipped logger destinations fed from the driver's run history.

Each history entry is one report round, already reduced across ranks by the controller
(`raytrain_events.ray.reports.aggregate`), so every metric reaches a destination once, not once per
rank, with the global `Timestamp` as its step (``step="sample"`` or ``"batch"``). Inside a Ray
Tune trial each destination's run is named after the trial and its algorithm set
(`name_destination`): MLflow and W&B run names, a TensorBoard sub-directory, a file-name suffix.
"""

from __future__ import annotations

import copy
import numbers
import os
from typing import Any, Dict, List, Optional, Sequence

from raytrain_events.core.logger import LoggerDestination
from raytrain_events.loggers import FileLogger, MLFlowLogger, TensorBoardLogger, WandBLogger

__all__ = ["RunLoggers", "name_destination", "STEP_UNITS"]

STEP_UNITS = ("sample", "batch", "token", "epoch")
_NOT_METRICS = ("time/", "wall_time", "attempt", "final", "world_size", "checkpoint_path")


class RunLoggers:
    """A `HistoryFollower` consumer that logs every new entry to ``destinations``."""

    def __init__(
        self, destinations: Sequence[LoggerDestination], step: str = "sample", hyperparameters: Optional[Dict] = None
    ) -> None:
        if step not in STEP_UNITS:
            raise ValueError(f"log_step={step!r}: use one of {', '.join(STEP_UNITS)} (the global Timestamp's units).")
        self.destinations = list(destinations)
        self.step_key = f"time/{step}"
        self.hyperparameters = hyperparameters
        self._started = False
        self._last_step: Optional[int] = None
        self._last: Dict[str, float] = {}

    def __call__(self, new: List[Dict[str, Any]], entries: List[Dict[str, Any]]) -> None:
        if not self._started:
            self._started = True
            if self.hyperparameters is not None:
                for destination in self.destinations:
                    destination.log_hyperparameters(dict(self.hyperparameters))
        for entry in new:
            step = int(entry.get(self.step_key, 0))
            metrics = metrics_of(entry)
            if step == self._last_step:  # the final report repeats the last one's metrics at the same step
                metrics = {k: v for k, v in metrics.items() if self._last.get(k) != v}
            if metrics:
                for destination in self.destinations:
                    destination.log_metrics(metrics, step=step)
            if step != self._last_step:
                self._last = {}
            self._last.update(metrics)
            self._last_step = step

    def close(self) -> None:
        for destination in self.destinations:
            destination.close()


def metrics_of(entry: Dict[str, Any]) -> Dict[str, float]:
    """The loggable metrics of a history entry: numbers, without counters and bookkeeping."""
    return {
        k: float(v)
        for k, v in entry.items()
        if not k.startswith(_NOT_METRICS) and isinstance(v, numbers.Number) and not isinstance(v, bool)
    }


def name_destination(destination: LoggerDestination, name: str) -> LoggerDestination:
    """A copy of ``destination`` whose run is called ``name`` (a Tune trial and its algorithm set).

    MLflow and W&B: the run name (unless one was given); TensorBoard: a ``name`` sub-directory of
    its log dir; a file logger: ``name`` before the file's extension. Others are returned as they are.
    """

    named = copy.copy(destination)
    if isinstance(named, MLFlowLogger):
        named.run_name = named.run_name or name
    elif isinstance(named, WandBLogger):
        named.init_kwargs = {**named.init_kwargs, "name": named.init_kwargs.get("name") or name}
    elif isinstance(named, TensorBoardLogger):
        named.log_dir = os.path.join(named.log_dir, name)
    elif isinstance(named, FileLogger):
        root, ext = os.path.splitext(named.path)
        named.path = f"{root}-{name}{ext}"
    else:
        return destination
    return named
