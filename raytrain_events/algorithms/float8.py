"""`Float8Training`: train the model's Linear layers with float8 matmuls (torchao), on GPUs that have them.

Applied once at ``INIT`` (before FSDP shards the model, as torchao requires). Refused, with the
reason and the fix, where the package or the device cannot do it (`check_float8_support`). With
``fsdp_float8_all_gather`` the weights' float8 scales are recomputed for FSDP after each
optimizer step (``BATCH_END``). Use it with ``precision="amp_bf16"`` for the rest of the model.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event
from raytrain_events.parallel.float8 import check_float8_support, convert_to_float8, model_device

__all__ = ["Float8Training"]


@register_algorithm("float8")
class Float8Training(Algorithm):
    """Convert eligible ``nn.Linear`` layers to torchao ``Float8Linear`` at INIT.

    Example::

        Trainer(..., precision="amp_bf16", algorithms=[Float8Training()])

    Args:
        skip: module names kept in their own precision (default: output heads).
        fsdp_float8_all_gather: FSDP all-gathers weights in float8 (half of bf16's bytes).
        emulate: run float8 numerics emulated, on any device (tests only: slower than fp32).
    """

    def __init__(
        self,
        skip: Sequence[str] = ("lm_head", "head", "output"),
        fsdp_float8_all_gather: bool = False,
        emulate: bool = False,
    ) -> None:
        self.skip = tuple(skip)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.emulate = emulate
        self.converted = 0

    def match(self, event: Event, state: Any) -> bool:
        return event == Event.INIT or (event == Event.BATCH_END and self.fsdp_float8_all_gather)

    def apply(self, event: Event, state: Any, logger: Any) -> None:
        if event == Event.INIT:
            device = model_device(state.model)
            if device is None:  # built on the meta device: the run's device is where it will live
                device = (
                    torch.device("cuda", torch.cuda.current_device())
                    if torch.cuda.is_available()
                    else torch.device("cpu")
                )
            check_float8_support(device, self.emulate)
            self.converted = convert_to_float8(
                state.model, skip=self.skip, fsdp_float8_all_gather=self.fsdp_float8_all_gather, emulate=self.emulate
            )
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(state.model)
