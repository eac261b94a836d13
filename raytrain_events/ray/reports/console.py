"""A Ray run's terminal: the driver's progress bar and the job's own lines; Ray's internals stay in its log files.

By default (``verbose=False``) each Ray line that used to crowd the terminal is dealt with at its
cause where Ray offers a setting, and kept out of the terminal (not out of Ray's log files) where
it does not. ``verbose=True`` leaves every Ray default alone.

===========================================================  ==================================================
Line on the terminal                                          Cause, and what is done here
===========================================================  ==================================================
``Started a local Ray instance. View the dashboard at ...``  ``ray.init``'s INFO log: ``logging_level=WARNING``
                                                              (`ensure_ray`).
``(TrainController) Requesting resources ...``,               Ray Train's INFO logs: ``RunConfig(logging_config=
``Attempting to start training worker group ...``,            LoggingConfig("WARNING"))`` (`train_logging_config`);
``Started training worker group ...``,                        Ray Train still writes every level to
``(RayTrainWorker) Setting up process group ...``             ``<session>/logs/train/ray-train-sys-*.log``.
``Dataset ... execution finished in N seconds``               Ray Data's INFO log: its console handler at WARNING
                                                              (``RAY_DATA_LOGGING_CONFIG`` for an embedded Ray, the
                                                              driver's handler here); every level stays in
                                                              ``<session>/logs/ray-data/ray-data.log``.
``Progress bars disabled. To enable, set ...``                Ray Data's progress bars are off on purpose (the
                                                              driver's bar replaces them; Ray Train copies the
                                                              driver's ``DataContext`` to the workers); Ray Data
                                                              warns once per process: not shown.
``(PlacementGroupCleaner) Failed to query Ray Train           The cleaner polls Ray's state API, which the dashboard
Controller actor state``, or its traceback ``Found multiple   serves: without a dashboard every poll fails, and with
active Ray instances``                                        several Ray instances on one machine it cannot tell
                                                              which one is its own. An embedded Ray gets its
                                                              dashboard on a known port and ``RAY_API_SERVER_ADDRESS``
                                                              (`embedded.local_instance`); elsewhere the lines are not shown.
``... 'PreemptionWatcher' ... max_restarts > 0``              Ray Train 2.60 creates its preemption watcher with
                                                              ``max_restarts=-1`` and the workers' actor handles as
                                                              arguments; Ray core logs that at ERROR once per
                                                              controller. Harmless, not shown (it stays in the
                                                              controller's ``worker-*.err``).
``(raylet) WARNING: N PYTHON worker processes have been       The raylet warns at 4x ``min(physical CPUs, num_cpus)``
started ...``                                                 processes; a Train + Data run needs about 12-16
                                                              (controller, workers, dataset manager, placement-group
                                                              cleaner, preemption watcher, stats actors, read
                                                              tasks), so every machine with few cores warned. An
                                                              embedded Ray sets ``RAY_worker_maximum_startup_
                                                              concurrency`` to its logical CPUs (at least 8).
``(RayTrainWorker) Reporting training result N: ...``         Ray Train's per-report INFO line; its logger is named by
                                                              a file path, so ``LoggingConfig`` misses it: not shown.
``(ListFiles) Exception in thread ...completion-signaler``    A Ray Data 2.60 race when a file-listing pool shuts
``InterruptedError``                                          down after its work is done: not shown.
``(pid=gcs_server) ... Failed to kill actor NIL_ID, return    Ray's own: the GCS's actor scheduler tries to kill an
status: Invalid: KillActor RPC failed``                       actor whose worker is NIL (by its text, one that had no
                                                              leased worker yet, as at a run's teardown; not
                                                              reproduced here). A RayTrainer run kills no actor
                                                              itself. Harmless, not shown.
``'EpochFeeder' ... constructor arguments in the object       Fixed at its cause: the feeder is created with plain
store and max_restarts > 0``                                  values only and gets the dataset by reference in each
                                                              ``start_epoch`` call (`feeder.py`, Restarts).
``(TrainController) Failed to send resource request for      Ray Train's autoscaling client under CPU overload, with
train-...`` and its ``GetTimeoutError`` traceback             a traceback it calls safe to ignore: not shown (Ray
                                                              may forward it a line at a time: the header opens
                                                              the block, its traceback lines are dropped).
``(RayTrainWorker) Resuming ... with a different config:``   Announced once on the driver before the progress bar
                                                              (`announce_config_change`); the workers log it at INFO
                                                              (``CheckpointConfig.announce_config_change=False``).
``(RayTrainWorker) Checkpoint save due at batch N is          This package's INFO lines on a worker: Ray Train's
postponed ...`` and other INFO lines of this package          worker logging sends the root logger's INFO to the
                                                              console (its level filter covers ``ray.train`` only);
                                                              `quiet_worker_console` keeps them in Ray Train's
                                                              ``ray-train-app-worker-*.log`` only.
===========================================================  ==================================================

Every other line (the job's own prints, warnings and errors from user code, Ray's errors) still
shows, printed above the progress bar.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from raytrain_events.ray import _compat

__all__ = [
    "announce_config_change",
    "train_logging_config",
    "drop_noise_until_shutdown",
    "quiet_terminal",
    "quiet_worker_console",
    "is_noise",
    "NOISE",
]

# (source, pattern): a forwarded line from ``source`` (an actor or task name, or "raylet";
# None: any source) matching ``pattern`` carries nothing for the user (see the table above).
NOISE: List[Tuple[Optional[str], re.Pattern[str]]] = [
    ("PlacementGroupCleaner", re.compile(r"Failed to query Ray Train Controller actor state")),
    (None, re.compile(r"'PreemptionWatcher' .*max_restarts > 0")),
    (None, re.compile(r"Progress bars disabled\. To enable")),
    (None, re.compile(r"Progress bars for operators disabled")),
    (None, re.compile(r"Dataset \S+ execution finished in")),
    (None, re.compile(r"Registered dataset logger for dataset")),
    ("raylet", re.compile(r"PYTHON worker processes have been started on node")),
    ("gcs_server", re.compile(r"Failed to kill actor NIL_ID")),
    # Ray Train's per-report INFO line on each worker: its logger is named by a file path, not
    # ``ray.train.*``, so Ray Train's LoggingConfig does not reach it.
    ("RayTrainWorker", re.compile(r"Reporting training result \d+: TrainingReport\(")),
]
# Sources whose traceback blocks are Ray-internal races or misconfigurations listed above.
_TRACEBACKS: Dict[str, re.Pattern[str]] = {
    "PlacementGroupCleaner": re.compile(r"PlacementGroupCleanerMonitor|Found multiple active Ray instances"),
}


# Ray-internal warnings logged with a traceback that say they are safe to ignore. Under CPU load Ray
# forwards such a block one line at a time, so the header opens the block for its source and the
# traceback's lines are dropped up to its exception line (`filter_batch`).
_BLOCK_HEADERS: List[Tuple[Optional[str], re.Pattern[str]]] = [
    # Ray Train's autoscaling coordinator client: "... If this only happens transiently during network
    # partition or CPU being overloaded, it's safe to ignore this error." (a GetTimeoutError traceback)
    ("TrainController", re.compile(r"Failed to send resource request for train-")),
    ("ListFiles", re.compile(r"completion-signaler")),  # the Ray Data race in the table above
]
_TRACEBACK_LINE = re.compile(r"^(Traceback \(most recent call last\):|\s|\^)")
_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception)\b")
_open_blocks: Set[Tuple[Optional[str], Any]] = set()  # (source, pid) inside a dropped block


def is_noise(source: Optional[str], line: str) -> bool:
    """True if ``line`` (printed by Ray ``source``) is one of the known lines without information."""
    return any((src is None or src == source) and pattern.search(line) for src, pattern in NOISE)


def _source(data: Dict[str, Any]) -> Optional[str]:
    if data.get("pid") in ("raylet", "autoscaler", "gcs_server"):
        return str(data["pid"])
    return data.get("actor_name") or data.get("task_name") or None


def filter_batch(data: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """One batch of forwarded worker lines without the noise; None if nothing is left."""
    source = _source(data)
    lines = list(data.get("lines", []))
    block = _TRACEBACKS.get(source or "")
    if block is not None and any(block.search(line) for line in lines):
        return None  # the whole traceback block of a known internal failure
    key = (source, data.get("pid"))
    kept = []
    for line in lines:
        if key in _open_blocks:
            if _TRACEBACK_LINE.match(line):
                continue
            _open_blocks.discard(key)
            if _EXCEPTION_LINE.match(line):
                continue  # the block's last line
        if any((src is None or src == source) and p.search(line) for src, p in _BLOCK_HEADERS):
            _open_blocks.add(key)
        elif not is_noise(source, line):
            kept.append(line)
    if not kept:
        return None
    return {**data, "lines": kept}


# --------------------------------------------------------------------------- one run
def train_logging_config(verbose: bool) -> Any:
    """Ray Train's `LoggingConfig`: INFO on the terminal only when verbose (files keep every level)."""
    from ray.train import LoggingConfig

    return LoggingConfig(log_level="INFO" if verbose else "WARNING")


