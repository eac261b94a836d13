"""`RunSpec`: everything a Ray worker needs to build and run its `Trainer`, as picklable data.

Models, optimizers and schedulers travel as factories (functions called on the worker), so a
large model is never pickled on the driver and each worker builds its own on its own device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

__all__ = ["RunSpec"]

Factory = Callable[..., Any]


@dataclass
class RunSpec:
    """What every worker runs. Built by `RayTrainer`; see its docstring for each field."""

    model: Factory
    optimizers: Factory
    max_duration: str
    batch_size: int
    schedulers: Optional[Factory] = None
    algorithms: Union[Sequence[Any], Factory] = ()
    callbacks: Union[Sequence[Any], Factory] = ()
    eval_datasets: List[str] = field(default_factory=list)
    eval_batch_size: Optional[int] = None
    eval_interval: Any = "1ep"
    grad_accum: int = 1
    precision: str = "fp32"
    seed: Optional[int] = 0
    get_num_tokens_in_batch: Optional[Callable[[Any], int]] = None
    collate_fn: Optional[Callable] = None
    prefetch_batches: int = 1
    shuffle_buffer_size: Optional[int] = None
    columns: Optional[List[str]] = None
    steps_per_epoch: Optional[int] = None
    report_interval: Optional[str] = None
    report_every_s: Optional[float] = 10.0
    checkpoint: Any = None
    storage_url: Optional[str] = None
    storage_options: Dict[str, Any] = field(default_factory=dict)
    run_name: str = "run"
    config: Dict[str, Any] = field(default_factory=dict)

    def build_model(self) -> Any:
        """Call the model factory (with ``config`` if it takes an argument)."""
        return _call(self.model, self.config)

    def build_optimizers(self, model: Any) -> Any:
        """Call the optimizer factory with the model (and ``config`` if it takes it)."""
        return _call(self.optimizers, model, self.config)

    def build_schedulers(self, optimizers: Any) -> Any:
        """Call the scheduler factory with the optimizers, or pass a ready list through."""
        if self.schedulers is None:
            return None
        if callable(self.schedulers) and not _is_state_schedule(self.schedulers):
            return _call(self.schedulers, optimizers, self.config)
        return self.schedulers

    def build_list(self, what: Union[Sequence[Any], Factory]) -> List[Any]:
        """Algorithms or callbacks: a factory's result, or a list (built by name if plain data)."""
        items = _call(what, self.config) if callable(what) else list(what)
        return list(items)


def _is_state_schedule(obj: Any) -> bool:
    # Composer-style schedules (fn(state) -> multiplier) are objects with this marker.
    return getattr(obj, "is_state_schedule", False)


def _call(fn: Factory, *args: Any) -> Any:
    """Call ``fn`` with as many leading ``args`` as it accepts."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(*args)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return fn(*args)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return fn(*args[: len(positional)])
