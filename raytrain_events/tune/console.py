"""A sweep's console: one line per trial event instead of Tune's periodic status tables.

`SweepConsole` is a Tune callback on the sweep's driver. It prints when a trial starts or restarts (its
algorithm set and other parameters), each report it makes (global samples, loss, the sweep's
metric), when the scheduler stops it early (with why: the scheduler, where, and the metric
there) and when it finishes or fails. `sweep` passes it and turns Tune's own reporter off
(``verbose=1``); ``verbose>=2`` gives Tune's tables back.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Set

from ray.tune import Callback

from raytrain_events.ray import _compat
from raytrain_events.tune.sets import algorithm_set_label, normalize_set

__all__ = ["SweepConsole", "trial_label"]


def trial_label(config: Dict[str, Any]) -> str:
    """The trial's algorithm set, as the sweep's table names it."""

    if "algorithms" not in (config or {}):
        return "-"
    return algorithm_set_label(normalize_set(config["algorithms"]))


#: Tune classes whose documented (alias) name is the one users write.
_SCHEDULER_NAMES = {"AsyncHyperBandScheduler": "ASHAScheduler"}


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class SweepConsole(Callback):
    """Print one line per trial event (see the module docstring)."""

    def __init__(
        self, metric: str, mode: str, scheduler: Any = None, print_fn: Optional[Callable[[str], None]] = None
    ) -> None:
        self.metric, self.mode = metric, mode
        name = type(scheduler).__name__ if scheduler is not None else None
        self.scheduler_name = _SCHEDULER_NAMES.get(name, name) if name else None
        self.time_attr = _compat.scheduler_time_attr(scheduler) or "time/sample"
        self._print = print_fn or (lambda line: print(line, file=sys.stdout, flush=True))
        self._last: Dict[str, Dict[str, Any]] = {}
        self._metric: Dict[str, Any] = {}  # the trial's last reported value of the sweep's metric
        self._started: Set[str] = set()

    def _line(self, trial: Any, text: str) -> None:
        self._print(f"[sweep] {trial.trial_id} ({trial_label(trial.config)}): {text}")

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        params = {k: v for k, v in (trial.config or {}).items() if k != "algorithms"}
        # Again (PBT copied another trial into it with a new config, or Tune retries it): say so.
        again = "restarted" if trial.trial_id in self._started else "started"
        self._started.add(trial.trial_id)
        self._line(trial, again + (f" with {params}" if params else ""))

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: Dict[str, Any], **info: Any) -> None:
        if (
            "validation" not in result
        ):  # an async validation's result is at an earlier checkpoint (ray/checkpointing/validation.py)
            self._last[trial.trial_id] = dict(result)
        if result.get(self.metric) is not None:
            self._metric[trial.trial_id] = result[self.metric]
        parts = [f"sample {result.get('time/sample', 0):,}", f"epoch {result.get('time/epoch', 0)}"]
        if isinstance(result.get("train/loss"), float):
            parts.append(f"loss {result['train/loss']:.4g}")
        if result.get(self.metric) is not None:
            parts.append(f"{self.metric} {_fmt(result[self.metric])}")
        self._line(trial, "reported " + ", ".join(parts))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        last = self._last.get(trial.trial_id) or dict(getattr(trial, "last_result", None) or {})
        value = self._metric.get(trial.trial_id, last.get(self.metric))
        where = f"{self.time_attr}={last.get(self.time_attr)}"
        if last.get("final") or self.scheduler_name is None:
            self._line(trial, f"finished at {where}, {self.metric} {_fmt(value)}")
        else:
            self._line(
                trial,
                f"stopped by {self.scheduler_name} at {where}: {self.metric} {_fmt(value)} was not among the "
                f"{'highest' if self.mode == 'max' else 'lowest'} of the trials that reached that point",
            )

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        error = getattr(trial, "error_file", None) or "see the trial's error.txt"
        self._line(trial, f"failed ({error})")
