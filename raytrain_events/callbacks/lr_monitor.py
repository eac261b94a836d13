"""`LRMonitor`: log each optimizer param group's learning rate after every batch.

Keys are ``lr-<OptimizerClass>/group<i>`` (Composer's names). Logged at ``BATCH_END``, after the
schedulers stepped, so the value is the rate the next batch will use. Reading ``group["lr"]``
is a Python float: no device sync.
"""

from __future__ import annotations

from raytrain_events.core.callback import Callback

__all__ = ["LRMonitor"]


class LRMonitor(Callback):
    """Log learning rates.

    Example::

        Trainer(..., callbacks=[LRMonitor()])
    """

    def batch_end(self, state, logger) -> None:
        metrics = {}
        for optimizer in state.optimizers:
            name = type(optimizer).__name__
            for index, group in enumerate(optimizer.param_groups):
                lr = group["lr"]
                metrics[f"lr-{name}/group{index}"] = float(lr) if not hasattr(lr, "item") else lr
        if metrics:
            logger.log_metrics(metrics, step=state.step)
