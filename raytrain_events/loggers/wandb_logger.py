"""`WandBLogger`: a thin wrapper over Weights & Biases, imported only when the logger is constructed.

``wandb.init`` runs on first use (not at construction), so a logger built on the driver can be
shipped to a worker; extra keyword arguments go to ``wandb.init``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from raytrain_events.core.logger import LoggerDestination

__all__ = ["WandBLogger"]


class WandBLogger(LoggerDestination):
    """Log to Weights & Biases.

    Example::

        Trainer(..., loggers=[WandBLogger(project="cifar", name="resnet18-mixup")])
    """

    def __init__(
        self,
        project: Optional[str] = None,
        entity: Optional[str] = None,
        name: Optional[str] = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb  # noqa: F401
        except ImportError as exc:
            raise ImportError("WandBLogger needs wandb: pip install 'raytrain_events[wandb]'.") from exc
        self.init_kwargs = {"project": project, "entity": entity, "name": name, **init_kwargs}
        self._run = None

    def _ensure_run(self):
        if self._run is None:
            import wandb

            self._run = wandb.run or wandb.init(**{k: v for k, v in self.init_kwargs.items() if v is not None})
        return self._run

    def log_hyperparameters(self, hyperparameters: Dict[str, Any]) -> None:
        self._ensure_run().config.update(hyperparameters, allow_val_change=True)

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        self._ensure_run().log(dict(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_run"] = None
        return state
