"""The small distributed interface the loop knows: rank, world size, and summing counters.

`LocalDist` is a single process. `TorchDist` wraps an initialized ``torch.distributed``
process group (Ray Train sets one up on every worker). Counters (samples, tokens, stop flags)
are summed over a separate gloo group on host memory, so counting never syncs a GPU stream,
and the sum is started asynchronously so it overlaps with forward and backward.

Every collective here marks itself in flight on the process's `HEARTBEAT` (a monotonic time
write), so a progress watchdog can say which collective a hung rank waits in.
"""

from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence

import torch

from raytrain_events.core.heartbeat import HEARTBEAT

__all__ = ["Dist", "LocalDist", "TorchDist", "PendingSum", "default_dist"]


class PendingSum:
    """A sum of integers across ranks that may still be in flight; `wait` returns it."""

    __slots__ = ("_values", "_tensor", "_work")

    def __init__(self, values: Optional[List[int]] = None, tensor: Any = None, work: Any = None) -> None:
        self._values = values
        self._tensor = tensor
        self._work = work

    def wait(self) -> List[int]:
        """Block until the sum is known and return it as Python ints."""
        if self._values is None:
            HEARTBEAT.enter("all_reduce (the batch's counters)")
            self._work.wait()
            HEARTBEAT.exit()
            self._values = self._tensor.tolist()
        return self._values


class Dist:
    """Interface: what the loop needs from a distributed backend."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        """True when there is more than one rank."""
        return self.world_size > 1

    def sum_ints_async(self, values: Sequence[int]) -> PendingSum:
        """Start summing ``values`` elementwise across ranks."""
        raise NotImplementedError

    def all_gather_object(self, obj: Any) -> List[Any]:
        """``obj`` from every rank, in rank order."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait for every rank."""


class LocalDist(Dist):
    """One process: every collective is the identity."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def sum_ints_async(self, values: Sequence[int]) -> PendingSum:
        return PendingSum(values=list(values))

    def all_gather_object(self, obj: Any) -> List[Any]:
        return [obj]


class TorchDist(Dist):
    """An initialized ``torch.distributed`` default group, plus a gloo group for counters."""

    def __init__(self, device: Optional[torch.device] = None, *, timeout_s: Optional[float] = None) -> None:
        """``timeout_s``: the counter group's timeout (under NCCL; None: torch's default)."""
        import torch.distributed as tdist

        if not tdist.is_available() or not tdist.is_initialized():
            raise RuntimeError("TorchDist needs an initialized torch.distributed process group (init_process_group).")
        self._tdist = tdist
        self.rank = tdist.get_rank()
        self.world_size = tdist.get_world_size()
        self.local_rank = int(__import__("os").environ.get("LOCAL_RANK", "0"))
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        self.device = torch.device(device)
        backend = tdist.get_backend()
        # Counters live on the host: a gloo group keeps them off the GPU stream under NCCL.
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self._counter_group = None if backend == "gloo" else tdist.new_group(backend="gloo", timeout=timeout)

    @property
    def gloo_group(self) -> Any:
        """A gloo group of every rank (None: the default group, which is gloo): host-side checks."""
        return self._counter_group

    def sum_ints_async(self, values: Sequence[int]) -> PendingSum:
        tensor = torch.tensor(list(values), dtype=torch.int64)
        work = self._tdist.all_reduce(tensor, group=self._counter_group, async_op=True)
        return PendingSum(tensor=tensor, work=work)

    def all_gather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.world_size
        with HEARTBEAT.collective("all_gather_object"):
            self._tdist.all_gather_object(out, obj, group=self._counter_group)
        return out

    def barrier(self) -> None:
        with HEARTBEAT.collective("barrier"):
            self._tdist.barrier(group=self._counter_group)


def default_dist(device: Optional[torch.device] = None) -> Dist:
    """`TorchDist` if a process group is initialized, else `LocalDist`."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        return TorchDist(device)
    return LocalDist(device)
