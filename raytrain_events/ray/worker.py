"""The function every Ray Train worker runs: build the `Trainer` from the `RunSpec` and fit.

Each worker builds its own model, optimizers, algorithms and callbacks from the spec's
factories, iterates its dataset shard, trains under DDP (Ray set up the process group:
gloo on CPU, NCCL on GPU) and reports to the controller through `RayReporter`.
"""

from __future__ import annotations

from typing import Any, Dict

from raytrain_events.core.data_spec import DataSpec
from raytrain_events.dist import LocalDist, TorchDist
from raytrain_events.parallel.deferred_init import has_meta_tensors
from raytrain_events.parallel.world import check_tensor_parallel_world
from raytrain_events.parallel.wrap import Parallel
from raytrain_events.ray.checkpointing.validation import async_eval_names
from raytrain_events.ray.data.loader import GlobalOrderLoader, GlobalOrderShard, ShardLoader, train_order
from raytrain_events.ray.reports.worker_reports import RayReporter
from raytrain_events.ray.spec import RunSpec
from raytrain_events.trainer import Trainer
from raytrain_events.trainer.evaluation import Evaluator
from raytrain_events.trainer.seed import seed_everything

__all__ = ["train_loop_per_worker", "build_worker_trainer"]


def build_worker_trainer(spec: RunSpec, history: Any = None, shards: Any = None) -> Trainer:
    """Build this worker's `Trainer` from the `RunSpec` (inside a Ray Train worker).

    The objects (model, optimizers, data, callbacks) are built here from the spec's factories; the
    loop options travel as they are (``options=spec``: a `RunSpec` is a `LoopOptions`), so a new
    loop option needs no change here. ``history``: the run's `RunHistory` actor, which replica groups
    report to directly, and ``shards`` their train shards by rank (`replica_groups.py`).
    """
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    # Before any collective or data call, on every rank alike: a group that cannot form whole tensor groups
    # (an elastic resize) ends here with the fix, instead of inside the dataset split or the device mesh.
    check_tensor_parallel_world(context.get_world_size(), spec.tensor_parallel, spec.parallelism_spec.context_parallel)
    device = ray.train.torch.get_device()
    from raytrain_events.ray.guards.watchdog import process_group_timeout_s

    pg_timeout = process_group_timeout_s(spec.hang_timeout)
    replicas = spec.fault_tolerance == "replica_groups"  # each worker its own group: no collective but torchft's
    distributed = context.get_world_size() > 1 and not replicas
    dist = TorchDist(device, timeout_s=pg_timeout) if distributed else LocalDist(device)
    if spec.seed is not None:
        seed_everything(spec.seed)  # the same initial weights on every rank
    model = spec.build_model()
    if not has_meta_tensors(model):  # a meta-device model is materialised by the Trainer, after sharding
        model.to(device)
    optimizers = spec.build_optimizers(model)
    schedulers = spec.build_schedulers(optimizers)
    algorithms = spec.build_list(spec.algorithms)
    if algorithms:
        from raytrain_events.algorithms.registry import build_algorithms

        algorithms = build_algorithms(algorithms)
    callbacks = spec.build_list(spec.callbacks)

    loader_options: Dict[str, Any] = dict(
        device=device, collate_fn=spec.collate_fn, prefetch_batches=spec.prefetch_batches, columns=spec.columns
    )
    commit: Any = None
    manager: Any = None
    if replicas:
        from raytrain_events.ray.replica_groups import setup_replica_groups

        optimizers, train, commit, manager = setup_replica_groups(
            spec,
            context.get_world_rank(),
            model,
            optimizers,
            schedulers,
            shards[context.get_world_rank()],  # made on the driver (driver.py)
            order_seed=spec.seed if spec.shuffle_buffer_size and spec.seed is not None else None,
            shuffle_rows=spec.shuffle_buffer_size,
            length=spec.steps_per_epoch,
            **loader_options,
        )
        commit.history = history
    else:
        train = _train_loader(ray.train.get_dataset_shard("train"), spec, context.get_world_rank(), loader_options)
    evaluators = [
        Evaluator(
            label=name,
            dataloader=ShardLoader(
                ray.train.get_dataset_shard(name), batch_size=spec.eval_batch_size or spec.batch_size, **loader_options
            ),
            **spec.eval_options.get(name, {}),
        )
        for name in spec.eval_names
        if name not in async_eval_names(spec.validation, spec.eval_names)  # those are evaluated as Ray tasks
    ]
    checkpoint = plan = None
    if spec.checkpoint is not None:
        from raytrain_events.ray.checkpointing.checkpointing import checkpoint_plan

        plan = checkpoint_plan(spec)
        checkpoint = plan.worker
        if replicas:
            from raytrain_events.ray.replica_groups import replica_checkpoint_config

            checkpoint = replica_checkpoint_config(plan.worker, spec.checkpoint, context.get_world_rank())
    from raytrain_events.ray.guards.operations import worker_guards

    counts_data = Parallel(spec.parallelism_spec).counts_data(context.get_world_rank())  # TP: one rank per group
    # Every rank arrived, or an error; replica groups: a preempted group is replaced like a failed one.
    guards = worker_guards(spec, dist, checkpointing=checkpoint is not None and not replicas)
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(train, get_num_tokens_in_batch=spec.get_num_tokens_in_batch),
        optimizers=optimizers,
        schedulers=schedulers,
        eval_dataloader=evaluators or None,
        algorithms=algorithms,
        callbacks=([commit] if commit is not None else [])  # first: the commit decides what the step counts
        + list(callbacks)
        + [
            RayReporter(
                interval=spec.report_interval,
                every_s=spec.report_every_s,
                counts_data=counts_data,
                validation=spec.validation,
                report_fn=None if commit is None else commit.report,
            )
        ]
        + guards,  # preemption: `guards`
        device=device,
        dist=dist,
        run_name=spec.run_name or "run",
        checkpoint=checkpoint,
        options=spec,  # a RunSpec is the run's LoopOptions, checked once on the driver
    )
    if commit is not None:
        from raytrain_events.ray.replica_groups import lead_saves, load_at_first_quorum

        commit.engine = trainer.engine  # quorum changes reach the loop's callbacks (on_quorum_change)
        lead_saves(trainer.state, commit)  # one saver: the lead group
        if plan is not None:  # storage is read at a start of the whole run only, not by a group that rejoins
            load_at_first_quorum(trainer.state, commit, plan.worker)
    elif plan is not None and context.get_world_rank() == 0:
        from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
        from raytrain_events.ray.checkpointing.checkpointing import hand_retention_to_ray

        checkpointer = find_checkpointer(trainer.state)
        if checkpointer is not None:  # Ray Train's snapshot decides what rank 0's checkpoint folder keeps
            hand_retention_to_ray(checkpointer, plan)
    return trainer


