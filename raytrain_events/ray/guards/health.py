"""The start-up health check: every rank meets once, within a deadline, before training.

Without it a rank that never arrives (stuck loading a model, a data set or a checkpoint; its node
lost) hangs every other rank in the first collective (DDP's parameter broadcast) until the
process-group timeout, and then nothing says which rank it was. Here every rank passes a gloo
``monitored_barrier`` after building its model, optimizers and loaders: rank 0 waits up to the
deadline for each rank and names those that did not come; the ranks then agree on a group id
(rank 0's), which names this worker group's watchdog dumps (``<run>/hangs/<group id>/``).

Example (inside a Ray Train worker)::

    group_id = check_startup(dist, timeout_s=300)
"""

from __future__ import annotations

import datetime
import re
import uuid
from typing import Any, List

from raytrain_events.core.heartbeat import HEARTBEAT

__all__ = ["StartupHealthError", "check_startup", "missing_ranks", "new_group_id"]


class StartupHealthError(RuntimeError):
    """A rank did not reach the start-up check within its deadline."""


def new_group_id() -> str:
    """A sortable, unique name for one worker group: ``YYYYmmdd-HHMMSS-<6 hex>``."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def missing_ranks(message: str) -> List[int]:
    """The ranks gloo's ``monitored_barrier`` error names ("Ranks 1, 3 failed to pass ..."); [] if none."""
    match = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    if not match:
        return []
    return [int(r) for r in re.findall(r"\d+", match.group(1))]


def check_startup(dist: Any, timeout_s: float) -> str:
    """Every rank of ``dist`` (a `Dist`) meets within ``timeout_s``; returns the group's id.

    Raises `StartupHealthError` naming the ranks that did not arrive (on rank 0; other ranks
    name rank 0, which they wait for).
    """
    if not dist.is_distributed:
        return new_group_id()
    import torch.distributed as tdist

    try:
        with HEARTBEAT.collective("start-up health check"):
            tdist.monitored_barrier(
                group=getattr(dist, "gloo_group", None),
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_all_ranks=True,
            )
    except RuntimeError as exc:
        ranks = missing_ranks(str(exc))
        if dist.rank == 0 and ranks:
            who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            raise StartupHealthError(
                f"Start-up health check: {who} of {dist.world_size} did not arrive within {timeout_s:g} s "
                "(every rank meets there after building its model, optimizers and data loaders, before "
                f"training). {who.capitalize()} is stuck in start-up (a model, data or checkpoint load) or its "
                f"node is gone: see its worker log. If start-up is only slow, raise hang_timeout (the deadline). "
                f"[{exc}]"
            ) from exc
        raise StartupHealthError(
            f"Start-up health check failed on rank {dist.rank} of {dist.world_size} within {timeout_s:g} s: rank 0 "
            f"reported a rank that did not arrive (see rank 0's error). [{exc}]"
        ) from exc
    ids = dist.all_gather_object(new_group_id() if dist.rank == 0 else None)
    return str(ids[0])
