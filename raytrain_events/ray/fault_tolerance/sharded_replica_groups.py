"""`ShardedReplicaGroups` (``fault_tolerance="replica_groups"``, ``replica_group_size=k > 1``): replica groups of
``k`` workers each, the model sharded inside each group (FSDP2, or HSDP inside it), torchft across the groups.

The layout (`ReplicaLayout`): group ``g`` is world ranks ``g*k .. g*k+k-1``; Ray Train's worker group is made to
build such groups (`ray/_compat_worker_group.py`: Ray 2.60 builds groups of one), starts one torch process group
per group (FSDP's), and replaces a failing group alone: a failure of any worker of a group replaces that group's
``k`` workers; the other groups keep training, their processes untouched. torchft's ``Manager`` runs on every
worker with the group's ``rank``/``world_size`` (torchtitan's layout): the group's rank 0 holds the group's place in
the Lighthouse's quorum, and each position's workers across the groups form one torchft process group, over which
the gradient shards are averaged (`CommitOptimizer`: each worker all-reduces its own shards) and a rejoining
group's position ``p`` heals from position ``p`` of a live group (`ShardedReplicaState`: the same shards, sent as
local tensors and copied into this worker's shards in place), never from storage.

Every guarantee of the one-worker groups carries over, through the same parts (`ray/replica_groups.py`): the step's
quorum cuts the global batch into one part per participating group and each group's part into one per position
(`ReplicaLayout.rows`: every row once), a committed step advances the Timestamp by the global batch, one lead group
saves (all its ``k`` workers: a sharded checkpoint of ``k`` ranks, which loads into any run of groups of ``k``),
``keep`` is honoured by it, a start of the whole run loads the checkpoint on every group.

Eval sets (in-loop, at the eval points of the global Timestamp, which every group shares): each group evaluates
the whole set, alone, as a one-worker group does; inside the group each position evaluates one of ``k`` equal parts
(`eval_parts`, cut once on the driver, the same for a replacement; `ReplicaLayout.eval_part`) and the metrics sync
over the group's own process group (the default one on its workers), so no collective crosses groups: a group that
is away, or dies mid-eval (Ray replaces all of it), holds nobody back, and the lead's report after its save carries
its metrics with the checkpoint's name. Asynchronous validation: as with one-worker groups, the run's history actor
starts the task on the lead's checkpoints; the task reshards the ``k``-rank checkpoint to its one process.

A `SpikeGuard` works as in one-worker groups (``callbacks/spike_groups.py``): its vote rides on every position's
all-reduce, on values the group's workers summed among themselves first, so every worker of every group rolls back
at the same step, each to its own shards' snapshot; a replacement's position ``p`` receives the skip list and
skipped counts with its shards (`ShardedReplicaState`). Its bisection and quarantine stay refused
(`replica_checks.py`).

Cost over one-worker groups of the same model: per step, each worker's all-reduce carries ``1/k`` of the gradients
(the shards it holds), ``k`` all-reduces in parallel instead of one of the whole; per rejoin, each position
receives ``1/k`` of the state. Every worker fetches the whole global batch's blocks (``k x groups`` reads of it).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from raytrain_events.core.replica_layout import ReplicaLayout
from raytrain_events.ray.fault_tolerance.protocol import WorkerParts
from raytrain_events.ray.fault_tolerance.replica_groups import (
    ReplicaGroups,
    as_dataset,
    checkpoint_config,
    fill_replica_state,
)
from raytrain_events.ray.replica_checks import min_replicas, torchft_config
from raytrain_events.ray.replica_groups import (
    CommitOptimizer,
    ReplicaCommit,
    ReplicaState,
    build_manager,
)
from raytrain_events.ray.replica_loader import ReplicaLoader

log = logging.getLogger(__name__)

__all__ = ["ShardedReplicaGroups", "ShardedReplicaGroupsWorker", "ShardedReplicaState"]


class ShardedReplicaGroups(ReplicaGroups):
    """The driver's side (see the module doc): `ReplicaGroups`' with groups of ``replica_group_size`` workers."""

    def __init__(self, spec: Any, plan: Any) -> None:  # noqa: D107
        super().__init__(spec, plan)
        tensor_parallel = spec.parallelism_spec.fsdp.tensor_parallel  # FSDP x TP inside each group
        self.layout = ReplicaLayout(spec.scaling.workers, spec.failures.replica_group_size, tensor_parallel)

    def torch_config(self, torch_options: Dict[str, Any]) -> Any:
        layout = self.layout
        return torchft_config(
            torch_options, layout.groups, float(self.spec.failures.replica_timeout_s), layout.group_size
        )

    def worker_side(
        self, data_config: Any, datasets: Dict[str, Any], history: Any
    ) -> Tuple[ShardedReplicaGroupsWorker, Dict[str, Any]]:
        # one train shard per worker (its feeder cursor); only the train set is cut by the step's quorum
        shards = data_config.configure({"train": datasets["train"]}, self.spec.scaling.workers, None, None)
        evals = {name: eval_parts(name, ds, self.layout) for name, ds in datasets.items() if name != "train"}
        return ShardedReplicaGroupsWorker(history, [s["train"] for s in shards], self.layout, evals), {}


def eval_parts(name: str, dataset: Any, layout: ReplicaLayout) -> List[Any]:
    """An eval set's `ReplicaLayout.data_parts` equal contiguous parts, an iterator each, made once on the driver:
    data-parallel position ``p`` of every group (and of every replacement) evaluates part ``p``
    (`ReplicaLayout.eval_part`; a tensor group's ranks share one). Equal: a group's FSDP forwards are collectives,
    so each position runs the same number of batches (Ray's ``split(equal=True)`` drops at most ``data_parts - 1``
    rows, as the restarts' deterministic split does). A set with fewer rows than parts is refused (its metrics would
    be computed over nothing), before any worker starts."""
    parts = as_dataset(dataset).split(layout.data_parts, equal=True)
    if parts[0].count() == 0:  # a split part's count: its blocks' metadata
        raise ValueError(
            f"eval set {name!r} has fewer rows than the {layout.data_parts} data-parallel workers of a replica group, "
            "which each evaluate an equal part of it. Fix: a larger eval set, or a smaller replica_group_size."
        )
    return [part.iterator() for part in parts]


def _local(tensor: Any) -> Any:
    """A DTensor's local shard (a view of its storage), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _to_local(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_local(v) for v in tree)
    return _local(tree).detach() if isinstance(tree, torch.Tensor) else tree


class ShardedReplicaState(ReplicaState):
    """What a joining worker receives from the same position of a healthy group: its shards as local tensors (the
    sender's and the receiver's meshes are alike, so a position's shards are the same slices of each tensor), and the
    loop's state `ReplicaState` sends (a `SpikeGuard`'s skip list, rollbacks and `State.skipped` included)."""

    def state_dict(self) -> Dict[str, Any]:
        return _to_local(super().state_dict())

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        assert self.model is not None and self.state is not None
        own = self.model.state_dict()
        with torch.no_grad():
            for name, value in sd["model"].items():  # into this worker's shards, in place
                _local(own[name]).copy_(value)
        self.optimizer.load_state_dict(sd["optimizer"])
        shard_optimizer_state(self.optimizer)
        self.load_loop_state(sd)  # schedulers, Timestamp, RNG; a SpikeGuard's skip list and State.skipped
        log.info("Recovered this group's shards from a healthy replica group at %s", self.state.timestamp)


def shard_optimizer_state(optimizer: Any) -> None:
    """Make each optimizer state tensor loaded as a plain tensor a DTensor like its parameter (a received state's
    ``exp_avg`` is a parameter's local shard; torch's ``load_state_dict`` keeps it plain)."""
    from torch.distributed.tensor import DTensor

    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        local = param.to_local()
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape:
                state[key] = DTensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )


