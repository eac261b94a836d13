"""Logger destinations: where metrics go. Each subclasses `raytrain_events.LoggerDestination`.

Destinations are attached on rank 0 (or on the driver), never once per rank. Third-party
packages (tensorboardX, mlflow, wandb) are imported when a logger is constructed, so importing
this package needs none of them; a missing one raises ImportError naming the install command.

Example::

    from raytrain_events.loggers import FileLogger, TensorBoardLogger

    Trainer(..., loggers=[FileLogger("run/metrics.jsonl"), TensorBoardLogger("run/tb")])

Files:

* ``file_logger.py``: `FileLogger`: metrics as JSON lines, one object per ``log_metrics`` call.
* ``mlflow_logger.py``: `MLFlowLogger`: a thin wrapper over ``mlflow``, imported only when the
  logger is constructed.
* ``tensorboard_logger.py``: `TensorBoardLogger`: scalars to a TensorBoard event file via
  tensorboardX.
* ``wandb_logger.py``: `WandBLogger`: a thin wrapper over Weights & Biases, imported only when the
  logger is constructed.
"""

from raytrain_events.loggers.file_logger import FileLogger
from raytrain_events.loggers.mlflow_logger import MLFlowLogger
from raytrain_events.loggers.tensorboard_logger import TensorBoardLogger
from raytrain_events.loggers.wandb_logger import WandBLogger

__all__ = ["FileLogger", "MLFlowLogger", "TensorBoardLogger", "WandBLogger"]
