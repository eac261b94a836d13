"""Ray Train glue: the driver (`RayTrainer`), the worker entry point, reports and aggregation.

Data flows one way: the driver's `RunSpec` goes to every worker, each worker runs the same
`Trainer` over its shard, reports rank-local counts and metrics at intervals, and a controller
callback sums them into the driver's global `Timestamp` and metrics history.
"""

from raytrain_events.ray.driver import RayResult, RayTrainer
from raytrain_events.ray.spec import RunSpec

__all__ = ["RayTrainer", "RayResult", "RunSpec"]
