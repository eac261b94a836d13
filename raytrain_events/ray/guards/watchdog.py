"""The progress watchdog: a hung rank is found, its stack saved and named, and the group restarted.

A rank that hangs instead of dying (a stuck collective, storage call or data loader) stops the
whole run: the other ranks wait in their next collective until the process-group timeout (30 min
by default), and then nothing says which rank or which line. Here every rank's loop events beat
the process's `HEARTBEAT` (and every collective marks itself in flight, see `raytrain_events.dist`);
a thread on each rank checks it. When a rank has made no progress for ``hang_timeout`` seconds
(default ``max(300, 20 x median step)``; every rank reaches it, since the others wait for the
hung one), each rank:

1. writes ``<run>/hangs/<group id>/rank-<r>.txt``: its heartbeat (last event, global batch, the
   collective in flight), its training thread's stack, and ``faulthandler``'s stacks of all threads;
2. waits up to ``grace_s`` for the other ranks' dumps; the lowest rank that dumped writes
   ``summary.txt`` (and ``hang.json`` for the run report) and logs it: the slowest rank (`slowest_rank`: no dump at all, else fewest
   batches, then not waiting in a collective, then the longest idle) and its frame;
3. exits the process, so Ray Train's ``FailureConfig`` restarts the group from the newest checkpoint.

The process-group timeout (`process_group_timeout_s`) is set from the same value, longer, so the
watchdog speaks first. Start-up (model build, checkpoint load, the data pipeline's first batch) is
not watched: the start-up health check (`raytrain_events.ray.guards.health`) has its own deadline; the
watchdog arms at the first batch of each fit.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Dict, List, Optional

from raytrain_events.core.callback import Callback
from raytrain_events.core.heartbeat import HEARTBEAT, thread_stack

__all__ = [
    "ProgressWatchdog",
    "default_hang_timeout",
    "process_group_timeout_s",
    "slowest_rank",
    "MIN_HANG_TIMEOUT_S",
]

logger = logging.getLogger(__name__)

#: The default hang timeout's floor, and its multiple of the median step.
MIN_HANG_TIMEOUT_S = 300.0
STEP_MULTIPLE = 20
_STDLIB = sysconfig.get_paths()["stdlib"]


def default_hang_timeout(step_seconds: List[float]) -> float:
    """``max(300 s, 20 x the median step)``: ``step_seconds`` are recent batch-to-batch times."""
    if not step_seconds:
        return MIN_HANG_TIMEOUT_S
    return max(MIN_HANG_TIMEOUT_S, STEP_MULTIPLE * statistics.median(step_seconds))


def grace_seconds(hang_timeout: Optional[float]) -> float:
    """How long a rank that fired waits for the other ranks' dumps: 10 s, or less for short timeouts."""
    return 10.0 if hang_timeout is None else min(10.0, max(2.0, hang_timeout / 2))


def process_group_timeout_s(hang_timeout: Optional[float]) -> float:
    """The process-group timeout for a run's ``hang_timeout``: after the watchdog has fired and dumped.

    With the derived default (None), 30 minutes (torch's gloo default; the watchdog fires first
    while the median step is under 90 s)."""
    if hang_timeout is None:
        return 1800.0
    return hang_timeout + 3 * grace_seconds(hang_timeout) + 30.0


# Where a beat's label falls in the loop after the batch count it carries was set (at batch_end):
# the batch's end, its eval and checkpoint, the epoch's end, then the next batch's data.
_LOOP_POSITION = {
    "start": 0,
    "fit_start": 0,
    "batch_end": 1,
    "eval_batch_end": 2,
    "batch_checkpoint": 3,
    "epoch_end": 4,
    "epoch_checkpoint": 5,
    "after_dataloader": 6,
    "fit_end": 7,
}


def slowest_rank(records: Dict[int, Dict[str, Any]], world_size: int) -> int:
    """The rank most likely holding the others up, from the ranks' dump records.

    A rank with no dump at all (frozen, or its process stopped) first; else the rank furthest
    behind in the loop (fewest batches done, then the earliest point after its last batch), then
    one not waiting in a collective (the others wait for it there), then the earliest last beat.
    Ranks dump at slightly different moments, so the last beat's wall time is compared, not idle time.
    """
    absent = [r for r in range(world_size) if r not in records]
    if absent:
        return absent[0]

    def behind(r: int) -> tuple:
        rec = records[r]
        last = rec.get("last_wall", -rec["idle_s"])
        return (rec["batch"], _LOOP_POSITION.get(rec.get("label", ""), 0), rec["collective"] is not None, last, r)

    return min(records, key=behind)


