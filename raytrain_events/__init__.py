"""raytrain_events: an event-driven PyTorch training loop that scales on Ray Train.

Importing this package imports neither Ray nor fsspec and installs no signal handlers; the
Ray-facing names (`RayTrainer`, `tune`) load on first use.
"""

from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.callback import Callback
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.core.engine import Engine, Trace
from raytrain_events.core.event import Event
from raytrain_events.core.logger import Logger, LoggerDestination
from raytrain_events.core.precision import Precision
from raytrain_events.core.state import State
from raytrain_events.core.time import Time, Timestamp, TimeUnit, ensure_time
from raytrain_events.trainer import Evaluator, LoopOptions, Trainer, seed_everything

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "Callback",
    "DataSpec",
    "Engine",
    "Event",
    "Evaluator",
    "Logger",
    "LoggerDestination",
    "Precision",
    "State",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Trace",
    "Trainer",
    "LoopOptions",
    "ensure_time",
    "seed_everything",
    "RayTrainer",
    "CheckpointConfig",
    "FSDPConfig",
    "__version__",
]

_LAZY = {
    "RayTrainer": ("raytrain_events.ray.driver", "RayTrainer"),
    "CheckpointConfig": ("raytrain_events.checkpoint.config", "CheckpointConfig"),
    "FSDPConfig": ("raytrain_events.parallel.config", "FSDPConfig"),
}


def __getattr__(name: str):
    if name == "tune":  # the sweep API module, imported on first use (it imports Ray Tune)
        import importlib

        return importlib.import_module("raytrain_events.tune")
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'raytrain_events' has no attribute {name!r}")
