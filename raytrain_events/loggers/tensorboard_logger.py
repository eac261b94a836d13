"""`TensorBoardLogger`: scalars to a TensorBoard event file via tensorboardX.

Every numeric metric becomes ``add_scalar(key, value, step)``; hyperparameters are written once
as a JSON text summary. tensorboardX is imported when the logger is constructed, so importing
this module costs nothing.
"""

from __future__ import annotations

import json
import numbers
from typing import Any, Dict, Optional

from raytrain_events.core.logger import LoggerDestination

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(LoggerDestination):
    """Write metrics to TensorBoard event files in ``log_dir``.

    Example::

        Trainer(..., loggers=[TensorBoardLogger("runs/exp1/tb")])
    """

    def __init__(self, log_dir: str, flush_secs: int = 30) -> None:
        try:
            import tensorboardX  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "TensorBoardLogger needs tensorboardX: pip install tensorboardX "
                "(or pip install 'raytrain_events[tensorboard]')."
            ) from exc
        self.log_dir, self.flush_secs = str(log_dir), int(flush_secs)
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=self.log_dir, flush_secs=self.flush_secs)
        return self._writer

    def log_hyperparameters(self, hyperparameters: Dict[str, Any]) -> None:
        self.writer.add_text("hyperparameters", json.dumps(hyperparameters, default=str, indent=2), 0)

    def log_metrics(self, metrics: Dict[str, Any], step: Optional[int] = None) -> None:
        writer = self.writer
        for key, value in metrics.items():
            if isinstance(value, numbers.Number) and not isinstance(value, bool):
                writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_writer"] = None
        return state
