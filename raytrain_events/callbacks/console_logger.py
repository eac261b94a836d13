"""`ConsoleLogger`: print the loss and the latest logged metrics at an interval, on rank 0.

Every ``log_interval`` (``"100ba"``, ``"1ep"``, ...) it prints one line: the timestamp, the
current loss (one host read per print) and, with ``metrics=True``, every metric in
``logger.metrics`` (the latest values of throughput, LR, eval metrics, ...). Eval results are
printed when an evaluation ends. Between prints it costs an integer comparison.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO, Union

from raytrain_events.core.callback import Callback
from raytrain_events.core.event import Event
from raytrain_events.core.interval import make_interval
from raytrain_events.core.plain import to_python
from raytrain_events.core.time import Time

__all__ = ["ConsoleLogger"]


def _fmt(value) -> str:
    value = to_python(value)
    return f"{value:.5g}" if isinstance(value, float) else str(value)


class ConsoleLogger(Callback):
    """Print progress lines.

    Example::

        Trainer(..., callbacks=[ConsoleLogger(log_interval="50ba")])
    """

    def __init__(
        self, log_interval: Union[str, int, Time] = "1ep", metrics: bool = True, stream: Optional[TextIO] = None
    ) -> None:
        self.log_interval = log_interval
        self.metrics = metrics
        self.stream = stream
        self._interval = None
        self._enabled = True

    def fit_start(self, state, logger) -> None:
        self._enabled = state.rank == 0
        self._interval = make_interval(self.log_interval, state.max_duration, what="log_interval")

    def _print(self, text: str) -> None:
        print(text, file=self.stream if self.stream is not None else sys.stdout, flush=True)

    def _line(self, state, logger, prefix: str) -> str:
        parts = [f"[{prefix}] epoch={state.epoch} batch={state.step}"]
        if state.loss is not None and hasattr(state.loss, "detach"):
            parts.append(f"loss/train={_fmt(state.loss.detach().float().mean())}")
        if self.metrics:
            parts += [f"{k}={_fmt(v)}" for k, v in sorted(logger.metrics.items()) if not k.startswith("metrics/")]
        return " ".join(parts)

    def batch_end(self, state, logger) -> None:
        if self._enabled and self._interval is not None and self._interval(state, Event.BATCH_END):
            self._print(self._line(state, logger, "batch"))

    def epoch_end(self, state, logger) -> None:
        if self._enabled and self._interval is not None and self._interval(state, Event.EPOCH_END):
            self._print(self._line(state, logger, "epoch"))

    def eval_end(self, state, logger) -> None:
        if not self._enabled:
            return
        values = [f"{k}={_fmt(v)}" for k, v in sorted(logger.metrics.items()) if k.startswith("metrics/")]
        if values:
            self._print(f"[eval] epoch={state.epoch} batch={state.step} " + " ".join(values))