def drop_noise_until_shutdown() -> None:
    """For the whole Ray session: the known noise in forwarded lines stays off the terminal.

    `quiet_terminal` covers a run; but Ray's own actors outlive it: Ray Train's placement-group
    cleaner, for one, polls the controller after the run ended and prints "Failed to query Ray
    Train Controller actor state" between the run and ``ray.shutdown`` (while the job writes its
    report, say). Ray removes the wrapped handler itself when the driver disconnects.
    """
    _filter_forwarded_lines(None)


class _DropNotices(logging.Filter):
    """Drops the known Ray Data notices (see the table above) from a console handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not is_noise(None, record.getMessage())


@contextlib.contextmanager
def quiet_terminal(
    verbose: bool, write: Optional[Callable[[str, Any], None]] = None, datasets: Sequence[Any] = ()
) -> Iterator[None]:
    """During a run: Ray Data's bars off, its INFO lines off the driver's terminal, known noise dropped.

    ``write(line, stream)`` prints a kept worker line (above the progress bar, say); ``stream`` is
    the real stdout or stderr Ray meant it for. ``datasets``: the run's Ray Datasets, each of which
    executes with the `DataContext` it was created with (the current one reaches only the workers).
    Everything is restored on exit.
    """
    if verbose:
        yield
        return
    from ray.data import DataContext

    contexts = [DataContext.get_current()] + [ds.context for ds in datasets if hasattr(ds, "context")]
    contexts = list({id(c): c for c in contexts}.values())
    saved_bars = [(c, c.enable_progress_bars, c.print_on_execution_start) for c in contexts]
    for c in contexts:
        c.enable_progress_bars, c.print_on_execution_start = False, False
    data_handlers = [h for h in logging.getLogger("ray.data").handlers if not _is_file_handler(h)]
    drop = _DropNotices()
    for handler in data_handlers:
        handler.addFilter(drop)
    restore = _filter_forwarded_lines(write)
    try:
        yield
    finally:
        restore()
        for handler in data_handlers:
            handler.removeFilter(drop)
        for c, bars, on_start in saved_bars:
            c.enable_progress_bars, c.print_on_execution_start = bars, on_start


class _OwnInfo(logging.Filter):
    """Drops this package's records below WARNING (a console handler's filter)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("raytrain_events")


