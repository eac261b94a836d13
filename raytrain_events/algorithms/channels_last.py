"""`ChannelsLast`: store the model's 4-D weights in NHWC ("channels last") memory format.

Convolutions on tensor-core GPUs run faster in NHWC; PyTorch then keeps activations in that
format too. Applied once at ``INIT`` (before optimizers step, and before DDP wraps the model);
inputs need no change. Composer's ``ChannelsLast``.
"""

from __future__ import annotations

import torch

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event

__all__ = ["ChannelsLast"]


@register_algorithm("channels_last")
class ChannelsLast(Algorithm):
    """Convert the model to ``torch.channels_last`` at INIT.

    Example::

        Trainer(..., algorithms=[ChannelsLast()])
    """

    def match(self, event: Event, state) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state, logger) -> None:
        # Module.to(memory_format=...) converts 4-D parameters and buffers in place (same Parameter
        # objects), so optimizers built before INIT keep pointing at the right tensors.
        state.model.to(memory_format=torch.channels_last)
        return None
