"""The gradient norm `SpikeGuard` judges, before any clipping: which `GradientClipping`'s pre-clip norm it
shares (`shared_clipping`), and the ``AFTER_BACKWARD`` hook that takes the norm before an unshared clipping
clips (`PreClipNorm`, added by the guard at INIT only then), and under replica groups each worker's share of its
group's norm (`group_share_norm`); `grad_norm`: the norm a batch is judged by (functions of the guard, whose
fields hold the parameters and the clipping, found once)."""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
from torch.distributed.tensor import DTensor

from raytrain_events.algorithms.gradient_clipping import GradientClipping, whole_grad_norm
from raytrain_events.core.callback import Callback
from raytrain_events.core.logger import Logger
from raytrain_events.core.state import State
from raytrain_events.parallel.pipeline import pipeline_group

__all__ = ["PreClipNorm", "grad_norm", "group_share_norm", "shared_clipping"]

vector_norm, stack = torch.linalg.vector_norm, torch.stack


class PreClipNorm(Callback):
    """The guard's ``AFTER_BACKWARD`` hook, added at INIT only when a `GradientClipping` is configured."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard

    def after_backward(self, state: State, logger: Logger) -> None:
        take_pre_clip(self.guard, state)


def take_pre_clip(guard: Any, state: State) -> None:
    """At AFTER_BACKWARD (`PreClipNorm`), with a GradientClipping whose norm is not shared: the norm before it
    clips (it runs at AFTER_TRAIN_BATCH, before the callbacks); the last microbatch's is the batch's."""
    if guard._params is None:
        find_params(guard, state)
    if guard._clip_other and state.scaler is None and guard.detector.grad_zscore is not None:
        guard._pre_clip = own_norm(guard, state)


def find_params(guard: Any, state: State) -> List[torch.Tensor]:
    """The trained parameters and the clipping to share, found once (a walk of the groups per batch costs)."""
    params = guard._params = [p for opt in state.optimizers for g in opt.param_groups for p in g["params"]]
    guard._pipelined = pipeline_group(state.model) is not None  # (a model's pipeline is set when it is wrapped)
    guard._clip = shared_clipping(state, params)
    guard._clip_other = guard._clip is None and any(isinstance(a, GradientClipping) for a in state.algorithms)
    return params


def own_norm(guard: Any, state: State) -> Optional[torch.Tensor]:
    """The guard's own norm of this batch's gradients (this rank's; a group's share; a pipeline's whole model's)."""
    params = guard._params
    assert params is not None
    if guard._group is not None:  # replica groups: this worker's share of its group's norm (spike_groups.py)
        return group_share_norm(params)
    if guard._pipelined:  # pipeline parallelism: the whole model's, over shards and stages
        return whole_grad_norm(state.model, params)
    # One norm per tensor, then theirs: torch._foreach_norm measured no cheaper on the CPU (docs/spikes.md)
    norms = [vector_norm(grad) for p in params if (grad := p.grad) is not None]
    return vector_norm(stack(norms)) if norms else None


def grad_norm(guard: Any, state: State) -> Optional[torch.Tensor]:
    """This batch's gradient norm (this rank's) before any clipping, as a tensor: GradientClipping's when shared."""
    if guard._params is None:
        find_params(guard, state)
    clip = guard._clip
    if clip is not None:  # GradientClipping ran just before (algorithms first): its pre-clip norm, not a second one
        total = clip.last_grad_norm
        if total is None or total is guard._clip_seen:  # it clipped nothing this batch (no gradients)
            return None
        guard._clip_seen = total
        return total
    if guard._clip_other:  # taken at AFTER_BACKWARD, before the clipping
        pre, guard._pre_clip = guard._pre_clip, None
        return pre
    return own_norm(guard, state)


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