def _train_loader(shard: Any, spec: RunSpec, rank: int, options: Dict[str, Any]) -> Any:
    """The train set in the group's global order (`TrainDataConfig`), else a plain Ray shard."""
    if isinstance(shard, GlobalOrderShard) and shard.mixture is not None:  # RayTrainer(mixture=...)
        from raytrain_events.ray.data.mixture_loader import MixtureOrderLoader

        return MixtureOrderLoader(
            shard, tokens_of_batch=spec.get_num_tokens_in_batch, length=spec.steps_per_epoch, **options
        )
    if isinstance(shard, GlobalOrderShard):
        order_seed, shuffle_rows = train_order(spec)  # the driver's prestart of the feeder uses the same
        return GlobalOrderLoader(
            shard, order_seed=order_seed, shuffle_rows=shuffle_rows, length=spec.steps_per_epoch, **options
        )
    return ShardLoader(
        shard,
        batch_size=spec.batch_size,
        shuffle_buffer_size=spec.shuffle_buffer_size,
        seed=None if spec.seed is None else spec.seed + 1000 * rank,
        length=spec.steps_per_epoch,
        **options,
    )


def train_loop_per_worker(config: Dict[str, Any]) -> Dict[str, Any]:
    """Ray Train entry point: ``config["spec"]`` is the `RunSpec`; returns rank 0's final timestamp."""
    spec: RunSpec = config["spec"]
    trainer = build_worker_trainer(spec, config.get("history"), config.get("shards"))
    try:
        state = trainer.fit()
    finally:
        if spec.fault_tolerance == "replica_groups":
            from raytrain_events.ray.replica_groups import shutdown_manager

            shutdown_manager(trainer.state)
    return {"timestamp": state.timestamp.state_dict(), "rank": state.rank}
