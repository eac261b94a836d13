"""`MLFlowLogger`: a thin wrapper over ``mlflow``, imported only when the logger is constructed.

The run starts on first use (not at construction), so a logger built on the driver can be
shipped to a worker. Metric keys keep their ``/`` (MLflow accepts them); hyperparameters are
flattened to ``a.b.c`` params.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Optional

from raytrain_events.core.logger import LoggerDestination
from raytrain_events.core.plain import flatten

__all__ = ["MLFlowLogger"]


class MLFlowLogger(LoggerDestination):
    """Log to MLflow.

    Example::

        Trainer(..., loggers=[MLFlowLogger(experiment_name="cifar", tracking_uri="http://mlflow:5000")])
    """

    def __init__(
        self,
        experiment_name: Optional[str] = None,
        run_name: Optional[str] = None,
        tracking_uri: Optional[str] = None,
        tags: Optional[Dict[str, str]] = None,
    ) -> None:
        try:
            import mlflow  # noqa: F401
        except ImportError as exc:
            raise ImportError("MLFlowLogger needs mlflow: pip install 'raytrain_events[mlflow]'.") from exc
        self.experiment_name, self.run_name = experiment_name, run_name
        self.tracking_uri, self.tags = tracking_uri, dict(tags or {})
        self._run_id: Optional[str] = None

    def _ensure_run(self):
        import mlflow

        if self._run_id is None:
            if self.tracking_uri:
                mlflow.set_tracking_uri(self.tracking_uri)
            if self.experiment_name:
                mlflow.set_experiment(self.experiment_name)
            run = mlflow.active_run() or mlflow.start_run(run_name=self.run_name, tags=self.tags or None)
            self._run_id = run.info.run_id
        return mlflow

    def log_hyperparameters(self, hyperparameters: Dict[str, Any]) -> None:
        self._ensure_run().log_params({k: str(v) for k, v in flatten(hyperparameters).items()})

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Number) and not isinstance(v, bool)}
        if numeric:
            self._ensure_run().log_metrics(numeric, step=step)

    def close(self) -> None:
        if self._run_id is not None:
            import mlflow

            mlflow.end_run()
            self._run_id = None
