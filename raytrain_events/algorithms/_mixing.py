"""Shared machinery of MixUp and CutMix: mix inputs with a permutation, then mix the targets.

At ``BEFORE_FORWARD`` (once per microbatch, so a permutation never crosses microbatches) the
subclass mixes the inputs and records the mixing coefficient ``lam`` (the weight of the original
sample) and the permutation. Targets are mixed at ``BEFORE_LOSS``, when ``state.outputs`` tells
the number of classes: ``lam * p + (1 - lam) * p[perm]`` where ``p`` is whatever the targets are
at that point (integers become one-hot; probabilities, for example from an earlier
LabelSmoothing, are used as they are). ``AFTER_LOSS`` restores the original targets.

With ``interpolate_loss=True`` targets stay as they are and the loss becomes
``lam * loss(y) + (1 - lam) * loss(y[perm])`` at ``AFTER_LOSS``.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch

from raytrain_events.algorithms._batch import (
    BatchKey,
    get_item,
    num_classes_of,
    resolve_key,
    set_item,
    to_probabilities,
)
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event

__all__ = ["MixingAlgorithm", "sample_mixing_coef"]


def sample_mixing_coef(alpha: float) -> float:
    """``lam ~ Beta(alpha, alpha)`` from Python's ``random`` (seeded by the trainer's ``seed``)."""
    return random.betavariate(alpha, alpha)


class MixingAlgorithm(Algorithm):
    """Base class: subclasses implement ``mix_inputs(inputs, permutation) -> mixed inputs`` and set ``mixing_coef``."""

    def __init__(self, alpha: float, interpolate_loss: bool, input_key: BatchKey, target_key: BatchKey) -> None:
        if not alpha > 0:
            raise ValueError(f"alpha={alpha!r} must be > 0 (the Beta(alpha, alpha) parameter), like 0.2.")
        self.alpha = float(alpha)
        self.interpolate_loss = bool(interpolate_loss)
        self.input_key, self.target_key = input_key, target_key
        self.mixing_coef: float = 1.0
        self.permutation: Optional[torch.Tensor] = None
        self._original_targets: Any = None
        self._target_key: Any = None

    def mix_inputs(self, inputs: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def match(self, event: Event, state) -> bool:
        if event == Event.BEFORE_FORWARD:
            return True
        if self.permutation is None:
            return False
        if self.interpolate_loss:
            return event == Event.AFTER_LOSS
        return event == Event.BEFORE_LOSS or (event == Event.AFTER_LOSS and self._target_key is not None)

    def apply(self, event: Event, state, logger) -> None:
        batch = state.batch
        if event == Event.BEFORE_FORWARD:
            key = resolve_key(batch, self.input_key, "input", state.model)
            inputs = get_item(batch, key)
            permutation = torch.randperm(inputs.shape[0], device=inputs.device)
            mixed = self.mix_inputs(inputs, permutation)  # sets self.mixing_coef
            self.permutation = permutation
            state.batch = set_item(batch, key, mixed)
        elif event == Event.BEFORE_LOSS:
            key = resolve_key(batch, self.target_key, "target", state.model)
            targets = get_item(batch, key)
            self._original_targets, self._target_key = targets, key
            state.batch = set_item(batch, key, self.mix_targets(targets, state.outputs))
        elif not self.interpolate_loss:  # AFTER_LOSS: put the original targets back
            state.batch = set_item(batch, self._target_key, self._original_targets)
            self._original_targets = self._target_key = None
        else:  # AFTER_LOSS with interpolate_loss
            key = resolve_key(batch, self.target_key, "target", state.model)
            targets = get_item(batch, key)
            permuted_batch = set_item(batch, key, targets[self.permutation])
            permuted_loss = state.model.loss(state.outputs, permuted_batch)
            state.loss = _interpolate(state.loss, permuted_loss, self.mixing_coef)
        return None

    def mix_targets(self, targets: torch.Tensor, outputs: Any) -> torch.Tensor:
        """``lam * p + (1 - lam) * p[perm]`` with ``p`` the targets as class probabilities."""
        num_classes = num_classes_of(outputs, type(self).__name__)
        probabilities = to_probabilities(targets, num_classes, torch.promote_types(outputs.dtype, torch.float32))
        lam = self.mixing_coef
        return probabilities * lam + probabilities[self.permutation] * (1.0 - lam)


def _interpolate(loss: Any, permuted: Any, lam: float) -> Any:
    if isinstance(loss, dict):
        return {k: lam * v + (1.0 - lam) * permuted[k] for k, v in loss.items()}
    if isinstance(loss, (list, tuple)):
        return type(loss)(lam * a + (1.0 - lam) * b for a, b in zip(loss, permuted))
    return lam * loss + (1.0 - lam) * permuted
