"""The function every Ray Train worker runs: build the `Trainer` from the `RunSpec` and fit.

Each worker builds its own model, optimizers, algorithms and callbacks from the spec's
factories and reads the driver's `RunPlan` (``ray/plan.py``: its checkpoint plan; the global batch and
order arrive with the train shard); the run's fault-tolerance strategy (`ray/fault_tolerance/`, chosen on the driver and shipped
here) builds its train loader, the optimizer the loop steps, its checkpoint config and the callbacks that go
first. Restarts train under DDP (Ray set up the process group: gloo on CPU, NCCL on GPU) and report to the
controller through `RayReporter`; replica groups train each worker alone under torchft.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.algorithms.registry import build_algorithms
from raytrain_events.core.data_spec import DataSpec
from raytrain_events.data.ray.loader import ShardLoader
from raytrain_events.dist import LocalDist, TorchDist
from raytrain_events.parallel.deferred_init import has_meta_tensors
from raytrain_events.parallel.world import check_tensor_parallel_world
from raytrain_events.parallel.wrap import Parallel
from raytrain_events.ray.checkpointing.validation import async_eval_names
from raytrain_events.ray.fault_tolerance import WorkerFaultTolerance, WorkerParts
from raytrain_events.ray.fault_tolerance.restarts import RestartsWorker
from raytrain_events.ray.guards.operations import worker_guards
from raytrain_events.ray.guards.watchdog import process_group_timeout_s
from raytrain_events.ray.plan import RunPlan
from raytrain_events.ray.reports.console import quiet_worker_console
from raytrain_events.ray.reports.worker_reports import RayReporter
from raytrain_events.ray.spec import RunSpec
from raytrain_events.trainer import Trainer
from raytrain_events.trainer.evaluation import Evaluator
from raytrain_events.trainer.seed import seed_everything

__all__ = ["train_loop_per_worker", "build_worker", "build_worker_trainer"]


def build_worker_trainer(
    spec: RunSpec, fault_tolerance: Optional[WorkerFaultTolerance] = None, plan: Optional[RunPlan] = None
) -> Trainer:
    """This worker's `Trainer` (`build_worker`'s, without its parts)."""
    return build_worker(spec, fault_tolerance, plan)[0]


def build_worker(
    spec: RunSpec, fault_tolerance: Optional[WorkerFaultTolerance] = None, plan: Optional[RunPlan] = None
) -> Tuple[Trainer, WorkerParts]:
    """Build this worker's `Trainer` from the `RunSpec` (inside a Ray Train worker), and the strategy's parts.

    The objects (model, optimizers, data, callbacks) are built here from the spec's factories; the
    loop options travel as they are (``options=spec``: a `RunSpec` is a `LoopOptions`), so a new
    loop option needs no change here. ``fault_tolerance``: the run's strategy's worker side, chosen on the
    driver (`ray/fault_tolerance/`); it builds the train loader, the optimizer the loop steps, the checkpoint
    config and the callbacks that go first. None: restarts (a spec built by hand, as the benches do).
    ``plan``: the driver's `RunPlan` (None: made here from ``spec``, for a spec built by hand).
    """
    import ray.train
    import ray.train.torch

    plan = plan if plan is not None else RunPlan.of(spec)
    ft = fault_tolerance if fault_tolerance is not None else RestartsWorker(plan.order)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    # Before any collective or data call, on every rank alike: a group that cannot form whole tensor groups
    # (an elastic resize) ends here with the fix, instead of inside the dataset split or the device mesh.
    check_tensor_parallel_world(world, spec.tensor_parallel, spec.parallelism_spec.context_parallel)
    device = ray.train.torch.get_device()
    distributed = world > 1 and ft.shares_process_group
    pg_timeout = process_group_timeout_s(spec.failures.hang_timeout)
    dist = TorchDist(device, timeout_s=pg_timeout) if distributed else LocalDist(device)
    model, optimizers, schedulers, algorithms, callbacks = _build_objects(spec, device)
    loader_options: Dict[str, Any] = dict(
        device=device,
        collate_fn=spec.data.collate_fn,
        prefetch_batches=spec.data.prefetch_batches,
        columns=spec.data.columns,
    )
    parts = ft.parts(spec, rank, model, optimizers, schedulers, loader_options, plan.checkpoint)
    evaluators = _evaluators(spec, parts, loader_options)
    counts_data = Parallel(spec.parallelism_spec).counts_data(rank, world)  # TP: one rank per group
    # Every rank arrived, or an error; the preemption guard saves only where the strategy says.
    guards = worker_guards(spec, dist, checkpointing=parts.saves_on_preemption)
    reporter = RayReporter(
        interval=spec.reports.report_interval,
        every_s=spec.reports.report_every_s,
        counts_data=counts_data,
        validation=spec.checkpoints.validation,
        report_fn=parts.report_fn,
    )
    return Trainer(
        model=model,
        train_dataloader=DataSpec(parts.train, get_num_tokens_in_batch=spec.data.get_num_tokens_in_batch),
        optimizers=parts.optimizers,
        schedulers=schedulers,
        eval_dataloader=evaluators or None,
        algorithms=algorithms,
        callbacks=[*parts.callbacks, *callbacks, reporter, *guards],  # guards: preemption
        device=device,
        dist=dist,
        run_name=spec.storage.run_name or "run",
        checkpoint=parts.checkpoint,
        options=spec,  # a RunSpec is the run's LoopOptions, checked once on the driver
    ), parts


def _build_objects(spec: RunSpec, device: Any) -> Tuple[Any, Any, Any, Any, List[Any]]:
    """The user's objects from the spec's factories, seeded alike on every rank: model (on ``device`` unless it
    is on the meta device: the Trainer materialises it after sharding), optimizers, schedulers, algorithms,
    callbacks."""
    if spec.seed is not None:
        seed_everything(spec.seed)  # the same initial weights on every rank
    model = spec.build_model()
    if not has_meta_tensors(model):
        model.to(device)
    optimizers = spec.build_optimizers(model)
    schedulers = spec.build_schedulers(optimizers)
    algorithms = spec.build_list(spec.algorithms)
    if algorithms:
        algorithms = build_algorithms(algorithms)
    return model, optimizers, schedulers, algorithms, spec.build_list(spec.callbacks)


def _evaluators(spec: RunSpec, parts: WorkerParts, loader_options: Dict[str, Any]) -> List[Evaluator]:
    """One `Evaluator` per in-loop eval set (the asynchronously validated ones run as Ray tasks instead), over
    Ray Train's shard of it or the strategy's own (replica groups)."""
    import ray.train

    validated = async_eval_names(spec.checkpoints.validation, spec.data.eval_names)
    return [
        Evaluator(
            label=name,
            dataloader=ShardLoader(
                ray.train.get_dataset_shard(name) if parts.eval_shards is None else parts.eval_shards[name],
                batch_size=spec.data.eval_batch_size or spec.data.batch_size,
                **loader_options,
            ),
            **spec.data.eval_options.get(name, {}),
        )
        for name in spec.data.eval_names
        if name not in validated
    ]


def train_loop_per_worker(config: Dict[str, Any]) -> Dict[str, Any]:
    """Ray Train entry point: ``config["run"]`` is the driver's `Shipped` run: ``"spec"`` the `RunSpec`, ``"plan"``
    the driver's `RunPlan`, ``"fault_tolerance"`` the run's strategy's worker side; returns rank 0's final
    timestamp."""
    config = config["run"].get()
    spec: RunSpec = config["spec"]
    quiet_worker_console(spec.reports.verbose)  # this package's INFO lines in Ray's files, not on the driver's terminal
    trainer, parts = build_worker(spec, config["fault_tolerance"], config["plan"])
    try:
        state = trainer.fit()
    finally:
        parts.close()
    return {"timestamp": state.timestamp.state_dict(), "rank": state.rank}
