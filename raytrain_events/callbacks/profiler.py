"""`Profiler`: ``torch.profiler`` on a wait/warmup/active schedule in batches, traces through the storage layer.

Each rank profiles its own training loop: it waits ``wait`` batches, warms the profiler up for
``warmup`` batches (recorded, then discarded: profiler start-up skews them), records ``active``
batches, and repeats that cycle ``repeat`` times (0: until training ends). Each finished cycle is a
Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing) written to
``<folder>/rank<r>_batch<b>.pt.trace.json``: ``r`` the rank, ``b`` the global batch the cycle ended
at. ``folder`` is any fsspec URL (a local folder, ``s3://bucket/run/profiler`` with
``storage_options``); the trace is exported to a local temporary file by torch, then written with
`raytrain_events.storage.fs.write_bytes_atomic`, so a reader never sees half a trace.

The durations are `Time` values in batches (``"2ba"`` or an int) or in epochs (``"1ep"``, turned into
batches with the epoch's length when training starts).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, Optional, Union

import torch

from raytrain_events.core.callback import Callback
from raytrain_events.core.time import Time, TimeUnit, ensure_time
from raytrain_events.storage.fs import join, resolve, write_bytes_atomic

__all__ = ["Profiler"]


class Profiler(Callback):
    """Profile training with ``torch.profiler`` and write one trace per rank and cycle.

    Example::

        Trainer(..., callbacks=[Profiler("s3://bucket/runs/r1/profiler", wait="5ba", warmup="1ba", active="3ba",
                                         storage_options={...})])
    """

    def __init__(
        self,
        folder: str,
        *,
        wait: Union[str, int, Time[Any]] = "1ba",
        warmup: Union[str, int, Time[Any]] = "1ba",
        active: Union[str, int, Time[Any]] = "4ba",
        repeat: int = 1,
        storage_options: Optional[Dict[str, Any]] = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        self.folder = folder
        self.storage_options = dict(storage_options or {})
        self._times = {"wait": _batches_or_epochs(wait, "wait"), "warmup": _batches_or_epochs(warmup, "warmup")}
        self._times["active"] = _batches_or_epochs(active, "active")
        if self._times["active"].value < 1:
            raise ValueError(f"Profiler active={active!r} must be at least one batch.")
        if not isinstance(repeat, int) or repeat < 0:
            raise ValueError(f"Profiler repeat={repeat!r} must be an int >= 0 (0: repeat until training ends).")
        self.repeat = repeat
        self.options = dict(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack)
        self.traces: list[str] = []  # URLs written, in order
        self._profiler: Optional[torch.profiler.profile] = None
        self._state: Any = None

    def fit_start(self, state: Any, logger: Any) -> None:
        steps = {name: self._in_batches(name, time, state) for name, time in self._times.items()}
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._state = state
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=steps["wait"], warmup=steps["warmup"], active=steps["active"], repeat=self.repeat
            ),
            on_trace_ready=self._write_trace,
            **self.options,
        )
        self._profiler.start()

    def batch_end(self, state: Any, logger: Any) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def fit_end(self, state: Any, logger: Any) -> None:
        self._stop()

    def close(self, state: Any, logger: Any) -> None:
        self._stop()  # a run that raised: stop profiling, write nothing more

    def _stop(self) -> None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        state = self._state
        name = f"rank{state.rank}_batch{state.step}.pt.trace.json"
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, name)
            profiler.export_chrome_trace(local)
            with open(local, "rb") as f:
                data = f.read()
        url = join(self.folder, name)
        fs, path = resolve(url, self.storage_options)
        write_bytes_atomic(fs, path, data)
        self.traces.append(url)

    @staticmethod
    def _in_batches(name: str, time: Time[Any], state: Any) -> int:
        if time.unit == TimeUnit.BATCH:
            return int(time.value)
        steps = state.steps_per_epoch
        if steps is None:
            raise ValueError(
                f"Profiler {name}={time.to_timestring()!r} is in epochs, but the train data has no length: give it in batches."
            )
        return int(time.value) * steps


def _batches_or_epochs(value: Union[str, int, Time[Any]], name: str) -> Time[Any]:
    time = ensure_time(value, TimeUnit.BATCH)
    if time.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or time.value < 0:
        raise ValueError(
            f"Profiler {name}={time.to_timestring()!r}: give a number of batches ('3ba', 3) or epochs ('1ep'); "
            "samples and tokens do not map to profiler steps."
        )
    return time
