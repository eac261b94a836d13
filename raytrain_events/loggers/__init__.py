"""Logger destinations: where metrics go. Each subclasses `raytrain_events.LoggerDestination`.

Destinations are attached on rank 0 (or on the driver), never once per rank. Third-party
packages (tensorboardX, mlflow, wandb) are imported when a logger is constructed, so importing
this package needs none of them; a missing one raises ImportError naming the install command.

Example::

    from raytrain_events.loggers import FileLogger, TensorBoardLogger

    Trainer(..., loggers=[FileLogger("run/metrics.jsonl"), TensorBoardLogger("run/tb")])
"""

from raytrain_events.loggers.file_logger import FileLogger
from raytrain_events.loggers.mlflow_logger import MLFlowLogger
from raytrain_events.loggers.tensorboard_logger import TensorBoardLogger
from raytrain_events.loggers.wandb_logger import WandBLogger

__all__ = ["FileLogger", "MLFlowLogger", "TensorBoardLogger", "WandBLogger"]
