"""Callbacks that observe the loop: throughput, learning rates, memory, NaN checks, early
stopping, progress display, per-source counts of a `Mixture` (`MixtureCounts`, ``data/mixture_counts.py``, which
`MixtureLoader` adds itself, with `OnlineMixture`, ``data/online_mixture.py``, for an ``online=`` mixture). One small file each; each overrides
only the events it needs, so
the Engine never calls it on the others.

Example::

    from raytrain_events.callbacks import EarlyStopper, LRMonitor, SpeedMonitor

    Trainer(..., callbacks=[SpeedMonitor(window_size=50), LRMonitor(),
                            EarlyStopper("metrics/eval/accuracy", "max", patience="2ep")])

Files:

* ``_monitor.py``: Shared by the stoppers: reading a monitored metric and comparing values.
* ``console_logger.py``: `ConsoleLogger`: print the loss and the latest logged metrics at an
  interval, on rank 0.
* ``early_stopper.py``: `EarlyStopper`: stop training when a monitored eval metric stops improving.
* ``lr_monitor.py``: `LRMonitor`: log each optimizer param group's learning rate after every batch.
* ``memory_monitor.py``: `MemoryMonitor`: log memory use every ``interval`` batches.
* ``nan_monitor.py``: `NaNMonitor`: stop training with a clear error when the loss is NaN or
  infinite.
* ``profiler.py``: `Profiler`: ``torch.profiler`` on a wait/warmup/active schedule in batches,
  traces through the storage layer.
* ``progress_bar.py``: `ProgressBar`: a tqdm bar per epoch on rank 0, showing the epoch, batch and
  latest loss.
* ``spike_bisect.py``: The torch side of ``SpikeGuard(bisect=True)``: replay a window on halves of
  its rows to find the culprits, train the rest, drop quarantined rows from later batches.
* ``spike_groups.py``: `SpikeGuard` under replica groups: each step's vote rides on its gradient
  all-reduce, so every group rolls back at the same committed step and skips the same rows.
* ``spike_guard.py``: `SpikeGuard`: on a loss spike every rank rolls back to a host snapshot and
  skips exactly the rows trained since.
* ``spike_norm.py``: the gradient norm `SpikeGuard` judges before any clipping (a shared
  `GradientClipping`'s, or its own at ``AFTER_BACKWARD``).
* ``spike_rollback.py``: `SpikeGuard`'s host snapshots and rollback: which snapshot a spike restores
  (judging the loss alone, one a later batch's loss vouched for), the restore, the skipped window's accounting.
* ``speed_monitor.py``: `SpeedMonitor`: rolling training throughput (batches, samples, tokens per
  second) and MFU.
* ``threshold_stopper.py``: `ThresholdStopper`: stop training once a monitored eval metric reaches
  a threshold.
"""

from raytrain_events.callbacks.console_logger import ConsoleLogger
from raytrain_events.callbacks.early_stopper import EarlyStopper
from raytrain_events.callbacks.lr_monitor import LRMonitor
from raytrain_events.callbacks.memory_monitor import MemoryMonitor, memory_report
from raytrain_events.callbacks.nan_monitor import NaNMonitor, NonFiniteLossError
from raytrain_events.callbacks.profiler import Profiler
from raytrain_events.callbacks.progress_bar import ProgressBar
from raytrain_events.callbacks.speed_monitor import SpeedMonitor
from raytrain_events.callbacks.spike_guard import SpikeGuard, SpikeRollbackError
from raytrain_events.callbacks.threshold_stopper import ThresholdStopper
from raytrain_events.data.mixture_counts import MixtureCounts, MixtureResumeError

__all__ = [
    "ConsoleLogger",
    "EarlyStopper",
    "LRMonitor",
    "MemoryMonitor",
    "MixtureCounts",
    "MixtureResumeError",
    "NaNMonitor",
    "NonFiniteLossError",
    "Profiler",
    "ProgressBar",
    "SpeedMonitor",
    "SpikeGuard",
    "SpikeRollbackError",
    "ThresholdStopper",
    "memory_report",
]
