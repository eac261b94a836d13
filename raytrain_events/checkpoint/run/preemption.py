"""SIGTERM (spot reclaim) during a local ``fit()``: save a checkpoint, then stop.

The handler is installed only for the duration of ``fit()`` and only on the main thread
(Python allows signal handlers nowhere else); it is never installed at import. Inside Ray
workers the train function runs off the main thread, so there preemption comes from
``ray.train.get_preemption_info()`` instead (see `raytrain_events.ray.reports.worker_reports`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["save_on_sigterm", "SAVE_FLAG"]

#: The agreement flag that asks the `Checkpointer` to save at the next batch all ranks agree on.
SAVE_FLAG = "save"


@contextlib.contextmanager
def save_on_sigterm(state: Any) -> Iterator[bool]:
    """While active, SIGTERM asks for a checkpoint and a stop after the current batch.

    Yields True if the handler could be installed (main thread), else False.
    """
    state.agreement.register(SAVE_FLAG)  # idempotent; every rank enters this at FIT_START
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.getsignal(signal.SIGTERM)

    def _handler(signum: int, frame: Any) -> None:
        state.request(SAVE_FLAG)
        state.stop_training("SIGTERM: saving a checkpoint before exit")

    signal.signal(signal.SIGTERM, _handler)
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, previous)