def _frame_of(stack: List[traceback.FrameSummary]) -> str:
    """The innermost frame outside the standard library: where a rank is stuck."""
    for frame in reversed(stack):
        if not frame.filename.startswith(_STDLIB) or "site-packages" in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return f"{stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}" if stack else "(no Python frame)"


class ProgressWatchdog(Callback):
    """Fail the worker group, with every rank's stack in the run dir, when no rank progresses.

    ``hang_timeout``: seconds without progress (None: ``default_hang_timeout`` of recent steps).
    ``dump_url``: this group's folder for the dumps (``<run>/hangs/<group id>``).
    ``on_hang(summary)``: what ends the rank (default: SIGKILL this process; Ray restarts the group).
    """

    def __init__(
        self,
        *,
        hang_timeout: Optional[float],
        dump_url: str,
        rank: int,
        world_size: int,
        storage_options: Optional[Dict[str, Any]] = None,
        grace_s: Optional[float] = None,
        on_hang: Optional[Callable[[str], None]] = None,
    ) -> None:
        if hang_timeout is not None and not hang_timeout > 0:
            raise ValueError(f"hang_timeout={hang_timeout!r} must be a positive number of seconds, or None.")
        self.hang_timeout = hang_timeout
        self.dump_url = dump_url
        self.rank, self.world_size = rank, world_size
        self.options = dict(storage_options or {})
        self.grace_s = grace_seconds(hang_timeout) if grace_s is None else grace_s
        self._on_hang = on_hang or _exit_process
        self._steps: deque = deque(maxlen=256)
        self._last_batch_end: Optional[float] = None
        self._armed = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._train_ident: Optional[int] = None
        self.fired: Optional[str] = None  # the summary, once it fired

    def timeout(self) -> float:
        """The hang timeout now (the derived default follows the observed steps)."""
        if self.hang_timeout is not None:
            return self.hang_timeout
        return default_hang_timeout(list(self._steps))

    # ---------------------------------------------------------------- the loop's beats
    def fit_start(self, state, logger) -> None:
        HEARTBEAT.reset()
        HEARTBEAT.beat("fit_start", int(state.timestamp.batch))
        self._train_ident = threading.get_ident()
        self._armed, self._last_batch_end = False, None
        self._stop.clear()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="raytrain-watchdog", daemon=True)
            self._thread.start()

    def after_dataloader(self, state, logger) -> None:
        self._armed = True  # the first batch came: start-up is over
        HEARTBEAT.beat("after_dataloader")

    def batch_end(self, state, logger) -> None:
        now = time.monotonic()
        if self._last_batch_end is not None:
            self._steps.append(now - self._last_batch_end)
        self._last_batch_end = now
        HEARTBEAT.beat("batch_end", int(state.timestamp.batch))

    def batch_checkpoint(self, state, logger) -> None:
        HEARTBEAT.beat("batch_checkpoint")

    def eval_batch_end(self, state, logger) -> None:
        HEARTBEAT.beat("eval_batch_end")

    def epoch_end(self, state, logger) -> None:
        HEARTBEAT.beat("epoch_end")

    def epoch_checkpoint(self, state, logger) -> None:
        HEARTBEAT.beat("epoch_checkpoint")

    def fit_end(self, state, logger) -> None:
        HEARTBEAT.beat("fit_end")

    def close(self, state, logger) -> None:
        self._armed = False
        self._stop.set()

    # ---------------------------------------------------------------- the watching thread
    def _watch(self) -> None:
        while not self._stop.wait(min(2.0, max(0.05, self.timeout() / 20))):
            if self._armed and HEARTBEAT.idle_s() >= self.timeout():
                try:
                    summary = self._fire()
                except Exception as exc:  # the dumps are best effort: still end the rank
                    summary = f"Progress watchdog on rank {self.rank}: no progress; writing the dumps failed: {exc!r}"
                    logger.error(summary)
                self.fired = summary
                self._on_hang(summary)
                return

    def _fire(self) -> str:
        # why here: defers fsspec until this runs
        from raytrain_events.storage.fs import join, resolve, write_bytes_atomic
        from raytrain_events.storage.run_dir import HANG_RECORD

        timeout = self.timeout()
        record, text = self._dump(timeout)
        fs, folder = resolve(self.dump_url, self.options)
        write_bytes_atomic(fs, join(folder, f"rank-{self.rank}.txt"), text.encode())
        records = self._gather(fs, folder, record)
        summary_path = join(folder, "summary.txt")
        if self.rank == min(records):
            summary = self._summary(records, timeout)
            slow = slowest_rank(records, self.world_size)
            event = {
                "wall": time.time(),
                "hang_timeout_s": timeout,
                "slowest_rank": slow,
                "frame": records[slow]["frame"] if slow in records else None,
                "batch": records[slow]["batch"] if slow in records else None,
            }
            write_bytes_atomic(fs, join(folder, HANG_RECORD), json.dumps(event).encode())  # the run report reads it
            write_bytes_atomic(fs, summary_path, summary.encode())
            logger.error(summary)
            return summary
        deadline = time.monotonic() + self.grace_s + 5.0
        while time.monotonic() < deadline and not fs.exists(summary_path):
            time.sleep(0.2)  # the summary's writer exits after writing: do not end the group before
        return f"Progress watchdog: rank {self.rank} dumped its stacks to {self.dump_url}"

    def _dump(self, timeout: float) -> tuple:
        """This rank's record (plain data) and dump text: heartbeat, training stack, all threads."""
        stack = thread_stack(self._train_ident)
        with tempfile.TemporaryFile("w+") as tmp:
            faulthandler.dump_traceback(file=tmp, all_threads=True)
            tmp.seek(0)
            all_threads = tmp.read()
        record = dict(
            HEARTBEAT.snapshot(),
            rank=self.rank,
            world_size=self.world_size,
            host=socket.gethostname(),
            pid=os.getpid(),
            hang_timeout_s=round(timeout, 3),
            frame=_frame_of(stack),
        )
        text = (
            json.dumps(record)
            + "\n\n--- training thread ---\n"
            + "".join(traceback.format_list(stack))
            + "\n--- all threads (faulthandler) ---\n"
            + all_threads
        )
        return record, text

    def _gather(self, fs: Any, folder: str, own: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
        """The dump records of every rank that wrote one within ``grace_s`` (this rank's included)."""
        # why here: defers fsspec until this runs
        from raytrain_events.storage.fs import join, list_dir, read_bytes

        deadline = time.monotonic() + self.grace_s
        names: List[str] = []
        while True:
            names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in list_dir(fs, folder)]
            ranks = [n for n in names if n.startswith("rank-") and n.endswith(".txt")]
            if len(ranks) >= self.world_size or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        records = {self.rank: own}
        for name in ranks:
            try:
                first = read_bytes(fs, join(folder, name)).split(b"\n", 1)[0]
                record = json.loads(first)
            except Exception:
                continue  # being written, or unreadable: that rank counts as absent
            records[int(record["rank"])] = record
        return records

    def _summary(self, records: Dict[int, Dict[str, Any]], timeout: float) -> str:
        slow = slowest_rank(records, self.world_size)
        lines = [
            f"Progress watchdog: no progress for {timeout:g} s (hang_timeout). Slowest rank: {slow}"
            + (
                " (no stack dump: its process is frozen or stopped)."
                if slow not in records
                else _describe(records[slow])
            )
        ]
        for rank in sorted(records):
            if rank != slow:
                lines.append(f"  rank {rank}:{_describe(records[rank])}")
        lines.append(
            f"Stacks of every rank: {self.dump_url}. Ending the worker group: Ray Train restarts it from the "
            "newest checkpoint (FailureConfig(max_failures)); set hang_timeout if this was not a hang."
        )
        return "\n".join(lines)


def _describe(record: Dict[str, Any]) -> str:
    where = (
        f"waiting in {record['collective']} for {record['collective_s']:.0f} s"
        if record.get("collective")
        else "not in a collective"
    )
    return (
        f" (host {record['host']}, pid {record['pid']}) at batch {record['batch']}, last progress "
        f"'{record['label']}' {record['idle_s']:.0f} s ago, {where}, in {record['frame']}"
    )


def _exit_process(summary: str) -> None:
    """End this rank now: a hung training thread cannot be interrupted, and Ray restarts the group."""
    del summary
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
