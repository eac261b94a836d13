"""`ProgressiveResizing`: train on smaller images first and grow them to full size.

At ``AFTER_DATALOADER`` image inputs ``(N, C, H, W)`` are scaled by a factor that stays at
``initial_scale`` until ``delay_fraction`` of the run, grows linearly, and reaches 1 when
``finetune_fraction`` of the run is left (Composer's schedule). Sizes are rounded down to a
multiple of ``size_increment``. ``mode="resize"`` interpolates; ``mode="crop"`` takes a random crop.
Integer targets are untouched; ``resize_targets=True`` also resizes dense targets (masks).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from raytrain_events.algorithms._batch import BatchKey, get_item, resolve_key, set_item
from raytrain_events.algorithms.registry import register_algorithm
from raytrain_events.core.algorithm import Algorithm
from raytrain_events.core.event import Event

__all__ = ["ProgressiveResizing", "resize_scale", "resize_images"]

_MODES = ("resize", "crop")


def resize_scale(elapsed: float, initial_scale: float, delay_fraction: float, finetune_fraction: float) -> float:
    """The scale factor after ``elapsed`` (0..1) of the run."""
    ramp = 1.0 - finetune_fraction - delay_fraction
    if elapsed <= delay_fraction:
        return initial_scale
    if ramp <= 0 or elapsed >= 1.0 - finetune_fraction:
        return 1.0
    return initial_scale + (1.0 - initial_scale) * (elapsed - delay_fraction) / ramp


def resize_images(images: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """Resize (bilinear) or randomly crop ``images`` to ``height x width``."""
    if (height, width) == tuple(images.shape[-2:]):
        return images
    if mode == "crop":
        top = random.randint(0, images.shape[-2] - height)
        left = random.randint(0, images.shape[-1] - width)
        return images[..., top : top + height, left : left + width]
    squeeze = images.dim() == 3  # (N, H, W) masks
    x = images.unsqueeze(1) if squeeze else images
    if x.is_floating_point():
        out = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    else:  # class-index masks: nearest neighbour keeps valid labels
        out = F.interpolate(x.float(), size=(height, width), mode="nearest").to(images.dtype)
    return out.squeeze(1) if squeeze else out


@register_algorithm("progressive_resizing")
class ProgressiveResizing(Algorithm):
    """Grow training image size from ``initial_scale`` to full size.

    Example::

        Trainer(..., algorithms=[ProgressiveResizing(initial_scale=0.5, finetune_fraction=0.2)])
    """

    def __init__(
        self,
        mode: str = "resize",
        initial_scale: float = 0.5,
        finetune_fraction: float = 0.2,
        delay_fraction: float = 0.5,
        size_increment: int = 4,
        resize_targets: bool = False,
        input_key: BatchKey = None,
        target_key: BatchKey = None,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r} is not supported: use one of {list(_MODES)}.")
        if not 0.0 < initial_scale <= 1.0:
            raise ValueError(f"initial_scale={initial_scale!r} must be in (0, 1], like 0.5.")
        if not (
            0.0 <= finetune_fraction <= 1.0
            and 0.0 <= delay_fraction <= 1.0
            and finetune_fraction + delay_fraction <= 1.0
        ):
            raise ValueError(
                f"finetune_fraction={finetune_fraction!r} and delay_fraction={delay_fraction!r} must be in [0, 1] "
                "and add up to at most 1."
            )
        if size_increment < 1:
            raise ValueError(f"size_increment={size_increment!r} must be a positive integer.")
        self.mode, self.initial_scale = mode, float(initial_scale)
        self.finetune_fraction, self.delay_fraction = float(finetune_fraction), float(delay_fraction)
        self.size_increment, self.resize_targets = int(size_increment), bool(resize_targets)
        self.input_key, self.target_key = input_key, target_key
        self.scale = self.initial_scale

    def match(self, event: Event, state) -> bool:
        return event == Event.AFTER_DATALOADER

    def apply(self, event: Event, state, logger) -> None:
        elapsed = float(state.get_elapsed_duration().value)
        self.scale = resize_scale(elapsed, self.initial_scale, self.delay_fraction, self.finetune_fraction)
        if self.scale >= 1.0:
            return None
        key = resolve_key(state.batch, self.input_key, "input", state.model)
        images = get_item(state.batch, key)
        if images.dim() != 4:
            raise ValueError(f"ProgressiveResizing needs images shaped (N, C, H, W), got {tuple(images.shape)}.")
        height, width = self.target_size(images.shape[-2], images.shape[-1])
        batch = set_item(state.batch, key, resize_images(images, height, width, self.mode))
        if self.resize_targets:
            tkey = resolve_key(batch, self.target_key, "target", state.model)
            targets = get_item(batch, tkey)
            if self.mode == "crop":
                raise ValueError(
                    "resize_targets=True needs mode='resize' (a random crop of targets would not match the inputs)."
                )
            batch = set_item(batch, tkey, resize_images(targets, height, width, "resize"))
        state.batch = batch
        return None

    def target_size(self, height: int, width: int) -> tuple:
        """``(h, w)`` at the current scale, rounded down to ``size_increment`` (at least one increment)."""
        inc = self.size_increment
        h = max(inc, int(height * self.scale) // inc * inc)
        w = max(inc, int(width * self.scale) // inc * inc)
        return min(h, height), min(w, width)

    def __repr__(self) -> str:
        return f"ProgressiveResizing(mode={self.mode!r}, initial_scale={self.initial_scale}, finetune_fraction={self.finetune_fraction})"
