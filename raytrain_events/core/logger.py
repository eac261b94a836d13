"""A minimal metrics logger shared by algorithms and callbacks.

Values may be tensors: the logger stores them as they are and never reads them back from the
device, so logging every batch costs no host sync. Destinations (files, TensorBoard, ...)
receive metrics where they are attached: on rank 0 or on the driver, never once per rank.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from raytrain_events.core.plain import to_python  # noqa: F401  (its old home; the converter lives in core/plain.py)

__all__ = ["Logger", "LoggerDestination", "to_python"]


class LoggerDestination:
    """Where metrics go (a file, TensorBoard, MLflow, ...). Override what you need."""

    def log_hyperparameters(self, hyperparameters: Dict[str, Any]) -> None:
        """Record run configuration once."""

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        """Record metrics (already plain floats) at a global batch ``step``."""

    def close(self) -> None:
        """Flush and release resources."""


class Logger:
    """Collects the latest value of each metric and forwards metrics to destinations.

    ``logger.metrics`` always holds the latest value per key (possibly a tensor); the Ray
    worker reads it at report time and reduces it across ranks.
    """

    def __init__(self, destinations: Sequence[LoggerDestination] = ()) -> None:
        self.destinations: List[LoggerDestination] = list(destinations)
        self.metrics: Dict[str, Any] = {}
        self.hyperparameters: Dict[str, Any] = {}

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        """Store ``metrics``; destinations get them as floats (one host read per call)."""
        self.metrics.update(metrics)
        if self.destinations:
            plain = {k: to_python(v) for k, v in metrics.items()}
            for destination in self.destinations:
                destination.log_metrics(plain, step)

    def log_hyperparameters(self, hyperparameters: Dict[str, Any]) -> None:
        """Store and forward run configuration."""
        self.hyperparameters.update(hyperparameters)
        for destination in self.destinations:
            destination.log_hyperparameters(dict(hyperparameters))

    def close(self) -> None:
        """Close every destination."""
        for destination in self.destinations:
            destination.close()
