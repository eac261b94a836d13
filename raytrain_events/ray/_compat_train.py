"""Ray Train V2's private names on a worker (part of `_compat`'s table, which lists them): the preemption notice this
worker holds, the worker actor's ``execute`` (to run a function on the actor's main thread), and Ray Train V2's
``TorchftConfig`` (replica groups' backend), and the controller's errors for a worker whose process or node is gone
(`worker_death_errors`, for the record of a failed group). The worker group's own methods, wrapped to build replica groups of several
workers, are in ``_compat_worker_group.py``. `probe_train_worker` checks them against the installed Ray.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

from raytrain_events.ray._compat_lookup import _attr, _import, _missing

__all__ = [
    "local_preemption_info",
    "torchft_config_class",
    "run_on_worker_main_thread",
    "probe_train_worker",
    "worker_death_errors",
    "reports_waiting",
]


def local_preemption_info() -> Any:
    """This Ray Train worker's preemption notice (a ``ray.train.PreemptionInfo``), or None.

    What ``ray.train.get_preemption_info()`` reads, without its barrier across the workers: cheap
    enough to look at every batch (the ranks agree through the loop's own collective)."""
    get_train_context = _import("ray.train.v2._internal.execution.context", "get_train_context")
    return _attr(_attr(get_train_context(), "preemption_context"), "preemption_info")


def reports_waiting() -> int:
    """How many of this worker's ``ray.train.report`` calls Ray has not handed to its controller yet: a report in
    Ray's ASYNC mode waits in Ray's one upload thread for its turn (the reports before it handed over: a checkpoint's
    registration waits for the save's commit, and each hand-over for the controller to take the one before)."""
    context = _import("ray.train.v2._internal.execution.context", "get_train_context")()
    return int(_attr(context, "report_call_index")) - int(_attr(context, "current_report_index"))


def worker_death_errors() -> Tuple[type, ...]:
    """The errors Ray Train's controller gives a worker whose health check failed or timed out (its process or node
    is gone), as against an exception the worker raised."""
    module = "ray.train.v2._internal.exceptions"
    return (_import(module, "WorkerHealthCheckFailedError"), _import(module, "WorkerHealthCheckTimeoutError"))


def torchft_config_class() -> Any:  # Ray Train V2's TorchftConfig (replica groups' Lighthouse, per-group restarts)
    return _import("ray.train.v2.torch.torchft_config", "TorchftConfig")


def run_on_worker_main_thread(fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """Run ``fn()`` on this Ray Train worker actor's main thread and return its result.

    Ray runs the train function on a thread of its own; the actor's main thread executes the
    actor's methods one at a time, and Ray Train's worker has ``execute(fn)``. ``fn`` travels
    pickled: give a module-level function (it then runs on this process's module state)."""
    import ray

    actor = ray.get_runtime_context().current_actor
    try:
        execute = actor.execute
    except AttributeError as exc:
        raise _missing("RayTrainWorker.execute", exc) from exc
    return ray.get(execute.remote(fn), timeout=timeout_s)


def probe_train_worker() -> None:
    worker = _import("ray.train.v2._internal.execution.worker_group.worker", "RayTrainWorker")
    for name in ("execute", "mark_preempt"):
        if not callable(getattr(worker, name, None)):
            raise _missing(f"RayTrainWorker.{name}")
    _import("ray.train.v2._internal.execution.context", "get_train_context")
    fields = getattr(_import("ray.train.v2._internal.execution.context", "TrainContext"), "__dataclass_fields__", {})
    for name in ("report_call_index", "current_report_index"):  # `reports_waiting`
        if name not in fields:
            raise _missing(f"TrainContext.{name}")
    worker_death_errors()
    context = _import("ray.train.v2._internal.execution.preemption", "PreemptionContext")
    if not hasattr(context(), "preemption_info"):
        raise _missing("PreemptionContext.preemption_info")
