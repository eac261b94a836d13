"""`NaNMonitor`: stop training with a clear error when the loss is NaN or infinite.

The check runs at ``AFTER_TRAIN_BATCH``, before the optimizer step, so a non-finite loss never
reaches the weights (on the checked batches). Reading the loss is a host sync, so ``interval``
controls how often it happens: the default checks every batch (safest; one small sync per
batch); ``interval=10`` checks every tenth batch.
"""

from __future__ import annotations

import torch

from raytrain_events.core.callback import Callback

__all__ = ["NaNMonitor", "NonFiniteLossError"]


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class NaNMonitor(Callback):
    """Raise `NonFiniteLossError` when the train loss is NaN/inf.

    Example::

        Trainer(..., callbacks=[NaNMonitor(interval=1)])
    """

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"interval={interval!r} must be >= 1 batches.")
        self.interval = int(interval)

    def after_train_batch(self, state, logger) -> None:
        batch = state.step + 1  # the batch being trained (the timestamp advances after it)
        if batch % self.interval:
            return
        loss = state.loss
        if loss is None:
            return
        tensors = (
            list(loss.values()) if isinstance(loss, dict) else list(loss) if isinstance(loss, (list, tuple)) else [loss]
        )
        for value in tensors:
            value = torch.as_tensor(value)
            if not bool(torch.isfinite(value).all()):
                raise NonFiniteLossError(
                    f"The training loss is {value.detach().float().flatten()[:4].tolist()} (not finite) at batch {batch} "
                    f"(epoch {state.epoch}, rank {state.rank}). Lower the learning rate, clip gradients "
                    "(algorithms=[GradientClipping(clipping_threshold=1.0)]), use amp_bf16 instead of amp_fp16, "
                    "or check the data for NaN/inf values."
                )
