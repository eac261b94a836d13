"""`SaveChannel`: what the ranks share so that a save costs the training thread only its copy.

Set up once per `Checkpointer` (every rank at the same point, like the rest of set-up):

* a token agreed by one collective at set-up: each rank names a save's directory from the token
  and its own save count (``checkpoint_name(timestamp, token=...)``), so ranks agree on the name
  without a collective per save;
* for background (async) saves, one gloo process group of every rank, made once with
  ``new_group``: the background save's collectives (gathering the RNG states to rank 0, DCP's
  planning) run on it, so they never interleave with DDP/FSDP or the loop's collectives on the
  default group. gloo whatever the training backend: the objects it moves are host memory (the
  staged copy, pickled RNG states), as DCP's async save does;
* the `HostStager` whose reusable host buffers take the device-to-host copy.

Per save, the training thread captures the RNG state (a few KiB) and stages the tensors; the
gather of every rank's RNG state to rank 0 (``gather_rngs``) runs in the background save.
A synchronous save runs everything on the training thread anyway and gathers there.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from raytrain_events.checkpoint.format.manifest import checkpoint_name
from raytrain_events.checkpoint.run.staging import HostStager, Staged

if TYPE_CHECKING:
    from raytrain_events.dist import Dist

__all__ = ["SaveChannel"]


class SaveChannel:
    """Directory names, the background process group and the host stager of one run's saves."""

    def __init__(self, dist: Dist, *, background: bool) -> None:
        self.dist = dist
        self.group: Any = None  # the background saves' process group (None: synchronous saves)
        token = uuid.uuid4().hex
        if dist.is_distributed:
            token = dist.all_gather_object(token)[0]  # rank 0's, once at set-up
            if background:
                import torch.distributed as tdist

                self.group = tdist.new_group(backend="gloo")
        self.token = token
        self.saves = 0
        self.stager: Optional[HostStager] = HostStager() if background else None

    def name(self, timestamp: Mapping[str, int]) -> str:
        """The next save's directory name, the same on every rank (each counts its own saves)."""
        self.saves += 1
        return checkpoint_name(timestamp, token=f"{self.token}/{self.saves}")

    def stage(self, tree: Any) -> Staged:
        """``tree`` copied to host buffers (async saves), or as it is (synchronous saves)."""
        if self.stager is None:
            return Staged(tree)
        return self.stager.stage(tree)

    def gather_rngs(self, rng: Any) -> Dict[int, Any]:
        """Every rank's RNG state on rank 0 ({rank: state}); {} on the others. Collective: every
        rank calls it once per save, in the background save when there is one."""
        dist = self.dist
        if not dist.is_distributed:
            return {0: rng}
        if self.group is None:  # a synchronous save, on the training thread
            return dict(enumerate(dist.all_gather_object(rng)))
        import torch.distributed as tdist

        rank = tdist.get_rank()
        out = [None] * dist.world_size if rank == 0 else None
        tdist.gather_object(rng, out, dst=0, group=self.group)
        return dict(enumerate(out)) if out is not None else {}