def quiet_worker_console(verbose: bool) -> None:
    """On a Ray Train worker, at the start: this package's INFO lines stay off the driver's terminal.

    Ray Train configures a worker's root logger at INFO with a console handler (forwarded to the
    driver) and a file handler; its `LoggingConfig` level filters ``ray.train`` records only. The
    console handlers get a filter (once); the files keep every line. ``verbose`` leaves them alone.
    """
    if verbose:
        return
    for handler in logging.getLogger().handlers:
        if not _is_file_handler(handler) and not any(isinstance(f, _OwnInfo) for f in handler.filters):
            handler.addFilter(_OwnInfo())


def _is_file_handler(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.FileHandler) or _compat.is_session_file_handler(handler)


def _filter_forwarded_lines(write: Optional[Callable[[str, Any], None]]) -> Callable[[], None]:
    """Wrap Ray's handler that prints the workers' lines on the driver; returns the undo."""

    return _compat.wrap_worker_line_handler("ray_print_logs", lambda handler: _filtered(handler, write))


def _filtered(handler: Callable[[Dict[str, Any]], None], write: Optional[Callable[[str, Any], None]]) -> Callable:
    def handle(data: Dict[str, Any]) -> None:
        kept = filter_batch(data)
        if kept is None:
            return
        if write is None:
            handler(kept)
        else:
            with _redirected(write):
                handler(kept)

    return handle


@contextlib.contextmanager
def _redirected(write: Callable[[str, Any], None]) -> Iterator[None]:
    """Ray prints worker lines to sys.stdout/stderr: hand them to ``write`` with the real stream."""

    class _Stream:
        def __init__(self, real: Any) -> None:
            self.real = real

        def write(self, text: str) -> int:
            for line in text.rstrip("\n").split("\n"):
                if line:
                    write(line, self.real)
            return len(text)

        def flush(self) -> None:
            self.real.flush()

    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Stream(saved[0]), _Stream(saved[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


# --------------------------------------------------------------------------- a resumed run
def announce_config_change(run_url: str, storage_options: Dict[str, Any], config: Dict[str, Any]) -> None:
    """Once, on the driver before the run starts: how the job's ``config`` differs from the one the run
    directory saved at its last start (one read of its config.yaml; nothing when there is none or it is equal)."""
    from omegaconf import OmegaConf

    # why here: defers fsspec until this runs
    from raytrain_events.storage.config_diff import format_config_diff
    from raytrain_events.storage.run_dir import RunDir

    try:
        saved = OmegaConf.to_container(RunDir(run_url, storage_options).load_config())
    except FileNotFoundError:
        return
    previous = saved.get("config") if isinstance(saved, dict) else None
    diff = format_config_diff(previous, config) if previous is not None else ""
    if diff:
        logging.getLogger(__name__).warning("Resuming %s; its config changed since the last start:\n%s", run_url, diff)
