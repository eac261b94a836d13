"""`LayerFreezing`: progressively freeze the earliest layers once training is far enough along.

After ``freeze_start`` (a fraction of the run), the fraction of layers frozen grows linearly
to ``freeze_level`` at the end of training:
``frozen_fraction = freeze_level * (t - freeze_start) / (1 - freeze_start)`` (Composer's schedule),
checked at each ``EPOCH_END`` (or ``BATCH_END`` with ``update_on="batch"``). A "layer" is a
module that owns parameters directly, in registration order (input side first).

Frozen parameters get ``requires_grad=False``. Because the trainer zeroes gradients with
``set_to_none=True``, optimizers skip them entirely (no update, no weight decay, no momentum),
while the optimizer's param groups stay as built, so checkpoints load into a fresh optimizer.
``find_unused_parameters`` is True so DDP accepts the missing gradients.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event

__all__ = ["LayerFreezing", "freeze_schedule", "parameter_layers"]


def freeze_schedule(elapsed: float, freeze_start: float, freeze_level: float) -> float:
    """Fraction of layers to freeze when ``elapsed`` of the run (0..1) is done."""
    if elapsed <= freeze_start:
        return 0.0
    return min(freeze_level, freeze_level * (elapsed - freeze_start) / (1.0 - freeze_start))


def parameter_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Modules that own parameters directly, in registration order."""
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


@register_algorithm("layer_freezing")
class LayerFreezing(Algorithm):
    """Freeze the first layers progressively during the last part of training.

    Example::

        Trainer(..., algorithms=[LayerFreezing(freeze_start=0.5, freeze_level=1.0)])
    """

    def __init__(self, freeze_start: float = 0.5, freeze_level: float = 1.0, update_on: str = "epoch") -> None:
        if not 0.0 <= freeze_start < 1.0:
            raise ValueError(f"freeze_start={freeze_start!r} must be a fraction of training in [0, 1), like 0.5.")
        if not 0.0 <= freeze_level <= 1.0:
            raise ValueError(f"freeze_level={freeze_level!r} must be in [0, 1] (the fraction of layers to freeze).")
        if update_on not in ("epoch", "batch"):
            raise ValueError(f"update_on={update_on!r} must be 'epoch' or 'batch'.")
        self.freeze_start, self.freeze_level = float(freeze_start), float(freeze_level)
        self._event = Event.EPOCH_END if update_on == "epoch" else Event.BATCH_END
        self.update_on = update_on
        self.num_frozen = 0

    @property
    def find_unused_parameters(self) -> bool:
        return True

    def match(self, event: Event, state) -> bool:
        return event == self._event or (event == Event.FIT_START and self.num_frozen > 0)

    def apply(self, event: Event, state, logger) -> None:
        layers = parameter_layers(state.model)
        if event == self._event:
            fraction = freeze_schedule(float(state.get_elapsed_duration().value), self.freeze_start, self.freeze_level)
            target = int(fraction * len(layers))
            if target <= self.num_frozen:
                return None
            self.num_frozen = target
            logger.log_metrics(
                {"layer_freezing/layers_frozen": target, "layer_freezing/fraction": fraction}, step=state.step
            )
        for layer in layers[: self.num_frozen]:  # FIT_START after a resume re-freezes the saved count
            for param in layer.parameters(recurse=False):
                param.requires_grad_(False)
                param.grad = None
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"num_frozen": self.num_frozen}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.num_frozen = int(state.get("num_frozen", 0))

    def __repr__(self) -> str:
        return f"LayerFreezing(freeze_start={self.freeze_start}, freeze_level={self.freeze_level})"
