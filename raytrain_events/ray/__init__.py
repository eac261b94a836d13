"""Ray Train glue: the driver (`RayTrainer`), the worker entry point, reports and aggregation.

Data flows one way: the driver's `RunSpec` goes to every worker, each worker runs the same
`Trainer` over its shard, reports rank-local counts and metrics at intervals, and a controller
callback sums them into the driver's global `Timestamp` and metrics history.

The subpackages:

* ``guards/``: worker guards: start-up health check, progress watchdog, preemption.
* ``reports/``: worker reports, their aggregation into the run's history, the driver's console,
  progress bar and loggers.
* ``checkpointing/``: checkpoints registered with Ray Train, and asynchronous validation
  (``RayTrainer(validation=AsyncValidation(...))``).
* ``fault_tolerance/``: how a run survives a failure, one strategy chosen on the driver: restarts of the
  worker group, or torchft replica groups; it hands the driver and the workers their parts.

The modules here are the entry points: the driver (``driver.py``, with its checks and options, and the
run's plan it ships to the workers, ``plan.py``),
the worker's function (``worker.py``), connecting to Ray (``cluster.py``, ``embedded.py``), torchft
replica groups, and the one table of Ray's private names (``_compat.py``).

Files:

* ``_compat.py``: Every private Ray name this package uses, in one place.
* ``_compat_data.py``: Ray Data's private names and the object store's byte counters (part of `_compat`'s table).
* ``_compat_lookup.py``: How `_compat` reaches a private Ray name: `RayCompatError` naming the Ray version and the name.
* ``_compat_train.py``: Ray Train V2's private names on a worker (part of `_compat`'s table).
* ``_compat_worker_group.py``: Ray Train V2's worker group, made to build replica groups of several workers
  (part of `_compat`'s table).
* ``cluster.py``: Connect to Ray: the existing cluster when there is one, else an embedded local
  instance.
* ``driver.py``: `RayTrainer`: run the event-driven `Trainer` on every Ray Train worker, from the
  driver.
* ``data_checks.py``: What the driver checks of the datasets before Ray starts, from metadata only:
  ``columns`` and ``steps_per_epoch`` against the train set.
* ``driver_checks.py``: What `RayTrainer` checks on the driver before Ray starts, so a bad run fails
  in seconds, not after start-up.
* ``embedded.py``: The environment of an embedded local Ray instance: what is set before
  ``ray.init`` starts it.
* ``plan.py``: `RunPlan`: the run's decisions (global batch, train order, mixture run, checkpoint
  plan), made once on the driver from the `RunSpec` and shipped to the workers.
* ``result.py``: `RayResult`: what a `RayTrainer` run produced: the global Timestamp, metrics, history,
  checkpoints.
* ``replica_abort.py``: Replica groups: a peer's failure ends every survivor's pending all-reduce at once,
  wherever it sits in the ring.
* ``replica_checks.py``: Which runs ``fault_tolerance="replica_groups"`` supports, checked on the
  driver before Ray starts; Ray's ``TorchftConfig`` for them.
* ``replica_groups.py``: Replica groups on the worker: the loop under torchft, each step committed
  or trained again.
* ``replica_lighthouse.py``: Replica groups lose their Lighthouse: the run stops with the reason and
  the fix.
* ``replica_loader.py``: Replica groups on the worker: each group's loader, a quorum before every
  step, then this group's part of the global batch.
* ``shipped.py``: `Shipped`: the worker's run in Ray's object store, so Ray Train's controller does not
  import the loop, the user's factories and torch's DTensor at every fit.
* ``spec_checks.py``: The checks of `RunSpec`'s options that need no data and no user code: each
  option's value, and combinations that cannot train as asked.
* ``spec.py``: `RunSpec`: the one definition of a `RayTrainer` run's options.
* ``async_validation.py``: the ``validation`` option: `AsyncValidation` and its checks (the spec's, light).
* ``spec_sections.py``: `RunSpec`'s sections (data, scaling, storage, checkpoints, reports, failures), each frozen.
* ``worker.py``: The function every Ray Train worker runs: build the `Trainer` from the `RunSpec`
  and fit.
"""

from typing import TYPE_CHECKING

from raytrain_events.lazy_names import lazy_names

if TYPE_CHECKING:
    from raytrain_events.data.ray.packed_source import PackedTokens
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
    from raytrain_events.ray.async_validation import AsyncValidation
    from raytrain_events.ray.driver import RayTrainer
    from raytrain_events.ray.result import RayResult
    from raytrain_events.ray.spec import RunSpec

__all__ = ["AsyncValidation", "PackedTokens", "ParquetRowGroups", "RayTrainer", "RayResult", "RunSpec"]

# Loaded on first use: Ray actors of ours (the data feeder, the run history) import modules of this
# package and must not pay for the driver's imports (torch among them).
_LAZY = {
    "RayTrainer": "raytrain_events.ray.driver",
    "RayResult": "raytrain_events.ray.result",
    "RunSpec": "raytrain_events.ray.spec",
    "AsyncValidation": "raytrain_events.ray.async_validation",
    "ParquetRowGroups": "raytrain_events.data.ray.parquet_seek",
    "PackedTokens": "raytrain_events.data.ray.packed_source",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())
