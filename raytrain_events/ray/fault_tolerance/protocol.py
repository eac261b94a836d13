"""What a fault-tolerance strategy provides: Ray Train's parts on the driver, the loop's parts on a worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

__all__ = ["FaultTolerance", "WorkerFaultTolerance", "WorkerParts"]


@dataclass
class WorkerParts:
    """The loop's parts a worker's strategy built (`WorkerFaultTolerance.parts`)."""

    train: Any  #: the train loader
    optimizers: Any  #: the optimizers the `Trainer` steps
    checkpoint: Any = None  #: the worker's `CheckpointConfig` (None: no checkpoints)
    callbacks: List[Any] = field(default_factory=list)  #: first in the loop's callbacks
    report_fn: Optional[Callable[[Dict[str, Any], Any], None]] = None  #: `RayReporter`'s (None: ray.train.report)
    saves_on_preemption: bool = False  #: whether the preemption guard saves a checkpoint on SIGTERM
    close: Callable[[], None] = lambda: None  #: after the fit, even a failed one
    #: This worker's eval set iterators by name, made on the driver (None: Ray Train's ``get_dataset_shard``)
    eval_shards: Optional[Dict[str, Any]] = None


class WorkerFaultTolerance(Protocol):
    """A strategy's worker side: picklable, shipped in Ray Train's ``train_loop_config``."""

    #: Whether the run's workers form one torch process group (DDP, FSDP); False: each trains alone.
    shares_process_group: bool

    def parts(  # noqa: PLR0913 (what the worker built, handed over once)
        self,
        spec: Any,
        rank: int,
        model: Any,
        optimizers: Any,
        schedulers: Any,
        loader_options: Dict[str, Any],
        plan: Any,
    ) -> WorkerParts:
        """This worker's loop parts. ``plan``: the run's `CheckpointPlan` (None without checkpoints)."""
        ...


class FaultTolerance(Protocol):
    """A strategy's driver side: Ray Train's parts for the run (`RayTrainer.fit` asks each once)."""

    def torch_config(self, torch_options: Dict[str, Any]) -> Any:
        """Ray Train's backend config (``TorchConfig`` or ``TorchftConfig``) from the run's torch options."""
        ...

    def failure_config(self) -> Any:
        """Ray Train's ``FailureConfig``."""
        ...

    def data_config(self, train_rows: Optional[int]) -> Any:
        """The run's `TrainDataConfig` (its global batch and the ranks that share rows)."""
        ...

    def worker_side(
        self, data_config: Any, datasets: Dict[str, Any], history: Any
    ) -> Tuple[WorkerFaultTolerance, Dict[str, Any]]:
        """The worker side to ship, and the datasets Ray Train shards (after the feeder started)."""
        ...

    def run_callbacks(self) -> List[Any]:
        """Controller callbacks (``ray.train.UserCallback``) the strategy adds."""
        ...
