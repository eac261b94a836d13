"""`ProgressBar`: a tqdm bar per epoch on rank 0, showing the epoch, batch and latest loss.

The bar advances every ``refresh_interval`` batches; only then is the loss read from the device
(one host sync per refresh, none in between). Other ranks show nothing.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

from raytrain_events.core.callback import Callback
from raytrain_events.core.plain import to_python
from raytrain_events.core.time import TimeUnit

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """Show training progress with tqdm.

    Example::

        Trainer(..., callbacks=[ProgressBar(refresh_interval=10)])
    """

    def __init__(self, refresh_interval: int = 10, stream: Optional[TextIO] = None, **tqdm_kwargs: Any) -> None:
        if refresh_interval < 1:
            raise ValueError(f"refresh_interval={refresh_interval!r} must be >= 1 batches.")
        self.refresh_interval = int(refresh_interval)
        self.stream = stream
        self.tqdm_kwargs = tqdm_kwargs
        self._bar = None
        self._pending = 0
        self._enabled = True

    def fit_start(self, state, logger) -> None:
        self._enabled = state.rank == 0

    def epoch_start(self, state, logger) -> None:
        if not self._enabled:
            return
        from tqdm.auto import tqdm

        total = state.steps_per_epoch
        md = state.max_duration
        if md is not None and md.unit == TimeUnit.BATCH:
            remaining = int(md.value) - state.step
            total = remaining if total is None else min(total - state.batch_idx, remaining)
        epochs = f"/{int(md.value)}" if md is not None and md.unit == TimeUnit.EPOCH else ""
        self._close_bar()
        self._bar = tqdm(
            total=total,
            desc=f"epoch {state.epoch + 1}{epochs}",
            file=self.stream if self.stream is not None else sys.stderr,
            dynamic_ncols=True,
            leave=True,
            **self.tqdm_kwargs,
        )
        self._pending = 0

    def batch_end(self, state, logger) -> None:
        if self._bar is None:
            return
        self._pending += 1
        if self._pending >= self.refresh_interval:
            self._flush(state)

    def _flush(self, state) -> None:
        if self._bar is None:
            return
        if self._pending:
            self._bar.update(self._pending)
            self._pending = 0
        loss = state.loss
        if loss is not None and hasattr(loss, "detach"):
            self._bar.set_postfix(loss=f"{float(to_python(loss.detach().float().mean())):.4g}", batch=state.step)

    def epoch_end(self, state, logger) -> None:
        self._flush(state)
        self._close_bar()

    def fit_end(self, state, logger) -> None:
        self._flush(state)
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self, state, logger) -> None:
        self._close_bar()
