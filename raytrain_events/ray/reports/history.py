"""The driver's record of a run: a small Ray actor the controller pushes history entries to.

The driver owns it and reads it during ``fit()`` (progress bar) and after (result); nothing
flows back to the workers. With asynchronous validation and replica groups it also starts the
validation tasks of the checkpoints the lead group reports (Ray Train never sees those): it lives on
the driver's node for the whole run, so a task it owns survives the loss of any group.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import ray
from ray.train import UserCallback

from raytrain_events.ray.checkpointing.validation import ASKED_KEY, LATE_KEY, VALIDATE_KEY, validates
from raytrain_events.ray.reports.aggregate import SAVE_PENDING_KEY, ReportAggregator

__all__ = ["RunHistory", "AggregatingCallback"]


@ray.remote(num_cpus=0)
class RunHistory:
    """Holds the aggregated history entries of one run."""

    def __init__(self) -> None:
        self.entries: List[Dict[str, Any]] = []
        self.error: Optional[str] = None
        self._validator: Any = None  # (CheckpointValidator, AsyncValidation), see `validate_checkpoints`
        self._asked = 0  # checkpoint entries that asked for a validation
        self._tasks: List[Any] = []
        self._counted: Dict[str, Any] = {}  # checkpoint path -> its validation task (None: not chosen) per asking entry

    def validate_checkpoints(self, validator: Any, validation: Any) -> None:
        """Run ``validator`` (the run's `CheckpointValidator`) as a Ray task with ``validation``'s resources on every
        ``validation.every``-th checkpoint entry that asks for it (``VALIDATE_KEY``: replica groups' lead). This
        actor owns the tasks, so a task outlives the group that saved its checkpoint; each records its own entry."""
        self._validator = (validator, validation)

    def add(self, entry: Dict[str, Any]) -> None:
        asks = entry.pop(VALIDATE_KEY, False)
        lost = self._mark_lost(entry.get(LATE_KEY) or ())
        if asks and self._validator is not None:
            self._validate(entry, lost)
        self.entries.append(entry)

    def _mark_lost(self, batches: Any) -> List[Dict[str, Any]]:
        """A replica-group lead's late save stands in for the save points at ``batches`` (``LATE_KEY``): their lead
        died before committing their checkpoints. Mark the entries naming those (``checkpoint_lost``); return them."""
        lost = []
        for old in self.entries:
            if old.get("checkpoint_path") and old.get("time/batch") in batches and not old.get(LATE_KEY):
                old["checkpoint_lost"] = True
                lost.append(old)
        return lost

    def _validate(self, entry: Dict[str, Any], lost: List[Dict[str, Any]]) -> None:
        """Count the checkpoint of ``entry`` and start its validation if it is an ``every``-th one (marked
        ``ASKED_KEY``: the one place this is decided for replica groups). A late save takes the place of the ``lost``
        checkpoints it stands in for: not counted again, and validated instead of them when one was chosen (their
        mark moves to it; their task, waiting for a commit that never comes, is cancelled)."""
        validator, validation = self._validator
        replaced = [old for old in lost if old["checkpoint_path"] in self._counted]
        if replaced:
            chosen = [old.pop(ASKED_KEY, False) for old in replaced]
            for old in replaced:
                task = self._counted.pop(old["checkpoint_path"], None)
                if task is not None:
                    ray.cancel(task)
                    self._tasks.remove(task)
        else:
            self._asked += 1
            chosen = [validates(validation, self._asked)]
        task = None
        if any(chosen):
            entry[ASKED_KEY] = True
            task = _validate.options(**validation.ray_remote_kwargs()).remote(validator, entry["checkpoint_path"])
            self._tasks.append(task)
        self._counted[entry["checkpoint_path"]] = task

    def validations(self) -> List[Any]:
        """The validation tasks this actor started (ObjectRefs; the driver waits for them after the fit)."""
        return list(self._tasks)

    def set_error(self, message: str) -> None:
        self.error = message

    def get(self) -> Dict[str, Any]:
        return {"entries": list(self.entries), "error": self.error}

    def since(self, index: int) -> List[Dict[str, Any]]:
        """The entries from ``index`` on (the driver follows the run incrementally)."""
        return self.entries[index:]

    def latest(self) -> Optional[Dict[str, Any]]:
        return self.entries[-1] if self.entries else None


#: How long a validation task waits for its checkpoint's commit: the lead's entry names the checkpoint as its
#: asynchronous save starts (the upload of a 100+ GB checkpoint takes minutes); a save that fails for good leaves
#: the task failing after this with the reader's error, recorded as the checkpoint's failed validation.
COMMIT_WAIT_S = 900.0


@ray.remote
def _validate(validator: Any, checkpoint_path: str) -> Dict[str, Any]:
    """One validation task: ``validator`` as Ray Train would call it (on an object with the checkpoint's ``path``),
    once the checkpoint is committed (`COMMIT_WAIT_S`)."""
    return validator(SimpleNamespace(path=checkpoint_path), commit_wait_s=COMMIT_WAIT_S)


class AggregatingCallback(UserCallback):
    """Ray Train controller callback: aggregate each report round and forward it: every entry to the run's
    history, and to Tune's queue all but those made while a save is pending (`SAVE_PENDING_KEY`: PBT acts on the
    first result past a point and copies its checkpoint; that point's checkpoint comes with a later result)."""

    def __init__(self, history: Any, report_queue: Any = None) -> None:
        self.history = history
        self.report_queue = report_queue  # a ray.util.queue.Queue (RayTrainer.fit(report_queue=...)) or None
        self.aggregator = ReportAggregator()

    def after_report(self, run_context, metrics, checkpoint) -> None:
        path = checkpoint.path if checkpoint is not None else None
        try:
            entry = self.aggregator.add(list(metrics), checkpoint_path=path)
        except Exception as exc:
            self.history.set_error.remote(f"{type(exc).__name__}: {exc}")
            raise
        entry["wall_time"] = time.time()  # the report's arrival: throughput and the report's time axis
        self.history.add.remote(entry)
        if self.report_queue is not None and not entry.get(SAVE_PENDING_KEY):
            self.report_queue.put(dict(entry))
