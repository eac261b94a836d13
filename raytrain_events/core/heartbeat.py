"""`Heartbeat`: this process's last sign of progress, and the collective it is waiting in.

A hung run shows up as ranks that stop making progress. To find them without any extra
collective, each rank records where it is: the loop's events (a batch ended, an eval batch
ended, a checkpoint was taken) call `beat`, and `raytrain_events.dist` wraps every collective
in `collective`, so a rank stuck in one says which (and since when). Both are a
``time.monotonic()`` read and a few attribute writes: cheap enough for every batch.

A watchdog thread reads `snapshot` (see `raytrain_events.ray.guards.watchdog`). The process has one
heartbeat, `HEARTBEAT`, because collectives are called from places that do not know the loop.

Example::

    from raytrain_events.core.heartbeat import HEARTBEAT

    HEARTBEAT.beat("batch_end", batch=17)
    with HEARTBEAT.collective("all_reduce counters"):
        ...  # the collective
    HEARTBEAT.snapshot()  # {"label": "batch_end", "batch": 17, "idle_s": ..., "collective": None, ...}
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from typing import Any, Dict, Iterator, List, Optional

__all__ = ["Heartbeat", "HEARTBEAT", "thread_stack"]


def thread_stack(ident: Optional[int]) -> List[traceback.FrameSummary]:
    """The current stack of the thread ``ident`` (outermost first); [] if it is gone."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    return traceback.extract_stack(frame) if frame is not None else []


class Heartbeat:
    """The monotonic time and label of the latest progress, and the collective in flight."""

    __slots__ = ("last", "label", "batch", "in_flight", "in_flight_since", "beats")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start over (a new fit in this process)."""
        self.last = time.monotonic()
        self.label = "start"
        self.batch = 0
        self.in_flight: Optional[str] = None
        self.in_flight_since: Optional[float] = None
        self.beats = 0

    def beat(self, label: str, batch: Optional[int] = None) -> None:
        """Record progress now: ``label`` says what (an event name), ``batch`` the global batch."""
        self.last = time.monotonic()
        self.label = label
        if batch is not None:
            self.batch = batch
        self.beats += 1

    def enter(self, name: str) -> None:
        """A collective named ``name`` starts (it counts as progress: the rank got here)."""
        now = time.monotonic()
        self.in_flight, self.in_flight_since, self.last = name, now, now

    def exit(self) -> None:
        """The collective in flight returned."""
        self.in_flight = self.in_flight_since = None
        self.last = time.monotonic()

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Mark ``name`` in flight for the duration of the block."""
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def idle_s(self, now: Optional[float] = None) -> float:
        """Seconds since the latest progress."""
        return (time.monotonic() if now is None else now) - self.last

    def snapshot(self) -> Dict[str, Any]:
        """Plain data: what the rank did last, how long ago, and the collective it waits in."""
        now = time.monotonic()
        since = self.in_flight_since
        return {
            "label": self.label,
            "batch": self.batch,
            "idle_s": round(now - self.last, 3),
            "last_wall": round(time.time() - (now - self.last), 3),  # comparable across ranks' dumps
            "collective": self.in_flight,
            "collective_s": None if since is None else round(now - since, 3),
            "beats": self.beats,
        }


#: This process's heartbeat (one per rank).
HEARTBEAT = Heartbeat()
