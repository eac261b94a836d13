"""`ReplicaGroups` (``fault_tolerance="replica_groups"``): each worker a torchft replica group that fails alone.

On the driver: Ray Train's ``TorchftConfig`` (a torchft Lighthouse as a Ray actor; Ray restarts a failed
group alone, `replica_checks.torchft_config`), the controller callback that ends the run when the Lighthouse
is gone (`LighthouseWatch`), and the train shards made here, once: Ray Train would configure a replaced
group's datasets as a world of one. Every group is served the whole global batch (``num_workers x
batch_size`` unless ``global_batch_size``) and cuts it by the step's quorum. On a worker: no process group
across the workers (each is a world of one; torchft's is the only collective), and the loop's parts from
``ray/replica_groups.py``: the Manager, the commit-gated optimizer, the quorum's loader and the commit
callback, which reports to the run's history directly (``ray.train.report`` is a barrier a missing group
would block).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.data.ray.data_config import TrainDataConfig
from raytrain_events.ray.fault_tolerance.protocol import WorkerParts
from raytrain_events.ray.replica_checks import min_replicas, torchft_config
from raytrain_events.ray.replica_groups import CommitOptimizer, ReplicaCommit, ReplicaState, build_manager
from raytrain_events.ray.replica_lighthouse import LighthouseWatch
from raytrain_events.ray.replica_loader import ReplicaLoader

__all__ = ["ReplicaGroups", "ReplicaGroupsWorker", "as_dataset", "fill_replica_state"]


class ReplicaGroups:
    """The driver's side (see the module doc)."""

    def __init__(self, spec: Any, plan: Any) -> None:  # noqa: D107
        self.spec = spec
        self.plan = plan  # the run's `RunPlan` (ray/plan.py)

    def torch_config(self, torch_options: Dict[str, Any]) -> Any:
        return torchft_config(torch_options, self.spec.scaling.workers, float(self.spec.failures.replica_timeout_s))

    def failure_config(self) -> Any:
        import ray.train

        return ray.train.FailureConfig(max_failures=self.spec.failures.max_failures)

    def data_config(self, train_rows: Optional[int]) -> Any:
        spec = self.spec
        return TrainDataConfig(
            batch=self.plan.batch.at(spec.scaling.workers),  # the plan's whole global batch, at any quorum
            order=self.plan.order,
            deterministic=spec.data.deterministic_split,
            train_rows=train_rows,
            tensor_parallel=spec.scaling.workers,  # every group gets the whole global batch (cut by the step's quorum)
        )

    def worker_side(
        self, data_config: Any, datasets: Dict[str, Any], history: Any
    ) -> Tuple[ReplicaGroupsWorker, Dict[str, Any]]:
        shards = data_config.configure({"train": datasets["train"]}, self.spec.scaling.workers, None, None)
        # Each group evaluates the whole of each eval set (see `ReplicaGroupsWorker`): one iterator per set (a
        # streaming pass per evaluation, as Ray Train gives a set it does not split), the same for a replaced group.
        evals = {name: as_dataset(ds).iterator() for name, ds in datasets.items() if name != "train"}
        return ReplicaGroupsWorker(history, [s["train"] for s in shards], evals), {}

    def run_callbacks(self) -> List[Any]:
        return [LighthouseWatch()]


def as_dataset(value: Any) -> Any:
    """A Ray Dataset, or Ray Train's zero-argument function returning one, as the Dataset."""
    return value if hasattr(value, "iterator") or not callable(value) else value()


