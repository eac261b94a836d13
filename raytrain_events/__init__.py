"""raytrain_events: an event-driven PyTorch training loop that scales on Ray Train.

Importing this package imports nothing heavy: neither torch, Ray nor fsspec, and installs no
signal handlers. Every public name loads its module on first use, so a process that needs one
light piece (a Ray actor of ours that only orders data, say) does not pay torch's import.

Subpackages (each ``__init__.py`` maps its own files):

* ``core/``: the pure logic: State, Event, Engine, Algorithm, Callback, Time/Timestamp (no Ray, no
  fsspec, no I/O).
* ``trainer/``: the loop (`Trainer`, `LoopOptions`) and its helpers; ``parallel/``: DDP/FSDP/TP
  wrapping.
* ``algorithms/``, ``callbacks/``, ``loggers/``, ``schedulers/``: one small file each.
* ``storage/``: fsspec storage, run directories (`RunDir`), locks; ``checkpoint/``: checkpoints on
  any fsspec URL.
* ``data/``: the data path: the train order's values, the local `MixtureLoader` and its per-source
  counts, and on Ray the feeder, loaders and seekable sources (``data/ray/``).
* ``ray/``: Ray Train glue (`RayTrainer`, its run plan, worker guards, reports); ``tune/``: Ray
  Tune sweeps.
* ``report/``: run and sweep reports; ``cli/``: the command line.

Files:

* ``__main__.py``: ``python -m raytrain_events`` and the ``raytrain-events`` console script.
* ``_torch_compat.py``: Every private torch name this package uses, in one place (the torch
  counterpart of `raytrain_events.ray._compat`).
* ``dist.py``: The small distributed interface the loop knows: rank, world size, and summing
  counters.
* ``hf.py``: Hugging Face ``transformers`` models in the loop (``pip install
  raytrain_events[hf]``).
* ``lazy_names.py``: A package's public names, each loaded from its module on first use (a PEP 562
  ``__getattr__``).
* ``metrics.py``: Small torchmetrics metrics the shipped models use (synchronized across ranks by
  torchmetrics).
* ``models.py``: Adapters that give a plain ``nn.Module`` the model protocol the loop expects.
"""

from typing import TYPE_CHECKING

from raytrain_events.lazy_names import lazy_names

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads these on first use
    from raytrain_events.checkpoint.config import CheckpointConfig
    from raytrain_events.core.algorithm import Algorithm
    from raytrain_events.core.callback import Callback, QuorumChange
    from raytrain_events.core.data_spec import DataSpec
    from raytrain_events.core.engine import Engine, Trace
    from raytrain_events.core.event import Event
    from raytrain_events.core.logger import Logger, LoggerDestination
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.core.precision import Precision
    from raytrain_events.core.state import State
    from raytrain_events.core.time import Time, Timestamp, TimeUnit, ensure_time
    from raytrain_events.data.mixture_loader import MixtureLoader
    from raytrain_events.parallel.config import FSDPConfig
    from raytrain_events.ray.driver import RayTrainer
    from raytrain_events.trainer import Evaluator, LoopOptions, Trainer, seed_everything

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "Callback",
    "QuorumChange",
    "DataSpec",
    "Engine",
    "Event",
    "Evaluator",
    "Logger",
    "LoggerDestination",
    "Mixture",
    "MixtureLoader",
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
    "Algorithm": "raytrain_events.core.algorithm",
    "Callback": "raytrain_events.core.callback",
    "QuorumChange": "raytrain_events.core.callback",
    "DataSpec": "raytrain_events.core.data_spec",
    "Engine": "raytrain_events.core.engine",
    "Trace": "raytrain_events.core.engine",
    "Event": "raytrain_events.core.event",
    "Logger": "raytrain_events.core.logger",
    "LoggerDestination": "raytrain_events.core.logger",
    "Mixture": "raytrain_events.core.mixture",
    "MixtureLoader": "raytrain_events.data.mixture_loader",
    "Precision": "raytrain_events.core.precision",
    "State": "raytrain_events.core.state",
    "Time": "raytrain_events.core.time",
    "Timestamp": "raytrain_events.core.time",
    "TimeUnit": "raytrain_events.core.time",
    "ensure_time": "raytrain_events.core.time",
    "Evaluator": "raytrain_events.trainer",
    "LoopOptions": "raytrain_events.trainer",
    "Trainer": "raytrain_events.trainer",
    "seed_everything": "raytrain_events.trainer",
    "RayTrainer": "raytrain_events.ray.driver",
    "CheckpointConfig": "raytrain_events.checkpoint.config",
    "FSDPConfig": "raytrain_events.parallel.config",
}


__getattr__ = lazy_names(__name__, {**_LAZY, "tune": "raytrain_events.tune"}, globals())


def __dir__() -> "list[str]":
    return sorted(set(globals()) | set(__all__))
