"""Worker-side reporting: send rank-local counts and metrics to the controller at intervals.

`ray.train.report` is a barrier across workers and Ray's controller collects one result every
~2 s (a report sooner than that blocks training), so `RayReporter` reports every ``every_s``
seconds (the ranks agree on the batch through the loop's per-batch collective), when the global
`Timestamp` crosses ``interval`` if one is given, when a checkpoint was saved, and at the end. A report the clock
asks for at an epoch's last batch waits for the epoch's end, so a point's metrics and its checkpoint go out
together. While a save that came due is postponed (the previous one still uploading), a report due meanwhile
still goes out at its own batch, marked ``save_pending`` (`SAVE_PENDING_KEY`): the driver's history and loggers
get the point, Tune does not (PBT acts on the first result past a point and copies its checkpoint; the save's own
report, batches later, is the result Tune gets). Each report carries this rank's samples and tokens since its
last report, the global Timestamp the rank computed, its mean train loss, and the latest logged metrics.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import torch

from raytrain_events.checkpoint.run.checkpointer import Checkpointer, find_checkpointer
from raytrain_events.checkpoint.run.preemption import SAVE_FLAG
from raytrain_events.core.callback import Callback
from raytrain_events.core.event import Event
from raytrain_events.core.heartbeat import HEARTBEAT
from raytrain_events.core.interval import make_interval
from raytrain_events.core.plain import to_python
from raytrain_events.core.time import counters_of
from raytrain_events.ray._compat import reports_waiting
from raytrain_events.ray.checkpointing.checkpointing import report_with_checkpoint
from raytrain_events.ray.checkpointing.validation import ASKED_KEY, validates
from raytrain_events.ray.reports.aggregate import SAVE_PENDING_KEY

__all__ = ["RayReporter", "REPORT_FLAG", "REPORTS_WAITING"]

#: Reports without a checkpoint that may wait in Ray's thread when no save uploads (`RayReporter._send`).
REPORTS_WAITING = 4

#: The agreement flag a rank whose report clock ran out requests (reports are collective).
REPORT_FLAG = "report"


def _ends_its_epoch(state: Any) -> bool:
    """This batch is the last of its epoch (False where the epoch's length is not known)."""
    steps = state.steps_per_epoch
    return steps is not None and int(state.timestamp.batch_in_epoch) == steps


def _preempting() -> bool:
    """True if Ray reports that a node of this run is about to be preempted (spot reclaim)."""
    import ray.train

    get_info = getattr(ray.train, "get_preemption_info", None)
    return get_info is not None and get_info() is not None


class RayReporter(Callback):
    """Report to Ray Train every ``interval`` of global time, on checkpoints, and at the end."""

    def __init__(  # noqa: PLR0913 (keyword-only: each a documented reporting option)
        self,
        *,
        interval: Any = None,
        every_s: Optional[float] = 10.0,
        report_fn: Optional[Callable[..., None]] = None,
        check_preemption: bool = False,
        preemption_fn: Optional[Callable[[], bool]] = None,
        counts_data: bool = True,
        validation: Any = None,
    ) -> None:
        """``counts_data``: this rank's samples and tokens count in the driver's global sums; False
        on all but one rank of a tensor group, whose ranks train the same rows (`Parallel.counts_data`).
        ``validation``: the run's `AsyncValidation` (None: in-loop evaluation only); the checkpoints it
        chooses are reported with ``validation=True`` (`raytrain_events.ray.checkpointing.validation`)."""
        if interval is None and every_s is None:
            raise ValueError("RayReporter needs report_interval (a Time) or report_every_s (seconds), or both.")
        self.interval = interval
        self.every_s = every_s
        self._last_report = time.monotonic()
        self._report_fn = report_fn
        self.check_preemption = check_preemption
        self.counts_data = counts_data
        self.validation = validation
        self._checkpoints_reported = 0  # this worker group's, for AsyncValidation(every=...)
        self._preempting = preemption_fn or _preempting
        self._due = None
        self._start: Optional[Dict[str, int]] = None
        self._checkpointer: Optional[Checkpointer] = None
        self._reset()

    def init(self, state, logger) -> None:
        # Every rank registers the same flags before the first batch (see `Agreement`).
        state.agreement.register(REPORT_FLAG)
        if self.check_preemption:
            state.agreement.register(SAVE_FLAG)

    def _reset(self) -> None:
        self.local_samples = 0
        self.local_tokens = 0
        self._loss_sum: Any = 0.0
        self._loss_count = 0

    def fit_start(self, state, logger) -> None:
        self._due = (
            make_interval(self.interval, state.max_duration, what="report_interval")
            if self.interval is not None
            else (lambda state, event: False)
        )
        self._last_report = time.monotonic()
        self._checkpointer = find_checkpointer(state)  # attached after INIT, so looked up here
        # The first report of this worker group says where it started (0, or a checkpoint).
        self._start = counters_of(state.timestamp)
        self._started_at = time.time()  # the group's start, for the goodput report's restarts
        self._reset()

    def after_dataloader(self, state, logger) -> None:
        # A clock cannot be compared across ranks: ask, and the batch's collective agrees.
        if self.every_s is not None and time.monotonic() - self._last_report >= self.every_s:
            state.request(REPORT_FLAG)

    def batch_end(self, state, logger) -> None:
        if self.counts_data:
            self.local_samples += state.batch_num_samples
            self.local_tokens += state.batch_num_tokens
        if state.loss is not None:
            # Summed on the device, in place after the first batch (no new tensor per batch).
            loss = state.loss.detach()
            if self._loss_count:
                self._loss_sum.add_(loss)
            else:
                self._loss_sum = loss.to(torch.float32, copy=True)
            self._loss_count += 1

    def batch_checkpoint(self, state, logger) -> None:
        if self._saved_checkpoint() or self._due(state, Event.BATCH_END):
            self._report(state, logger)
        elif state.agreed(REPORT_FLAG) and not _ends_its_epoch(state):
            # The clock's report at an epoch's last batch waits for the epoch's end (its eval and save), else
            # that point's metrics-only result would come before the one with its checkpoint (see `_save_pending`).
            self._report(state, logger)

    def epoch_checkpoint(self, state, logger) -> None:
        if self._saved_checkpoint() or state.agreed(REPORT_FLAG) or self._due(state, Event.EPOCH_END):
            self._report(state, logger)

    def _save_pending(self) -> bool:
        """A save that came due is postponed (the previous one still uploading; the ranks agree,
        `Checkpointer.postponed`): a report now goes out without its checkpoint, which comes batches later in a
        report of its own. Tune's PBT acts on the first result past a point and copies the checkpoint reported with
        it ("Skip exploit", or a paused donor's older checkpoint, on a result without one: `raytrain_events.tune.pbt`),
        so such a report is marked (`SAVE_PENDING_KEY`) and kept from Tune; the driver's history and loggers get it
        (before, it was held back and merged into the save's report: its point, an epoch's eval, never reached them)."""
        return self._checkpointer is not None and self._checkpointer.postponed

    def fit_end(self, state, logger) -> None:
        self._report(state, logger, final=True)

    def _saved_checkpoint(self) -> bool:
        return self._checkpointer is not None and self._checkpointer.has_unreported()

    def _report(self, state, logger, final: bool = False) -> None:
        loss_sum = float(self._loss_sum)  # the one host read per report
        metrics = {k: to_python(v) for k, v in logger.metrics.items() if not torch.is_tensor(v) or v.numel() == 1}
        if state.optimizers:  # the learning rate the last batch used (the run report plots it)
            metrics.setdefault("train/lr", float(state.optimizers[0].param_groups[0]["lr"]))
        report: Dict[str, Any] = {
            "rank": state.rank,
            "start": self._start,
            "local_samples": self.local_samples,
            "local_tokens": self.local_tokens,
            "timestamp": counters_of(state.timestamp),
            "train_loss_sum": loss_sum,
            "train_loss_count": self._loss_count,
            "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
            "final": final,
        }
        if self._start is not None:
            report["started_at"] = self._started_at
        checkpoint = self._checkpointer.take_unreported() if self._checkpointer is not None else None
        if checkpoint is None and not final and self._save_pending():
            report[SAVE_PENDING_KEY] = True
        # A report while a save uploads waits in Ray's upload thread, not in training (`_send`).
        behind_upload = checkpoint is None and self._checkpointer is not None and self._checkpointer.uploading(state)
        state.agreement.clear(REPORT_FLAG)
        self._last_report = time.monotonic()
        self._start = None
        self._reset()
        self._send(report, checkpoint, behind_upload)
        if self.check_preemption and not final and self._preempting():
            # Every rank got the same answer (it is a barrier): save at the next batch.
            state.request(SAVE_FLAG)

    def _send(self, report: Dict[str, Any], checkpoint: Any, behind_upload: bool = False) -> None:
        """``ray.train.report``. Ray hands a worker's reports to its controller in order, one at a time (its result
        queue holds one), and a save is registered in a report whose turn comes when the save has committed
        (`report_with_checkpoint`, in Ray's one upload thread). A report without a checkpoint made in plain mode
        waits for its turn in training: for the rest of a save's upload, then for the controller to take each
        report before it (bench/report_blocking.py: training held 9.0-9.3 s of 26.6-26.7 s by a 6 s upload). So it goes
        out in Ray's ASYNC mode and waits in that thread: always while a save uploads (``behind_upload``, agreed by
        the ranks: at most the upload's length of reports), else while fewer than `REPORTS_WAITING` are waiting,
        so that reports asked for faster than the controller takes them (a short ``report_every_s``) hold training
        as before instead of piling up in Ray's thread."""
        if self._report_fn is not None:
            self._report_fn(report, checkpoint)
            return
        import ray.train

        with HEARTBEAT.collective("ray.train.report (a barrier across workers)"):
            if checkpoint is None and (behind_upload or reports_waiting() < REPORTS_WAITING):
                ray.train.report(report, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)
            elif checkpoint is None:
                ray.train.report(report)
            else:
                self._checkpoints_reported += 1
                asked = validates(self.validation, self._checkpoints_reported)
                if asked:  # the driver's record of the choice (`unfinished_validations` reads it)
                    report[ASKED_KEY] = True
                report_with_checkpoint(report, checkpoint, validation=asked)
