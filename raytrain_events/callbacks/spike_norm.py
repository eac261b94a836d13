"""The gradient norm `SpikeGuard` judges, before any clipping: which `GradientClipping`'s pre-clip norm it
shares (`shared_clipping`), and the ``AFTER_BACKWARD`` hook that takes the norm before an unshared clipping
clips (`PreClipNorm`, added by the guard at INIT only then), and under replica groups each worker's share of its
group's norm (`group_share_norm`)."""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
from torch.distributed.tensor import DTensor

from raytrain_events.algorithms.gradient_clipping import GradientClipping
from raytrain_events.core.callback import Callback
from raytrain_events.core.logger import Logger
from raytrain_events.core.state import State

__all__ = ["PreClipNorm", "group_share_norm", "shared_clipping"]


class PreClipNorm(Callback):
    """The guard's ``AFTER_BACKWARD`` hook, added at INIT only when a `GradientClipping` is configured."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def after_backward(self, state: State, logger: Logger) -> None:
        self.guard._take_pre_clip(state)


def shared_clipping(state: State, params: List[torch.Tensor]) -> Optional[GradientClipping]:
    """The `GradientClipping` whose pre-clip norm is this guard's gradient norm, or None: clipping by the L2
    norm of exactly the optimized parameters, none of them sharded (an FSDP clip's norm is the global one,
    the guard's this rank's)."""
    trained = {id(p) for p in params}
    for algorithm in state.algorithms:
        if (
            type(algorithm) is GradientClipping
            and algorithm.clipping_type == "norm"
            and algorithm.norm_type == 2.0
            and trained == {id(p) for p in state.model.parameters() if p.requires_grad}
            and not any(isinstance(p, DTensor) for p in params)
        ):
            return algorithm
    return None


def group_share_norm(params: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """This worker's share of its replica group's gradient norm, as a norm (None without gradients): the root of the
    sum of its gradients' squares, each tensor's divided by how many workers of the group hold the same values (a
    DTensor's replicated mesh dimensions: HSDP's replicate inside the group, a tensor-parallel model's replicated
    parameters). The group sums the squares of these shares (`StepVote.group_sum`), which is then the whole model's
    squared norm exactly, each shard counted once. Local tensors only (a DTensor's own norm would be a collective per
    parameter); a one-worker group's plain gradients give their plain norm."""
    squares = []
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        copies = 1
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            copies = math.prod(mesh.size(i) for i, placement in enumerate(grad.placements) if placement.is_replicate())
            grad = grad.to_local()
        square = torch.linalg.vector_norm(grad).float().square()
        squares.append(square / copies if copies > 1 else square)
    return torch.stack(squares).sum().sqrt() if squares else None
