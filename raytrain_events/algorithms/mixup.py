"""`MixUp`: train on convex combinations of pairs of samples and of their labels.

``x' = lam * x + (1 - lam) * x[perm]`` with ``lam ~ Beta(alpha, alpha)`` and a random permutation
of the microbatch, at ``BEFORE_FORWARD``; the targets become ``lam * y + (1 - lam) * y[perm]``
(as class probabilities) for the loss only. Zhang et al., 2017; Composer's ``MixUp``. See
`raytrain_events.algorithms._mixing` for how targets are mixed and restored.
"""

from __future__ import annotations

import torch

from raytrain_events.algorithms._batch import BatchKey
from raytrain_events.algorithms._mixing import MixingAlgorithm, sample_mixing_coef
from raytrain_events.algorithms.registry import register_algorithm

__all__ = ["MixUp", "mixup_batch"]


def mixup_batch(inputs: torch.Tensor, permutation: torch.Tensor, lam: float) -> torch.Tensor:
    """``lam * inputs + (1 - lam) * inputs[permutation]`` (a new tensor)."""
    return inputs * lam + inputs[permutation] * (1.0 - lam)


@register_algorithm("mixup")
class MixUp(MixingAlgorithm):
    """Mix inputs and targets of random sample pairs.

    Example::

        Trainer(..., algorithms=[MixUp(alpha=0.2)])

    After each ``BEFORE_FORWARD``, ``mixing_coef`` is the ``lam`` used and ``permutation`` the
    pairing. ``interpolate_loss=True`` mixes the two losses instead of the targets (for losses
    that need integer targets).
    """

    def __init__(
        self,
        alpha: float = 0.2,
        interpolate_loss: bool = False,
        input_key: BatchKey = None,
        target_key: BatchKey = None,
    ) -> None:
        super().__init__(alpha, interpolate_loss, input_key, target_key)

    def mix_inputs(self, inputs: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
        self.mixing_coef = sample_mixing_coef(self.alpha)
        return mixup_batch(inputs, permutation, self.mixing_coef)

    def __repr__(self) -> str:
        return f"MixUp(alpha={self.alpha}, interpolate_loss={self.interpolate_loss})"
