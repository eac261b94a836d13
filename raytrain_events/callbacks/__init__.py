"""Callbacks that observe the loop: throughput, learning rates, memory, NaN checks, early
stopping, progress display, per-source counts of a `Mixture` (`MixtureCounts`, which
`MixtureLoader` adds itself). One small file each; each overrides only the events it needs, so
the Engine never calls it on the others.

Example::

    from raytrain_events.callbacks import EarlyStopper, LRMonitor, SpeedMonitor

    Trainer(..., callbacks=[SpeedMonitor(window_size=50), LRMonitor(),
                            EarlyStopper("metrics/eval/accuracy", "max", patience="2ep")])
"""

from raytrain_events.callbacks.console_logger import ConsoleLogger
from raytrain_events.callbacks.early_stopper import EarlyStopper
from raytrain_events.callbacks.lr_monitor import LRMonitor
from raytrain_events.callbacks.memory_monitor import MemoryMonitor, memory_report
from raytrain_events.callbacks.mixture_counts import MixtureCounts, MixtureResumeError
from raytrain_events.callbacks.nan_monitor import NaNMonitor, NonFiniteLossError
from raytrain_events.callbacks.profiler import Profiler
from raytrain_events.callbacks.progress_bar import ProgressBar
from raytrain_events.callbacks.speed_monitor import SpeedMonitor
from raytrain_events.callbacks.threshold_stopper import ThresholdStopper

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
    "ThresholdStopper",
    "memory_report",
]
