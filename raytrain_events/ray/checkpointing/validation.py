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

The option's value type and its checks (`AsyncValidation`, `parse_validation`, `check_validation`,
`async_eval_names`) live in `raytrain_events.ray.async_validation`, which `RunSpec` imports (it
imports nothing of this package); they are re-exported here.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from raytrain_events.core.time import report_key
from raytrain_events.ray.async_validation import (  # re-exported: the option's value type and checks
    AsyncValidation,
    async_eval_names,
    check_validation,
    parse_validation,
)

__all__ = [
    "AsyncValidation",
    "ASKED_KEY",
    "LATE_KEY",
    "VALIDATE_KEY",
    "VALIDATION_KEY",
    "async_eval_names",
    "check_validation",
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
#: A replica-group lead's late save (`core/save_points.py`): the batches of the save points it stands in for, whose
#: checkpoints were never committed (`RunHistory.add` marks their entries ``checkpoint_lost``).
LATE_KEY = "checkpoint_late_for"
#: The key a checkpoint's history entry carries when its validation was asked for: set where that is decided (rank 0's
#: `RayReporter` for Ray Train's validations, `RunHistory` for the replica groups'), read by `unfinished_validations`.
ASKED_KEY = "validation_asked"


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
    # why here: defers fsspec until this runs
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

    The checkpoints asked for are the entries marked ``ASKED_KEY`` by the one place that chose them (`validates`
    counted there: rank 0's `RayReporter`, or `RunHistory` for replica groups); they are not counted again here."""
    done = {e.get("validated_checkpoint") for e in entries if is_validation_entry(e)}
    out = []
    for entry in training_entries(entries):
        if not entry.get(ASKED_KEY):
            continue
        name = str(entry["checkpoint_path"]).rstrip("/").rsplit("/", 1)[-1]
        if name not in done:
            counters = {k[len("time/") :]: v for k, v in entry.items() if k.startswith("time/")}
            limit = "" if validation.timeout_s is None else f" (timeout_s={validation.timeout_s})"
            error = f"no result: the validation task timed out{limit}, was cancelled or was lost"
            out.append(validation_entry(counters, name, time.time(), validation="failed", validation_error=error))
    return out
