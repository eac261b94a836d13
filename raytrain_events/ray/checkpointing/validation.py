"""Asynchronous validation on Ray: evaluate checkpoints as Ray tasks while training goes on.

``RayTrainer(validation=AsyncValidation(datasets=["val"]))`` (or ``validation="async"``: every
eval set) takes those eval sets off the training ranks: rank 0 reports each chosen checkpoint to
Ray Train with ``validation=True``, and Ray Train's controller runs the function of a
``ray.train.ValidationConfig`` on it as a Ray task with its own resources
(alpha in Ray 2.60). That function
(`raytrain_events.ray.checkpointing.validate_checkpoint.CheckpointValidator`) loads the checkpoint into one
process through the project's checkpoint loading (which reshards), evaluates it with the user's
model factory and the same metrics code as the in-loop eval, and appends a history entry at the
checkpoint's global `Timestamp`: the run history, driver loggers, report and Tune results get the
metrics where the in-loop eval would have put them. Training never waits for it (Ray queues the
tasks; one runs at a time), and a failed or timed-out validation never fails the run: it is
logged and recorded (``"validation": "failed"`` with its error). In-loop evaluation is the default
(``validation=None``).

Validation entries arrive after later training entries (they are async), so consumers that want
"the newest training state" use `training_entries` / `is_validation_entry`.

This module is light (no torch): `RunSpec` imports it to check the option.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "AsyncValidation",
    "VALIDATE_KEY",
    "VALIDATION_KEY",
    "in_training_order",
    "is_validation_entry",
    "parse_validation",
    "ray_validation_config",
    "training_entries",
    "unfinished_validations",
    "validates",
    "validation_entry",
    "wait_history_validations",
]

#: The history entry key that marks a validation's entry: "async" (metrics) or "failed" (an error).
VALIDATION_KEY = "validation"
#: The key a checkpoint's history entry carries when the run's `RunHistory` actor is to run its validation (replica
#: groups: Ray Train never sees their checkpoints); the actor removes it and validates every ``every``-th such entry.
VALIDATE_KEY = "validate_checkpoint"


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


def validates(validation: Optional[AsyncValidation], checkpoints_reported: int) -> bool:
    """Whether the ``checkpoints_reported``-th checkpoint (1-based) of a worker group is validated."""
    return validation is not None and checkpoints_reported % validation.every == 0


def ray_validation_config(validator: Callable[..., Dict[str, Any]], validation: AsyncValidation) -> Any:
    """Ray Train's ``ValidationConfig`` running ``validator(checkpoint)`` as a task with the option's resources."""
    from ray.train import ValidationConfig, ValidationTaskConfig

    return ValidationConfig(
        fn=validator,
        task_config=ValidationTaskConfig(timeout_s=validation.timeout_s),
        ray_remote_kwargs=validation.ray_remote_kwargs(),
    )


def is_validation_entry(entry: Mapping[str, Any]) -> bool:
    """A history entry a validation task added (at its checkpoint's Timestamp, after later training entries)."""
    return VALIDATION_KEY in entry


def in_training_order(entries: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """The entries with each validation moved to just after the training entry that reported its checkpoint.

    Validations arrive late (after later training reports); in this order each one sits at its
    checkpoint's place, so "the newest value of a metric" means the newest Timestamp, as with
    in-loop evals. A validation whose checkpoint is not among the entries stays at its arrival.
    """
    from raytrain_events.storage.fs import basename

    by_checkpoint: Dict[str, List[Mapping[str, Any]]] = {}
    reported = {basename(str(e["checkpoint_path"])) for e in training_entries(entries) if e.get("checkpoint_path")}
    out: List[Mapping[str, Any]] = []
    for entry in entries:
        name = entry.get("validated_checkpoint")
        if is_validation_entry(entry) and name in reported:
            by_checkpoint.setdefault(str(name), []).append(entry)
    for entry in entries:
        if is_validation_entry(entry):
            if entry.get("validated_checkpoint") not in reported:
                out.append(entry)
            continue
        out.append(entry)
        if entry.get("checkpoint_path"):
            out.extend(by_checkpoint.pop(basename(str(entry["checkpoint_path"])), []))
    return out


def training_entries(entries: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """The history entries of the training reports, in order (validation entries left out)."""
    return [e for e in entries if not is_validation_entry(e)]


def validation_entry(
    counters: Optional[Mapping[str, int]], checkpoint_name: str, started: float, **fields: Any
) -> Dict[str, Any]:
    """A validation's history entry: the checkpoint's counters (``time/*``), its name and times, ``fields``
    (the metrics and ``validation="async"``, or ``validation="failed"`` and ``validation_error``)."""
    from raytrain_events.core.time import report_key

    entry: Dict[str, Any] = {report_key(k): int(v) for k, v in (counters or {}).items()}
    entry.update(fields)
    entry["validated_checkpoint"] = checkpoint_name
    entry["wall_time_started"] = started  # "wall_time*" keys are bookkeeping, never logged as metrics
    entry["wall_time"] = time.time()
    entry["validation/seconds"] = entry["wall_time"] - started
    return entry


def wait_history_validations(history: Any, validation: AsyncValidation) -> None:
    """After the fit, on the driver: wait for the validation tasks the run's history actor started (replica groups'
    checkpoints) up to ``timeout_s``, and cancel the rest (`unfinished_validations` then records them as failed)."""
    import ray  # on the driver only: this module stays light (`RunSpec` imports it)

    tasks = ray.get(history.validations.remote())
    if tasks:
        _, left = ray.wait(tasks, num_returns=len(tasks), timeout=validation.timeout_s)
        for task in left:
            ray.cancel(task, force=True)


def unfinished_validations(entries: Sequence[Mapping[str, Any]], validation: AsyncValidation) -> List[Dict[str, Any]]:
    """Failed entries for the checkpoints whose validation was asked for but left no entry (Ray cancelled
    it at ``timeout_s``, or its task was lost): the driver records them once the fit has ended.

    The checkpoints asked for are those `validates` chose: every ``every``-th checkpoint of each worker
    group (``attempt``), counted in the history's checkpoint entries."""
    done = {e.get("validated_checkpoint") for e in entries if is_validation_entry(e)}
    counts: Dict[Any, int] = {}
    out = []
    for entry in training_entries(entries):
        path = entry.get("checkpoint_path")
        if not path:
            continue
        attempt = entry.get("attempt")
        counts[attempt] = counts.get(attempt, 0) + 1
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        if validates(validation, counts[attempt]) and name not in done:
            counters = {k[len("time/") :]: v for k, v in entry.items() if k.startswith("time/")}
            limit = "" if validation.timeout_s is None else f" (timeout_s={validation.timeout_s})"
            error = f"no result: the validation task timed out{limit}, was cancelled or was lost"
            out.append(validation_entry(counters, name, time.time(), validation="failed", validation_error=error))
    return out
