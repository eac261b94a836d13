"""`SpeedMonitor`: rolling training throughput (batches, samples, tokens per second) and MFU.

At every ``BATCH_END`` it records the wall clock and the global sample and token counts of the
`Timestamp` (already summed over ranks by the loop, so no extra collective is made). Once the
window holds ``window_size + 1`` batch ends it logs, over the last ``window_size`` batches:

- ``throughput/batches_per_sec``, ``throughput/samples_per_sec``, ``throughput/tokens_per_sec``
  (the last only when the data counts tokens): global rates;
- ``throughput/device/...``: the same divided by ``world_size`` (the average per device);
- with ``flops_per_sample``: ``throughput/device/flops_per_sec``, and with ``peak_flops`` (one
  device's peak) ``throughput/device/mfu``;
- ``wall_clock/train`` and ``wall_clock/eval``: seconds spent training and evaluating so far.

Time spent in evaluation is left out of the window, so evals do not depress throughput.
Nothing is read from the device.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Dict, Optional, Tuple

from raytrain_events.core.callback import Callback

__all__ = ["SpeedMonitor"]


class SpeedMonitor(Callback):
    """Log throughput over a rolling window of batches.

    Example::

        Trainer(..., callbacks=[SpeedMonitor(window_size=50, flops_per_sample=6 * n_params * seq_len,
                                             peak_flops=989e12)])
    """

    def __init__(
        self,
        window_size: int = 100,
        flops_per_sample: Optional[float] = None,
        peak_flops: Optional[float] = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window_size < 1:
            raise ValueError(f"window_size={window_size!r} must be >= 1 (batches per throughput window).")
        if peak_flops is not None and flops_per_sample is None:
            raise ValueError("peak_flops is given but flops_per_sample is not: MFU needs both.")
        self.window_size = int(window_size)
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self._clock = clock
        # (train seconds so far, batches, samples, tokens) at each batch end.
        self._history: Deque[Tuple[float, int, int, int]] = collections.deque(maxlen=self.window_size + 1)
        self._train_start: Optional[float] = None
        self._eval_seconds = 0.0
        self._eval_start: Optional[float] = None
        self.last: Dict[str, float] = {}

    def fit_start(self, state, logger) -> None:
        self._train_start = self._clock()

    def batch_end(self, state, logger) -> None:
        now = self._clock()
        if self._train_start is None:
            self._train_start = now
        train_seconds = now - self._train_start - self._eval_seconds
        ts = state.timestamp
        self._history.append((train_seconds, ts.get_value("ba"), ts.get_value("sp"), ts.get_value("tok")))
        metrics: Dict[str, Any] = {"wall_clock/train": train_seconds}
        if len(self._history) == self._history.maxlen:
            metrics.update(self._rates(state.world_size))
            self.last = dict(metrics)
        logger.log_metrics(metrics, step=state.step)

    def _rates(self, world_size: int) -> Dict[str, float]:
        (t0, b0, s0, k0), (t1, b1, s1, k1) = self._history[0], self._history[-1]
        elapsed = t1 - t0
        if elapsed <= 0:
            return {}
        rates = {
            "throughput/batches_per_sec": (b1 - b0) / elapsed,
            "throughput/samples_per_sec": (s1 - s0) / elapsed,
        }
        if k1 > k0:
            rates["throughput/tokens_per_sec"] = (k1 - k0) / elapsed
        for key in list(rates):
            rates[key.replace("throughput/", "throughput/device/")] = rates[key] / world_size
        if self.flops_per_sample is not None:
            device_flops = rates["throughput/device/samples_per_sec"] * self.flops_per_sample
            rates["throughput/device/flops_per_sec"] = device_flops
            if self.peak_flops:
                rates["throughput/device/mfu"] = device_flops / self.peak_flops
        return rates

    def eval_start(self, state, logger) -> None:
        self._eval_start = self._clock()

    def eval_end(self, state, logger) -> None:
        if self._eval_start is not None:
            self._eval_seconds += self._clock() - self._eval_start
            self._eval_start = None
            logger.log_metrics({"wall_clock/eval": self._eval_seconds}, step=state.step)
