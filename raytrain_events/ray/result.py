"""`RayResult`: what a `RayTrainer` run produced: the global Timestamp, metrics, history, checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from raytrain_events.core.time import Timestamp

__all__ = ["RayResult"]


@dataclass
class RayResult:
    """What a run produced: the global Timestamp, metrics, history and checkpoints."""

    timestamp: Timestamp
    metrics: Dict[str, Any]
    history: List[Dict[str, Any]]
    checkpoints: List[Any] = field(default_factory=list)
    run_url: Optional[str] = None
    ray_result: Any = None
    metric: Optional[str] = None
    mode: str = "max"
    # The feeder's record of the first batch's wait (`EpochFeeder.start_report`): the prestarted (epoch, sample,
    # time), the first rank's request, whether it found the prestarted stream; None without a feeder of ours.
    data_start: Optional[Dict[str, Any]] = None

    @property
    def validations(self) -> List[Dict[str, Any]]:
        """The asynchronous validations' history entries (``validation="async"`` or ``"failed"``), as they arrived."""
        return [e for e in self.history if "validation" in e]

    @property
    def latest_checkpoint(self) -> Any:
        """The newest committed checkpoint (None if the run saved none)."""
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def best_checkpoint(self) -> Any:
        """The kept checkpoint with the best ``metric`` (`CheckpointConfig.metric`/``mode``) when it was saved.

        Without a metric, or if no kept checkpoint has a value for it, the newest checkpoint.
        """
        if not self.metric:
            return self.latest_checkpoint
        # why here: defers fsspec until this runs
        from raytrain_events.storage.fs import basename

        scores = {}
        for entry in self.history:
            value = entry.get(self.metric)
            if entry.get("checkpoint_path") and isinstance(value, (int, float)):
                scores[basename(entry["checkpoint_path"])] = float(value)
            elif entry.get("validated_checkpoint") and isinstance(value, (int, float)):  # an async validation's
                scores[entry["validated_checkpoint"]] = float(value)
        scored = [c for c in self.checkpoints if getattr(c, "name", None) in scores]
        if not scored:
            return self.latest_checkpoint
        sign = 1.0 if self.mode == "max" else -1.0
        return max(reversed(scored), key=lambda c: sign * scores[c.name])  # ties: the newest