class ShardedReplicaGroupsWorker:
    """The worker's side: ``history`` (the run's `RunHistory` actor), ``shards`` (the train shards by world rank),
    ``layout`` (the groups) and ``evals`` (per eval set, one iterator per position: `eval_parts`), all made on the
    driver."""

    shares_process_group = True  # the group's workers: one torch process group (Ray's, per group), FSDP over it

    def __init__(  # noqa: D107
        self, history: Any, shards: List[Any], layout: ReplicaLayout, evals: Optional[Dict[str, List[Any]]] = None
    ) -> None:
        self.history = history
        self.shards = shards
        self.layout = layout
        self.evals = dict(evals or {})  # per eval set: one iterator per position (`eval_parts`)
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
        layout = self.layout
        group, position = layout.group_of(rank), layout.position_of(rank)
        check_group_process_group(position, layout.group_size)
        # the model and optimizer sharded in place by the Trainer (FSDP2)
        replicas = fill_replica_state(ShardedReplicaState(), model, optimizers, schedulers)
        manager, watch = build_manager(
            replicas,
            group,
            spec.storage.run_name or "run",
            min_replicas(layout.groups),
            float(spec.failures.replica_timeout_s),
            position=position,
            group_size=layout.group_size,
        )
        self._manager = manager
        optimizer = CommitOptimizer(manager, replicas.optimizer, watch)
        train = ReplicaLoader(
            self.shards[rank],
            manager,
            replicas,
            group_size=layout.group_size,
            position=position,
            tensor_parallel=layout.tensor_parallel,
            length=spec.data.steps_per_epoch,
            **loader_options,
        )
        load = None if plan is None else plan.worker
        commit = ReplicaCommit(
            train, optimizer, history=self.history, group=group, load=load, validation=spec.checkpoints.validation
        )
        return WorkerParts(
            train=train,
            optimizers=optimizer,
            checkpoint=None if plan is None else checkpoint_config(plan.worker, spec.checkpoints.checkpoint, group),
            callbacks=[commit],
            report_fn=commit.report,
            saves_on_preemption=False,
            close=self.close,
            eval_shards={name: parts[layout.eval_part(rank)] for name, parts in self.evals.items()},
        )

    def close(self) -> None:
        """Stop this worker's Manager at the end (a finished group must not hold the others' quorum)."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)


def check_group_process_group(position: int, group_size: int) -> None:
    """This worker's torch process group is its replica group's (Ray's, per group), with it at ``position``."""
    import torch.distributed as dist

    if not dist.is_initialized() or (dist.get_world_size(), dist.get_rank()) != (group_size, position):
        found = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else None
        raise RuntimeError(
            f"replica groups of {group_size} workers: this worker's process group is {found} (size, rank), not its "
            f"group's ({group_size}, {position}); Ray Train's worker group did not build the groups "
            "(ray/_compat_worker_group.py). Fix: install ray==2.60.0, or use replica_group_size=1."
        )
