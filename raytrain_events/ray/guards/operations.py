"""What keeps a long Ray run operating itself, set up on each worker before its `Trainer`.

`worker_guards` runs the start-up health check (`raytrain_events.ray.guards.health`: every rank meets
within the deadline, or the error names the one that did not) and returns the callbacks that
watch the run: the progress watchdog (`raytrain_events.ray.guards.watchdog`) and, when the run saves
checkpoints, the preemption guard (`raytrain_events.ray.guards.preemption`). One ``hang_timeout``
(a `RunSpec` option) sets the watchdog, the start-up deadline and, on the driver, the
process-group timeout (`raytrain_events.ray.guards.watchdog.process_group_timeout_s`).
"""

from __future__ import annotations

from typing import Any, List

from raytrain_events.core.callback import Callback
from raytrain_events.ray.guards.health import check_startup
from raytrain_events.ray.guards.watchdog import MIN_HANG_TIMEOUT_S, ProgressWatchdog

__all__ = ["worker_guards", "startup_deadline_s"]


def startup_deadline_s(hang_timeout: Any) -> float:
    """The start-up health check's deadline: ``hang_timeout``, or the watchdog's floor (300 s)."""

    return float(hang_timeout) if hang_timeout is not None else MIN_HANG_TIMEOUT_S


def worker_guards(spec: Any, dist: Any, *, checkpointing: bool) -> List[Callback]:
    """Check that every rank arrived, then the watchdog (and preemption guard) for this worker group."""
    # why here: defers fsspec until this runs
    from raytrain_events.storage.run_dir import RunDir

    group_id = check_startup(dist, startup_deadline_s(spec.failures.hang_timeout))
    guards: List[Callback] = [
        ProgressWatchdog(
            hang_timeout=spec.failures.hang_timeout,
            dump_url=RunDir(spec.storage.run_url).hangs(group_id),
            rank=dist.rank,
            world_size=dist.world_size,
            storage_options=spec.storage.storage_options,
        )
    ]
    if checkpointing:
        # why here: defers fsspec until this runs
        from raytrain_events.ray.guards.preemption import PreemptionGuard

        guards.append(
            PreemptionGuard(dist=dist, run_url=spec.storage.run_url, storage_options=spec.storage.storage_options)
        )
    return guards
