"""`CutMix`: paste a random box from another sample into each image, and mix labels by area.

For images ``(N, C, H, W)``: ``lam ~ Beta(alpha, alpha)``; a box of area about ``(1 - lam) * H * W``
centred uniformly at random (clipped to the image) is copied from ``x[perm]`` into ``x``; then
``lam`` is recomputed from the clipped box as ``1 - box_area / (H * W)`` and the targets become
``lam * y + (1 - lam) * y[perm]``. Yun et al., 2019; Composer's ``CutMix``.
"""

from __future__ import annotations

import math
import random
from typing import Tuple

import torch

from raytrain_events.algorithms._batch import BatchKey
from raytrain_events.algorithms._mixing import MixingAlgorithm, sample_mixing_coef
from raytrain_events.algorithms.registry import register_algorithm

__all__ = ["CutMix", "random_box", "cutmix_batch"]


def random_box(height: int, width: int, lam: float) -> Tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of a box with area ``(1 - lam) * H * W`` before clipping."""
    cut_ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut_ratio), int(width * cut_ratio)
    cy, cx = random.randint(0, height - 1), random.randint(0, width - 1)
    top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
    left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
    return top, bottom, left, right


def cutmix_batch(inputs: torch.Tensor, permutation: torch.Tensor, box: Tuple[int, int, int, int]) -> torch.Tensor:
    """A copy of ``inputs`` with ``box`` of each image replaced by that of ``inputs[permutation]``."""
    top, bottom, left, right = box
    mixed = inputs.clone()
    mixed[..., top:bottom, left:right] = inputs[permutation][..., top:bottom, left:right]
    return mixed


@register_algorithm("cutmix")
class CutMix(MixingAlgorithm):
    """Cut-and-paste image regions between samples; labels weigh by pasted area.

    Example::

        Trainer(..., algorithms=[CutMix(alpha=1.0)])

    After each ``BEFORE_FORWARD``, ``bbox`` is ``(top, bottom, left, right)`` and ``mixing_coef``
    the area-corrected weight of the original image.
    """

    def __init__(
        self,
        alpha: float = 1.0,
        interpolate_loss: bool = False,
        input_key: BatchKey = None,
        target_key: BatchKey = None,
    ) -> None:
        super().__init__(alpha, interpolate_loss, input_key, target_key)
        self.bbox: Tuple[int, int, int, int] = (0, 0, 0, 0)

    def mix_inputs(self, inputs: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
        if inputs.dim() != 4:
            raise ValueError(f"CutMix needs images shaped (N, C, H, W), got inputs of shape {tuple(inputs.shape)}.")
        height, width = inputs.shape[-2], inputs.shape[-1]
        box = random_box(height, width, sample_mixing_coef(self.alpha))
        top, bottom, left, right = box
        self.bbox = box
        self.mixing_coef = 1.0 - (bottom - top) * (right - left) / float(height * width)
        return cutmix_batch(inputs, permutation, box)

    def __repr__(self) -> str:
        return f"CutMix(alpha={self.alpha})"
