"""`GradientClipping`: clip gradients by global norm or by value before the optimizer step.

Runs at ``AFTER_TRAIN_BATCH``: every microbatch's gradient has been accumulated and, with fp16
mixed precision, the `GradScaler` has already unscaled them, so the threshold is in true
gradient units. Composer's ``GradientClipping`` with ``clipping_type`` "norm" or "value".
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event
from raytrain_events.parallel.pipeline import whole_model_norm

__all__ = ["GradientClipping", "whole_grad_norm"]

_TYPES = ("norm", "value")


@register_algorithm("gradient_clipping")
class GradientClipping(Algorithm):
    """Clip gradients so their global L2 norm (``"norm"``) or each element (``"value"``) is at most the threshold.

    Example::

        Trainer(..., algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=1.0)])

    With ``"norm"`` the pre-clipping norm of the last batch is kept in ``last_grad_norm`` (a tensor,
    never read back to the host here).
    """

    def __init__(self, clipping_type: str = "norm", clipping_threshold: float = 1.0, norm_type: float = 2.0) -> None:
        if clipping_type not in _TYPES:
            raise ValueError(f"clipping_type={clipping_type!r} is not supported: use one of {list(_TYPES)}.")
        if not clipping_threshold > 0:
            raise ValueError(f"clipping_threshold={clipping_threshold!r} must be > 0.")
        self.clipping_type = clipping_type
        self.clipping_threshold = float(clipping_threshold)
        self.norm_type = float(norm_type)
        self.last_grad_norm: Optional[torch.Tensor] = None

    def match(self, event: Event, state) -> bool:
        return event == Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state, logger) -> None:
        params = [p for p in state.model.parameters() if p.grad is not None]
        if not params:
            return None
        if self.clipping_type == "norm":
            if any(isinstance(p.grad, DTensor) for p in params):
                # FSDP: each rank holds a shard of every gradient; the norm is over all of them.
                by_mesh = _by_mesh(params)
                # Pipeline parallelism: each rank holds one stage's gradients; the norm is over all stages.
                total = whole_model_norm(state.model, _sharded_total_norm(by_mesh, self.norm_type), self.norm_type)
                for group in by_mesh:  # foreach ops cannot mix meshes either
                    torch.nn.utils.clip_grads_with_norm_(group, self.clipping_threshold, total)
                self.last_grad_norm = total
            else:
                self.last_grad_norm = torch.nn.utils.clip_grad_norm_(
                    params, self.clipping_threshold, norm_type=self.norm_type
                )
        else:
            torch.nn.utils.clip_grad_value_(params, self.clipping_threshold)
        return None

    def __repr__(self) -> str:
        return f"GradientClipping(clipping_type={self.clipping_type!r}, clipping_threshold={self.clipping_threshold})"


def whole_grad_norm(model: torch.nn.Module, params: list, norm_type: float = 2.0) -> torch.Tensor:
    """The whole model's gradient norm from the gradients of ``params`` this rank holds, as the
    clipping computes it: each mesh's norm made whole (FSDP's shards, TP's splits) and, under pipeline
    parallelism, combined over the stages (`whole_model_norm`). Collective where sharded or pipelined:
    every rank calls it at the same point (the spike guard's norm under PP)."""
    by_mesh = _by_mesh([p for p in params if p.grad is not None])
    return whole_model_norm(model, _sharded_total_norm(by_mesh, norm_type), norm_type)


def _by_mesh(params: list) -> list:
    """``params`` in groups by their gradient's DeviceMesh (FSDP x TP: the split layers on the 2-D
    (shard, tensor) mesh, the rest on its 1-D shard mesh; DTensor ops cannot mix meshes)."""
    groups: dict = {}
    for param in params:
        groups.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    return list(groups.values())


def _sharded_total_norm(by_mesh: list, norm_type: float) -> torch.Tensor:
    """The global gradient norm of parameters grouped by mesh: one norm per mesh, made whole
    (``full_tensor``), then the norm of those norms."""
    norms = []
    for group in by_mesh:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.nn.utils.get_total_norm(norms, norm_type=norm_type)
