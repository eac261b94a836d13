"""The ``validation`` option of a `RayTrainer` run: `AsyncValidation` and its checks.

`RunSpec` (ray/spec.py, ray/spec_sections.py) parses and checks the option with these; what runs a
validation (the Ray task, the history entries) is `raytrain_events.ray.checkpointing.validation`,
which re-exports them. This module imports only the standard library, so the spec imports nothing of
the checkpointing package (tests/core/test_imports.py).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["AsyncValidation", "async_eval_names", "check_validation", "parse_validation"]


@dataclass(frozen=True)
class AsyncValidation:
    """Which eval sets are evaluated off the training ranks, on which checkpoints, with what resources.

    Example::

        RayTrainer(..., datasets={"train": tr, "val": va}, checkpoint=CheckpointConfig(save_interval="500ba"),
                   validation=AsyncValidation(datasets=["val"], every=2, resources={"CPU": 4, "GPU": 1}))

    Args:
        datasets: the eval sets (names in ``datasets``) to evaluate as Ray tasks; None: every eval set.
            The others stay in-loop evaluations.
        every: validate every this many checkpoints (1: each one) of a worker group.
        resources: the Ray resources of each validation task (``{"CPU": 1}``; ``"GPU"`` for a GPU).
        timeout_s: cancel a validation after this many seconds (recorded as failed); None: no limit.
        batch_size: eval rows per batch in the task (default: the run's ``eval_batch_size`` or ``batch_size``).
        callbacks: ``callbacks(config) -> list`` of `Callback` objects for the validating `Trainer`
            (its state holds the checkpoint's Timestamp), or a list of them.
    """

    datasets: Optional[Tuple[str, ...]] = None
    every: int = 1
    resources: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1})
    timeout_s: Optional[float] = None
    batch_size: Optional[int] = None
    callbacks: Any = ()

    def __post_init__(self) -> None:
        if self.datasets is not None:
            if isinstance(self.datasets, str) or not all(isinstance(d, str) for d in self.datasets):
                raise TypeError(
                    f"AsyncValidation(datasets={self.datasets!r}) must be a list of eval set names, e.g. ['val']."
                )
            object.__setattr__(self, "datasets", tuple(self.datasets))
            if not self.datasets:
                raise ValueError("AsyncValidation(datasets=[]) validates nothing: name eval sets, or use None for all.")
        if not _positive_int(self.every):
            raise ValueError(f"AsyncValidation(every={self.every!r}) must be a positive integer (1: each checkpoint).")
        if self.batch_size is not None and not _positive_int(self.batch_size):
            raise ValueError(f"AsyncValidation(batch_size={self.batch_size!r}) must be a positive integer or None.")
        if self.timeout_s is not None and (
            not isinstance(self.timeout_s, numbers.Real) or isinstance(self.timeout_s, bool) or self.timeout_s <= 0
        ):
            raise ValueError(f"AsyncValidation(timeout_s={self.timeout_s!r}) must be a positive number or None.")
        resources = dict(self.resources or {})
        bad = {k: v for k, v in resources.items() if not isinstance(v, numbers.Real) or isinstance(v, bool) or v < 0}
        if not isinstance(self.resources, Mapping) or bad:
            raise ValueError(
                f"AsyncValidation(resources={self.resources!r}) must map Ray resource names to amounts >= 0, "
                "e.g. {'CPU': 1} or {'CPU': 4, 'GPU': 1}."
            )
        object.__setattr__(self, "resources", resources)

    def ray_remote_kwargs(self) -> Dict[str, Any]:
        """``ray.remote`` options of the task: its resources, and no retry (a failure is recorded, not retried)."""
        resources = dict(self.resources)
        out: Dict[str, Any] = {"num_cpus": resources.pop("CPU", 0), "max_retries": 0}
        if "GPU" in resources:
            out["num_gpus"] = resources.pop("GPU")
        if "memory" in resources:
            out["memory"] = resources.pop("memory")
        if resources:
            out["resources"] = resources
        return out


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_validation(value: Any) -> Optional[AsyncValidation]:
    """The ``validation`` option: None or "in_loop" (default), "async", a dict of fields, or `AsyncValidation`."""
    if value is None or value == "in_loop":
        return None
    if value == "async":
        return AsyncValidation()
    if isinstance(value, AsyncValidation):
        return value
    if isinstance(value, Mapping):  # from a config file or a Tune override
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(AsyncValidation)})
        if unknown:
            raise ValueError(
                f"validation={dict(value)!r} has unknown keys {unknown}: use "
                f"{', '.join(f.name for f in dataclasses.fields(AsyncValidation))}."
            )
        return AsyncValidation(**value)
    raise ValueError(
        f"validation={value!r}: use None (in-loop evaluation, the default), 'async' (every eval set as Ray tasks "
        "on checkpoints), or AsyncValidation(datasets=[...], every=..., resources=...)."
    )


def check_validation(validation: Optional[AsyncValidation], checkpoint: Any, eval_names: Optional[List[str]]) -> None:
    """Refuse an asynchronous validation that cannot run, naming the fix (on the driver, before Ray starts).

    ``eval_names``: the run's eval sets, or None when a datasets factory names them only at the start."""
    if validation is None:
        return
    if checkpoint is None:
        raise ValueError(
            "validation='async' evaluates checkpoints, and this run saves none: pass "
            "checkpoint=CheckpointConfig(save_interval=...) (e.g. '500ba'), or validation=None to evaluate in the loop."
        )
    if eval_names is None:
        return
    if not eval_names:
        raise ValueError(
            "validation='async' has no eval set to evaluate: add one to datasets (e.g. datasets={'train': tr, "
            "'val': va}), or pass validation=None."
        )
    unknown = sorted(set(validation.datasets or ()) - set(eval_names))
    if unknown:
        raise ValueError(
            f"AsyncValidation(datasets={list(validation.datasets or ())}) names {unknown}, which are not eval sets "
            f"of this run ({eval_names}): name eval sets from datasets (every name besides 'train')."
        )


def async_eval_names(validation: Optional[AsyncValidation], eval_names: Sequence[str]) -> List[str]:
    """The eval sets evaluated as Ray tasks (the rest are evaluated in the loop)."""
    if validation is None:
        return []
    return [n for n in eval_names if validation.datasets is None or n in validation.datasets]
