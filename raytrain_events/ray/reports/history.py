"""The driver's record of a run: a small Ray actor the controller pushes history entries to.

The driver owns it and reads it during ``fit()`` (progress bar) and after (result); nothing
flows back to the workers.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import ray
from ray.train import UserCallback

from raytrain_events.ray.reports.aggregate import ReportAggregator

__all__ = ["RunHistory", "AggregatingCallback"]


@ray.remote(num_cpus=0)
class RunHistory:
    """Holds the aggregated history entries of one run."""

    def __init__(self) -> None:
        self.entries: List[Dict[str, Any]] = []
        self.error: Optional[str] = None

    def add(self, entry: Dict[str, Any]) -> None:
        self.entries.append(entry)

    def set_error(self, message: str) -> None:
        self.error = message

    def get(self) -> Dict[str, Any]:
        return {"entries": list(self.entries), "error": self.error}

    def since(self, index: int) -> List[Dict[str, Any]]:
        """The entries from ``index`` on (the driver follows the run incrementally)."""
        return self.entries[index:]

    def latest(self) -> Optional[Dict[str, Any]]:
        return self.entries[-1] if self.entries else None


class AggregatingCallback(UserCallback):
    """Ray Train controller callback: aggregate each report round and forward it."""

    def __init__(self, history: Any, report_queue: Any = None) -> None:
        self.history = history
        self.report_queue = report_queue  # a ray.util.queue.Queue (RayTrainer.fit(report_queue=...)) or None
        self.aggregator = ReportAggregator()

    def after_report(self, run_context, metrics, checkpoint) -> None:
        path = checkpoint.path if checkpoint is not None else None
        try:
            entry = self.aggregator.add(list(metrics), checkpoint_path=path)
        except Exception as exc:
            self.history.set_error.remote(f"{type(exc).__name__}: {exc}")
            raise
        entry["wall_time"] = time.time()  # the report's arrival: throughput and the report's time axis
        self.history.add.remote(entry)
        if self.report_queue is not None:
            self.report_queue.put(dict(entry))
