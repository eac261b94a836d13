"""`Restarts` (``fault_tolerance=None``, the default): a failure restarts the whole worker group from its last
checkpoint.

Ray Train's ``FailureConfig(max_failures=...)`` restarts the group; every worker joins one torch process group
(DDP, FSDP, TP, CP) through Ray's ``TorchConfig``; the train set is cut from the run's global order
(`TrainDataConfig`: the feeder actor) by Ray Train's dataset shards; checkpoints are reported to Ray Train,
which owns their retention (`RayRetention`), and a SIGTERM saves one (the preemption guard). Each failed group
is recorded in the run directory by the controller (`FailureRecorder`), for the goodput report's restarts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from raytrain_events.checkpoint.run.checkpointer import find_checkpointer
from raytrain_events.core.callback import Callback
from raytrain_events.data.order import TrainOrder
from raytrain_events.data.ray.data_config import TrainDataConfig
from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard, ShardLoader
from raytrain_events.data.ray.mixture_loader import MixtureOrderLoader
from raytrain_events.ray.checkpointing.checkpointing import hand_retention_to_ray
from raytrain_events.ray.fault_tolerance.protocol import WorkerParts
from raytrain_events.ray.reports.failures import FailureRecorder
from raytrain_events.storage.run_dir import RunDir

__all__ = ["Restarts", "RestartsWorker", "RayRetention"]


class Restarts:
    """The driver's side (see the module doc)."""

    def __init__(self, spec: Any, plan: Any) -> None:  # noqa: D107
        self.spec = spec
        self.plan = plan  # the run's `RunPlan` (ray/plan.py)

    def torch_config(self, torch_options: Dict[str, Any]) -> Any:
        from ray.train.torch import TorchConfig

        return TorchConfig(**torch_options)

    def failure_config(self) -> Any:
        import ray.train

        return ray.train.FailureConfig(max_failures=self.spec.failures.max_failures)

    def data_config(self, train_rows: Optional[int]) -> Any:
        spec = self.spec
        return TrainDataConfig(
            batch=self.plan.batch,
            order=self.plan.order,
            deterministic=spec.data.deterministic_split,
            train_rows=train_rows,
            tensor_parallel=spec.parallelism_spec.batch_group,  # the ranks that share rows: PP x CP x TP
            serving_rank=spec.parallelism_spec.serving_rank,  # pipeline_outermost: a pipeline's stages apart
        )

    def worker_side(
        self, data_config: Any, datasets: Dict[str, Any], history: Any
    ) -> Tuple[RestartsWorker, Dict[str, Any]]:
        # Ray Train shards every dataset (the train set's: the global order, whose shards carry the plan's order);
        # the eval sets it splits by rank are read once, here (`TrainDataConfig.read_once`), not at each group's start
        return RestartsWorker(self.plan.order), data_config.read_once(datasets)

    def run_callbacks(self) -> List[Any]:
        # Each failed group on record, even one that never reported (the goodput report's restarts and causes).
        return [FailureRecorder(RunDir(self.spec.storage.run_url, self.spec.storage.storage_options))]


class RestartsWorker:
    """The worker's side: the train shard Ray Train made, the plan's checkpoints, retention handed to Ray."""

    shares_process_group = True

    def __init__(self, order: TrainOrder = TrainOrder()) -> None:  # noqa: D107
        self.order = order  # the run plan's (for a plain Ray shard's local shuffle)

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
        import ray.train

        callbacks: List[Any] = [RayRetention(plan)] if plan is not None and rank == 0 else []
        return WorkerParts(
            train=train_loader(ray.train.get_dataset_shard("train"), spec, self.order, rank, loader_options),
            optimizers=optimizers,
            checkpoint=None if plan is None else plan.worker,
            callbacks=callbacks,
            saves_on_preemption=plan is not None,
        )


class RayRetention(Callback):
    """Rank 0: once the `Checkpointer` is attached (``AFTER_LOAD``), Ray Train's snapshot decides what the run's
    checkpoint folder keeps (`hand_retention_to_ray`)."""

    def __init__(self, plan: Any) -> None:  # noqa: D107
        self.plan = plan

    def after_load(self, state, logger) -> None:
        checkpointer = find_checkpointer(state)
        if checkpointer is not None:
            hand_retention_to_ray(checkpointer, self.plan)


def train_loader(shard: Any, spec: Any, order: TrainOrder, rank: int, options: Dict[str, Any]) -> Any:
    """The train set in the group's global order (`TrainDataConfig`), else a plain Ray shard (locally shuffled
    in windows of ``order.shuffle_rows`` rows)."""
    if isinstance(shard, GlobalOrderShard) and shard.mixture is not None:  # RayTrainer(mixture=...)
        return MixtureOrderLoader(
            shard, tokens_of_batch=spec.data.get_num_tokens_in_batch, length=spec.data.steps_per_epoch, **options
        )
    if isinstance(shard, GlobalOrderShard):  # in the run plan's order, which the shard carries
        return GlobalOrderLoader(shard, length=spec.data.steps_per_epoch, **options)
    return ShardLoader(
        shard,
        batch_size=spec.data.batch_size,
        shuffle_buffer_size=order.shuffle_rows,
        seed=None if spec.seed is None else spec.seed + 1000 * rank,
        length=spec.data.steps_per_epoch,
        **options,
    )
