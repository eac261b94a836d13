"""`MemoryMonitor`: log memory use every ``interval`` batches.

On CUDA: ``torch.cuda.memory_stats`` (allocator counters kept on the host, so no device sync):
``memory/allocated_gb``, ``memory/active_gb``, ``memory/reserved_gb``, ``memory/peak_allocated_gb``
and ``memory/alloc_retries``. Always: the process's host memory, ``memory/host_rss_gb`` (current,
from ``/proc/self/statm`` where it exists) and ``memory/host_peak_rss_gb`` (from
``resource.getrusage``), without needing psutil. GB here is 1e9 bytes.
"""

from __future__ import annotations

import os
import sys
from typing import Dict

import torch

from raytrain_events.core.callback import Callback

__all__ = ["MemoryMonitor", "memory_report"]

_GB = 1e9
_CUDA_KEYS = {
    "allocated_bytes.all.current": "memory/allocated_gb",
    "active_bytes.all.current": "memory/active_gb",
    "reserved_bytes.all.current": "memory/reserved_gb",
    "allocated_bytes.all.peak": "memory/peak_allocated_gb",
}


def _host_memory() -> Dict[str, float]:
    out: Dict[str, float] = {}
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out["memory/host_peak_rss_gb"] = peak * (1 if sys.platform == "darwin" else 1024) / _GB
    except (ImportError, OSError):  # pragma: no cover - Windows
        pass
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        out["memory/host_rss_gb"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / _GB
    except (OSError, ValueError, IndexError):  # not Linux
        pass
    return out


def memory_report(device: torch.device = None) -> Dict[str, float]:
    """Current memory figures (CUDA allocator stats if ``device`` is CUDA, plus host RSS)."""
    report = _host_memory()
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        for key, name in _CUDA_KEYS.items():
            if key in stats:
                report[name] = stats[key] / _GB
        report["memory/alloc_retries"] = float(stats.get("num_alloc_retries", 0))
    return report


class MemoryMonitor(Callback):
    """Log memory every ``interval`` batches (default every batch; each read is a few host calls).

    Example::

        Trainer(..., callbacks=[MemoryMonitor(interval=100)])
    """

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"interval={interval!r} must be >= 1 batches.")
        self.interval = int(interval)
        self.last: Dict[str, float] = {}

    def batch_end(self, state, logger) -> None:
        if state.step % self.interval:
            return
        device = _model_device(state.model)
        self.last = memory_report(device)
        logger.log_metrics(self.last, step=state.step)


def _model_device(model) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")
