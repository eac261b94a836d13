"""`LabelSmoothing`: train against ``(1 - s) * one_hot(y) + s / C`` instead of the hard label.

At ``BEFORE_LOSS`` the targets in ``state.batch`` are replaced by smoothed probabilities (the
number of classes ``C`` is ``state.outputs.shape[1]``); at ``AFTER_LOSS`` the original targets are
put back, so anything after the loss (metrics, other algorithms) sees the labels it expects.
Targets that are already probabilities (from MixUp or CutMix) are smoothed the same way:
``(1 - s) * p + s / C``. Composer's ``LabelSmoothing``.
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_events.algorithms._batch import (
    BatchKey,
    get_item,
    num_classes_of,
    resolve_key,
    set_item,
    to_probabilities,
)
from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event

__all__ = ["LabelSmoothing", "smooth_labels"]


def smooth_labels(logits: Any, targets: Any, smoothing: float = 0.1) -> Any:
    """Smoothed class probabilities shaped like ``logits`` (integer or probability ``targets``)."""
    num_classes = num_classes_of(logits, "LabelSmoothing")
    probabilities = to_probabilities(targets, num_classes, torch.promote_types(logits.dtype, torch.float32))
    return probabilities * (1.0 - smoothing) + smoothing / num_classes


@register_algorithm("label_smoothing")
class LabelSmoothing(Algorithm):
    """Smooth the training targets by ``smoothing``.

    Example::

        Trainer(..., algorithms=[LabelSmoothing(smoothing=0.1)])
    """

    def __init__(self, smoothing: float = 0.1, target_key: BatchKey = None) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing!r} must be in [0, 1), like 0.1.")
        self.smoothing = float(smoothing)
        self.target_key = target_key
        self._original = None
        self._key = None

    def match(self, event: Event, state) -> bool:
        return event == Event.BEFORE_LOSS or (event == Event.AFTER_LOSS and self._key is not None)

    def apply(self, event: Event, state, logger) -> None:
        if event == Event.BEFORE_LOSS:
            key = resolve_key(state.batch, self.target_key, "target", state.model)
            targets = get_item(state.batch, key)
            self._original, self._key = targets, key
            smoothed = smooth_labels(state.outputs, targets, self.smoothing)
            state.batch = set_item(state.batch, key, smoothed)
        else:
            state.batch = set_item(state.batch, self._key, self._original)
            self._original = self._key = None
        return None

    def __repr__(self) -> str:
        return f"LabelSmoothing(smoothing={self.smoothing})"
