"""Which runs `fault_tolerance="replica_groups"` supports, checked on the driver before Ray starts.

Replica groups (`replica_groups.py` runs them on the workers) train under torchft through Ray
Train's ``TorchftConfig``: each replica group is ``replica_group_size`` Ray Train workers (1: each
worker a group holding a whole replica; more: the model sharded inside each group with FSDP,
`fault_tolerance/sharded_replica_groups.py`), so ``num_workers / replica_group_size`` is the number
of groups. What is not built yet is refused here with the reason and the fix, instead of training
wrongly: sharding in one-worker groups, context or pipeline parallelism inside a group (tensor parallelism
inside a group is built: FSDP x TP, each tensor group the same rows, `core/replica_layout.quorum_part`), a group
size that does not divide the workers, a Ray whose worker group cannot be made to build groups of
several, elastic groups, several optimizers, token counting, fp16's GradScaler, checkpoints kept by rank
(``keep_best``), and fewer than two groups. In-loop eval sets are supported (each group evaluates the whole
set alone: one worker the whole of it, `fault_tolerance/replica_groups.py`; a group of several a part per position,
`fault_tolerance/sharded_replica_groups.py`), and asynchronous validation (the run's history actor starts the tasks
on the lead's checkpoints, sharded ones resharded to one process: `ray/reports/history.py`).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict

from raytrain_events.callbacks.spike_guard import SpikeGuard
from raytrain_events.core.replica_layout import layout_problem
from raytrain_events.ray import _compat
from raytrain_events.ray._compat_worker_group import require, sharded_torchft_config

__all__ = [
    "FAULT_TOLERANCE",
    "check_fault_tolerance",
    "lighthouse_options",
    "refuse_group_callbacks",
    "require_torchft",
    "torchft_config",
]

#: The values of ``RunSpec.fault_tolerance``.
FAULT_TOLERANCE = (None, "replica_groups")


def require_torchft() -> None:
    """Raise ImportError naming the extra when torchft is not installed (checked without importing it)."""
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(
            "fault_tolerance='replica_groups' trains under torchft, which is not installed. "
            "Fix: pip install 'raytrain_events[ft]' (torchft 0.2.0), or drop fault_tolerance."
        )


def check_fault_tolerance(spec: Any) -> None:
    """Refuse a ``fault_tolerance`` value, or a combination replica groups do not support yet (`RayTrainer`
    calls it on the driver before Ray starts; a Tune trial's overrides, when the trial builds its `RayTrainer`)."""
    value = spec.failures.fault_tolerance
    timeout = spec.failures.replica_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(
            f"replica_timeout_s={timeout!r} must be a number of seconds > 0 (default 30: a collective's or a peer "
            "transfer's limit; a quorum waits twice that)."
        )
    if value not in FAULT_TOLERANCE:
        raise ValueError(
            f"fault_tolerance={value!r} is not an option. Fix: use None (a failure restarts the worker group from its last "
            "checkpoint) or 'replica_groups' (each worker a torchft replica group that fails alone)."
        )
    if value is None:
        if spec.failures.replica_group_size != 1:
            raise ValueError(
                f"replica_group_size={spec.failures.replica_group_size!r} sets the workers of each replica group, but this run "
                "has none. Fix: fault_tolerance='replica_groups' (each group shards the model over its workers), "
                "or drop replica_group_size."
            )
        return
    problem = (
        layout_problem(spec.scaling.workers, spec.failures.replica_group_size)
        if spec.failures.replica_group_size != 1
        else ""
    )
    if problem and not isinstance(spec.scaling.workers, tuple):  # (an elastic group is refused below)
        raise ValueError(f"fault_tolerance='replica_groups': {problem}")
    refusals = _unsupported(spec)
    if refusals:
        raise ValueError(
            "fault_tolerance='replica_groups' does not support " + "; ".join(refusals) + ". Fix: change these "
            "options, or drop fault_tolerance to recover by restarting the worker group."
        )
    require_torchft()
    if spec.failures.replica_group_size > 1:
        require()  # a Ray whose worker group cannot be made to build groups of several: refused, naming the fix


def _callback_refusals(callbacks: Any) -> list:
    """What of ``callbacks`` (instances) replica groups cannot run, one phrase each. A `SpikeGuard` runs in groups
    of one worker and of several: every group votes on each step with its gradient all-reduce (a group of several
    on values summed over its workers first) and rolls back at the same committed step (``callbacks/
    spike_groups.py``); not with its bisection or quarantine."""
    guards = [c for c in callbacks if isinstance(c, SpikeGuard)]
    refusals = []
    if any(g.bisect or g.row_key is not None for g in guards):
        refusals.append(
            "SpikeGuard(bisect=True) or a quarantine (row_key=, quarantine_from=): the bisection replays the window "
            "on groups of its rows and the quarantine sums the rows it drops, with collectives of one world; across "
            "replica groups the replay would need every group in one quorum for the whole search while torchft may "
            "drop or add a group at any step, and the dropped rows' counts would need a vote of their own (use "
            "SpikeGuard() without them: the window is rolled back and skipped in every group)"
        )
    return refusals


def refuse_group_callbacks(callbacks: Any) -> None:
    """On each worker (`ReplicaCommit` at INIT): the callbacks a factory (``callbacks(config)``) built, refused as
    the driver refuses instances (`check_fault_tolerance`)."""
    refusals = _callback_refusals(callbacks)
    if refusals:
        raise ValueError(
            "fault_tolerance='replica_groups' does not support " + "; ".join(refusals) + ". Fix: change these "
            "options, or drop fault_tolerance to recover by restarting the worker group."
        )


def _unsupported(spec: Any) -> list:
    """What in ``spec`` replica groups do not support yet, one phrase each."""
    # A factory's callbacks: refused on the workers.
    refusals = [] if callable(spec.callbacks) else _callback_refusals(spec.callbacks)
    workers = spec.scaling.workers
    if isinstance(workers, tuple):
        refusals.append("an elastic num_workers=(min, max): pass a fixed num_workers (the replica groups)")
    elif workers < 2:
        refusals.append(f"num_workers={workers!r}: replica groups need num_workers >= 2 (one group per worker)")
    if spec.failures.replica_group_size == 1:
        parallel = spec.parallelism_spec
        if parallel.kind != "ddp" or parallel.batch_group > 1:
            refusals.append(
                "parallelism other than 'ddp' with replica_group_size=1: each group is one worker holding a whole "
                "replica (to shard the model inside each group: replica_group_size=k, k workers per group)"
            )
    else:
        refusals += _sharded_unsupported(spec)
    if spec.data.get_num_tokens_in_batch is not None:
        refusals.append("get_num_tokens_in_batch: committed steps are counted in samples only")
    if spec.checkpoints.checkpoint is not None and spec.checkpoints.checkpoint.keep_best is not None:
        refusals.append("CheckpointConfig(keep_best=...): ranking needs Ray Train's reports; use keep=N (the newest N)")
    if spec.data.mixture is not None:
        refusals.append("mixture=: each group cuts one train set's global batches; mixtures come later")
    if "fp16" in str(spec.precision).lower():
        refusals.append("precision='fp16': fp16's GradScaler steps around the commit; use 'bf16' or 'fp32'")
    return refusals


def _sharded_unsupported(spec: Any) -> list:
    """What a run of replica groups of several workers (``replica_group_size > 1``) does not support, one phrase
    each: the model must be sharded inside each group (FSDP2, or HSDP inside it, optionally x TP) over the group's
    workers."""
    size = spec.failures.replica_group_size
    parallel = spec.parallelism_spec
    if parallel.kind != "fsdp" or parallel.fsdp is None:
        return [
            f"replica_group_size={size} with parallelism={spec.parallelism!r}: a group of several workers shards its "
            "model (parallelism='fsdp' or FSDPConfig(...)); for a whole replica per worker use replica_group_size=1"
        ]
    fsdp = parallel.fsdp
    refusals = [
        f"FSDPConfig({name}={degree}) inside replica groups of {size} workers: each group shards with FSDP (or HSDP), "
        f"optionally with tensor_parallel; {name} is not built for replica groups yet ({why})"
        for name, degree, why in (
            (
                "context_parallel",
                fsdp.context_parallel,
                "a context group's ranks share rows and split each sequence: the quorum's cut (core/replica_layout."
                "quorum_part) and the eval parts would need the context dimension too, and its all-to-all must be "
                "proved under a replaced group",
            ),
            (
                "pipeline_parallel",
                fsdp.pipeline_parallel,
                "a pipeline's stages hold different layers and only the first loads batches: the commit, the heal by "
                "position and the eval parts assume every position loads its rows and steps one optimizer",
            ),
        )
        if degree > 1
    ]
    try:
        fsdp.mesh_shape(size)  # the group's own mesh: HSDP's replicate must divide the group
    except ValueError as error:
        refusals.append(f"a group of replica_group_size={size} workers cannot hold this mesh ({error})")
    return refusals


def min_replicas(groups: int) -> int:
    """Groups a step needs to commit: all but one (at least 1). A lone group that started first waits for a
    second instead of training alone, and one group away at a time never stops the run."""
    return max(1, groups - 1)


def lighthouse_bind(node_ip: str) -> str:
    """Where the Lighthouse listens: loopback when Ray runs on loopback (tests), else every interface."""
    return "127.0.0.1:0" if node_ip.startswith("127.") else "[::]:0"


#: How long the Lighthouse waits for a group's heartbeat (its Manager sends one every 100 ms from a thread of its own,
#: outside Python's GIL) before it counts the group dead. This is what a failure costs the others: a dead group stops
#: holding back the next quorum once this has passed since its last heartbeat.
HEARTBEAT_TIMEOUT_MS = 500


def lighthouse_options(groups: int, replica_timeout_s: float) -> Dict[str, Any]:
    """The Lighthouse's settings (see `torchft_config`). torchft 0.2.0 forms a quorum at once when every group of the
    previous quorum has asked for the next one (its fast quorum: each step, no group missing). Otherwise it waits while
    a group that still heartbeats has not asked, up to ``join_timeout_ms``: that wait keeps a group that is merely
    late (the lead writing a checkpoint's host copy, a slow start, a loaded machine) in the quorum, so it is
    ``replica_timeout_s`` (later than a collective's limit it would fail the step anyway; below the quorum's 2x). A
    dead group stops heartbeating and stops holding the quorum back after ``HEARTBEAT_TIMEOUT_MS``."""
    return {
        "min_replicas": min_replicas(groups),  # the others train on while a group is away
        "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
        "join_timeout_ms": int(replica_timeout_s * 1000),
    }


def torchft_config(torch_options: Dict[str, Any], groups: int, replica_timeout_s: float, group_size: int = 1) -> Any:
    """Ray Train's ``TorchftConfig``: the Lighthouse as a Ray actor on the head, bound as `lighthouse_bind` says,
    with `lighthouse_options`; for groups of ``group_size > 1`` workers, the one that makes Ray build them
    (`ray/_compat_worker_group.py`)."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    node_ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == here)
    lighthouse = {"bind": lighthouse_bind(node_ip), **lighthouse_options(groups, replica_timeout_s)}
    if group_size > 1:
        return sharded_torchft_config(group_size, lighthouse, **torch_options)
    return _compat.torchft_config_class()(lighthouse_kwargs=lighthouse, **torch_options)
