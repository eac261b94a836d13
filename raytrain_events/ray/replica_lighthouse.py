"""Replica groups lose their Lighthouse: the run stops with the reason and the fix.

Ray Train 2.60's ``TorchftConfig`` runs the torchft Lighthouse as a Ray actor on the head node
and does not restart it (a restarted one would listen on a new port the groups' Managers do
not know). Without it no group can form a quorum, and what Ray does next never ends: every
group fails its quorum, Ray restarts the whole worker group, the restart asks the dead actor
for its address and fails to start, and Ray retries that start without end (start-up failures
count against ``FailureConfig.controller_failure_limit``, unlimited by default, not
``max_failures``). Seen here: still retrying 10 minutes after the kill.

So the loss ends the run, at once, with one error that names it:

- on a worker, a failed quorum is checked against the Lighthouse itself (`lighthouse_reachable`:
  a TCP connect to ``TORCHFT_LIGHTHOUSE``, three tries over about 2 s); when it is gone the
  worker raises `LighthouseLostError`, naming the Lighthouse and the fix;
- on Ray Train's controller, `LighthouseWatch` (a ``ray.train.UserCallback`` that `RayTrainer`
  adds to replica-group runs) sees that error among the workers' and raises it there: an error
  in a controller callback fails the run (Ray's failure policy retries no such error).

Cost: nothing per step; on a failed quorum, one TCP connect (up to three).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Dict, Optional
from urllib.parse import urlparse

from ray.train import UserCallback

__all__ = ["LighthouseLostError", "LighthouseWatch", "lighthouse_reachable", "lighthouse_lost"]

_LOST = "replica groups: the torchft Lighthouse at "  # how a `LighthouseLostError` begins

#: Where Ray Train puts the Lighthouse's address for the workers (torchft's ``Manager`` reads it).
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class LighthouseLostError(RuntimeError):
    """The torchft Lighthouse of a replica-groups run is gone (see the module doc)."""


def lighthouse_reachable(address: Optional[str], tries: int = 3, wait_s: float = 1.0) -> bool:
    """True if something accepts a TCP connection at ``address`` (``http://host:port``) within ``tries``."""
    if not address:
        return True  # nothing to check against: leave the failure as it was
    parsed = urlparse(address if "//" in address else f"http://{address}")
    if parsed.hostname is None or parsed.port is None:
        return True
    for attempt in range(tries):
        try:
            with socket.create_connection((parsed.hostname, parsed.port), timeout=2.0):
                return True
        except OSError:
            if attempt + 1 < tries:
                time.sleep(wait_s)
    return False


def lighthouse_lost(error: BaseException) -> Optional[LighthouseLostError]:
    """After a failed quorum: a `LighthouseLostError` to raise if the Lighthouse is gone, else None."""
    address = os.environ.get(LIGHTHOUSE_ENV)
    if lighthouse_reachable(address):
        return None
    return LighthouseLostError(
        f"{_LOST}{address} is gone ({type(error).__name__}: {error}). It ran as "
        "a Ray actor on the head node (Ray Train's TorchftConfig), which Ray does not restart, and no replica group "
        "can train without it, so the run stops. Fix: run again with the same run_name and storage_path: with "
        "checkpoint=CheckpointConfig(save_interval=...) it resumes from the newest storage checkpoint (the lead "
        "group's); without checkpoints it starts over."
    )


class LighthouseWatch(UserCallback):
    """On Ray Train's controller: end the run when a worker reports `LighthouseLostError`."""

    def after_exception(self, run_context: Any, worker_exceptions: Dict[int, Exception]) -> None:
        for error in worker_exceptions.values():  # the workers' own exceptions (or their text)
            text = str(error)
            start = text.find(_LOST)
            if isinstance(error, LighthouseLostError) or start >= 0:
                raise LighthouseLostError(text[max(start, 0) :].splitlines()[0])