class ReplicaGroupsWorker:
    """The worker's side: ``history`` (the run's `RunHistory` actor), ``shards`` (the train shards by group) and
    ``evals`` (an iterator per in-loop eval set), all made on the driver.

    Eval sets: every group evaluates the whole set, alone (its metrics synced within the group only), at the eval
    interval of the global `Timestamp`, which every group shares; the lead group's metrics go to the history
    with its report, so a checkpoint's entry carries the eval of that checkpoint's state. No collective across
    groups, so a group away (or dying mid-eval) holds no other group back, and the next lead has the same
    metrics. Cost per evaluation: the whole eval set's forward passes per group (k x plain DDP's compute, one
    group's wall time: the groups evaluate at once, as the others would wait for a lead evaluating alone at the
    next quorum). ``docs/operating.md`` says why not a shard per group."""

    shares_process_group = False  # each worker its own group: no collective but torchft's

    def __init__(self, history: Any, shards: List[Any], evals: Optional[Dict[str, Any]] = None) -> None:  # noqa: D107
        self.history = history
        self.shards = shards
        self.evals = dict(evals or {})
        self._manager: Any = None

    def parts(  # noqa: PLR0913 (see `WorkerFaultTolerance.parts`)
        self,
        spec: Any,
        rank: int,
        model: Any,
        optimizers: Any,
        schedulers: Any,
        loader_options: Dict[str, Any],
        plan: Any,
    ) -> WorkerParts:
        shard = self.shards[rank]
        replicas = fill_replica_state(ReplicaState(), model, optimizers, schedulers)
        manager, watch = build_manager(
            replicas,
            rank,
            spec.storage.run_name or "run",
            min_replicas(shard.world_size),
            float(spec.failures.replica_timeout_s),
        )
        self._manager = manager
        optimizer = CommitOptimizer(manager, replicas.optimizer, watch)
        train = ReplicaLoader(
            shard,
            manager,
            replicas,
            length=spec.data.steps_per_epoch,
            **loader_options,
        )
        load = None if plan is None else plan.worker  # its autoresume/load_from: read at the first quorum
        commit = ReplicaCommit(
            train, optimizer, history=self.history, group=rank, load=load, validation=spec.checkpoints.validation
        )
        return WorkerParts(
            train=train,
            optimizers=optimizer,
            checkpoint=None if plan is None else checkpoint_config(plan.worker, spec.checkpoints.checkpoint, rank),
            callbacks=[commit],  # first: the commit decides what the step counts
            report_fn=commit.report,
            saves_on_preemption=False,  # a preempted group is replaced like a failed one
            close=self.close,
            eval_shards=self.evals,
        )

    def close(self) -> None:
        """Stop this group's Manager at the end (a finished group must not hold the others' quorum)."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)


def checkpoint_config(worker: Any, config: Any, group: int) -> Any:
    """The workers' `CheckpointConfig` under replica groups (``worker``: the run's Ray plan's, ``config``: the
    run's own). Nothing is reported to Ray Train (its report is a barrier a missing group would block), so
    the saving group prunes to ``keep`` itself; only group 0 may take the run directory's lock (every group
    is a rank 0 of its own); a SIGTERM is a failure like any other (the group is replaced, the others train
    on), not a save. Nothing is loaded when the `Trainer` is built (``autoresume``/``load_from`` off): the load
    waits for the first quorum (`ray/replica_groups.load_at_first_quorum`, with ``worker``'s settings)."""
    return dataclasses.replace(
        worker,
        keep=config.keep,
        lock_run_dir=worker.lock_run_dir and group == 0,
        save_on_sigterm=False,
        autoresume=False,
        load_from=None,
    )


def fill_replica_state(replicas: Any, model: Any, optimizers: Any, schedulers: Any) -> Any:
    """``replicas`` (a `ReplicaState`: what a rejoining group receives) holding the worker's model, its one
    optimizer (refused otherwise: a commit steps one) and its schedulers as a list."""
    inner = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if len(inner) != 1:
        raise ValueError(
            f"fault_tolerance='replica_groups' steps one optimizer per commit; optimizers= built {len(inner)}. "
            "Fix: one optimizer over all parameters (param groups for different settings)."
        )
    replicas.model, replicas.optimizer = model, inner[0]
    replicas.schedulers = (
        list(schedulers) if isinstance(schedulers, (list, tuple)) else [] if schedulers is None else [schedulers]
    )
    return replicas
