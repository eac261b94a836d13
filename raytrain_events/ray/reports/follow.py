"""`HistoryFollower`: the driver's view of a run while it trains (progress bar, loggers).

A daemon thread asks the run's `RunHistory` actor for the entries added since its last look,
once per ``poll_s``, and hands each batch of new entries to every consumer
(``consumer(new_entries, all_entries)``); leaving the ``with`` block takes a last look, so the
consumers see every entry exactly once, in order.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Sequence

__all__ = ["HistoryFollower"]

Consumer = Callable[[List[Dict[str, Any]], List[Dict[str, Any]]], None]
logger = logging.getLogger(__name__)


class HistoryFollower:
    """Poll a `RunHistory` actor and feed new entries to ``consumers``."""

    def __init__(self, history: Any, consumers: Sequence[Consumer], poll_s: float = 1.0) -> None:
        self.history = history
        self.consumers = list(consumers)
        self.poll_s = poll_s
        self.entries: List[Dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="raytrain-history", daemon=True)

    def __enter__(self) -> HistoryFollower:
        if self.consumers:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.poll(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll(timeout=5)

    def poll(self, timeout: float) -> None:
        """Fetch new entries and hand them to the consumers (a failed fetch is retried next time)."""
        import ray

        with self._lock:
            try:
                new = ray.get(self.history.since.remote(len(self.entries)), timeout=timeout)
            except Exception:  # busy, or gone at the very end: the run's result has everything
                return
            if not new:
                return
            self.entries.extend(new)
            for consumer in self.consumers:
                try:
                    consumer(new, self.entries)
                except Exception:  # a failing logger must not stop the run
                    logger.warning("A run history consumer failed", exc_info=True)
