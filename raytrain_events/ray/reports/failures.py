"""`FailureRecorder`: each worker group's failure, as Ray Train's controller saw it, in the run directory.

The run history learns of a worker group through its reports, so a group that fails before its first
one (a second failure while the first restart was still starting, a node lost during start-up) leaves no
history entry: the goodput report would merge two restarts into one and keep only one cause. The
controller sees each failure in its poll of the group: Ray Train calls ``UserCallback.after_exception`` with
the failed ranks' errors (a raised exception, a killed process's failed health check, a hang the watchdog
ended) before it restarts the group. (A restart Ray's elastic policy makes on a lost node before a poll
sees a death is not a failure to it: no record; the goodput report then names the cause as before.) This callback writes one small record per failure (``failures/at-<ms>.json``, named by
`RunDir`), read by `raytrain_events.report.goodput`.

Cost: one small write per failure, on the controller; nothing per step.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Dict

from ray.train import UserCallback

from raytrain_events.ray._compat import RayCompatError, worker_death_errors
from raytrain_events.storage.fs import resolve, write_bytes_atomic
from raytrain_events.storage.run_dir import RunDir

__all__ = ["FailureRecorder", "failure_record"]

log = logging.getLogger(__name__)

#: The longest error text a record keeps per rank (a traceback's last line is enough to name the cause).
ERROR_CHARS = 300


def _error_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1:  # a traceback Ray carried from the worker: its last line names the error ("ValueError: ...")
        return lines[-1][:ERROR_CHARS]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:ERROR_CHARS]


def _died(exc: BaseException) -> bool:
    """The rank's process or node is gone (Ray's health check failed or timed out), not an error it raised: the
    others' errors are then mostly its consequence (a collective's peer closed the connection)."""
    try:
        return isinstance(exc, worker_death_errors())
    except RayCompatError:  # a Ray that renamed them (tests/ray/test_compat.py says so): the record still goes out
        return False


def failure_record(worker_exceptions: Dict[int, BaseException], wall: float) -> Dict[str, Any]:
    """The record of one failure: when, which ranks, each one's error in a line, and which ranks died (listed first
    in ``errors``: the cause, where the others' errors followed from it)."""
    ranked = sorted(worker_exceptions.items(), key=lambda item: (not _died(item[1]), int(item[0])))
    return {
        "wall": wall,
        "ranks": sorted(int(rank) for rank in worker_exceptions),
        "died": sorted(int(rank) for rank, exc in worker_exceptions.items() if _died(exc)),
        "errors": {str(int(rank)): _error_line(exc) for rank, exc in ranked},
    }


class FailureRecorder(UserCallback):
    """Ray Train controller callback: write a record of each failed worker group into ``run_dir``."""

    def __init__(self, run_dir: RunDir) -> None:  # noqa: D107
        self.run_dir = run_dir

    def after_exception(self, run_context: Any, worker_exceptions: Dict[int, Exception]) -> None:
        record = failure_record(worker_exceptions, time.time())
        try:
            fs, path = resolve(self.run_dir.failure(record["wall"]), self.run_dir.storage_options)
            write_bytes_atomic(fs, path, json.dumps(record).encode())
        except Exception as exc:  # the record serves the report only: never stop Ray's restart for it
            log.warning("Could not record the worker group's failure in %s: %s", self.run_dir.url, exc)
