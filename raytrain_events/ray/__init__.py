"""Ray Train glue: the driver (`RayTrainer`), the worker entry point, reports and aggregation.

Data flows one way: the driver's `RunSpec` goes to every worker, each worker runs the same
`Trainer` over its shard, reports rank-local counts and metrics at intervals, and a controller
callback sums them into the driver's global `Timestamp` and metrics history.

Asynchronous validation (``RayTrainer(validation=AsyncValidation(...))``): `validation.py` holds the
option and the history bookkeeping, `validate_checkpoint.py` the Ray task that loads a checkpoint
and evaluates it while training goes on.
"""

from typing import TYPE_CHECKING

from raytrain_events.lazy_names import lazy_names

if TYPE_CHECKING:
    from raytrain_events.ray.driver import RayResult, RayTrainer
    from raytrain_events.ray.spec import RunSpec
    from raytrain_events.ray.validation import AsyncValidation

__all__ = ["AsyncValidation", "RayTrainer", "RayResult", "RunSpec"]

# Loaded on first use: Ray actors of ours (the data feeder, the run history) import modules of this
# package and must not pay for the driver's imports (torch among them).
_LAZY = {
    "RayTrainer": "raytrain_events.ray.driver",
    "RayResult": "raytrain_events.ray.driver",
    "RunSpec": "raytrain_events.ray.spec",
    "AsyncValidation": "raytrain_events.ray.validation",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())
