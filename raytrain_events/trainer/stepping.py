"""The optimizer step of a batch, with closures for optimizers that re-evaluate the loss (SAM).

An optimizer with ``uses_closure = True`` (e.g. `raytrain_events.algorithms.sam.SAMOptimizer`) gets
``optimizer.step(closure)``: the closure zeroes the gradients and runs the batch's forward, loss
and backward again, over the same microbatches (grad accumulation) and, under DDP, with the same
gradient all-reduce, firing the microbatch events again; it returns the batch's loss. Other
optimizers get a plain ``step()`` (through the `GradScaler` with fp16).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import torch

from raytrain_events.core.event import Event

if TYPE_CHECKING:
    from raytrain_events.core.state import State

#: ``forward_backward(active, autocast, create_graph)``: the batch's forward, loss and backward again
#: (all its microbatches), setting ``state.loss``; the loop's own, so a closure trains like the step.
ForwardBackward = Callable[[Mapping[Event, bool], Optional[contextlib.AbstractContextManager[Any]], bool], None]

__all__ = ["step_optimizers", "ForwardBackward"]


def step_optimizers(
    state: State,
    forward_backward: ForwardBackward,
    active: Mapping[Event, bool],
    autocast: Optional[contextlib.AbstractContextManager[Any]],
    create_graph: bool,
) -> None:
    """Step every optimizer of ``state`` once, after the batch's backward."""
    scaler = state.scaler
    for optimizer in state.optimizers:
        if getattr(optimizer, "uses_closure", False):
            if scaler is not None:
                raise ValueError(
                    f"{type(optimizer).__name__} re-evaluates the loss in a closure, which the fp16 GradScaler "
                    "cannot step: use precision='amp_bf16' or 'fp32'."
                )
            trained_loss = state.loss  # the batch's loss at the weights it trained, not the closure's
            optimizer.step(_closure(state, forward_backward, active, autocast, create_graph))
            state.loss = trained_loss
        elif scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()


def _closure(
    state: State,
    forward_backward: ForwardBackward,
    active: Mapping[Event, bool],
    autocast: Optional[contextlib.AbstractContextManager[Any]],
    create_graph: bool,
) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            forward_backward(active, autocast, create_graph)
        loss: torch.Tensor = state.loss
        return loss

    return closure
