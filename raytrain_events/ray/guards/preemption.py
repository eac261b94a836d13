"""Preemption on a Ray worker: a SIGTERM or a notice becomes a committed checkpoint at the next batch.

A cloud gives 30 s to 2 minutes between its notice and the kill. Two ways a worker hears of it:

* **SIGTERM** to the worker process. Ray runs the train function off the main thread, and only
  the main thread may set a signal handler, so `PreemptionGuard` has the worker actor's main
  thread install one (`_compat.run_on_worker_main_thread`) for the duration of the fit: it only
  notes the time. (Without it Ray's own handler exits the process at once: a restart from the
  last periodic checkpoint, the work since then lost.)
* **Ray's preemption notice** (a node of the group is draining: ``ray.train.get_preemption_info``).
  The guard reads this worker's copy each batch (`_compat.local_preemption_info`: an attribute
  read, not the barrier ``get_preemption_info`` is), instead of at report time only.

Either way the rank asks for a save through the loop's per-batch collective (`Agreement`), so
every rank saves at the same, next batch boundary; on SIGTERM the ranks also stop there (the fit
returns cleanly: continue the run by its name). Once the save is committed, rank 0 logs the
notice-to-commit time and writes it to ``<run>/preemptions/batch-<N>.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

from raytrain_events.checkpoint.run.preemption import SAVE_FLAG
from raytrain_events.core.callback import Callback
from raytrain_events.ray._compat import local_preemption_info, run_on_worker_main_thread
from raytrain_events.storage.fs import resolve, write_bytes_atomic
from raytrain_events.storage.run_dir import PREEMPTIONS_DIR as PREEMPTIONS_DIR  # re-exported
from raytrain_events.storage.run_dir import RunDir

__all__ = ["PreemptionGuard", "PREEMPT_FLAG", "PREEMPTIONS_DIR"]

logger = logging.getLogger(__name__)

#: The agreement flag: some rank heard of a preemption before this batch's collective.
PREEMPT_FLAG = "preempt"

# Written by the SIGTERM handler on the main thread, read by the training thread.
_SIGTERM: Dict[str, float] = {}
_previous_handler: Any = None
_previous_wakeup_fd = -1
_wakeup: Optional[Tuple[int, int]] = None  # (read end, write end) of the signal wakeup pipe
_lock = threading.Lock()


def _on_sigterm(signum: int, frame: Any) -> None:
    if not _SIGTERM:
        _SIGTERM.update(wall=time.time(), mono=time.monotonic())


def _install_handler() -> bool:
    """On the main thread: note SIGTERMs instead of exiting (returns True once installed).

    Python runs the handler only when the main thread next runs Python code (on a Ray worker,
    when the controller next polls it: up to seconds later), so the signal's number is also
    written, at once and by the C-level handler, to a wakeup pipe the training thread reads
    each batch (`_sigterm_arrived`)."""
    global _previous_handler, _previous_wakeup_fd, _wakeup
    with _lock:
        _SIGTERM.clear()
        current = signal.getsignal(signal.SIGTERM)
        if current is not _on_sigterm:
            _previous_handler = current
        signal.signal(signal.SIGTERM, _on_sigterm)
        if _wakeup is None:
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            os.set_blocking(write_end, False)
            _previous_wakeup_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
            _wakeup = (read_end, write_end)
            if _previous_wakeup_fd != -1:  # someone else's (an event loop's): leave it, use the handler only
                signal.set_wakeup_fd(_previous_wakeup_fd)
                os.close(read_end)
                os.close(write_end)
                _wakeup = None
    return True


def _restore_handler() -> bool:
    """On the main thread: the handler (and wakeup fd) that were there before `_install_handler`."""
    global _wakeup
    with _lock:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm and _previous_handler is not None:
            signal.signal(signal.SIGTERM, _previous_handler)
        if _wakeup is not None:
            signal.set_wakeup_fd(_previous_wakeup_fd)
            for fd in _wakeup:
                os.close(fd)
            _wakeup = None
    return True


def _sigterm_arrived() -> bool:
    """True once a SIGTERM reached this process (the wakeup pipe, or the Python handler already ran)."""
    if _wakeup is not None and not _SIGTERM:
        try:
            data = os.read(_wakeup[0], 512)
        except (BlockingIOError, OSError):
            data = b""
        if signal.SIGTERM.value in data:
            _SIGTERM.update(wall=time.time(), mono=time.monotonic())
    return bool(_SIGTERM)


def _ray_notice() -> Optional[Dict[str, Any]]:
    info = local_preemption_info()
    if info is None:
        return None
    return {"cause": "preemption notice", "detail": str(info)}


class PreemptionGuard(Callback):
    """Save at the next batch on a SIGTERM or a preemption notice; on SIGTERM stop there too.

    ``dist``: the run's `Dist` (the ranks gather their notice times once, at the save).
    ``run_url``: where ``preemptions/`` records go. ``notice_fn()``: a notice or None (default:
    Ray's, see the module doc); ``sigterm``: install the SIGTERM handler (on a Ray worker).
    """

    def __init__(
        self,
        *,
        dist: Any,
        run_url: str,
        storage_options: Optional[Dict[str, Any]] = None,
        sigterm: bool = True,
        notice_fn: Optional[Callable[[], Optional[Dict[str, Any]]]] = None,
    ) -> None:
        self.dist = dist
        self.run_url = run_url
        self.options = dict(storage_options or {})
        self.sigterm = sigterm
        self._notice_fn = notice_fn or _ray_notice
        self._installed = False
        self._pending: Optional[Dict[str, Any]] = None  # this rank's notice, until its save committed
        self._notice_seen = False
        self._agreed_at: Optional[float] = None
        self.records: list = []  # what rank 0 logged, one dict per preemption save

    def init(self, state, logger) -> None:
        state.agreement.register(SAVE_FLAG)
        state.agreement.register(PREEMPT_FLAG)

    def fit_start(self, state, logger) -> None:
        self._pending, self._notice_seen = None, False
        if self.sigterm and not self._installed:
            try:
                self._installed = bool(run_on_worker_main_thread(_install_handler))
            except Exception as exc:  # still checked for notices; SIGTERM then exits as Ray's handler does
                logging.getLogger(__name__).warning("SIGTERM handler not installed on rank %d: %r", state.rank, exc)

    def after_dataloader(self, state, logger) -> None:
        if self._pending is not None:
            return
        notice: Optional[Dict[str, Any]] = None
        if _sigterm_arrived():
            notice = {"cause": "SIGTERM", "wall": _SIGTERM["wall"], "mono": _SIGTERM["mono"]}
        elif not self._notice_seen:
            notice = self._notice_fn()
            if notice is not None:
                self._notice_seen = True  # one save per notice: the group ends when the node goes
                notice = dict(notice, wall=time.time(), mono=time.monotonic())
        if notice is None:
            return
        self._pending = dict(notice, rank=state.rank, batch=int(state.timestamp.batch))
        state.request(SAVE_FLAG)
        state.request(PREEMPT_FLAG)
        if notice["cause"] == "SIGTERM":
            state.stop_training(f"SIGTERM on rank {state.rank}: saved a checkpoint at the next batch and stopped")

    def batch_end(self, state, logger) -> None:
        if state.agreed(PREEMPT_FLAG):  # every rank knows now (the batch's collective): the save comes next
            self._agreed_at = time.time()

    def batch_checkpoint(self, state, logger) -> None:
        # The `Checkpointer` is the first callback: it already saved this batch (SAVE_FLAG was agreed too).
        if not state.agreed(PREEMPT_FLAG):
            return
        state.agreement.clear(PREEMPT_FLAG)
        agreed = self._agreed_at if self._agreed_at is not None else time.time()
        self._agreed_at = None
        # why here: defers torch until this runs
        from raytrain_events.checkpoint.run.checkpointer import find_checkpointer

        checkpointer = find_checkpointer(state)
        name = None
        if checkpointer is not None and checkpointer.saved:
            name = checkpointer.saved[-1].name
            checkpointer.saved[-1].wait()  # rank 0: committed (the commit waits for every rank's files)
            checkpointer.wait()
        committed = time.time()
        notices = self.dist.all_gather_object(self._pending)
        self._pending = None
        if state.rank == 0:
            self._record(state, [n for n in notices if n is not None], name, agreed, committed)

    def close(self, state, logger) -> None:
        if self._installed:
            self._installed = False
            try:
                run_on_worker_main_thread(_restore_handler)
            except Exception as exc:
                logging.getLogger(__name__).warning("SIGTERM handler not restored: %r", exc)

    def _record(self, state: Any, notices: list, name: Optional[str], agreed: float, committed: float) -> None:
        first = min(notices, key=lambda n: n["wall"]) if notices else {"wall": agreed, "cause": "?", "rank": None}
        batch = int(state.timestamp.batch)
        record = {
            "cause": first["cause"],
            "rank": first["rank"],
            "ranks": sorted(n["rank"] for n in notices),
            "notice_batch": first.get("batch"),
            "saved_batch": batch,
            "checkpoint": name,
            "notice_to_agreed_s": round(agreed - first["wall"], 3),
            "notice_to_commit_s": round(committed - first["wall"], 3),
            "save_s": round(committed - agreed, 3),
            "stopping": bool(state.stop_requested),
            "wall": committed,
        }
        self.records.append(record)
        logger.warning(
            "Preemption (%s on rank %s): checkpoint %s committed at batch %d, %.2f s after the notice "
            "(%.2f s to the next batch boundary, %.2f s to save and commit)%s.",
            record["cause"],
            record["rank"],
            name,
            batch,
            record["notice_to_commit_s"],
            record["notice_to_agreed_s"],
            record["save_s"],
            "; stopping" if record["stopping"] else "; training on",
        )
        try:
            fs, path = resolve(RunDir(self.run_url).preemption(batch), self.options)
            write_bytes_atomic(fs, path, json.dumps(record).encode())
        except Exception as exc:  # the record is for people: never fail the save for it
            logger.warning("Could not write the preemption record: %r", exc)
