"""How a `RayTrainer` run survives a failure: one strategy, chosen once on the driver (`choose`).

The driver asks its strategy for Ray Train's parts (the backend config, the failure config, the train
data config, the controller callbacks) and ships the strategy's worker side to every worker, which asks
it for the loop's parts (the train loader, the optimizer, the checkpoint config, the callbacks that go
first, where reports go, what to close). ``ray/driver.py`` and ``ray/worker.py`` hold no branch on
``RunSpec.fault_tolerance``; ``tests/test_ownership.py`` checks it. A new way to survive failures
(sharded replica groups, spike rollback) is a new strategy here, not a branch there.

Files:

* ``protocol.py``: `FaultTolerance` (the driver's side) and `WorkerFaultTolerance` (the worker's), and the
  `WorkerParts` a worker's side hands the worker's build.
* ``restarts.py``: `Restarts` (``fault_tolerance=None``): a failure restarts the whole worker group from
  its last checkpoint (Ray Train's ``FailureConfig``); DDP across the workers.
* ``replica_groups.py``: `ReplicaGroups` (``fault_tolerance="replica_groups"``): each worker a torchft
  replica group that fails alone while the others train on (the loop's parts: ``ray/replica_groups.py``).
* ``sharded_replica_groups.py``: `ShardedReplicaGroups` (``fault_tolerance="replica_groups"``,
  ``replica_group_size=k > 1``): replica groups of ``k`` workers, the model sharded inside each (FSDP2),
  torchft across the groups; a failed worker's group is replaced alone and heals from a live group's shards.
"""

from __future__ import annotations

from typing import Any

from raytrain_events.ray.fault_tolerance.protocol import FaultTolerance, WorkerFaultTolerance, WorkerParts
from raytrain_events.ray.fault_tolerance.replica_groups import ReplicaGroups
from raytrain_events.ray.fault_tolerance.restarts import Restarts
from raytrain_events.ray.fault_tolerance.sharded_replica_groups import ShardedReplicaGroups
from raytrain_events.ray.replica_checks import check_fault_tolerance

__all__ = ["FaultTolerance", "WorkerFaultTolerance", "WorkerParts", "choose"]


def choose(spec: Any, plan: Any) -> FaultTolerance:
    """The run's strategy for ``spec.failures.fault_tolerance`` (``plan``: the run's `RunPlan`, whose global batch and
    order its data config hands on), after refusing a value or a combination it does not support
    (`replica_checks.check_fault_tolerance`: on the driver, before Ray starts)."""
    check_fault_tolerance(spec)
    if spec.failures.fault_tolerance == "replica_groups" and spec.failures.replica_group_size > 1:
        return ShardedReplicaGroups(spec, plan)
    if spec.failures.fault_tolerance == "replica_groups":
        return ReplicaGroups(spec, plan)
    return Restarts(spec, plan)
