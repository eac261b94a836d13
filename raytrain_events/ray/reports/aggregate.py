"""Driver-side aggregation of worker reports into one global `Timestamp` and metrics history.

`ReportAggregator` is pure (tested without Ray): given one report per rank, it sums the
rank-local sample and token counts into the global counts, checks them against the global
`Timestamp` every worker computed (a mismatch raises `TimestampMismatchError`), reduces the
metrics across ranks and appends one history entry. `AggregatingCallback` runs it on Ray
Train's controller and forwards each entry to the driver's `RunHistory` actor (and to Tune).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from raytrain_events.core.time import COUNTER_UNITS
from raytrain_events.ray.checkpointing.validation import ASKED_KEY

__all__ = ["ReportAggregator", "TimestampMismatchError", "reduce_metrics", "SAVE_PENDING_KEY"]

COUNTERS = tuple(COUNTER_UNITS)
#: A report (and its history entry) made while a save that came due waits for the previous upload: its checkpoint
#: follows in a later report. The driver's history and loggers take it; Tune does not (`AggregatingCallback`).
SAVE_PENDING_KEY = "save_pending"


class TimestampMismatchError(RuntimeError):
    """The workers' global Timestamp disagrees with the sum of their rank-local counts."""


def reduce_metrics(reports: List[Dict[str, Any]]) -> Dict[str, float]:
    """Reduce per-rank metrics: train loss weighted by batches, every other metric averaged.

    Eval metrics are torchmetrics values already synchronized across ranks, so their mean is
    the global value; train loss is each rank's own, so it is averaged over all ranks' batches.
    """
    out: Dict[str, float] = {}
    loss_count = sum(r.get("train_loss_count", 0) for r in reports)
    if loss_count:
        out["train/loss"] = sum(r.get("train_loss_sum", 0.0) for r in reports) / loss_count
    keys: Dict[str, List[float]] = {}
    for report in reports:
        for key, value in report.get("metrics", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                keys.setdefault(key, []).append(float(value))
    for key, values in keys.items():
        out[key] = math.fsum(values) / len(values)
    return out


class ReportAggregator:
    """Sums per-rank counts into the driver's global timestamp and keeps the history."""

    def __init__(self) -> None:
        self.timestamp: Dict[str, int] = {name: 0 for name in COUNTERS}
        self.history: List[Dict[str, Any]] = []
        self.attempt = 0

    def add(self, reports: List[Dict[str, Any]], checkpoint_path: Optional[str] = None) -> Dict[str, Any]:
        """Fold one round of reports (``reports[i]`` from rank ``i``) in; return the new entry."""
        if not reports:
            raise ValueError("No worker reports to aggregate.")
        starts = [r.get("start") for r in reports]
        if any(s is not None for s in starts):
            if any(s != starts[0] for s in starts):
                raise TimestampMismatchError(f"Workers started from different timestamps: {starts}.")
            # A new worker group (first run, or a restart from a checkpoint): counts restart there.
            self.attempt += 1
            self.timestamp = {name: int(starts[0][name]) for name in COUNTERS}
            started = [r["started_at"] for r in reports if r.get("started_at") is not None]
            # Where and when this group started: the goodput report's restarts (report/goodput.py).
            new_attempt: Dict[str, Any] = {"resumed_from_batch": int(starts[0]["batch"])}
            if started:
                new_attempt["attempt_started_at"] = min(started)
        self.timestamp["sample"] += sum(int(r["local_samples"]) for r in reports)
        self.timestamp["token"] += sum(int(r["local_tokens"]) for r in reports)
        first = reports[0]["timestamp"]
        self.timestamp["batch"] = int(first["batch"])
        self.timestamp["epoch"] = int(first["epoch"])
        for rank, report in enumerate(reports):
            worker_ts = report["timestamp"]
            wrong = {k: (worker_ts[k], self.timestamp[k]) for k in COUNTERS if int(worker_ts[k]) != self.timestamp[k]}
            if wrong:
                detail = ", ".join(f"{k}: worker {w} vs driver {d}" for k, (w, d) in wrong.items())
                raise TimestampMismatchError(
                    f"Rank {rank}'s global Timestamp disagrees with the sum of all ranks' local counts ({detail}). "
                    "Every rank must count the samples and tokens it trained on; check get_num_tokens_in_batch."
                )
        entry: Dict[str, Any] = {f"time/{name}": value for name, value in self.timestamp.items()}
        entry.update(reduce_metrics(reports))
        entry["attempt"] = self.attempt
        if any(s is not None for s in starts):
            entry.update(new_attempt)
        entry["final"] = bool(reports[0].get("final", False))
        entry["world_size"] = len(reports)
        if reports[0].get(SAVE_PENDING_KEY):  # the ranks agree on it (`RayReporter._save_pending`)
            entry[SAVE_PENDING_KEY] = True
        if checkpoint_path is not None:
            entry["checkpoint_path"] = checkpoint_path
            if reports[0].get(ASKED_KEY):  # rank 0 asked Ray Train to validate it (`RayReporter._send`)
                entry[ASKED_KEY] = True
        self.history.append(entry)
        return entry
